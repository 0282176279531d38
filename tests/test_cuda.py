"""CUDA paths: registration, zero-copy device views, UVA and staged lookups.
They run where an NVIDIA GPU and the CUDA runtime are present and skip,
printing why, everywhere else."""

import numpy as np
import pytest
import torch

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import cudart as cuda
from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint
from numa_engram.errors import LookupIdError
from numa_engram.model.hashing import ngram_hashes

AVAILABLE, WHY_NOT = cuda.available()
if AVAILABLE and not torch.cuda.is_available():
    AVAILABLE, WHY_NOT = False, "the CUDA runtime loads but this torch build has no CUDA"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not AVAILABLE, reason=f"no usable GPU: {WHY_NOT}")]


@pytest.fixture
def table(tmp_path):
    spec = EngramSpec.small(rows_per_head=5000, head_dim=128)
    ckpt = str(write_synthetic_checkpoint(tmp_path / "c.safetensors", spec, raw=True))
    t = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 2, 1),
                                 checkpoint=ckpt, register_device=0)
    yield spec, t
    t.close()


def _bits(x):
    return x.cpu().view(torch.int16).numpy()


def test_uva_lookup_is_zero_copy_and_bit_exact(table):
    spec, t = table
    view = t.device_view()
    assert view.weights.data_ptr() == t.weights.ctypes.data  # UVA: host pointer is device pointer
    ids = ngram_hashes(spec, np.random.default_rng(0).integers(0, 1000, 4096), 1)
    ids[::5] = -1
    got = t.lookup_cuda(torch.from_numpy(ids).cuda())
    np.testing.assert_array_equal(_bits(got), _bits(t.lookup(ids)))
    np.testing.assert_array_equal(_bits(view.lookup_torch(torch.from_numpy(ids).cuda())),
                                  _bits(got))
    bad = torch.from_numpy(ids).cuda()
    bad[3, 5] = 10**9
    t.lookup_cuda(bad)  # no host sync: recorded on the device
    with pytest.raises(LookupIdError, match="token 3, column 5"):
        t.check_device_errors()
    with pytest.raises(LookupIdError, match="on the host"):
        t.lookup_cuda(ids)


def test_graph_capture_replays_new_ids(table):
    spec, t = table
    static_ids = torch.zeros((512, spec.n_hash_cols), dtype=torch.int64, device="cuda")
    out = torch.empty((512, 4, 128), dtype=torch.bfloat16, device="cuda")
    t.lookup_cuda(static_ids, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t.lookup_cuda(static_ids, out=out)
    for seed in range(3):
        ids = ngram_hashes(spec, np.random.default_rng(seed).integers(0, 1000, 512), 1)
        static_ids.copy_(torch.from_numpy(ids))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_bits(out), _bits(t.lookup(ids)))


def test_cuda_prefetch_backend(table):
    from numa_engram.lookup.prefetch import PrefetchScheduler

    spec, t = table
    ids = torch.from_numpy(ngram_hashes(spec, np.arange(100), 1)).cuda()
    with PrefetchScheduler({1: lambda i, out: t.lookup_cuda(i, out=out)}, {1: (4, 128)},
                           max_tokens=128, backend="cuda") as s:
        s.submit(1, ids)
        got = s.wait(1)
        torch.cuda.synchronize()
    np.testing.assert_array_equal(_bits(got), _bits(t.lookup(ids.cpu().numpy())))


def test_ple_rows_on_the_gpu_are_zero_copy_and_equal_the_cpu_lookup(tmp_path):
    from numa_engram.checkpoints.synthetic import write_ple_checkpoint
    from numa_engram.model.ple import PLESpec
    from numa_engram.tables.pletable import SharedPLETable

    spec = PLESpec(layer_ids=[2], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=30000, split_ngram_parts=7)
    ckpt = str(write_ple_checkpoint(tmp_path / "p.safetensors", spec, seed=3))
    with SharedPLETable.create(spec, 2, etp_rank=1, etp_size=2, checkpoint=ckpt,
                               mode="independent", register_device=0) as table:
        rows = table.device_rows()
        assert rows.raw.data_ptr() == table.weights.ctypes.data
        ids = np.random.default_rng(0).integers(0, spec.rows(2), (4096, spec.n_heads))
        dev_ids = torch.from_numpy(ids).cuda()
        got = table.lookup_cuda(dev_ids)
        np.testing.assert_array_equal(_bits(got), _bits(table.lookup(ids)))
        packed = table.lookup_cuda(dev_ids, packed=True)
        np.testing.assert_array_equal(packed.cpu().numpy(), table.lookup_packed(ids))
        bad = dev_ids.clone()
        bad[7, 3] = spec.rows(2)
        table.lookup_cuda(bad)
        with pytest.raises(LookupIdError, match=f"first {spec.rows(2)} "):
            rows.check_errors()


def test_tier_mapped_stages_rows_through_pinned_buffers_to_the_device(tmp_path):
    """The vLLM plugin's tier mapped on a GPU (integrations/vllm/mapped.py):
    ids computed on the device, the rows gathered from the checkpoint's
    mapping into pinned host staging, copied to fixed device buffers and
    dequantised there: the CPU lookup's rows bit for bit (BF16 and vLLM's
    packed rows), call after call through the same buffers; the mapped
    pages are never registered with CUDA."""
    from numa_engram.integrations.vllm import mapped

    spec = EngramSpec.small(rows_per_head=5000, head_dim=128)
    ckpt = str(write_synthetic_checkpoint(tmp_path / "m.safetensors", spec, seed=2))
    shard = shard_heads(spec.bucket_sizes(1), 2, 1)
    heads = shard.head_end - shard.head_start
    with SharedEngramTable.create(spec, 1, shard, checkpoint=ckpt, tier="mapped") as t:
        assert t.tier == "mapped" and t.registration is None
        staging = mapped.Staging(64, {"weights": (heads, spec.head_dim),
                                      "scales": (heads, spec.scales_per_row)},
                                 (spec.n_hash_cols,), 0)
        assert staging.host["weights"].is_pinned() and staging.device["weights"].is_cuda
        ahead = mapped.ReadAhead()
        for seed in range(3):
            ids = ngram_hashes(spec, np.random.default_rng(seed).integers(0, 1000, 64), 1)
            ids = np.where(ids < 0, -1, ids + spec.head_offsets(1))  # global, as vLLM's
            ids[::7] = -1
            want = t.lookup(ids, id_format="global")
            out = torch.empty((64, heads, spec.head_dim), dtype=torch.bfloat16, device="cuda")
            mapped.engram_lookup(t, staging, ahead, torch.from_numpy(ids).cuda(), out)
            np.testing.assert_array_equal(_bits(out), _bits(want))
            w, s = t.lookup(ids, id_format="global", packed=True)
            packed = torch.empty((64, heads, spec.head_dim + spec.scales_per_row),
                                 dtype=torch.uint8, device="cuda")
            mapped.engram_lookup(t, staging, ahead, torch.from_numpy(ids).cuda(), packed)
            np.testing.assert_array_equal(packed.cpu().numpy(),
                                          np.concatenate([w.numpy(), s.numpy()], axis=-1))
        assert ahead.lookups == 6
