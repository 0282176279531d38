"""Checkpoint scenarios run by tests/support/dist_harness.py in spawned ranks (gloo,
127.0.0.1), for both table families: one rank damages the checkpoint
(truncates it, or replaces it with another version) just before its own
part of a shared load."""

from __future__ import annotations

import os

from numa_engram import SharedEngramTable, shard_heads
from numa_engram.groups.group import TorchGroup
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable

from .socket_scenarios import LAYER, make_spec

PLE_SPEC = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=7)
PLE_LAYER = 5
ENGRAM_ROWS_PER_HEAD = 1000


def whole_table(family: str, checkpoint: str, timeout_s: float = 30):
    """The layer's whole table, one copy shared by the world group."""
    group = TorchGroup(None, timeout_s)
    if family == "engram":
        spec = make_spec(ENGRAM_ROWS_PER_HEAD)
        return SharedEngramTable.create(spec, LAYER, shard_heads(spec.bucket_sizes(LAYER), 1, 0),
                                        group=group, mode="dp_shared", timeout_s=timeout_s,
                                        checkpoint=checkpoint, load_threads=2)
    return SharedPLETable.create(PLE_SPEC, PLE_LAYER, group=group, mode="dp_shared",
                                 timeout_s=timeout_s, checkpoint=checkpoint, load_threads=2)


def damaged_during_load(rank, world, *, family, checkpoint, other, damage, damager):
    """``damager`` truncates the checkpoint to half (``damage`` "truncate")
    or replaces it with ``other`` ("replace") just before its load."""
    import numa_engram.groups.steps as steps

    if rank == damager:
        def hook(step):
            if step == "before-load" and damage == "truncate":
                os.truncate(checkpoint, os.path.getsize(checkpoint) // 2)
            elif step == "before-load":
                os.replace(other, checkpoint)
        steps.STEP_HOOK = hook
    try:
        table = whole_table(family, checkpoint)
    except Exception as exc:
        return {"raised": type(exc).__name__, "text": str(exc)}
    table.close()
    return {"raised": None}
