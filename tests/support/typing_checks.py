"""The public API as a type checker sees it.  Checked by the project's one
mypy run (``[tool.mypy] files`` in pyproject.toml), never run: a line that
must fail the type check carries ``# type: ignore[code]``, and
``warn_unused_ignores`` makes an ignore that nothing needed an error, so
each of those lines fails the check the day the mistake type-checks."""

import torch
from typing_extensions import assert_type

from numa_engram import EngramSpec, HashState, SharedEngramTable, shard_heads
from numa_engram.model.hashstate import HashState as RealHashState
from numa_engram.tables.table import SharedEngramTable as RealTable


def the_lazy_names_are_the_real_classes() -> None:
    # README's own spec (lists where a list is natural) passes
    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[1000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    table = SharedEngramTable.create(spec, 14, shard_heads(spec.bucket_sizes(14), 1, 0))
    assert_type(table, RealTable)
    assert_type(HashState(spec, max_requests=4), RealHashState)
    assert_type(table.lookup([[0]]), torch.Tensor)
    assert_type(table.lookup([[0]], packed=True), tuple[torch.Tensor, torch.Tensor])


def a_misspelt_mode_id_format_key_or_count_fails() -> None:
    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    SharedEngramTable.create(spec, 1, shard, mode="indepndent")  # type: ignore[arg-type]
    table = SharedEngramTable.create(spec, 1, shard)
    table.lookup([[0]], id_format="globl")  # type: ignore[call-overload]
    table.mode_report()["backing_pth"]  # type: ignore[typeddict-item]
    HashState(spec, max_requests="many")  # type: ignore[arg-type]
