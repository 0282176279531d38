"""EngramSpec construction: every size bounded, every field type-checked,
a SpecError within a second (never a hang, a wrap or a raw TypeError)."""

import json
import re
import time

import pytest

from numa_engram import EngramSpec
from numa_engram.errors import SpecError, SpecMismatchError
from numa_engram.model.spec import MAX_NGRAM_SIZE

BASE = dict(layer_ids=(1,), engram_vocab_sizes=(1000, 1000), max_ngram_size=3,
            n_head_per_ngram=4, head_dim=64, compressed_vocab_size=1000, pad_id=0)


def spec_with(**changes):
    return EngramSpec(**{**BASE, **changes})


@pytest.mark.parametrize("changes, text", [
    ({"n_head_per_ngram": 10**6}, "n_head_per_ngram must be in 1..1024"),
    ({"layer_ids": tuple(range(40)), "n_head_per_ngram": 64}, "distinct primes, above 4096"),
    ({"engram_vocab_sizes": (2**62, 2**62)}, "engram vocab sizes must be in 2.."),
    ({"engram_vocab_sizes": (2**63, 5)}, "engram vocab sizes must be in 2.."),
    ({"engram_vocab_sizes": (2**40, 2**40), "n_head_per_ngram": 1024, "head_dim": 65536},
     "byte offsets would not fit"),
    ({"n_head_per_ngram": 2.5}, "n_head_per_ngram must be an integer, got float 2.5"),
    ({"head_dim": "128"}, "head_dim must be an integer, got str '128'"),
    ({"head_dim": None}, "head_dim must be an integer, got NoneType"),
    ({"pad_id": -1}, "pad_id -1 is not a compressed id (0..999)"),
    ({"pad_id": 1000}, "pad_id 1000 is not a compressed id"),
    ({"max_ngram_size": 100, "engram_vocab_sizes": (1000,) * 99},
     f"max_ngram_size must be in 2..{MAX_NGRAM_SIZE}"),
    ({"layer_ids": (1.0,)}, "layer_ids entry must be an integer, got float"),
    ({"layer_ids": "14"}, "layer_ids must be a sequence of integers"),
    ({"seed": -3}, "seed must be in 0.."),
    ({"max_ngram_size": True}, "max_ngram_size must be an integer, got bool"),
])
def test_specs_that_cannot_exist_are_refused_at_once(changes, text):
    t0 = time.thread_time()  # this thread's CPU time: the same on a loaded host
    with pytest.raises(SpecError, match=re.escape(text)):
        spec_with(**changes)
    assert time.thread_time() - t0 < 1.0


def test_largest_allowed_head_count_builds_its_primes_in_well_under_a_second():
    spec = spec_with(n_head_per_ngram=1024, engram_vocab_sizes=(10**6,) * 2, layer_ids=(1, 2))
    t0 = time.thread_time()  # this thread's CPU time: the same on a loaded host
    assert len(spec.bucket_sizes(2)) == 2048
    assert time.thread_time() - t0 < 1.0


def _config(**changes):
    doc = {"engram_layer_ids": [1], "engram_vocab_size": 1000, "engram_max_ngram_size": 3,
           "engram_n_heads": 4, "engram_head_dim": 64, "engram_compressed_vocab_size": 10,
           "engram_pad_token_id": 2}
    doc.update(changes)
    return {"text_config": doc}


def test_from_config_types_and_both_pad_spellings():
    table = list(range(10))
    spec = EngramSpec.from_config(_config(), (table, 10))
    assert spec.pad_id == 2 and spec.n_head_per_ngram == 4
    old = _config(engram_pad_id=3)
    del old["text_config"]["engram_pad_token_id"]
    assert EngramSpec.from_config(old, (table, 10)).pad_id == 3
    with pytest.raises(SpecError, match="config field 'engram_n_heads' must be an integer, got "
                                        "NoneType"):
        EngramSpec.from_config(_config(engram_n_heads=None), (table, 10))
    with pytest.raises(SpecError, match="'engram_head_dim' must be an integer, got float"):
        EngramSpec.from_config(_config(engram_head_dim=64.5), (table, 10))
    with pytest.raises(SpecError, match="'engram_vocab_size' entry must be an integer"):
        EngramSpec.from_config(_config(engram_vocab_size=[1000, "x"]), (table, 10))
    with pytest.raises(SpecMismatchError, match="engram_num_embeddings has 2 entries"):
        EngramSpec.from_config(_config(engram_num_embeddings=[1, 2]), (table, 10))


def test_named_spec_file_round_trips(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_with().to_dict()))
    assert EngramSpec.named(str(path)) == spec_with()
