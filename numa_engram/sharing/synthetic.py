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
