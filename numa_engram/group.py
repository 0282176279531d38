"""Coordination for the sharing protocol: broadcast from the leader,
all-gather small objects and barrier, each bounded by a timeout.

``TorchGroup`` runs over a torch.distributed CPU process group (gloo); the
caller passes it in (no global state).  ``SingleProcessGroup`` is the
one-member group of a private table.  ``sharing_groups`` forms the
node-local sharing (EDP) groups of a world, per the rule in sharding.py.
"""

from __future__ import annotations

import logging
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
    the protocol step.  gloo bounds every collective by the process group's
    own timeout (``init_process_group(timeout=)`` / ``new_group(timeout=)``;
    ``sharing_groups`` creates its groups with ``timeout_s``); barriers also
    use ``timeout_s`` directly."""

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
        """Every collective of the group bounded by ``timeout_s`` while
        inside (the process group's own timeout is restored after)."""
        import torch
        from torch.distributed import distributed_c10d as c10d

        pg = self.pg or self._dist.group.WORLD
        try:
            before = pg._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):  # not a gloo group: its own bound stands
            yield
            return
        saved = self.timeout_s
        c10d._set_pg_timeout(timedelta(seconds=timeout_s), pg)
        self.timeout_s = timeout_s
        try:
            yield
        finally:
            c10d._set_pg_timeout(before, pg)
            self.timeout_s = saved

    def _run(self, step: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:  # gloo: timeout, or a peer's socket closed
            raise GroupTimeout(
                f"step '{step}': the sharing group {list(self.ranks)} did not complete within "
                f"{self.timeout_s:.0f} s or a member died ({str(exc).splitlines()[0][:200]})"
            ) from exc

    def broadcast(self, obj: Any, step: str) -> Any:
        box = [obj if self.rank == 0 else None]
        self._run(step, self._dist.broadcast_object_list, box, src=self.leader_global_rank,
                  group=self.pg)
        return box[0]

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._run(step, self._dist.all_gather_object, out, obj, group=self.pg)
        return out

    def barrier(self, step: str) -> None:
        self._run(step, self._dist.monitored_barrier, group=self.pg,
                  timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)


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
