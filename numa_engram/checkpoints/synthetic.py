"""Synthetic checkpoints for tests, benchmarks and the demo: a V4.1 Engram
checkpoint (quantised normals through safetensors, or random bytes
streamed) and a Qwen4-Exp PLE checkpoint under vLLM's split-parts names
(random bytes streamed), each deterministic in its seed.  The readers are
``checkpoint`` and ``plecheckpoint``; nothing here is read at serving time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..model.ple import PLESpec
from ..model.spec import EngramSpec
from .checkpoint import DEFAULT_NAMES, INDEX_FILE, TensorNames
from .plecheckpoint import PREFIX

RAW_CHUNK = 64 << 20  # bytes written at a time by the streaming writers

# (name, safetensors dtype, shape, bytes, the bytes themselves or None: random)
Streamed = tuple[str, str, list[int], int, bytes | None]

# what vLLM routes to DeepSeek V4.1 (deepseek_v4 / DeepseekV4ForCausalLM is
# V4, which has no Engram layers)
V41_MODEL_TYPE = "deepseek_v41"
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"


def v41_text_model(spec: EngramSpec, vocab_size: int) -> dict[str, Any]:
    """The text model's fields of a V4.1 ``text_config`` that vLLM 0.31-0.34
    read (without a default) to build the model around the Engram layers,
    sized tiny: hidden size 64, 4 heads, 4 experts (2 routed per token, 1
    shared).  ``num_hidden_layers`` covers the last Engram layer.  Even
    layers are sliding-window only (compress ratio 0), odd ones compressed
    2x (vLLM accepts only 0, 1 or 2; a compressed layer needs attention
    heads of 512 with a rope part of 64, and a KV and index source among
    the compressed layers at or before it: layer 1).  ``vocab_size``: the
    tokenizer's."""
    layers = max(spec.layer_ids) + 1
    return {
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": layers,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        # attention (MLA with low-rank q and grouped o projections)
        "num_attention_heads": 4, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 32, "o_lora_rank": 32, "o_groups": 2, "sliding_window": 16,
        "rope_theta": 10000.0, "compress_rope_theta": 10000.0,
        "compress_ratios": [i % 2 * 2 for i in range(layers)],
        "kv_source_layer_ids": [1], "index_source_layer_ids": [1],
        # the compressed layers' sparse indexer
        "index_topk": 16, "index_n_heads": 2, "index_head_dim": 32,
        # hyper-connections
        "hc_mult": 2, "hc_eps": 1e-6, "hc_sinkhorn_iters": 2,
        # mixture of experts
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "num_hash_layers": 0, "norm_topk_prob": True,
        "hidden_act": "silu", "swiglu_limit": 10.0,
    }


def synthetic_layer(spec: EngramSpec, layer_id: int, seed: int = 0,
                    raw: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic FP8 rows for one layer (quantised normals, or raw bytes)."""
    from ..model.fp8 import random_rows

    return random_rows(spec.rows(layer_id), spec.head_dim, seed=seed * 1000 + layer_id,
                       block=spec.block, raw=raw)


def write_synthetic_checkpoint(path: str | os.PathLike, spec: EngramSpec, *, seed: int = 0,
                               raw: bool = False, names: TensorNames = DEFAULT_NAMES,
                               layers: Sequence[int] | None = None,
                               shards: int = 1) -> Path:
    """Every layer's weights (float8_e4m3fn) and scales (float8_e8m0fnu), as
    the real checkpoints store them, with the spec in the metadata.
    ``shards=1``: one safetensors file at ``path``; more: a directory
    ``path`` of that many files and a model.safetensors.index.json, as
    sharded Hugging Face checkpoints ship (each tensor in one file)."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for layer in layers or spec.layer_ids:
        w, s = synthetic_layer(spec, layer, seed, raw)
        w_name, s_name = names.of(layer)
        tensors[w_name] = torch.from_numpy(w).view(torch.float8_e4m3fn)
        tensors[s_name] = torch.from_numpy(s).view(torch.float8_e8m0fnu)
    metadata = {"engram_spec": json.dumps(spec.to_dict())}
    if shards == 1:
        save_file(tensors, str(path), metadata=metadata)
        return Path(path)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(shards):
        part = {n: t for j, (n, t) in enumerate(sorted(tensors.items())) if j % shards == i}
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(root / name), metadata=metadata)
        weight_map.update({n: name for n in part})
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def _stream(path: str | os.PathLike, metadata: dict[str, str], tensors: list[Streamed],
            seed: int, bytes_of: Callable[[str, np.ndarray], np.ndarray]) -> Path:
    """One safetensors file written in chunks: the header, then each tensor's
    given bytes or random ones (``bytes_of(dtype, chunk)`` shapes them)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, size, _ in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        for _, dtype, _, size, given in tensors:
            if given is not None:
                fh.write(given)
                continue
            left = size
            while left:
                chunk = bytes_of(dtype, rng.integers(0, 256, min(left, RAW_CHUNK),
                                                     dtype=np.uint8))
                fh.write(chunk.tobytes())
                left -= len(chunk)
    return Path(path)


def write_raw_checkpoint(path: str | os.PathLike, spec: EngramSpec, *, seed: int = 0,
                         layers: Sequence[int] | None = None) -> Path:
    """Every layer's tensors as one safetensors file of random FP8 bytes and
    normal ue8m0 scales (110..134), written in chunks: no torch, and never
    a whole tensor in memory (tables of many GiB, the NUMA guests)."""
    tensors: list[Streamed] = []
    for layer in layers or spec.layer_ids:
        w_name, s_name = DEFAULT_NAMES.of(layer)
        rows = spec.rows(layer)
        tensors += [(w_name, "F8_E4M3", [rows, spec.head_dim], rows * spec.head_dim, None),
                    (s_name, "F8_E8M0", [rows, spec.scales_per_row],
                     rows * spec.scales_per_row, None)]
    return _stream(path, {"engram_spec": json.dumps(spec.to_dict())}, tensors, seed,
                   lambda dtype, chunk: 110 + chunk % 25 if dtype == "F8_E8M0" else chunk)


def synthetic_scale(spec: PLESpec, layer_id: int) -> float:
    """The per-tensor scale the synthetic PLE writer stores for a layer."""
    return float(np.float32(0.0123 * (1 + spec.dense_index(layer_id))))


def write_ple_checkpoint(path: str | os.PathLike, spec: PLESpec, *, seed: int = 0,
                         layers: Sequence[int] | None = None) -> Path:
    """The layers' parts (random bytes: every FP8 byte, NaNs included) and
    scales as one safetensors file under vLLM's names, streamed in chunks:
    never a whole part in memory, any size."""
    tensors: list[Streamed] = []
    dtype = "F8_E4M3" if spec.dtype == "float8_e4m3fn" else "BF16"
    for layer in layers or spec.layer_ids:
        prefix = "model." + PREFIX.format(index=layer - 1)
        for part in range(spec.split_ngram_parts):
            a, b = spec.part_rows(layer, part)
            tensors.append((f"{prefix}shard_{part}.weight", dtype, [b - a, spec.head_dim],
                            (b - a) * spec.row_bytes, None))
        if spec.dtype == "float8_e4m3fn":
            tensors.append((f"{prefix}weight_scale", "F32", [], 4,
                            struct.pack("<f", synthetic_scale(spec, layer))))
    return _stream(path, {"ple_spec": json.dumps(spec.to_dict())}, tensors, seed,
                   lambda _dtype, chunk: chunk)
