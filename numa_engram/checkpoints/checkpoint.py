"""Read an Engram layer's row range of FP8 weights and ue8m0 scales from
safetensors files straight into a caller-given buffer (the mapped table).
The files (found, headers read once, regular files only, checked unchanged
before and after a load) are ``safetensorsfiles``'s; this module names a
layer's tensors and checks them against the spec.  (Synthetic checkpoints
in the same layout: ``checkpoints.synthetic``.)

A layer's tensors are resolved once (``resolve``: files, names, dtypes,
shapes and offsets, every header entry checked against its file) into a
``CheckpointPlan``; the rows themselves are read with ``preadv`` at the
tensor's byte offset into the destination, chunk by chunk, through one
descriptor per file, so nothing else of the file is read, no intermediate
copy is made, and a file replaced meanwhile is noticed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError, NumaEngramError, SpecMismatchError
from ..model.spec import EngramSpec
from ..store.chunks import for_each_chunk
from .familyreaders import CheckpointReader, ChunkDone
from .safetensorsfiles import INDEX_FILE as INDEX_FILE  # (the synthetic writer's)
from .safetensorsfiles import Header, OpenFiles, TensorLocation, checkpoint_files, locate

if TYPE_CHECKING:
    from ..model.sharding import ShardInfo
    from ..store.storage import BackingFile

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("F8_E4M3", "U8")
SCALE_DTYPES = ("F8_E8M0", "U8")
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class TensorNames:
    """Names of a layer's tensors; ``{layer}`` is replaced by the layer id.
    For checkpoints laid out otherwise than the names ``find_names`` knows."""

    weights: str = "layers.{layer}.engram.embed.weight"
    scales: str = "layers.{layer}.engram.embed.scale"

    def of(self, layer_id: int) -> tuple[str, str]:
        return self.weights.format(layer=layer_id), self.scales.format(layer=layer_id)


V41_NAMES = TensorNames()
DEFAULT_NAMES = V41_NAMES  # what the synthetic writer uses
# Where a layer's tensors may sit: V4.1's module path, with or without a
# "model." prefix, the scale also as vLLM's weight_scale_inv, and the names
# this library wrote before it followed V4.1.
_WEIGHT_CANDIDATES = ("{p}layers.{layer}.engram.embed.weight",
                      "{p}layers.{layer}.engram.embedding.weight")
_SCALE_CANDIDATES = ("{p}layers.{layer}.engram.embed.scale",
                     "{p}layers.{layer}.engram.embed.weight_scale_inv",
                     "{p}layers.{layer}.engram.embedding.scale")


@dataclass(frozen=True)
class CheckpointPlan:
    """A layer's two tensors, resolved once by the leader before anything is
    allocated (files, offsets, dtypes, shapes, the spec metadata checked):
    every loader reads through it and refuses a file that changed since."""

    layer_id: int
    weights: TensorLocation
    scales: TensorLocation


def find_names(files: dict[str, str], layer_id: int) -> TensorNames:
    """The layer's weight and scale tensor names among the checkpoint's:
    exactly one candidate of each, else CheckpointError listing what was
    found."""
    found = []
    for candidates in (_WEIGHT_CANDIDATES, _SCALE_CANDIDATES):
        names = [c.format(p=p, layer=layer_id) for c in candidates for p in ("", "model.")]
        hits = [n for n in names if n in files]
        if len(hits) != 1:
            engram = sorted(n for n in files if f"layers.{layer_id}.engram" in n)
            what = "weights" if candidates is _WEIGHT_CANDIDATES else "scales"
            raise CheckpointError(
                f"layer {layer_id}: {'no' if not hits else len(hits)} {what} tensor"
                f"{'s' if len(hits) > 1 else ''} among the known names {hits or names}; the "
                f"checkpoint's engram tensors of that layer: {engram or 'none'}; pass "
                "names=TensorNames(...) for another layout")
        found.append(hits[0])
    return TensorNames(*found)


def check_spec_metadata(header: dict, path: str, spec: EngramSpec) -> None:
    """The ``engram_spec`` our writer stores, when present, must be this spec."""
    meta = header.get("__metadata__")
    doc = meta.get("engram_spec") if isinstance(meta, dict) else None
    if doc is None:
        return
    try:
        theirs = EngramSpec.from_dict(json.loads(doc))
    except (ValueError, TypeError, RecursionError, NumaEngramError):
        raise CheckpointError(f"{path}: unreadable engram_spec metadata") from None
    if theirs.fingerprint != spec.fingerprint:
        raise SpecMismatchError(f"{path} was written for spec {theirs.to_dict()}, this process "
                                f"has {spec.to_dict()}; use the checkpoint's spec")


def _check_tensor(loc: TensorLocation, rows: int, width: int, dtypes: tuple[str, ...]) -> None:
    if loc.dtype not in dtypes:
        raise CheckpointError(f"{loc.name} in {loc.path} has dtype {loc.dtype}, expected one of "
                              f"{dtypes}")
    if loc.shape != (rows, width):
        raise CheckpointError(f"{loc.name} in {loc.path} has shape {list(loc.shape)}, the spec "
                              f"says [{rows}, {width}]")


def resolve(paths, spec: EngramSpec, layer_id: int,
            names: TensorNames | None = None) -> CheckpointPlan:
    """The layer's tensors in a checkpoint (file, list of files or
    directory), every check made: names, dtypes, shapes, offsets inside the
    files, the spec metadata.  Reads headers only: fast for any table size."""
    if isinstance(paths, CheckpointPlan):
        return paths
    return resolve_layers(paths, spec, [layer_id], names)[layer_id]


def resolve_layers(paths, spec: EngramSpec, layer_ids: Sequence[int],
                   names: TensorNames | None = None) -> dict[int, CheckpointPlan]:
    """``resolve`` for several layers, the index read and each file's
    header parsed once for all of them."""
    files = checkpoint_files(paths)
    headers: dict[str, Header] = {}
    plans = {}
    for layer_id in layer_ids:
        w_name, s_name = (names or find_names(files, layer_id)).of(layer_id)
        w_loc, s_loc = locate(files, w_name, headers), locate(files, s_name, headers)
        for path in {w_loc.path, s_loc.path}:
            check_spec_metadata(headers[path][0], path, spec)
        rows = spec.rows(layer_id)
        _check_tensor(w_loc, rows, spec.head_dim, WEIGHT_DTYPES)
        _check_tensor(s_loc, rows, spec.scales_per_row, SCALE_DTYPES)
        plans[layer_id] = CheckpointPlan(layer_id, w_loc, s_loc)
    return plans


def load_rows(paths, spec: EngramSpec, layer_id: int, row_start: int, row_end: int,
              weights_out: np.ndarray, scales_out: np.ndarray, *,
              names: TensorNames | None = None, chunk_bytes: int = 64 << 20,
              progress: Progress | None = None, threads: int = 1,
              cpus: Sequence[int] = ()) -> None:
    """Copy rows [row_start, row_end) of the layer's weights and scales into
    ``weights_out`` ([n, head_dim] uint8) and ``scales_out`` ([n, head_dim/block]).
    ``paths``: a ``CheckpointPlan`` (``resolve``), a safetensors file, a list
    of them, or a checkpoint directory (with model.safetensors.index.json).
    ``names=None`` finds the layer's two tensors by V4.1's module path
    (``find_names``).  Each file is opened once and every row read through
    that descriptor; a file that is not what was resolved (replaced or
    rewritten), before or during the copy, is a CheckpointError.

    ``threads`` copy chunks in parallel (pread releases the GIL), each
    pinned to ``cpus`` when given (the CPUs of the node the rows live on, so
    the writes stay local)."""
    rows = spec.rows(layer_id)
    n = row_end - row_start
    if not 0 <= row_start <= row_end <= rows:
        raise CheckpointError(f"row range [{row_start}, {row_end}) outside layer {layer_id}'s "
                              f"{rows} rows")
    if weights_out.shape != (n, spec.head_dim) or scales_out.shape != (n, spec.scales_per_row):
        raise CheckpointError(f"destination shapes {weights_out.shape}, {scales_out.shape} do not "
                              f"hold {n} rows of {spec.head_dim} + {spec.scales_per_row} bytes")
    plan = resolve(paths, spec, layer_id, names)
    if plan.layer_id != layer_id:
        raise CheckpointError(f"the checkpoint plan is for layer {plan.layer_id}, not {layer_id}")
    with OpenFiles([plan.weights, plan.scales]) as files:
        chunks = [(loc, a, min(n, a + max(1, chunk_bytes // out.shape[1])), out)
                  for loc, out in ((plan.weights, weights_out), (plan.scales, scales_out))
                  for a in range(0, n, max(1, chunk_bytes // out.shape[1]))]

        def one(chunk) -> int:
            loc, a, b, out = chunk
            width = loc.shape[1]
            files.read_into(loc, (row_start + a) * width, memoryview(out[a:b].reshape(-1).data))
            return (b - a) * width

        for_each_chunk(chunks, one, threads=threads,
                       total=n * spec.row_bytes, progress=progress, pin_cpus=cpus,
                       name="numa-engram-load")
        files.check_unchanged("while the table loaded")


class EngramReader(CheckpointReader):
    """The Engram family's reader (``model.families.EngramFamily.reader``)."""

    plan_type = CheckpointPlan

    def _resolve(self, paths: Any, spec: Any, layer_id: int,
                 names: TensorNames | None) -> CheckpointPlan:
        return resolve(paths, spec, layer_id, names)

    def load(self, backing: BackingFile, plan: Any, spec: Any, layer_id: int,
             shard: ShardInfo, part: tuple[int, int], names: TensorNames | None, *,
             progress: ChunkDone, threads: int, cpus: Sequence[int]) -> None:
        a, b = part
        w = backing.region("weights").reshape(shard.num_rows, spec.head_dim)[a:b]
        s = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)[a:b]
        load_rows(plan, spec, layer_id, shard.row_start + a, shard.row_start + b, w, s,
                  names=names, progress=progress, threads=threads, cpus=cpus)


READER = EngramReader()
