"""Qwen4-Exp's PLE tables: layout, multipliers, hash ids, row-range shards
and rows, each against vLLM 0.31.0's own ``qwen4_exp`` code loaded from its
wheel (its Triton kernels under the interpreter, its torch path otherwise),
atol 0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from numa_engram.errors import LookupIdError, SpecError
from numa_engram.lookup.ple import PLERows, bf16_lut, bf16_value, reference_rows
from numa_engram.model.ple import PLESpec
from numa_engram.model.plehashing import PLEHistory, ple_ids, ple_ids_numpy

from .support import vllm_harness as harness
from .support.kernel_paths import assert_prints_true
from .support.untraced import untraced

torch = pytest.importorskip("torch")

SMALL = dict(ple_embed_dim=64, vocab_size=5000, eos_token_id=7, ngram_size=3, heads_per_ngram=8,
             ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128)


@pytest.fixture(scope="module")
def vllm():
    root, why = harness.wheel_sources()
    if root is None:
        pytest.skip(why)
    return harness.ple_modules(root)


def vllm_embedding(vllm, spec: PLESpec, layer: int):
    """vLLM's Qwen4ExpNGramEmbedding for the layer, its hashing buffers made
    by vLLM's own classmethods (the table itself is not built)."""
    cls = vllm.nv.Qwen4ExpNGramEmbedding
    emb = cls.__new__(cls)
    torch.nn.Module.__init__(emb)
    dense = spec.dense_index(layer)
    emb.ngram_size, emb.heads_per_ngram = spec.ngram_size, spec.heads_per_ngram
    emb.ngram_heads, emb.eos_token_id = spec.n_heads, spec.eos_token_id
    emb.layer_multipliers = torch.tensor(cls._make_layer_multipliers(
        ngram_size=spec.ngram_size, unigram_vocab_size=spec.vocab_size, seed=spec.seed,
        ple_dense_layer_id=dense), dtype=torch.long)
    sizes, offsets, _ = cls._make_vocab_layout(
        ngram_vocab_size_base=spec.ngram_vocab_size_base, ngram_heads=spec.n_heads,
        ple_dense_layer_id=dense)
    emb.ngram_heads_vocab_sizes = torch.tensor(sizes, dtype=torch.long)
    emb.ngram_heads_offsets = torch.tensor(offsets, dtype=torch.long)
    return emb


@pytest.mark.parametrize("seed,base,ngram,heads", [(1234, 1000, 3, 8), (7, 50_000, 4, 2),
                                                    (0, 20_000_000, 3, 8)])
def test_layout_and_multipliers_equal_vllms(vllm, seed, base, ngram, heads):
    spec = PLESpec(**{**SMALL, "seed": seed, "ngram_vocab_size_base": base, "ngram_size": ngram,
                      "heads_per_ngram": heads, "ple_embed_dim": 16 * (ngram - 1) * heads},
                   layer_ids=[9, 3, 30, 12])
    cls = vllm.nv.Qwen4ExpNGramEmbedding
    assert spec.layer_ids == (3, 9, 12, 30)
    for dense, layer in enumerate(spec.layer_ids):
        sizes, offsets, total = cls._make_vocab_layout(
            ngram_vocab_size_base=base, ngram_heads=spec.n_heads, ple_dense_layer_id=dense)
        assert list(spec.bucket_sizes(layer)) == sizes
        assert spec.head_offsets(layer).tolist() == offsets
        assert spec.rows(layer) == -(-total // 128) * 128
        assert spec.multipliers(layer).tolist() == cls._make_layer_multipliers(
            ngram_size=ngram, unigram_vocab_size=spec.vocab_size, seed=seed,
            ple_dense_layer_id=dense)


def random_batch(rng, spec: PLESpec, n_reqs: int, max_len: int, eos_rate: float):
    lengths = rng.integers(1, max_len + 1, size=n_reqs)
    qs = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    ids = rng.integers(0, spec.vocab_size, size=int(qs[-1]), dtype=np.int64)
    ids[rng.random(len(ids)) < eos_rate] = spec.eos_token_id
    ctx = rng.integers(0, spec.vocab_size, size=(n_reqs, spec.ngram_size - 1), dtype=np.int64)
    ctx[rng.random(ctx.shape) < 0.3] = spec.eos_token_id
    return ids, qs, ctx


@pytest.mark.parametrize("seed", [1234, 99])
@pytest.mark.parametrize("ngram", [3, 5])
def test_ids_equal_vllms_torch_path_and_triton_kernel(vllm, seed, ngram):
    """Random packed batches (requests of 1-40 tokens, EOS inside the chunks
    and in the contexts), several layers: our native pass, our numpy path,
    vLLM's torch path and vLLM's Triton kernel give the same ids."""
    spec = PLESpec(**{**SMALL, "seed": seed, "ngram_size": ngram, "heads_per_ngram": 2,
                      "ple_embed_dim": 8 * (ngram - 1)}, layer_ids=[2, 5, 11])
    rng = np.random.default_rng(seed)
    compared = 0
    for trial in range(4):
        ids, qs, ctx = random_batch(rng, spec, n_reqs=1 + trial * 3, max_len=40,
                                    eos_rate=0.08)
        ours = ple_ids(spec, spec.layer_ids, ids, qs, ctx)
        for i, layer in enumerate(spec.layer_ids):
            emb = vllm_embedding(vllm, spec, layer)
            t_ids, t_qs, t_ctx = (torch.from_numpy(a.copy()) for a in (ids, qs, ctx))
            with untraced():
                torch_path = emb.compute_ngram_ids(t_ids, t_qs, t_ctx).numpy()
                triton_path = vllm.ops.ple_ngram_ids(
                    t_ids, t_qs, t_ctx, emb.layer_multipliers, emb.ngram_heads_vocab_sizes,
                    emb.ngram_heads_offsets, spec.eos_token_id, spec.heads_per_ngram).numpy()
            np.testing.assert_array_equal(ours[:, i], torch_path)
            np.testing.assert_array_equal(ours[:, i], triton_path)
            np.testing.assert_array_equal(ple_ids_numpy(spec, layer, ids, qs, ctx), torch_path)
            compared += torch_path.size
    assert compared > 1000


def test_many_values_on_long_streams_equal_vllms_torch_path(vllm):
    """100,000+ ids a layer at V4-like sizes (vocab 151,936, base 20M, the
    defaults): the native pass against vLLM's torch path."""
    spec = PLESpec(layer_ids=[4, 8], ple_embed_dim=2560, vocab_size=151_936,
                   eos_token_id=151_645)
    rng = np.random.default_rng(5)
    ids, qs, ctx = random_batch(rng, spec, n_reqs=12, max_len=1200, eos_rate=0.01)
    ours = ple_ids(spec, spec.layer_ids, ids, qs, ctx)
    for i, layer in enumerate(spec.layer_ids):
        emb = vllm_embedding(vllm, spec, layer)
        with untraced():
            want = emb.compute_ngram_ids(*(torch.from_numpy(a.copy()) for a in (ids, qs, ctx)))
        np.testing.assert_array_equal(ours[:, i], want.numpy())
    assert ours.size >= 100_000


def test_history_hashes_chunks_as_the_whole_sequence(vllm):
    """Requests fed in random chunks (prefill pieces, then 1-token decode
    steps, two slots interleaved, one restarted): each token's ids equal
    those of its whole sequence hashed at once by vLLM."""
    spec = PLESpec(**SMALL, layer_ids=[1, 2])
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, spec.vocab_size, size=n, dtype=np.int64) for n in (60, 45, 30)]
    for s in seqs:
        s[rng.random(len(s)) < 0.05] = spec.eos_token_id
    history = PLEHistory(spec, max_requests=4)
    got: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    pos = [0, 0, 0]
    plan = [(0, 1, 17), (0, 1, 8)] + [(0, 1, 1)] * 10
    plan += [(2, None, 25)] + [(2, None, 1)] * 5  # sequence 2 restarts slot 1
    for a, b, n in plan:
        reqs = [(r, slot) for r, slot in ((a, 0), (b, 1)) if r is not None] if b is not None \
            else [(a, 1)]
        chunk, qs, slots, restart = [], [0], [], []
        for r, slot in reqs:
            take = seqs[r][pos[r]:pos[r] + n]
            chunk.append(take)
            qs.append(qs[-1] + len(take))
            slots.append(slot)
            restart.append(pos[r] == 0)
        out = history.ids(spec.layer_ids, np.concatenate(chunk), qs, slots, restart=restart)
        for k, (r, _) in enumerate(reqs):
            got[r].append(out[qs[k]:qs[k + 1]])
            pos[r] += qs[k + 1] - qs[k]
    for r in (0, 1, 2):
        mine = np.concatenate(got[r])
        whole = seqs[r][:len(mine)]
        for i, layer in enumerate(spec.layer_ids):
            emb = vllm_embedding(vllm, spec, layer)
            with untraced():
                want = emb.compute_ngram_ids(torch.from_numpy(whole),
                                             torch.tensor([0, len(whole)]),
                                             torch.full((1, 2), spec.eos_token_id))
            np.testing.assert_array_equal(mine[:, i], want.numpy())


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_row_range_shards_equal_vocab_parallel_embeddings(vllm, world):
    spec = PLESpec(layer_ids=[1, 2], ple_embed_dim=2560, vocab_size=151_936,
                   eos_token_id=151_645)
    rows = spec.rows(2)
    for rank in range(world):
        got = vllm.vocab.VocabParallelEmbedding._get_indices(rows, rows, rows, rows, rank, world)
        assert spec.shard_rows(2, rank, world) == (got.org_vocab_start_index,
                                                   got.org_vocab_end_index)


def test_checkpoint_parts_tile_the_table_as_vllms_loader_copies_them(vllm):
    """``part_rows`` are the rows vLLM's loader expects in
    ``ngram_embedding.shard_{i}``; copied by vLLM's overlap rule into each
    TP range they fill every row exactly once."""
    spec = PLESpec(**{**SMALL, "split_ngram_parts": 7}, layer_ids=[1])
    rows, filled = spec.rows(1), np.zeros(spec.rows(1), dtype=np.int64)
    for rank in range(2):
        start, end = spec.shard_rows(1, rank, 2)
        dest = torch.zeros(end - start, 1, dtype=torch.int64)
        for part in range(spec.split_ngram_parts):
            p0, p1 = spec.part_rows(1, part)
            src = torch.arange(p0, p1, dtype=torch.int64).reshape(-1, 1)
            vllm.ple.copy_ple_embedding_shard_(dest, src, checkpoint_start=p0, tp_start=start,
                                                  tp_end=end)
        filled[start:end] += 1
        assert dest.reshape(-1).tolist() == list(range(start, end))
    assert (filled == 1).all() and rows % 128 == 0


def canonical(bits: torch.Tensor) -> np.ndarray:
    """BF16 bits with every NaN written 0x7FC0 (NaN payloads are not data)."""
    out = bits.view(torch.int16).numpy().view(np.uint16).copy()
    out[np.isnan(bits.float().numpy())] = 0x7FC0
    return out


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7e-5, 2.5e35, 1e-38])
def test_fp8_rows_with_a_per_tensor_scale_equal_vllms_dequantize(vllm, scale):
    """Every byte (NaNs included) and awkward scales (rounding to BF16,
    overflow, subnormals): our rows equal vLLM's ``F.embedding`` of the FP8
    weight then its method's ``dequantize`` to BF16."""
    rng = np.random.default_rng(1)
    table = rng.integers(0, 256, size=(4096, 160), dtype=np.uint8)
    table[:256, 0] = np.arange(256)
    ids = rng.integers(0, 4096, size=3000)
    ids[:256] = np.arange(256)
    rows = PLERows(table, dtype="float8_e4m3fn", row_start=0, total_rows=4096, scale=scale)
    weight = torch.from_numpy(table).view(torch.float8_e4m3fn)
    layer = torch.nn.Module()
    layer.weight_scale = torch.tensor(scale, dtype=torch.float32)
    looked = torch.nn.functional.embedding(torch.from_numpy(ids), weight)
    want = vllm.common.Qwen4ExpPLEFp8EmbeddingMethod().dequantize(layer, looked, torch.bfloat16)
    got = rows.rows_bf16(ids)
    np.testing.assert_array_equal(np.where(got == 0x7FC0, 0x7FC0, got), canonical(want))
    np.testing.assert_array_equal(got, reference_rows(table, ids, row_start=0, scale=scale))


def test_the_c_kernels_product_equals_the_byte_table_for_4000_scales():
    """The vectorised C product against ``bf16_lut`` (each byte's BF16 of
    byte x scale, numpy's fp32 product rounded to nearest even): every byte,
    every BF16 exponent's scales (subnormal, huge), zeros, infinities, NaN,
    negative scales; a row width that leaves a vector tail."""
    rng = np.random.default_rng(4)
    patterns = np.concatenate([rng.integers(0, 1 << 16, 4000), [0, 0x8000, 0x7F80, 0xFF80,
                                                                0x7FC0, 0x0001, 0x7F7F]])
    scales = bf16_value(patterns.astype(np.uint16))
    table = np.zeros((256, 259), dtype=np.uint8)
    table[:, :256] = np.arange(256, dtype=np.uint8)[None, :]
    table[:, 256:] = np.arange(3, dtype=np.uint8)[None, :] + 0x7E
    ids = np.arange(256)
    for scale in scales:
        got = PLERows(table, dtype="float8_e4m3fn", row_start=0, total_rows=256,
                      scale=float(scale)).rows_bf16(ids)
        lut = bf16_lut(float(scale))
        np.testing.assert_array_equal(got, lut[table], err_msg=f"scale {scale!r}")


@pytest.mark.slow  # starts an interpreter (~1 s)
@pytest.mark.parametrize("disabled", [(), ("NUMA_ENGRAM_NO_VBMI",), ("NUMA_ENGRAM_NO_AVX512",)],
                         ids=["best", "avx512bw", "portable"])
def test_every_row_path_gives_the_byte_tables_bits(disabled):
    """The AVX-512 VBMI rows (byte permutes of the scale's table's low and
    high bytes, a block of rows at once) where the CPU has them, the
    AVX-512BW row (eight-register word permutes) without VBMI, else the
    portable table read: each gives ``bf16_lut``'s bits for every byte
    under awkward scales, in rows whose width leaves a vector tail (259
    bytes), for calls shorter and longer than the prefetch window (16
    rows), ids outside the shard zeroed, and blocks whose rows are all
    inside it (converted as one run)."""
    code = """
        import numpy as np
        from numa_engram.lookup.ple import PLERows, bf16_lut
        table = np.zeros((300, 259), dtype=np.uint8)
        table[:, :256] = np.arange(256, dtype=np.uint8)[None, :]
        table[:, 256:] = (np.arange(300)[:, None] + np.arange(3)) % 256
        ok = True
        for scale in (1.0, 0.0123, 3.7e-5, 2.5e35, 1e-38, -0.5):
            rows = PLERows(table, dtype="float8_e4m3fn", row_start=100, total_rows=500,
                           scale=scale)
            for n in (1, 15, 16, 17, 40, 3000):
                mixed = (np.arange(n, dtype=np.int64) * 7919) % 500
                for ids in (mixed, mixed % 300 + 100):  # (the second: all in the shard)
                    want = np.where(((ids >= 100) & (ids < 400))[:, None],
                                    bf16_lut(scale)[table[np.clip(ids - 100, 0, 299)]], 0)
                    ok = ok and np.array_equal(rows.rows_bf16(ids), want)
        print(ok)
    """
    assert_prints_true(code, disabled)


def test_bf16_rows_equal_vllms_lookup(vllm):
    rng = np.random.default_rng(2)
    table = rng.integers(0, 256, size=(1000, 2 * 96), dtype=np.uint8)
    ids = rng.integers(0, 1000, size=(50, 16))
    rows = PLERows(table, dtype="bfloat16", row_start=0, total_rows=1000)
    weight = torch.from_numpy(table).view(torch.bfloat16)
    want = vllm.common.Qwen4ExpPLEUnquantizedEmbeddingMethod().dequantize(
        None, torch.nn.functional.embedding(torch.from_numpy(ids), weight), torch.bfloat16)
    np.testing.assert_array_equal(rows.rows_bf16(ids), want.view(torch.int16).numpy()
                                  .view(np.uint16))


def test_row_range_shards_summed_as_vllm_reduces_them_equal_the_whole_table(vllm):
    """Four shards: each one's packed rows equal vLLM's shard lookup
    (``VocabParallelEmbedding``'s own masking, then ``F.embedding``, others'
    rows zeroed; vLLM's pinned-table Triton kernel states the same rule but
    Triton 3.9's interpreter refuses its scalar mask); the raw bytes summed
    as vLLM all-reduces FP8 (as int8) are the whole table's rows, and
    dequantised after the sum equal the unsharded BF16 rows."""
    spec = PLESpec(**SMALL, layer_ids=[1])
    rows = spec.rows(1)
    rng = np.random.default_rng(4)
    table = rng.integers(0, 256, size=(rows, spec.head_dim), dtype=np.uint8)
    ids = rng.integers(0, rows, size=(300, spec.n_heads))
    total = torch.zeros((*ids.shape, spec.head_dim), dtype=torch.int8)
    for rank in range(4):
        start, end = spec.shard_rows(1, rank, 4)
        shard = PLERows(np.ascontiguousarray(table[start:end]), dtype="float8_e4m3fn",
                        row_start=start, total_rows=rows, scale=0.5)
        packed = shard.rows_packed(ids)
        masked, outside = vllm.vocab.get_masked_input_and_mask(
            torch.from_numpy(ids), start, end, 0, rows, rows)
        want = torch.nn.functional.embedding(masked, torch.from_numpy(table[start:end].copy()))
        want.masked_fill_(outside.unsqueeze(-1), 0)
        np.testing.assert_array_equal(packed, want.numpy())
        total += torch.from_numpy(packed).view(torch.int8)
    whole = PLERows(table, dtype="float8_e4m3fn", row_start=0, total_rows=rows, scale=0.5)
    np.testing.assert_array_equal(total.view(torch.uint8).numpy(), table[ids])
    flat = np.ascontiguousarray(total.view(torch.uint8).numpy().reshape(-1, spec.head_dim))
    summed = PLERows(flat, dtype="float8_e4m3fn", row_start=0, total_rows=ids.size, scale=0.5)
    np.testing.assert_array_equal(summed.rows_bf16(np.arange(ids.size)).reshape(
        *ids.shape, spec.head_dim), whole.rows_bf16(ids))


def test_packed_rows_are_pooled_and_a_held_result_is_never_written_again():
    """rows_packed's arrays come from a pool: one nothing refers to any more
    is handed out again (the same memory), one still held (or a slice or
    tensor of it) is not, and every result keeps its rows."""
    import torch

    rng = np.random.default_rng(4)
    table = rng.integers(0, 256, (500, 24), dtype=np.uint8)
    rows = PLERows(table, dtype="float8_e4m3fn", row_start=0, total_rows=500, scale=0.5)
    first_ids, second_ids = rng.integers(0, 500, (2, 3, 4))
    first = rows.rows_packed(first_ids)
    address = first.ctypes.data
    second = rows.rows_packed(second_ids)  # the first is held: another buffer
    assert second.ctypes.data != address
    np.testing.assert_array_equal(first, table[first_ids])
    np.testing.assert_array_equal(second, table[second_ids])
    kept = [first[1], torch.from_numpy(second)]  # a slice of one, a tensor of the other
    taken = {address, second.ctypes.data}
    del first, second
    third = rows.rows_packed(second_ids[::-1].copy())
    assert third.ctypes.data not in taken
    np.testing.assert_array_equal(kept[0], table[first_ids[1]])
    np.testing.assert_array_equal(kept[1].numpy(), table[second_ids])
    reused = third.ctypes.data
    del kept, third
    again = rows.rows_packed(first_ids)  # nothing held now: the last buffer again
    assert again.ctypes.data == reused
    np.testing.assert_array_equal(again, table[first_ids])


def test_row_ids_outside_the_layer_are_refused_naming_the_id():
    rows = PLERows(np.zeros((256, 8), dtype=np.uint8), dtype="float8_e4m3fn", row_start=0,
                   total_rows=256, scale=1.0)
    for bad in (-1, 256, 10**12):
        with pytest.raises(LookupIdError, match=f"{bad}.*256 rows"):
            rows.rows_bf16([3, bad])
    with pytest.raises(LookupIdError, match="integers"):
        rows.rows_packed([1.5])
    with pytest.raises(ValueError, match="per-tensor scale"):
        PLERows(np.zeros((4, 8), dtype=np.uint8), dtype="float8_e4m3fn", row_start=0,
                total_rows=4)


def test_spec_from_config_reads_as_vllm_does(tmp_path):
    """``text_config`` or the top level; seed 1234 and 512 parts when
    absent; a Qwen3.8-Flash-Next-class layer is 320,001,536 rows of 160."""
    text = {"ple_layer_ids": [2, 6], "ple_embed_dim": 2560, "vocab_size": 151_936,
            "eos_token_id": 151_645, "ple_embedding_dtype": "float8_e4m3fn"}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text,
                                                      "split_ngram_parts": 64}))
    spec = PLESpec.from_config(tmp_path / "config.json")
    # (Qwen4ExpConfig drops the top-level split_ngram_parts beside a text_config)
    assert (spec.seed, spec.split_ngram_parts, spec.head_dim, spec.rows(2)) == (
        1234, 512, 160, 320_001_536)
    assert PLESpec.from_config({"text_config": {**text, "split_ngram_parts": 64}}
                               ).split_ngram_parts == 64
    assert spec.dtype == "float8_e4m3fn"
    assert PLESpec.from_config({**text, "seed": 5}).seed == 5
    top = {k: v for k, v in text.items() if k != "ple_embedding_dtype"}
    assert PLESpec.from_config(top).dtype == "bfloat16"
    assert PLESpec.from_config({**top, "quantization_config": {"quant_method": "fp8"}}
                               ).dtype == "float8_e4m3fn"
    assert PLESpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("change,match", [
    ({"ple_layer_ids": []}, "ple_layer_ids"),
    ({"ple_layer_ids": [0, 3]}, "1-based"),
    ({"ple_embed_dim": 2561}, "ple_embed_dim 2561"),
    ({"eos_token_id": [1, 2]}, "eos_token_id must be one integer"),
    ({"eos_token_id": 10**6}, "eos_token_id must be in"),
    ({"ngram_size": 1}, "ngram_size must be in"),
    ({"vocab_size": "big"}, "vocab_size must be an integer"),
    ({"ple_embedding_dtype": "int4"}, "ple_embedding_dtype"),
])
def test_bad_configs_name_the_field(change, match):
    doc = {"ple_layer_ids": [2, 6], "ple_embed_dim": 2560, "vocab_size": 151_936,
           "eos_token_id": 151_645, **change}
    with pytest.raises(SpecError, match=match):
        PLESpec.from_config(doc)


def test_fingerprint_is_storage_only():
    """Two specs that differ only in how ids are hashed (seed, eos, vocab)
    store the same bytes: same fingerprint; any storage fact changes it."""
    a = PLESpec(**SMALL, layer_ids=[1, 2])
    assert a.fingerprint == PLESpec(**{**SMALL, "seed": 9, "eos_token_id": 3,
                                       "vocab_size": 77}, layer_ids=[1, 2]).fingerprint
    for change in ({"ple_embed_dim": 128}, {"ngram_vocab_size_base": 1001},
                   {"dtype": "bfloat16"}, {"make_ngram_vocab_size_divisible_by": 64}):
        assert PLESpec(**{**SMALL, **change}, layer_ids=[1, 2]).fingerprint != a.fingerprint


def test_batch_shapes_are_checked():
    spec = PLESpec(**SMALL, layer_ids=[1])
    with pytest.raises(SpecError, match="query_start"):
        ple_ids(spec, [1], [1, 2, 3], [0, 5])
    with pytest.raises(SpecError, match="context must be"):
        ple_ids(spec, [1], [1, 2, 3], [0, 3], [[1, 2, 3]])
    with pytest.raises(SpecError, match="layer 4 has no PLE table"):
        ple_ids(spec, [4], [1, 2, 3])
    with pytest.raises(SpecError, match="distinct slots"):
        PLEHistory(spec, 2).ids([1], [1, 2], [0, 1, 2], [0, 0])
    assert ple_ids(spec, [1], []).shape == (0, 1, spec.n_heads)
