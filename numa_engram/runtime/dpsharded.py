"""DP-sharded mode: TP x EDP shards, hash ids gathered, rows exchanged.

Each member of a node-local EDP group holds the rows of a slice of its TP
rank's heads (shard index ``tp_rank * edp + edp_rank``).  A lookup:
1. all-gathers the members' token counts; the slot is the group's largest
   (padding never goes past the node's own maximum); a count above
   ``max_tokens`` fails in every member alike;
2. pads each member's hash ids with DEAD_ID to the slot and all-gathers them;
3. looks up the member's own heads for every gathered token (DEAD rows are
   zeros, never row 0);
4. exchanges rows with one all-to-all: member j gets, from every member,
   that member's heads for j's tokens; concatenated by head they are the TP
   rank's rows, of which the first T (the member's own tokens) are returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from ..errors import LookupIdError, SpecError, TopologyError
from ..literals import IdFormat
from ..lookup.cpu import check_hash_ids, check_ids_in_range, id_base
from ..lookup.outputs import OutputPool, check_bf16_out
from ..model.sharding import DEAD_ID, ShardInfo, shard_heads
from ..model.spec import EngramSpec

if TYPE_CHECKING:
    import torch

    from ..tables.table import SharedEngramTable


@dataclass(frozen=True)
class ShardedHeads:
    """Head slices of one TP rank's EDP group, in EDP-rank order."""

    tp_rank: int
    edp: int
    members: tuple[ShardInfo, ...]

    @classmethod
    def of(cls, spec: EngramSpec, layer_id: int, tp: int, edp: int, tp_rank: int) -> ShardedHeads:
        sizes = spec.bucket_sizes(layer_id)
        members = tuple(shard_heads(sizes, tp * edp, tp_rank * edp + e) for e in range(edp))
        return cls(tp_rank, edp, members)

    @property
    def head_start(self) -> int:
        return self.members[0].head_start

    @property
    def head_end(self) -> int:
        return self.members[-1].head_end


# rows appended to a member's ids when counts are given: its real token
# count, then 1 if its ids passed the check (column 0 of each)
STATUS_ROWS = 2


def _with_status(ids: np.ndarray, slot: int, ok: bool) -> np.ndarray:
    """``[slot + STATUS_ROWS, cols]``: the ids (cut to the slot when there
    are more, which the others then see as a wrong count), DEAD padding,
    then the status rows."""
    out = pad_hash_ids(ids[:slot], slot + STATUS_ROWS)
    out[slot, 0], out[slot + 1, 0] = ids.shape[0], int(ok)
    return out


def pad_hash_ids(hash_ids: np.ndarray, slot: int) -> np.ndarray:
    """``[slot, n_cols]``: the ids, then DEAD_ID rows."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.shape[0] > slot:
        raise LookupIdError(f"{ids.shape[0]} tokens do not fit the exchange slot of {slot}")
    out = np.full((slot, ids.shape[1]), DEAD_ID, dtype=np.int64)
    out[: ids.shape[0]] = ids
    return out


class ShardedModeReport(TypedDict):
    """What ``DPShardedLookup.mode_report()`` says (JSON-ready)."""

    mode: str  # dp_sharded
    embedding_dp_size: int
    edp_rank: int
    tp_rank: int
    tp_heads: list[int]  # [first, end) of this TP rank's heads
    owned_heads: list[int]  # [first, end) of the heads this member holds
    row_start: int
    row_end: int
    max_tokens: int | None


class DPShardedLookup:
    """Lookup of a TP rank's heads in the DP-sharded mode.

    ``table`` holds this member's head slice (``heads.members[edp_rank]``);
    ``group`` is the node-local EDP group in EDP-rank order: any Group whose
    ``process_group`` is set (what ``sharing_groups`` returns, or an adapted
    serving-stack group), or a torch ProcessGroup itself (gloo or NCCL;
    None: the world)."""

    def __init__(self, table: SharedEngramTable, heads: ShardedHeads, edp_rank: int,
                 group: Any = None, *, max_tokens: int | None = None) -> None:
        import torch.distributed as dist

        from ..groups.group import Group

        process_group = group

        if not isinstance(heads, ShardedHeads):
            raise SpecError(f"heads must be the ShardedHeads of the layer (ShardedHeads.of(spec, "
                            f"layer, tp, edp, tp_rank)), got {type(heads).__name__}; a member's "
                            "ShardInfo is heads.members[edp_rank], which the table holds")
        if isinstance(process_group, Group):
            if process_group.process_group is None and process_group.size > 1:
                raise TopologyError("DP-sharded lookups need tensor all-gather and all-to-all: "
                                    "pass a group whose process_group is a torch ProcessGroup")
            if process_group.rank != edp_rank:
                raise TopologyError(f"edp_rank {edp_rank} is not this member's rank "
                                    f"{process_group.rank} in the group")
            process_group = process_group.process_group

        if dist.get_world_size(process_group) != heads.edp:
            raise TopologyError(f"the EDP group has {dist.get_world_size(process_group)} members,"
                                f" the shard layout {heads.edp}")
        mine = heads.members[edp_rank]
        if (table.shard.head_start, table.shard.head_end) != (mine.head_start, mine.head_end):
            raise TopologyError(f"the table holds heads [{table.shard.head_start}, "
                                f"{table.shard.head_end}), EDP rank {edp_rank} owns "
                                f"[{mine.head_start}, {mine.head_end})")
        self.table, self.heads, self.edp_rank = table, heads, edp_rank
        self.pg, self.max_tokens, self._dist = process_group, max_tokens, dist
        # the exchange's receive buffer and the result come from a pool, as
        # the table's own outputs do: no fresh mmap and page faults per step
        self._outputs = OutputPool()

    def lookup(self, hash_ids: Any, *, id_format: IdFormat = "bucket",
               counts: Sequence[int] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """BF16 ``[T, tp_heads, head_dim]`` for this member's ``hash_ids [T, n_hash_cols]``
        (T may be 0: an idle replica still takes part); ``id_format="global"``
        for rows of the layer's whole table.

        ``counts``: every EDP member's token count in EDP-rank order, as a
        serving stack already knows them (vLLM's ``num_tokens_across_dp``),
        the same list in every member.  The count all-gather is then skipped:
        one collective per direction (ids gathered with each member's count
        and id check riding along, rows exchanged).  A count that disagrees
        with the ids a member passed, or a bad id, is a LookupIdError in
        every member, before any row is exchanged.

        ``out``: a contiguous CPU BF16 tensor ``[T, tp_heads, head_dim]``
        the rows are written to (and returned); one of another shape is a
        ValueError in this member and a LookupIdError in the others, before
        any row is exchanged."""
        import torch

        ids = check_hash_ids(hash_ids, self.table.spec.n_hash_cols)
        # every member checks its ids against all of its TP rank's heads (and
        # its out buffer) before any exchange, so a bad one fails all members
        # alike, at once, and the group stays in step for the next lookup
        problem = self._check_ids(ids, id_format)
        bad_out = self._check_out(out, ids.shape[0])
        problem = problem or bad_out
        given = counts is not None
        if counts is not None:
            counts = self._check_counts(counts)
        else:
            counts, oks = self._gather_counts(ids.shape[0], problem is None)
            self._raise_unless_all_ok(oks, problem, bad_out)
        slot = max(counts)
        if self.max_tokens is not None and slot > self.max_tokens:
            raise LookupIdError(f"EDP members have {counts} tokens; the slot limit is "
                                f"{self.max_tokens} (raise max_tokens or split the batch)")
        if slot == 0:  # decided from counts alone: no member takes part in a collective
            if ids.shape[0]:
                raise LookupIdError(f"counts says every EDP member has 0 tokens, this one "
                                    f"passed {ids.shape[0]}")
            if bad_out:
                raise ValueError(bad_out)
            return out if out is not None else torch.zeros(
                (0, self._tp_heads(), self.table.spec.head_dim), dtype=torch.bfloat16)
        if given:  # each member's count and id check ride along with its ids
            gathered = self._gather_ids(_with_status(ids, slot, problem is None))
            gathered = self._statuses_checked(gathered, slot, counts, problem, bad_out)
        else:
            gathered = self._gather_ids(pad_hash_ids(ids, slot))         # [edp * slot, cols]
        rows = self.table.lookup(gathered, id_format=id_format)           # [edp*slot, own, d]
        return self._exchange(rows, slot, ids.shape[0], out)

    def _raise_unless_all_ok(self, oks: Sequence[bool], problem: str | None,
                             bad_out: str | None) -> None:
        if not all(oks):
            bad = [e for e, ok in enumerate(oks) if not ok]
            if bad_out:
                raise ValueError(f"{bad_out}; no rows were exchanged")
            mine = f": {problem}" if problem else ""
            raise LookupIdError(f"EDP member(s) {bad} of TP rank {self.heads.tp_rank} passed hash "
                                "ids outside their heads' buckets (or a wrong out= buffer); no "
                                f"rows were exchanged{mine}")

    def _check_counts(self, counts: Sequence[int]) -> list[int]:
        """The caller's counts: one non-negative int per EDP member."""
        try:
            out = [int(c) for c in counts]
        except (TypeError, ValueError):
            raise LookupIdError(f"counts must be token counts (ints), got {counts!r}") from None
        if len(out) != self.heads.edp or min(out) < 0:
            raise LookupIdError(f"counts must give each of the {self.heads.edp} EDP members' "
                                f"token count (>= 0), got {out}")
        return out

    def _statuses_checked(self, gathered: np.ndarray, slot: int, counts: list[int],
                          problem: str | None, bad_out: str | None) -> np.ndarray:
        """The gathered ids without their status rows, once every member's
        real count matches ``counts`` and every member's ids are good (the
        same verdict in every member: they all see the same statuses)."""
        per = slot + STATUS_ROWS
        blocks = gathered.reshape(self.heads.edp, per, -1)
        real = [int(b[slot, 0]) for b in blocks]
        oks = [bool(b[slot + 1, 0]) for b in blocks]
        odd = [e for e, (n, c) in enumerate(zip(real, counts)) if n != c]
        if odd:
            raise LookupIdError(f"counts says EDP members have {counts} tokens, but member(s) "
                                f"{odd} passed {[real[e] for e in odd]}; pass every member's "
                                "real count (the same list in every member)")
        self._raise_unless_all_ok(oks, problem, bad_out)
        return np.ascontiguousarray(blocks[:, :slot]).reshape(self.heads.edp * slot, -1)

    def mode_report(self) -> ShardedModeReport:
        """What this member really runs, for the deployment log."""
        mine = self.heads.members[self.edp_rank]
        return {"mode": "dp_sharded", "embedding_dp_size": self.heads.edp,
                "edp_rank": self.edp_rank, "tp_rank": self.heads.tp_rank,
                "tp_heads": [self.heads.head_start, self.heads.head_end],
                "owned_heads": [mine.head_start, mine.head_end],
                "row_start": mine.row_start, "row_end": mine.row_end,
                "max_tokens": self.max_tokens}

    # --------------------------------------------------------- internals --
    def _tp_heads(self) -> int:
        return self.heads.head_end - self.heads.head_start

    def _check_ids(self, ids: np.ndarray, id_format: IdFormat) -> str | None:
        spec, layer = self.table.spec, self.table.layer_id
        first, end = self.heads.head_start, self.heads.head_end
        sizes = np.asarray(spec.bucket_sizes(layer)[first:end], dtype=np.int64)
        base = id_base(spec, layer, first, end, id_format)  # refuses an unknown format
        try:
            check_ids_in_range(ids, self.heads.head_start, sizes, base)
        except LookupIdError as exc:
            return str(exc)
        return None

    def _check_out(self, out: Any, tokens: int) -> str | None:
        if out is None:
            return None
        try:
            check_bf16_out(out, (tokens, self._tp_heads(), self.table.spec.head_dim))
        except ValueError as exc:
            return str(exc)
        return None

    def _gather_counts(self, count: int, ok: bool) -> tuple[list[int], list[bool]]:
        import torch

        mine = torch.tensor([count, int(ok)], dtype=torch.int64)
        out = [torch.empty(2, dtype=torch.int64) for _ in range(self.heads.edp)]
        self._dist.all_gather(out, mine, group=self.pg)
        return [int(t[0]) for t in out], [bool(t[1]) for t in out]

    def _gather_ids(self, padded: np.ndarray) -> np.ndarray:
        import torch

        mine = torch.from_numpy(padded)
        out = [torch.empty_like(mine) for _ in range(self.heads.edp)]
        self._dist.all_gather(out, mine, group=self.pg)
        return torch.cat(out).numpy()

    def _exchange(self, rows: torch.Tensor, slot: int, tokens: int,
                  out: torch.Tensor | None) -> torch.Tensor:
        """all-to-all: chunk j of ours (our heads, j's tokens) goes to member j;
        our ``tokens`` rows of every member's heads, side by side by head,
        are the result (written to ``out`` when given)."""
        import torch

        d = self.table.spec.head_dim
        owned = [m.num_heads for m in self.heads.members]
        send = rows.reshape(-1)
        recv, _ = self._outputs.take((slot * sum(owned) * d,))
        self._dist.all_to_all_single(
            recv, send, output_split_sizes=[slot * h * d for h in owned],
            input_split_sizes=[slot * owned[self.edp_rank] * d] * self.heads.edp,
            group=self.pg)
        parts = [p.view(slot, h, d) for p, h in zip(recv.split([slot * h * d for h in owned]),
                                                       owned)]
        if out is None:
            result, _ = self._outputs.take((slot, sum(owned), d))
            return torch.cat(parts, dim=1, out=result)[:tokens]
        first = 0
        for part, h in zip(parts, owned):
            out[:, first:first + h].copy_(part[:tokens])
            first += h
        return out
