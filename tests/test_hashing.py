import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_engram.errors import SpecError
from numa_engram.model.hashing import compress_ids, ngram_hashes, ngram_hashes_numpy, table_rows
from numa_engram.model.spec import EngramSpec

from .support.engram_reference import (
    reference_hashes,
    reference_multipliers,
    reference_primes,
    scalar_hash,
)


def _reference(spec, ids_bt, layer):
    return reference_hashes(ids_bt, spec.multipliers(layer), spec.bucket_sizes(layer),
                            spec.max_ngram_size, spec.n_head_per_ngram, spec.pad_id)


def test_demo_primes_and_multipliers_equal_the_reference():
    spec = EngramSpec.demo()
    want = reference_primes(spec.layer_ids, spec.engram_vocab_sizes, spec.n_head_per_ngram)
    for layer in spec.layer_ids:
        assert list(spec.bucket_sizes(layer)) == want[layer]
        assert (spec.multipliers(layer) == reference_multipliers(0, layer, 3, 99092)).all()
    primes = [p for layer in spec.layer_ids for p in spec.bucket_sizes(layer)]
    assert len(set(primes)) == len(primes) == 32
    assert spec.bucket_sizes(1)[0] == 646403  # first prime above 129280*5 - 1


def test_v4_sized_primes_take_well_under_a_second():
    t0 = time.thread_time()  # this thread's CPU time: the same on a loaded host
    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    rows = spec.rows(1) + spec.rows(14)
    assert time.thread_time() - t0 < 0.5
    assert spec.n_hash_cols == 24 and spec.row_bytes == 264 and rows > 768_000_000


specs = st.builds(
    lambda sizes, max_n, heads, vocab, pad, seed, layers: EngramSpec(
        layer_ids=layers, engram_vocab_sizes=sizes[: max_n - 1], max_ngram_size=max_n,
        n_head_per_ngram=heads, head_dim=32, compressed_vocab_size=vocab, pad_id=pad % vocab,
        seed=seed),
    st.lists(st.integers(2, 5000), min_size=4, max_size=4),
    st.integers(2, 5), st.integers(1, 4), st.integers(1, 200_000), st.integers(0, 10**6),
    st.integers(0, 2**31), st.lists(st.integers(0, 60), min_size=1, max_size=3, unique=True))


@settings(max_examples=60, deadline=None)
@given(spec=specs, data=st.data())
def test_hashes_equal_reference_on_random_configs(spec, data):
    layer = data.draw(st.sampled_from(spec.layer_ids))
    b = data.draw(st.integers(1, 3))
    t = data.draw(st.integers(1, 40))
    near_top = data.draw(st.booleans())
    lo = max(0, spec.compressed_vocab_size - 3) if near_top else 0
    ids = np.array(data.draw(st.lists(st.integers(lo, spec.compressed_vocab_size - 1),
                                      min_size=b * t, max_size=b * t))).reshape(b, t)
    got = ngram_hashes(spec, ids, layer)
    assert got.dtype == np.int64 and got.shape == (b, t, spec.n_hash_cols)
    np.testing.assert_array_equal(got, _reference(spec, ids, layer))
    np.testing.assert_array_equal(ngram_hashes_numpy(spec, ids, layer), got)
    assert (got >= 0).all() and (got < np.array(spec.bucket_sizes(layer))).all()


def test_long_batch_rows_of_different_content_and_single_sequence():
    spec = EngramSpec.demo()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, spec.compressed_vocab_size, size=(4, 5000))
    ids[1, :100] = spec.compressed_vocab_size - 1
    got = ngram_hashes(spec, ids, 15)
    np.testing.assert_array_equal(got, _reference(spec, ids, 15))
    np.testing.assert_array_equal(ngram_hashes(spec, ids, 15, threads=2), got)  # threaded
    np.testing.assert_array_equal(ngram_hashes_numpy(spec, ids, 15), got)
    np.testing.assert_array_equal(ngram_hashes(spec, ids[2], 15), got[2])
    # pad handling is per row: row 3's first position uses pad, not row 2's tail
    np.testing.assert_array_equal(ngram_hashes(spec, ids[3:4], 15)[0], got[3])


def test_overflow_and_floor_modulo_against_python_ints():
    spec = EngramSpec.demo()
    m = spec.multipliers(1)
    ids = np.array([[99091, 99090, 99089, 7]])
    got = ngram_hashes(spec, ids, 1)
    primes = spec.bucket_sizes(1)
    for t in range(4):
        back = [ids[0, t - k] if t - k >= 0 else spec.pad_id for k in range(3)]
        for n in (2, 3):
            for j in range(8):
                col = (n - 2) * 8 + j
                assert got[0, t, col] == scalar_hash(back[:n], m[:n], primes[col])


def test_negative_ids_and_negative_mixes_take_the_floor_modulo():
    spec = EngramSpec.small(compressed_vocab_size=50)
    ids = np.array([[-1, -7, 3, -(2**40), 2**62]])  # negatives pass through compression
    np.testing.assert_array_equal(ngram_hashes(spec, ids, 1), _reference(spec, ids, 1))


def test_empty_inputs_keep_their_shape():
    spec = EngramSpec.demo()
    assert ngram_hashes(spec, np.zeros(0, np.int64), 1).shape == (0, 16)
    assert ngram_hashes(spec, np.zeros((3, 0), np.int64), 1).shape == (3, 0, 16)


def test_compression_map_and_negative_passthrough():
    table = np.array([0, 0, 1, 2, 2])
    np.testing.assert_array_equal(compress_ids([4, 3, -1, 0], table), [2, 2, -1, 0])
    with pytest.raises(SpecError, match="outside the compression table"):
        compress_ids([5], table)


def test_table_rows_add_head_offsets():
    spec = EngramSpec.small(rows_per_head=10, n_head_per_ngram=2)
    rows = table_rows(spec, np.zeros((1, spec.n_hash_cols), dtype=np.int64), 1)
    sizes = spec.bucket_sizes(1)
    assert rows[0].tolist() == [0, sizes[0], sizes[0] + sizes[1], sum(sizes[:3])]


def test_bad_spec_and_layer_are_clear_errors():
    with pytest.raises(SpecError, match="one size per order"):
        EngramSpec(layer_ids=[1], engram_vocab_sizes=[10], max_ngram_size=3, n_head_per_ngram=1,
                   head_dim=32, compressed_vocab_size=10, pad_id=0)
    with pytest.raises(SpecError, match="multiple of the scale block"):
        EngramSpec.small(head_dim=48)
    with pytest.raises(SpecError, match="layer 3 has no Engram table"):
        EngramSpec.small().bucket_sizes(3)


def test_fingerprint_changes_with_what_decides_bytes():
    base = EngramSpec.small()
    assert base.fingerprint == EngramSpec.small().fingerprint and len(base.fingerprint) == 32
    for other in (EngramSpec.small(seed=1), EngramSpec.small(head_dim=128),
                  EngramSpec.small(rows_per_head=1001), EngramSpec.small(layer_ids=(1, 15))):
        assert other.fingerprint != base.fingerprint


def test_fingerprint_needs_no_tokenizer():
    """The pad id (the tokenizer's map) decides no table byte: a spec from
    the config alone (storage_of_config) has the fingerprint of the one
    built with the token map, so a table service and a client without the
    tokenizer match."""
    base = EngramSpec.small()
    assert EngramSpec.from_dict({**base.to_dict(), "pad_id": 7}).fingerprint == base.fingerprint
    config = {"text_config": {
        "engram_layer_ids": [1, 14], "engram_vocab_size": 1000, "engram_max_ngram_size": 3,
        "engram_n_heads": 4, "engram_head_dim": 64, "engram_compressed_vocab_size": 1000,
        "engram_pad_token_id": 3}}
    token_map = np.arange(1000, dtype=np.int64)[::-1].copy()  # pad 3 -> compressed 996
    full = EngramSpec.from_config(config, token_map)
    storage = EngramSpec.storage_of_config(config)
    assert full.pad_id == 996 and storage.pad_id == 0
    assert storage.fingerprint == full.fingerprint == base.fingerprint
    assert storage.bucket_sizes(14) == full.bucket_sizes(14)


@pytest.mark.parametrize("vocab", [(2, 3), (1 << 20, 7), (1 << 40, (1 << 33) + 5)])
def test_native_floor_modulo_by_invariant_primes_is_exact(vocab):
    """Tiny primes (2, 3, 5), mid-size and ~2^40 ones: the multiply-shift
    remainders equal numpy's floor modulo over the whole int64 range."""
    spec = EngramSpec(layer_ids=[3], engram_vocab_sizes=vocab, max_ngram_size=3,
                      n_head_per_ngram=3, head_dim=64, compressed_vocab_size=7, pad_id=1)
    rng = np.random.default_rng(sum(vocab))
    ids = np.concatenate([rng.integers(0, 1 << 62, 4000), [0, 1, (1 << 63) - 1, -1, -(1 << 63)]])
    np.testing.assert_array_equal(ngram_hashes(spec, ids, 3), ngram_hashes_numpy(spec, ids, 3))
