"""The family seam (model/families.py and its registries above model/):
specs and configs find their family, each family's answers are the ones
the callers used to compute themselves, and no caller above model/ tests a
family's type or attributes again."""

import re
from pathlib import Path

import pytest

from numa_engram.errors import SpecError
from numa_engram.model.families import (
    ENGRAM,
    PLE,
    families,
    family_named,
    family_of,
    family_of_config,
    has_tables,
)
from numa_engram.model.ple import PLESpec
from numa_engram.model.sharding import ShardInfo, WorldLayout, shard_heads
from numa_engram.model.spec import EngramSpec

PACKAGE = Path(__file__).resolve().parent.parent / "numa_engram"
PLE_SPEC = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=7)


def test_a_spec_finds_its_family_and_anything_else_is_refused_by_name():
    assert family_of(EngramSpec.small()) is ENGRAM
    assert family_of(PLE_SPEC) is PLE
    with pytest.raises(SpecError, match="dict is no table family's spec"):
        family_of({"layer_ids": [1]})
    assert family_named("ple") is PLE
    with pytest.raises(SpecError, match="no table family is named 'hbm'"):
        family_named("hbm")
    assert sorted(f.name for f in families()) == ["engram", "ple"]


@pytest.mark.parametrize("doc, family, tables", [
    ({"ple_layer_ids": [2]}, PLE, True),
    ({"text_config": {"ple_layer_ids": [2]}}, PLE, True),
    ({"engram_layer_ids": [1]}, ENGRAM, True),
    ({"text_config": {"engram_layer_ids": [1]}}, ENGRAM, True),
    ({"ple_layer_ids": [2], "engram_layer_ids": [1]}, PLE, True),  # PLE looked for first
    ({"hidden_size": 8}, ENGRAM, False),  # the fallback: Engram's checks name what is missing
    (["ple_layer_ids"], ENGRAM, False),
    (None, ENGRAM, False),
])
def test_a_config_document_finds_its_family(doc, family, tables):
    assert family_of_config(doc) is family
    assert has_tables(doc) is tables


def test_a_rank_holds_heads_of_engram_and_a_row_range_of_ple():
    spec = EngramSpec.small()
    assert ENGRAM.shard(spec, 14, 1, 2) == shard_heads(spec.bucket_sizes(14), 2, 1)
    assert PLE.shard(PLE_SPEC, 5, 1, 2) == PLE_SPEC.shard(5, 1, 2)


def test_the_service_names_each_familys_tables_as_it_did():
    fingerprint = bytes(range(32))
    heads = ShardInfo(4, 8, 100, 200, 100)
    rows = ShardInfo(0, 16, 1024, 2048, 1024)
    assert ENGRAM.table_name(fingerprint, 14, heads, 4096, "all") == \
        "engram-0001020304050607-l14-h4-8-p4096-nall"
    assert PLE.table_name(fingerprint, 5, rows, 2 << 20, "1") == \
        "ple-0001020304050607-l5-r1024-2048-p2097152-n1"


def test_the_dp_sharded_exchange_is_engram_slices_and_ple_rows():
    world = WorldLayout(tp=1, dp=4, gpus_per_host=4)
    spec = EngramSpec.small()
    own = -(-spec.n_hash_cols // (world.tp * world.edp_size()))
    assert ENGRAM.dp_sharded_exchange_bytes(spec, world, 8) == \
        (world.edp_size() - 1) * 8 * own * spec.head_dim * 2 * len(spec.layer_ids)
    assert PLE.dp_sharded_exchange_bytes(PLE_SPEC, world, 8) == \
        world.edp_size() * 8 * PLE_SPEC.n_hash_cols * PLE_SPEC.row_bytes * 2


def test_each_familys_reader_passes_its_own_plan_through(tmp_path):
    from numa_engram.checkpoints.familyreaders import reader_of
    from numa_engram.checkpoints.synthetic import write_ple_checkpoint

    path = tmp_path / "ple.safetensors"
    write_ple_checkpoint(str(path), PLE_SPEC)
    reader = reader_of(PLE_SPEC)
    plan = reader.resolve(str(path), PLE_SPEC, 5)
    assert isinstance(plan, reader.plan_type)
    assert reader.resolve(plan, PLE_SPEC, 5) is plan
    assert reader_of(EngramSpec.small()).plan_type.__name__ == "CheckpointPlan"


SEAM_BREACH = re.compile(r"isinstance\([^)]*(PLESpec|PLECheckpoint)|"
                         r"hasattr\([^)]*(bucket_sizes|ple_embed_dim)")


def test_no_module_above_model_tests_a_familys_type_or_attributes():
    """The issue-51 seam: the callers ask the family (model/families.py)."""
    above = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "model"]
    breaches = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}" for p in above
                for n, line in enumerate(p.read_text().splitlines(), 1) if SEAM_BREACH.search(line)]
    assert breaches == []


def test_every_family_names_a_reader_table_and_model_directory_that_import():
    """A family whose parts above model/ are missing or misnamed fails here,
    not at a user's first create (docs/design.md, "Adding a family")."""
    from numa_engram.checkpoints.familyreaders import CheckpointReader

    for family in families():
        assert isinstance(family.part("reader"), CheckpointReader), family.name
        assert isinstance(family.part("table"), type), family.name
        assert callable(family.part("directory").open), family.name
