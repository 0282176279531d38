"""Qwen4-Exp PLE tables in safetensors checkpoints: each layer's table split
into ``split_ngram_parts`` row ranges (``...ngram_embedding.shard_{i}.weight``,
part i holding ``PLESpec.part_rows``) and, for FP8, one fp32
``...ngram_embedding.weight_scale``; vLLM's loader copies the parts into
each rank's row range by overlap, and so does ``load_ple_rows``.  (The
synthetic writer: ``sharing.synthetic``.)"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..model.ple import PLESpec
from ..store.chunks import for_each_chunk
from .checkpoint import FileIdentity, TensorLocation, checkpoint_files, locate

# vLLM's module path of a PLE layer's table (``layers.{index}``: the
# 0-based decoder layer, one less than the 1-based ple_layer_ids entry)
PREFIX = "layers.{index}.ple.ple_embedding.ngram_embedding."
MODEL_PREFIXES = ("model.", "model.language_model.", "")
ROW_DTYPES = {"float8_e4m3fn": ("F8_E4M3", "U8"), "bfloat16": ("BF16",)}
RAW_CHUNK = 64 << 20


@dataclass(frozen=True)
class PLECheckpointPlan:
    """A layer's parts (in part order) and scale, resolved once by the
    leader: every loader reads through it."""

    layer_id: int
    parts: tuple[TensorLocation, ...]
    starts: tuple[int, ...]  # the layer row each part begins at
    scale: TensorLocation | None

    @property
    def identities(self) -> dict[str, FileIdentity | None]:
        locs = [*self.parts, *([self.scale] if self.scale else [])]
        return {loc.path: loc.identity for loc in locs}


def _name(files: dict[str, str], layer_id: int, leaf: str) -> str | None:
    for prefix in MODEL_PREFIXES:
        name = prefix + PREFIX.format(index=layer_id - 1) + leaf
        if name in files:
            return name
    return None


def resolve_ple(paths: Any, spec: PLESpec, layer_id: int) -> PLECheckpointPlan:
    """The layer's parts and scale in a checkpoint (file, files or
    directory), each name, dtype and shape checked; headers only."""
    if isinstance(paths, PLECheckpointPlan):
        return paths
    files = checkpoint_files(paths)
    headers: dict[str, Any] = {}
    parts, starts = [], []
    for part in range(spec.split_ngram_parts):
        start, end = spec.part_rows(layer_id, part)
        name = _name(files, layer_id, f"shard_{part}.weight")
        if name is None:
            found = sorted(n for n in files if f"layers.{layer_id - 1}.ple." in n)[:6]
            want = PREFIX.format(index=layer_id - 1) + f"shard_{part}.weight"
            raise CheckpointError(f"PLE layer {layer_id}: no tensor for part {part} of "
                                  f"{spec.split_ngram_parts} (...{want}); that layer's PLE "
                                  f"tensors: {found or 'none'}")
        loc = locate(files, name, headers)
        _check(loc, ROW_DTYPES[spec.dtype], (end - start, spec.head_dim))
        parts.append(loc)
        starts.append(start)
    scale = None
    if spec.dtype == "float8_e4m3fn":
        name = _name(files, layer_id, "weight_scale")
        if name is None:
            raise CheckpointError(f"PLE layer {layer_id}: the FP8 table has no weight_scale "
                                  "tensor (vLLM refuses such a checkpoint too)")
        scale = locate(files, name, headers)
        if scale.dtype != "F32" or int(np.prod(scale.shape, dtype=np.int64)) != 1:
            raise CheckpointError(f"{scale.name} in {scale.path} is {scale.dtype} "
                                  f"{list(scale.shape)}; a per-tensor scale is one F32")
    return PLECheckpointPlan(layer_id, tuple(parts), tuple(starts), scale)


def _check(loc: TensorLocation, dtypes: tuple[str, ...], shape: tuple[int, int]) -> None:
    if loc.dtype not in dtypes or loc.shape != shape:
        raise CheckpointError(f"{loc.name} in {loc.path} is {loc.dtype} {list(loc.shape)}; the "
                              f"spec says {'/'.join(dtypes)} {list(shape)}")


def read_scale(plan: PLECheckpointPlan) -> float | None:
    if plan.scale is None:
        return None
    with open(plan.scale.path, "rb") as fh:
        _check_identity(fh.fileno(), plan.scale)
        data = os.pread(fh.fileno(), 4, plan.scale.data_offset)
    if len(data) != 4:
        raise CheckpointError(f"{plan.scale.path} ends inside {plan.scale.name}")
    return float(struct.unpack("<f", data)[0])


def _check_identity(fd: int, loc: TensorLocation) -> None:
    if loc.identity is not None and FileIdentity.of(os.fstat(fd)) != loc.identity:
        raise CheckpointError(f"{loc.path} changed since the checkpoint was resolved; a "
                              "checkpoint must not be rewritten while tables load from it")


def load_ple_rows(plan: PLECheckpointPlan, spec: PLESpec, row_start: int, row_end: int,
                  out: np.ndarray, *, threads: int = 1,
                  progress: Callable[[int, int], None] | None = None,
                  cpus: Sequence[int] = ()) -> None:
    """Copy layer rows ``[row_start, row_end)`` into uint8 ``out [n,
    row_bytes]`` from the parts that overlap them, in chunks on
    ``threads`` threads (pinned to ``cpus``)."""
    width = spec.row_bytes
    if out.shape != (row_end - row_start, width):
        raise CheckpointError(f"destination {out.shape} does not hold rows {row_start}.."
                              f"{row_end} of {width} bytes")
    per_chunk = max(1, RAW_CHUNK // width)
    chunks = []
    for loc, start in zip(plan.parts, plan.starts):
        a, b = max(row_start, start), min(row_end, start + loc.shape[0])
        chunks += [(loc, r - start, min(b, r + per_chunk) - start, r - row_start)
                   for r in range(a, b, per_chunk)]
    fds = {path: os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in plan.identities}
    try:
        for loc in plan.parts:
            _check_identity(fds[loc.path], loc)

        def one(chunk: tuple[TensorLocation, int, int, int]) -> int:
            loc, a, b, at = chunk
            view = memoryview(out[at:at + b - a].reshape(-1).data)
            got = 0
            while got < len(view):
                n = os.preadv(fds[loc.path], [view[got:]], loc.data_offset + a * width + got)
                if n == 0:
                    raise CheckpointError(f"{loc.path} ends inside {loc.name}: truncated")
                got += n
            return (b - a) * width

        for_each_chunk(chunks, one, threads=threads, total=out.size, progress=progress,
                       pin_cpus=cpus, name="numa-engram-load")
    finally:
        for fd in fds.values():
            os.close(fd)
