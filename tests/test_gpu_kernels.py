"""The fused GPU lookup kernel, run on CPU tensors by Triton's interpreter
(TRITON_INTERPRET=1): bit-exact with the CPU kernel on every (weight byte,
scale byte) pair, DEAD and bad ids, persistent grids of several sizes,
packed output, global rows.  On a GPU host tests/test_cuda.py and
tools/gpu_check.py run the same kernel for real."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from numa_engram import EngramSpec  # noqa: E402
from numa_engram.checkpoints.synthetic import synthetic_layer  # noqa: E402
from numa_engram.errors import LookupIdError  # noqa: E402
from numa_engram.lookup.cpu import lookup_rows  # noqa: E402
from numa_engram.model.fp8 import dequantize_rows  # noqa: E402
from numa_engram.model.hashing import ngram_hashes  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'numa_engram[test]')")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is not 1 in this process: the CPU runs need the interpreter",
                allow_module_level=True)

from numa_engram.lookup import triton_kernels as gk  # noqa: E402


def _bits(x):
    return x.view(torch.int16).numpy()


def _run(w, s, ids, *, head_start, sizes, base=None, max_sms=4, packed=False, block=32):
    sizes_t = torch.tensor(np.asarray(sizes, np.int64))
    offsets = torch.tensor(np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64))
    base_t = torch.zeros_like(sizes_t) if base is None else torch.tensor(base, dtype=torch.int64)
    ids_t = ids if torch.is_tensor(ids) else torch.from_numpy(ids)
    shape = (ids_t.shape[0], len(sizes), w.shape[1])
    err = gk.new_error_record("cpu")
    if packed:
        out = torch.empty(shape, dtype=torch.uint8)
        out_s = torch.empty((*shape[:2], shape[2] // block), dtype=torch.uint8)
    else:
        out, out_s = torch.empty(shape, dtype=torch.int16), None
    gk.lookup(torch.from_numpy(w), torch.from_numpy(s), ids_t, head_start=head_start,
              sizes=sizes_t, offsets=offsets, base=base_t, out=out, err=err, out_scales=out_s,
              block=block, max_sms=max_sms)
    return (out, out_s, err) if packed else (out, err)


def test_every_weight_and_scale_byte_matches_the_cpu_kernel():
    w = np.tile(np.arange(256, dtype=np.uint8), (256, 1))           # row r: every weight byte
    s = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)  # ... with scale byte r
    ids = np.arange(256, dtype=np.int64)[:, None]
    out, err = _run(w, s, ids, head_start=0, sizes=[256])
    want = lookup_rows(w, s, ids, head_start=0, bucket_sizes=[256])
    np.testing.assert_array_equal(out.numpy(), _bits(want))
    assert err.tolist() == [0, gk.NO_ERROR, 0]


@pytest.fixture(scope="module")
def shard():
    spec = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64)
    w, s = synthetic_layer(spec, 1, raw=True)
    return spec, w, s


@pytest.mark.parametrize("max_sms", [1, 2, 3, 7, 64])
def test_random_ids_with_dead_and_bad_ones_on_persistent_grids(shard, max_sms):
    spec, w, s = shard
    sizes = spec.bucket_sizes(1)[2:6]
    first = sum(spec.bucket_sizes(1)[:2])
    ws, ss = w[first:first + sum(sizes)], s[first:first + sum(sizes)]
    ids = ngram_hashes(spec, np.random.default_rng(max_sms).integers(0, 1000, 123), 1)
    ids[::7, 3] = -1
    good = ids.copy()
    ids[5, 4] = sizes[2] + 3      # bad: past its head's buckets
    ids[40, 2] = -7               # bad: negative, not DEAD
    out, err = _run(ws, ss, ids, head_start=2, sizes=sizes, max_sms=max_sms)
    good[5, 4] = good[40, 2] = -1
    want = lookup_rows(ws, ss, good, head_start=2, bucket_sizes=sizes)
    np.testing.assert_array_equal(out.numpy(), _bits(want))  # bad rows are zeros
    assert err.tolist() == [2, 5 * 4 + 2, sizes[2] + 3]


def test_packed_rows_dequantise_to_the_lookup(shard):
    spec, w, s = shard
    sizes = spec.bucket_sizes(1)
    ids = ngram_hashes(spec, np.random.default_rng(9).integers(0, 1000, 50), 1)
    ids[3] = -1
    pw, ps, err = _run(w, s, ids, head_start=0, sizes=sizes, packed=True)
    got = dequantize_rows(pw.reshape(-1, 64), ps.reshape(-1, 2)).view(50, len(sizes), 64)
    want = lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not pw[3].any() and err[0] == 0


def test_global_int32_rows_strided_along_tokens(shard):
    spec, w, s = shard
    sizes = spec.bucket_sizes(1)
    ids = ngram_hashes(spec, np.random.default_rng(2).integers(0, 1000, 64), 1)
    ids[::3, 1] = -1
    rows = np.where(ids >= 0, ids + spec.head_offsets(1), -1).astype(np.int32)
    wide = torch.zeros((64, 3, len(sizes)), dtype=torch.int32)
    wide[:, 1] = torch.from_numpy(rows)
    out, err = _run(w, s, wide[:, 1], head_start=0, sizes=sizes, base=spec.head_offsets(1))
    want = lookup_rows(w, s, ids, head_start=0, bucket_sizes=sizes)
    np.testing.assert_array_equal(out.numpy(), _bits(want))
    assert err[0] == 0


def test_device_shard_host_side_on_cpu_tensors(shard):
    """DeviceShard's own code (ids on its device, error record, raise and
    clear) with the kernel interpreted: a CPU 'device'."""
    from numa_engram.lookup.gpu import DeviceShard

    spec, w, s = shard
    sizes = np.asarray(spec.bucket_sizes(1), np.int64)
    view = object.__new__(DeviceShard)
    view.device, view.lease, view.head_start, view.block = torch.device("cpu"), None, 0, 32
    view.weights, view.scales = torch.from_numpy(w), torch.from_numpy(s)
    view.sizes = torch.from_numpy(sizes)
    view.offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(sizes)[:-1])))
    view.global_base = torch.from_numpy(spec.head_offsets(1))
    view._host_sizes, view._host_global_base = sizes, spec.head_offsets(1)
    view._formats = set()
    view.zero_base = torch.zeros_like(view.sizes)
    view.errors = gk.new_error_record("cpu")
    ids = torch.from_numpy(ngram_hashes(spec, np.arange(30), 1))
    np.testing.assert_array_equal(_bits(view.lookup(ids)), _bits(view.lookup_torch(ids)))
    with pytest.raises(LookupIdError, match="on the host"):
        view.lookup(ids.numpy())
    bad = ids.clone()
    bad[4, 6] = 10**9
    view.lookup(bad)  # no raise, no sync: recorded
    with pytest.raises(LookupIdError, match="hash id 1000000000 at token 4, column 6") as caught:
        view.check_errors()
    assert "head 6's buckets [0, " in str(caught.value)  # the CPU path's message
    view.check_errors()  # cleared


# PLE (Qwen4-Exp) row gather: the same kernel file, run on CPU tensors.

def _nan_canonical(bits):
    """BF16 bits with every NaN as 0x7FC0 (torch's products carry other
    NaN payloads; the value is the same)."""
    u = bits.view(np.uint16)
    nan = ((u & 0x7F80) == 0x7F80) & ((u & 0x7F) != 0)
    return np.where(nan, np.uint16(0x7FC0), u).view(np.int16)


def _ple_rows(table, dtype, *, row_start=0, total_rows=None, scale=None):
    from numa_engram.lookup.gpu import PLEDeviceRows

    total = table.shape[0] + row_start if total_rows is None else total_rows
    return PLEDeviceRows(torch.from_numpy(table), dtype=dtype, row_start=row_start,
                         total_rows=total, scale=scale)


@pytest.mark.parametrize("scale", [0.0125, 3.0e38, 1e-40, float("nan"), float("inf"), 0.0])
def test_ple_fp8_rows_equal_the_cpu_path_and_vllms_rule_for_every_byte(scale):
    from numa_engram.lookup.ple import PLERows

    table = np.tile(np.arange(256, dtype=np.uint8), (4, 1))[:, :160].copy()  # 160: not 2^k
    table[2] = np.arange(96, 256, dtype=np.uint8)
    ids = torch.tensor([[0, 1], [2, 3], [2, 0]])
    dev = _ple_rows(table, "float8_e4m3fn", scale=scale)
    got = dev.lookup(ids)
    cpu = PLERows(table, dtype="float8_e4m3fn", row_start=0, total_rows=4, scale=scale)
    np.testing.assert_array_equal(_bits(got), cpu.rows_bf16(ids.numpy()).view(np.int16))
    np.testing.assert_array_equal(_bits(got), _nan_canonical(_bits(dev.lookup_torch(ids))))
    dev.check_errors()


@pytest.mark.parametrize("max_sms", [1, 3, 64])
def test_ple_shard_rows_zeros_for_other_shards_and_a_record_for_bad_ids(max_sms):
    from numa_engram.lookup.ple import reference_rows

    rng = np.random.default_rng(max_sms)
    table = rng.integers(0, 256, (300, 48), dtype=np.uint8)
    table[table == 0x7F] = 0  # NaN bytes aside: compared by value below too
    dev = _ple_rows(table, "float8_e4m3fn", row_start=1000, total_rows=2000, scale=0.5)
    ids = torch.from_numpy(rng.integers(900, 1400, (37, 3)).astype(np.int32))
    got = dev.lookup(ids, max_sms=max_sms)
    want = reference_rows(table, ids.numpy(), row_start=1000, scale=0.5)
    np.testing.assert_array_equal(_bits(got), want.view(np.int16))
    assert not _bits(got)[(ids.numpy() < 1000) | (ids.numpy() >= 1300)].any()
    packed = dev.lookup(ids, packed=True, max_sms=max_sms)
    np.testing.assert_array_equal(packed.numpy(), _bits(dev.lookup_torch(ids, packed=True))
                                  .view(np.uint8).reshape(packed.shape))
    bad = ids.clone()
    bad[5, 1], bad[30, 0] = 2000, -3
    got = dev.lookup(bad, max_sms=max_sms)  # no raise, no sync: recorded
    assert not _bits(got)[5, 1].any() and not _bits(got)[30, 0].any()
    with pytest.raises(LookupIdError, match=r"2 PLE row id\(s\) .* first 2000 \(position 16\)"):
        dev.check_errors()
    dev.check_errors()  # cleared
    with pytest.raises(LookupIdError, match="PLE row id 2000 \\(position 16\\)"):
        dev.lookup_torch(bad)


def test_ple_bf16_rows_and_the_checks_on_ids_and_out():
    rng = np.random.default_rng(7)
    table = rng.integers(0, 256, (50, 2 * 24), dtype=np.uint8)
    dev = _ple_rows(table, "bfloat16", row_start=10, total_rows=100)
    ids = torch.arange(0, 100, 3)
    got = dev.lookup(ids)
    assert got.shape == (34, 24) and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(dev.lookup_torch(ids)))
    local = ids.numpy() - 10
    inside = (local >= 0) & (local < 50)
    np.testing.assert_array_equal(_bits(got)[inside], table.view(np.int16)[local[inside]])
    out = torch.empty((34, 24), dtype=torch.bfloat16)
    assert dev.lookup(ids, out) is out
    with pytest.raises(ValueError, match=r"contiguous torch.bfloat16 tensor \[34, 24\]"):
        dev.lookup(ids, torch.empty((34, 23), dtype=torch.bfloat16))
    with pytest.raises(LookupIdError, match="on the host"):
        dev.lookup(ids.numpy())
    with pytest.raises(LookupIdError, match="int64 or int32, got torch.float32"):
        dev.lookup(ids.float())
    assert dev.lookup(torch.empty((0, 2), dtype=torch.int64)).shape == (0, 2, 24)
