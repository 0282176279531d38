"""What the store and the sharing protocol need to know of a table family
(DeepSeek's Engram, Qwen4-Exp's PLE): the bytes of a shard's rows, a few
fixed bytes beside them, which shards are valid, and a fingerprint of
storage facts only.  ``EngramSpec`` and ``PLESpec`` are the two."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .sharding import ShardInfo


class TableFamily(Protocol):
    @property
    def fingerprint(self) -> bytes: ...

    @property
    def layer_ids(self) -> Sequence[int]: ...

    @property
    def n_hash_cols(self) -> int:
        """Ids per token and layer (one per hash head)."""
        ...

    @property
    def head_dim(self) -> int: ...

    def table_bytes(self, layer_id: int | None = None) -> int: ...

    @property
    def row_bytes(self) -> int: ...

    def rows(self, layer_id: int) -> int: ...

    def row_regions(self) -> tuple[tuple[str, int], ...]:
        """(region name, bytes per row) of the table file, in file order;
        the first is the one placement plans and readers name ``weights``."""
        ...

    def fixed_regions(self) -> tuple[tuple[str, int], ...]:
        """(region name, bytes) that do not scale with rows (a per-tensor
        scale), after the row regions."""
        ...

    def shard_bytes(self, layer_id: int, num_shards: int, index: int) -> int:
        """Bytes of one of ``num_shards`` shards (heads or row ranges, as the
        family shards) of the layer's table."""
        ...

    def check_shard(self, layer_id: int, shard: ShardInfo) -> None:
        """TopologyError unless ``shard`` is a valid shard of the layer."""
        ...
