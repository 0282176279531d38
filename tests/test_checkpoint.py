import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from numa_engram.checkpoint import (
    TensorNames,
    load_rows,
    synthetic_layer,
    write_synthetic_checkpoint,
)
from numa_engram.errors import CheckpointError
from numa_engram.sharding import shard_heads
from numa_engram.spec import EngramSpec

SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64)  # 8 heads


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return write_synthetic_checkpoint(path, SPEC, raw=True)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("method", ["pread", "slice"])
def test_every_shard_reads_back_exactly(ckpt, tp, method):
    for layer in SPEC.layer_ids:
        w_all, s_all = synthetic_layer(SPEC, layer, raw=True)
        for rank in range(tp):
            if (tp - 1) * -(-SPEC.n_hash_cols // tp) >= SPEC.n_hash_cols:
                pytest.skip(f"{tp} shards of {SPEC.n_hash_cols} heads is not head-wise valid")
            info = shard_heads(SPEC.bucket_sizes(layer), tp, rank)
            w = np.zeros((info.num_rows, 64), np.uint8)
            s = np.zeros((info.num_rows, 2), np.uint8)
            seen = []
            load_rows(ckpt, SPEC, layer, info.row_start, info.row_end, w, s, method=method,
                      chunk_bytes=4096, progress=lambda d, t, acc=seen: acc.append((d, t)))
            np.testing.assert_array_equal(w, w_all[info.row_start:info.row_end])
            np.testing.assert_array_equal(s, s_all[info.row_start:info.row_end])
            assert seen[-1][0] == seen[-1][1] == info.num_rows * SPEC.row_bytes


def test_files_hold_real_fp8_dtypes(ckpt):
    from safetensors import safe_open

    with safe_open(str(ckpt), framework="pt") as f:
        w_name, s_name = TensorNames().of(1)
        assert f.get_tensor(w_name).dtype == torch.float8_e4m3fn
        assert f.get_tensor(s_name).dtype == torch.float8_e8m0fnu


def test_missing_tensor_wrong_shape_and_dtype(tmp_path, ckpt):
    w = np.zeros((10, 64), np.uint8)
    s = np.zeros((10, 2), np.uint8)
    with pytest.raises(CheckpointError, match="in none of"):
        load_rows(ckpt, SPEC, 1, 0, 10, w, s, names=TensorNames("nope.{layer}", "x.{layer}"))
    bad = tmp_path / "bad.safetensors"
    w_name, s_name = TensorNames().of(1)
    save_file({w_name: torch.zeros((5, 64), dtype=torch.uint8),
               s_name: torch.zeros((SPEC.rows(1), 2), dtype=torch.float32)}, str(bad))
    with pytest.raises(CheckpointError, match=r"has shape \[5, 64\]"):
        load_rows(bad, SPEC, 1, 0, 10, w, s)
    save_file({w_name: torch.zeros((SPEC.rows(1), 64), dtype=torch.uint8),
               s_name: torch.zeros((SPEC.rows(1), 2), dtype=torch.float32)}, str(bad))
    with pytest.raises(CheckpointError, match="dtype F32"):
        load_rows(bad, SPEC, 1, 0, 10, w, s)
    with pytest.raises(CheckpointError, match="outside layer"):
        load_rows(ckpt, SPEC, 1, 0, SPEC.rows(1) + 1, w, s)
    with pytest.raises(CheckpointError, match="destination shapes"):
        load_rows(ckpt, SPEC, 1, 0, 11, w, s)
