import os

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
@pytest.mark.parametrize("method, threads", [("pread", 1), ("slice", 1), ("pread", 3)])
def test_every_shard_reads_back_exactly(ckpt, tp, method, threads):
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
                      chunk_bytes=4096, progress=lambda d, t, acc=seen: acc.append((d, t)),
                      threads=threads, cpus=sorted(os.sched_getaffinity(0)))
            np.testing.assert_array_equal(w, w_all[info.row_start:info.row_end])
            np.testing.assert_array_equal(s, s_all[info.row_start:info.row_end])
            assert seen[-1][0] == seen[-1][1] == info.num_rows * SPEC.row_bytes
            assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # monotonic


def test_files_hold_real_fp8_dtypes(ckpt):
    from safetensors import safe_open

    with safe_open(str(ckpt), framework="pt") as f:
        w_name, s_name = TensorNames().of(1)
        assert f.get_tensor(w_name).dtype == torch.float8_e4m3fn
        assert f.get_tensor(s_name).dtype == torch.float8_e8m0fnu


def test_missing_tensor_wrong_shape_and_dtype(tmp_path, ckpt):
    w = np.zeros((10, 64), np.uint8)
    s = np.zeros((10, 2), np.uint8)
    with pytest.raises(CheckpointError, match="is in none of"):
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


NAMINGS = {
    "v4.1": TensorNames("layers.{layer}.engram.embed.weight", "layers.{layer}.engram.embed.scale"),
    "model-prefix": TensorNames("model.layers.{layer}.engram.embed.weight",
                                "model.layers.{layer}.engram.embed.scale"),
    "vllm-scale-inv": TensorNames("model.layers.{layer}.engram.embed.weight",
                                  "model.layers.{layer}.engram.embed.weight_scale_inv"),
    "ours-before": TensorNames("layers.{layer}.engram.embedding.weight",
                               "layers.{layer}.engram.embedding.scale"),
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_sharded_checkpoint_with_an_index_loads_bit_exact_under_each_naming(tmp_path, naming):
    root = write_synthetic_checkpoint(tmp_path / "ckpt", SPEC, names=NAMINGS[naming], shards=3)
    assert (root / "model.safetensors.index.json").exists()
    assert len(list(root.glob("*.safetensors"))) == 3
    for layer in SPEC.layer_ids:
        info = shard_heads(SPEC.bucket_sizes(layer), 2, 1)
        w = np.empty((info.num_rows, SPEC.head_dim), np.uint8)
        s = np.empty((info.num_rows, SPEC.scales_per_row), np.uint8)
        load_rows(str(root), SPEC, layer, info.row_start, info.row_end, w, s)
        w_all, s_all = synthetic_layer(SPEC, layer)
        np.testing.assert_array_equal(w, w_all[info.row_start:info.row_end])
        np.testing.assert_array_equal(s, s_all[info.row_start:info.row_end])


def test_ambiguous_or_missing_tensors_and_spec_mismatch_are_refused(tmp_path):
    from numa_engram.errors import SpecMismatchError

    w = np.empty((10, SPEC.head_dim), np.uint8)
    s = np.empty((10, SPEC.scales_per_row), np.uint8)
    both = tmp_path / "both"
    both.mkdir()
    write_synthetic_checkpoint(both / "a.safetensors", SPEC, names=NAMINGS["v4.1"])
    write_synthetic_checkpoint(both / "b.safetensors", SPEC, names=NAMINGS["model-prefix"])
    with pytest.raises(CheckpointError, match=r"2 weights tensors among the known names "
                                              r"\['layers.1.engram.embed.weight', "
                                              r"'model.layers.1.engram.embed.weight'\]"):
        load_rows(str(both), SPEC, 1, 0, 10, w, s)
    other = tmp_path / "other.safetensors"
    write_synthetic_checkpoint(other, SPEC, names=TensorNames("emb.{layer}.w", "emb.{layer}.s"))
    with pytest.raises(CheckpointError, match="no weights tensor"):
        load_rows(str(other), SPEC, 1, 0, 10, w, s)
    load_rows(str(other), SPEC, 1, 0, 10, w, s, names=TensorNames("emb.{layer}.w",
                                                                   "emb.{layer}.s"))
    theirs = tmp_path / "theirs.safetensors"
    write_synthetic_checkpoint(theirs, EngramSpec.small(seed=5))
    with pytest.raises(SpecMismatchError, match="was written for spec"):
        load_rows(str(theirs), EngramSpec.small(), 1, 0, 10, w, s)
