"""Coordination for the sharing protocol: broadcast from the leader,
all-gather small objects and barrier, each bounded by a timeout.

``TorchGroup`` runs over a torch.distributed CPU process group (gloo); the
caller passes it in (no global state).  ``SingleProcessGroup`` is the
one-member group of a private table.  ``sharing_groups`` forms the
node-local sharing (EDP) groups of a world, per the rule in sharding.py.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from .errors import GroupTimeout, NumaEngramError
from .sharding import WorldLayout

log = logging.getLogger(__name__)


@runtime_checkable
class Group(Protocol):
    """What the sharing protocol needs of a group; any object with these
    members works (a serving stack can pass its own).  ``process_group`` is
    the torch ProcessGroup behind it, or None."""

    rank: int  # in the group; 0 leads
    size: int
    ranks: tuple[int, ...]  # world ranks of the members, in group order
    process_group: Any

    def broadcast(self, obj: Any, step: str) -> Any: ...
    def all_gather(self, obj: Any, step: str) -> list[Any]: ...
    def barrier(self, step: str) -> None: ...


class SingleProcessGroup:
    """The group of a table private to this process."""

    rank = 0
    size = 1
    process_group = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """This process's rank in the world, when torch.distributed is up."""
        import sys

        dist = sys.modules.get("torch.distributed")
        return (dist.get_rank(),) if dist is not None and dist.is_initialized() else (0,)

    def broadcast(self, obj: Any, step: str) -> Any:
        return obj

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        return [obj]

    def barrier(self, step: str) -> None:
        return None


class TorchGroup:
    """A torch.distributed gloo group.  A collective that does not complete
    (a peer that never joins, a leader that died) raises GroupTimeout naming
    the protocol step.  Every collective is started asynchronously and
    waited for at most ``timeout_s`` (gloo's own timeout does not fire when a
    member is stopped); after a timeout the group is broken: make a new one."""

    def __init__(self, process_group=None, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise NumaEngramError("torch.distributed is not initialised: call "
                                  "init_process_group('gloo', ...) first")
        self._dist = dist
        self.pg = process_group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self.ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group \
            else tuple(range(self.size))
        self.leader_global_rank = self.ranks[0]

    @property
    def process_group(self):
        return self.pg

    @contextmanager
    def bounded(self, timeout_s: float):
        """Every collective of the group bounded by ``timeout_s`` while inside."""
        saved, self.timeout_s = self.timeout_s, timeout_s
        try:
            yield
        finally:
            self.timeout_s = saved

    def _run(self, step: str, start):
        """Start an async collective and wait at most timeout_s for it: a
        member that is stopped (SIGSTOP) or hung never answers, and gloo's
        own timeout does not fire then; the wait's does."""
        try:
            start().wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo: timeout, or a peer's socket closed
            raise GroupTimeout(
                f"step '{step}': the sharing group {list(self.ranks)} did not complete within "
                f"{self.timeout_s:.0f} s or a member died ({str(exc).splitlines()[0][:200]})"
            ) from exc

    def _bytes(self, step: str, data: bytes | None, src: int | None) -> list[bytes]:
        """All members' byte strings (src=None), or the src member's."""
        import torch

        dist, size = self._dist, torch.tensor([len(data or b"")], dtype=torch.int64)
        if src is None:
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
            self._run(step, lambda: dist.all_gather(sizes, size, group=self.pg, async_op=True))
        else:
            self._run(step, lambda: dist.broadcast(size, src=src, group=self.pg, async_op=True))
            sizes = [size]
        longest = max(int(n) for n in sizes)
        buf = torch.zeros(max(1, longest), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if src is None:
            outs = [torch.empty_like(buf) for _ in range(self.size)]
            self._run(step, lambda: dist.all_gather(outs, buf, group=self.pg, async_op=True))
        else:
            self._run(step, lambda: dist.broadcast(buf, src=src, group=self.pg, async_op=True))
            outs = [buf]
        return [o[:int(n)].numpy().tobytes() for o, n in zip(outs, sizes)]

    def broadcast(self, obj: Any, step: str) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else None
        return pickle.loads(self._bytes(step, data, self.leader_global_rank)[0])

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        return [pickle.loads(b) for b in self._bytes(step, pickle.dumps(obj), None)]

    def barrier(self, step: str) -> None:
        self.all_gather(None, step)


def sharing_groups(layout: WorldLayout, timeout_s: float = 300.0,
                   socket_of: Sequence[int] | None = None) -> TorchGroup:
    """Form every node-local sharing group of the world (a collective: all
    ranks call it) and return this rank's.  ``socket_of`` (NUMA node of each
    rank's GPU) splits groups per socket: one copy per socket, read locally.
    Logs the membership."""
    import torch.distributed as dist

    me = dist.get_rank()
    mine = None
    for ranks in layout.edp_groups(socket_of):
        pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s), backend="gloo")
        if me in ranks:
            mine = TorchGroup(pg, timeout_s)
    log.info("rank %d: sharing group %s (EDP size %d of tp=%d dp=%d, %d GPUs per node%s)", me,
             list(layout.edp_group(me, socket_of)), layout.edp_size(), layout.tp, layout.dp,
             layout.gpus_per_node, ", split per socket" if socket_of is not None else "")
    assert mine is not None  # every rank is in exactly one group
    return mine
