"""Coordination for the sharing protocol: broadcast from the leader,
all-gather small objects and barrier, each bounded by a timeout.

``TorchGroup`` runs over a torch.distributed CPU process group (gloo); the
caller passes it in (no global state).  ``SingleProcessGroup`` is the
one-member group of a private table; ``socketgroup.SocketGroup`` one that
needs no torch.  ``Members`` is what a group of processes knows of itself,
theirs in common.  ``sharing_groups`` forms the node-local sharing (EDP)
groups of a world, per the rule in sharding.py.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from ..errors import GroupTimeout, NumaEngramError, TopologyError
from ..host import procfs
from ..host.topology import gpu_node
from ..literals import DEFAULT_DIRECTORY
from ..model.sharding import WorldLayout
from .identity import HostIdentity

log = logging.getLogger(__name__)


@runtime_checkable
class Group(Protocol):
    """What the sharing protocol needs of a group; any object with these
    members works (a serving stack can pass its own).  ``process_group`` is
    the torch ProcessGroup behind it, or None; ``identity`` says what the
    members share (host, directory, socket), "" when nothing was measured;
    ``bounded(t)`` bounds every collective made inside it by t seconds (a
    group that bounds its collectives itself returns a no-op context)."""

    @property
    def rank(self) -> int: ...  # in the group; 0 leads
    @property
    def size(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...  # world ranks of the members, in group order
    @property
    def process_group(self) -> Any: ...
    @property
    def identity(self) -> str: ...

    def bounded(self, timeout_s: float) -> AbstractContextManager[None]: ...
    def broadcast(self, obj: Any, step: str) -> Any: ...
    def all_gather(self, obj: Any, step: str) -> list[Any]: ...
    def barrier(self, step: str) -> None: ...


class SingleProcessGroup:
    """The group of a table private to this process."""

    rank = 0
    size = 1
    process_group = None
    identity = "this process"

    @property
    def ranks(self) -> tuple[int, ...]:
        """This process's rank in the world, when torch.distributed is up."""
        import sys

        dist = sys.modules.get("torch.distributed")
        return (dist.get_rank(),) if dist is not None and dist.is_initialized() else (0,)

    # (the Group protocol's signatures: one process has nothing to wait for)
    def bounded(self, timeout_s: float) -> AbstractContextManager[None]:  # noqa: ARG002
        return nullcontext()  # nothing to wait for

    def broadcast(self, obj: Any, step: str) -> Any:  # noqa: ARG002
        return obj

    def all_gather(self, obj: Any, step: str) -> list[Any]:  # noqa: ARG002
        return [obj]

    def barrier(self, step: str) -> None:  # noqa: ARG002
        return None


class Members:
    """What a group of processes knows of itself (the Group protocol's
    members but the collectives) and the bound on its collectives, which
    ``bounded`` changes for a while."""

    def __init__(self, rank: int, size: int, ranks: tuple[int, ...], timeout_s: float,
                 identity: str) -> None:
        self._rank, self._size, self._ranks = rank, size, ranks
        self.timeout_s, self._identity = timeout_s, identity

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def identity(self) -> str:
        return self._identity

    @contextmanager
    def bounded(self, timeout_s: float) -> Iterator[None]:
        """Every collective of the group bounded by ``timeout_s`` while inside."""
        saved, self.timeout_s = self.timeout_s, timeout_s
        try:
            yield
        finally:
            self.timeout_s = saved


class TorchGroup(Members):
    """A torch.distributed gloo group.  A collective that does not complete
    (a peer that never joins, a leader that died) raises GroupTimeout naming
    the protocol step.  Every collective is started asynchronously and
    waited for at most ``timeout_s`` (gloo's own timeout does not fire when a
    member is stopped); after a timeout the group is broken: make a new one."""

    def __init__(self, process_group: Any = None, timeout_s: float = 300.0,
                 identity: str = "") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise NumaEngramError("torch.distributed is not initialised: call "
                                  "init_process_group('gloo', ...) first")
        self._dist = dist
        self._pg = process_group
        size = dist.get_world_size(process_group)
        super().__init__(dist.get_rank(process_group), size,
                         tuple(dist.get_process_group_ranks(process_group)) if process_group
                         else tuple(range(size)), timeout_s, identity)
        self.leader_global_rank = self._ranks[0]
        self._roll = RollCall(self._ranks, dist.get_rank())

    @property
    def process_group(self) -> Any:
        return self._pg

    def _run(self, step: str, start: Callable[[], Any]) -> None:
        """Start an async collective and wait at most timeout_s for it: a
        member that is stopped (SIGSTOP) or hung never answers, and gloo's
        own timeout does not fire then; the wait's does."""
        call = self._roll.arrive()
        try:
            start().wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo: timeout, or a peer's socket closed
            raise GroupTimeout(
                f"step '{step}': the sharing group {list(self.ranks)} did not complete within "
                f"{self.timeout_s:.0f} s or a member died; {self._roll.absent(call)} "
                f"({str(exc).splitlines()[0][:200]})") from exc

    def _bytes(self, step: str, data: bytes | None, src: int | None) -> list[bytes]:
        """All members' byte strings (src=None), or the src member's."""
        import torch

        dist, size = self._dist, torch.tensor([len(data or b"")], dtype=torch.int64)
        if src is None:
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
            self._run(step, lambda: dist.all_gather(sizes, size, group=self._pg, async_op=True))
        else:
            self._run(step, lambda: dist.broadcast(size, src=src, group=self._pg, async_op=True))
            sizes = [size]
        longest = max(int(n) for n in sizes)
        buf = torch.zeros(max(1, longest), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if src is None:
            outs = [torch.empty_like(buf) for _ in range(self.size)]
            self._run(step, lambda: dist.all_gather(outs, buf, group=self._pg, async_op=True))
        else:
            self._run(step, lambda: dist.broadcast(buf, src=src, group=self._pg, async_op=True))
            outs = [buf]
        return [o[:int(n)].numpy().tobytes() for o, n in zip(outs, sizes)]

    def broadcast(self, obj: Any, step: str) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else None
        return pickle.loads(self._bytes(step, data, self.leader_global_rank)[0])

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        return [pickle.loads(b) for b in self._bytes(step, pickle.dumps(obj), None)]

    def barrier(self, step: str) -> None:
        self.all_gather(None, step)


class RollCall:
    """Who reached each collective of a group, through torch.distributed's
    rendezvous store: a member writes a key as it arrives, and a member that
    timed out reads whose keys are missing.  Store calls run on one worker
    thread, so a store whose host (rank 0) is stopped never blocks the
    collective itself, and the read is bounded.  Members number their
    groups of the same ranks in creation order, and their collectives in
    call order: the protocol makes the same calls in every member."""

    _instances: dict[tuple[int, ...], int] = {}
    _lock = threading.Lock()
    READ_TIMEOUT_S = 5.0  # a loaded 2-core CI host missed 2 s once

    def __init__(self, ranks: tuple[int, ...], me: int) -> None:
        with RollCall._lock:  # members create their groups in the same order
            instance = RollCall._instances.get(ranks, 0)
            RollCall._instances[ranks] = instance + 1
        self._prefix = f"numa_engram/arrived/{'-'.join(map(str, ranks))}/{instance}"
        self._ranks, self._me, self._calls = ranks, me, 0
        self._jobs: queue.SimpleQueue | None = None

    def _submit(self, fn: Callable[[], Any]) -> Future:
        """Run fn on this roll call's worker, a daemon thread (a store call
        stuck on a stopped host must not hold up the interpreter's exit)."""
        if self._jobs is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()

            def work() -> None:
                while True:
                    job, future = jobs.get()
                    try:
                        future.set_result(job())
                    except Exception as exc:
                        future.set_exception(exc)
            threading.Thread(target=work, name="numa-engram-rollcall", daemon=True).start()
            self._jobs = jobs
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def _store(self) -> Any:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()

    def arrive(self) -> int:
        """Mark this member's arrival at the next collective (in the
        background); returns the collective's number."""
        call, self._calls = self._calls, self._calls + 1
        key = f"{self._prefix}/{call}/{self._me}"
        self._submit(lambda: self._store().set(key, "1"))
        return call

    def absent(self, call: int) -> str:
        """'members [world ranks] did not arrive', or why that is unknown."""
        def read() -> list[int]:
            store = self._store()
            return [r for r in self._ranks if not store.check([f"{self._prefix}/{call}/{r}"])]
        try:
            missing = self._submit(read).result(timeout=self.READ_TIMEOUT_S)
        except Exception:  # the store's host may be the member that is gone
            return ("which members did not arrive is unknown (the rendezvous store, kept by "
                    "world rank 0, did not answer: that rank may be stopped or dead)")
        if not missing:
            return "every member arrived (one died or hung inside the collective)"
        return f"member(s) at world rank(s) {missing} did not arrive"


def _cpu_group_of(group: Any) -> Any:
    """The process group to run sharing_groups over: a vLLM GroupCoordinator's
    CPU group; never the default group when that is NCCL (vLLM's world
    group is), which cannot carry the identities."""
    import torch.distributed as dist

    if all(hasattr(group, a) for a in ("rank_in_group", "world_size", "cpu_group")):
        return group.cpu_group
    if group is None and dist.is_initialized() and dist.get_backend() == "nccl":
        raise TopologyError("the default process group is NCCL, which cannot gather the "
                            "ranks' identities: pass world_group= a gloo group (vLLM: "
                            "get_world_group(), whose cpu_group is used)")
    return group


def as_group(group: Any, timeout_s: float = 300.0) -> Group:
    """Adapt what a serving stack has to a Group: our groups and any object
    with the Group surface as they are; an object with vLLM's
    GroupCoordinator surface (``rank_in_group``, ``world_size``,
    ``cpu_group``) runs over its CPU process group, so our timeouts bound
    it; a torch.distributed ProcessGroup (or None: the world) is wrapped."""
    if isinstance(group, Group):  # ours, or any object with the Group surface
        return group
    if all(hasattr(group, a) for a in ("rank_in_group", "world_size", "cpu_group")):
        wrapped = TorchGroup(group.cpu_group, timeout_s)
        if (wrapped.rank, wrapped.size) != (group.rank_in_group, group.world_size):
            raise TopologyError(f"the coordinator says rank {group.rank_in_group} of "
                                f"{group.world_size}, its cpu_group rank {wrapped.rank} of "
                                f"{wrapped.size}")
        return wrapped
    return TorchGroup(group, timeout_s)


@dataclass(frozen=True)
class RankIdentity:
    """Where a rank really is (its ``HostIdentity``, the record the join
    step checks too), what it asks to share (its TP rank, its GPU's socket)
    and the mount namespace, which is only logged."""

    rank: int
    tp_rank: int
    host: HostIdentity
    socket: int | None
    mount_ns: str
    # the group the caller put this rank in (a WorldLayout's arithmetic or a
    # within= list), or None: measured identity may split it, never widen it
    limit: tuple[int, ...] | None = None

    def key(self, per_socket: bool) -> tuple:
        return (self.tp_rank, *self.host.key(), self.socket if per_socket else None, self.limit)

    def describe(self, per_socket: bool) -> str:
        text = f"tp_rank {self.tp_rank}, {self.host.describe()}"
        return text + (f", socket {self.socket}" if per_socket else "")


def local_identity(rank: int, tp_rank: int, directory: str,
                   numa_socket: int | None = None,
                   limit: tuple[int, ...] | None = None) -> RankIdentity:
    return RankIdentity(rank, tp_rank, HostIdentity.here(directory), numa_socket,
                        procfs.namespace("mnt"), limit)


def caller_limit(rank: int, world_layout: WorldLayout | None, socket_of: Sequence[int] | None,
                 within: Sequence[Sequence[int]] | None) -> tuple[int, ...] | None:
    """The ranks the caller allows ``rank`` to share with: its layout group
    intersected with its within= group (None: no limit given)."""
    allowed: set[int] | None = None
    if world_layout is not None:
        allowed = set(world_layout.edp_group(rank, socket_of))
    if within is not None:
        mine = [tuple(int(r) for r in g) for g in within if rank in g]
        if len(mine) != 1:
            raise TopologyError(f"within= must put rank {rank} in exactly one group, it is in "
                                f"{len(mine)}: {[list(g) for g in mine]}")
        allowed = set(mine[0]) if allowed is None else allowed & set(mine[0])
    return None if allowed is None else tuple(sorted(allowed))


def identity_groups(identities: Sequence[RankIdentity],
                    per_socket: bool = False) -> list[tuple[int, ...]]:
    """The sharing groups: ranks with the same identity key, in rank order,
    groups ordered by their first rank.  Any rank order works."""
    groups: dict[tuple, list[int]] = {}
    for ident in sorted(identities, key=lambda i: i.rank):
        groups.setdefault(ident.key(per_socket), []).append(ident.rank)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def sharing_groups(world_group: Any = None, *, tp_rank: int | None = None,
                   device: int | None = None, per_socket: bool = False,
                   directory: str = DEFAULT_DIRECTORY, timeout_s: float = 300.0,
                   socket_of: Sequence[int] | None = None,
                   within: Sequence[Sequence[int]] | None = None) -> TorchGroup:
    """Form every sharing group of the world from where the ranks really are
    (a collective: every rank of ``world_group``, default the whole world,
    calls it) and return this rank's: the ranks with the same ``tp_rank``
    that can map one file (same host boot id, uid and table directory).
    ``per_socket`` splits them by the NUMA node of each rank's GPU
    (``device``): one copy per socket, the replicate-per-node layout.

    A ``WorldLayout`` passed first limits the groups to its arithmetic (tp
    from it, the TP rank from the world rank, ``socket_of`` the node of each
    rank's GPU), and ``within`` (world rank groups, e.g. a serving stack's
    own EDP groups) likewise: the groups are the intersection of what the
    caller asked for and what the measured identities allow.  Measured
    identity may split a group the caller formed (members that cannot share
    a file), never merge ranks the caller put apart; a split is logged."""
    import torch.distributed as dist

    world_layout = world_group if isinstance(world_group, WorldLayout) else None
    if world_layout is not None:
        world_group = None
    world_group = _cpu_group_of(world_group)
    me = dist.get_rank()
    if world_layout is not None and tp_rank is None:
        tp_rank = world_layout.coords(me)[0]
    if tp_rank is None:
        raise TopologyError("sharing_groups needs tp_rank= (this rank's tensor-parallel rank)")
    numa_socket = None
    if socket_of is not None:
        per_socket, numa_socket = True, int(socket_of[me])
    elif per_socket:
        numa_socket = gpu_node(device)
    limit = caller_limit(me, world_layout, socket_of, within)
    world = TorchGroup(world_group, timeout_s)
    identities = world.all_gather(local_identity(me, tp_rank, directory, numa_socket, limit),
                                  "identity")
    groups = identity_groups(identities, per_socket)
    ident = next(i for i in identities if i.rank == me)
    mine = None
    for ranks in groups:
        if world_group is None:  # every world rank creates every group, in one order
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s),
                                backend="gloo")
        elif me in ranks:
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s),
                                backend="gloo", use_local_synchronization=True)
        else:
            continue
        if me in ranks:
            mine = TorchGroup(pg, timeout_s, identity=ident.describe(per_socket))
    assert mine is not None  # every rank is in exactly one group
    if limit is not None and limit != tuple(mine.ranks):
        log.warning("rank %d: the caller's layout or within= gives sharing group %s; the "
                    "measured identities allow only %s, which is used", me, list(limit),
                    list(mine.ranks))
    log.info("rank %d: sharing group %s (%s; host %s, mount ns %s)", me, list(mine.ranks),
             mine.identity, ident.host.hostname, ident.mount_ns)
    return mine
