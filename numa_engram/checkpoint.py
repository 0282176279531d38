"""Read a layer's row range of FP8 weights and ue8m0 scales from safetensors
files straight into a caller-given buffer (the mapped table), and write small
synthetic checkpoints in the same layout.

Tensor metadata (name, dtype, shape) is checked through the ``safetensors``
package; the rows themselves are read with ``preadv`` at the tensor's byte
offset into the destination, chunk by chunk, so nothing else of the file is
read and no intermediate copy is made.  ``method="slice"`` uses the
package's own slicing instead (same bytes, one more copy).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .chunks import for_each_chunk
from .errors import CheckpointError, NumaEngramError, SpecMismatchError
from .spec import EngramSpec

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
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(paths) -> dict[str, str]:
    """tensor name -> file of a checkpoint: a directory with
    model.safetensors.index.json (its weight_map), a directory of
    .safetensors files, one file, or a list of files."""
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        index = os.path.join(paths, INDEX_FILE)
        if os.path.exists(index):
            try:
                weight_map = json.loads(Path(index).read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
            files = {name: os.path.join(paths, f) for name, f in weight_map.items()}
            checkpoint_paths(sorted(set(files.values())))  # each a regular file
            return files
        paths = sorted(str(p) for p in Path(paths).glob("*.safetensors"))
    out: dict[str, str] = {}
    for path in checkpoint_paths(paths):
        header, _ = read_header(path)
        out.update({name: path for name in header if name != "__metadata__"})
    return out


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


@dataclass(frozen=True)
class TensorLocation:
    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offset: int  # absolute byte offset of element 0 in the file


def checkpoint_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [str(p) for p in paths]
    if not out:
        raise CheckpointError("no checkpoint files given")
    for path in out:  # before any open: opening a FIFO would block forever
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc.strerror}") from exc
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"checkpoint {path} is not a regular file (a FIFO, device or "
                                  "directory); pass the safetensors file itself")
    return out


def read_header(path: str) -> tuple[dict, int]:
    """The safetensors JSON header of a file and where its data starts."""
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100 << 20:
                raise CheckpointError(f"{path}: header of {size} bytes; not a safetensors file")
            return json.loads(fh.read(size)), 8 + size
    except (OSError, struct.error, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read a safetensors header ({exc})") from exc


def locate(files: dict[str, str], name: str) -> TensorLocation:
    """Find a tensor in the checkpoint's files (``checkpoint_files``),
    checking its metadata with safetensors."""
    from safetensors import safe_open

    path = files.get(name)
    if path is None:
        raise CheckpointError(f"tensor {name!r} is in none of {sorted(set(files.values()))}; "
                              "check the layer id and the TensorNames pattern")
    header, base = read_header(path)
    if name not in header:
        raise CheckpointError(f"the index says {name!r} is in {path}, but it is not there")
    with safe_open(path, framework="pt") as f:  # the package's own view of it
        sl = f.get_slice(name)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
    begin, _ = header[name]["data_offsets"]
    return TensorLocation(path, name, dtype, shape, base + begin)


def check_spec_metadata(path: str, spec: EngramSpec) -> None:
    """The ``engram_spec`` our writer stores, when present, must be this spec."""
    header, _ = read_header(path)
    doc = (header.get("__metadata__") or {}).get("engram_spec")
    if doc is None:
        return
    try:
        theirs = EngramSpec.from_dict(json.loads(doc))
    except (ValueError, NumaEngramError) as exc:
        raise CheckpointError(f"{path}: unreadable engram_spec metadata ({exc})") from exc
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


def load_rows(paths, spec: EngramSpec, layer_id: int, row_start: int, row_end: int,
              weights_out: np.ndarray, scales_out: np.ndarray, *,
              names: TensorNames | None = None, chunk_bytes: int = 64 << 20,
              method: str = "pread", progress: Progress | None = None, threads: int = 1,
              cpus: Sequence[int] = ()) -> None:
    """Copy rows [row_start, row_end) of the layer's weights and scales into
    ``weights_out`` ([n, head_dim] uint8) and ``scales_out`` ([n, head_dim/block]).
    ``paths``: a safetensors file, a list of them, or a checkpoint
    directory (with model.safetensors.index.json).  ``names=None`` finds the
    layer's two tensors by V4.1's module path (``find_names``).

    ``threads`` copy chunks in parallel (pread releases the GIL), each
    pinned to ``cpus`` when given (the CPUs of the node the rows live on, so
    the writes stay local).  ``method="slice"`` (safetensors' own reader,
    one thread) is the reference path."""
    rows = spec.rows(layer_id)
    n = row_end - row_start
    if not 0 <= row_start <= row_end <= rows:
        raise CheckpointError(f"row range [{row_start}, {row_end}) outside layer {layer_id}'s "
                              f"{rows} rows")
    if weights_out.shape != (n, spec.head_dim) or scales_out.shape != (n, spec.scales_per_row):
        raise CheckpointError(f"destination shapes {weights_out.shape}, {scales_out.shape} do not "
                              f"hold {n} rows of {spec.head_dim} + {spec.scales_per_row} bytes")
    if method not in ("pread", "slice"):
        raise ValueError(f"method must be 'pread' or 'slice', got {method!r}")
    files = checkpoint_files(paths)
    w_name, s_name = (names or find_names(files, layer_id)).of(layer_id)
    w_loc, s_loc = locate(files, w_name), locate(files, s_name)
    for path in {w_loc.path, s_loc.path}:
        check_spec_metadata(path, spec)
    _check_tensor(w_loc, rows, spec.head_dim, WEIGHT_DTYPES)
    _check_tensor(s_loc, rows, spec.scales_per_row, SCALE_DTYPES)
    copy = _pread_rows if method == "pread" else _slice_rows
    chunks = [(loc, a, min(n, a + max(1, chunk_bytes // out.shape[1])), out)
              for loc, out in ((w_loc, weights_out), (s_loc, scales_out))
              for a in range(0, n, max(1, chunk_bytes // out.shape[1]))]

    def one(chunk) -> int:
        loc, a, b, out = chunk
        copy(loc, row_start + a, row_start + b, out[a:b])
        return (b - a) * out.shape[1]

    for_each_chunk(chunks, one, threads=1 if method == "slice" else threads,
                   total=n * spec.row_bytes, progress=progress, pin_cpus=cpus,
                   name="numa-engram-load")


def _pread_rows(loc: TensorLocation, a: int, b: int, out: np.ndarray) -> None:
    width = loc.shape[1]
    view = memoryview(out.reshape(-1))
    offset = loc.data_offset + a * width
    fd = os.open(loc.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise CheckpointError(f"{loc.path} ends inside {loc.name} (rows {a}..{b}): "
                                      "truncated checkpoint")
            got += n
    finally:
        os.close(fd)


def _slice_rows(loc: TensorLocation, a: int, b: int, out: np.ndarray) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(loc.path, framework="pt") as f:
        t = f.get_slice(loc.name)[a:b]
    out[...] = t.view(torch.uint8).numpy()


# ---------------------------------------------------------------- writer --

def synthetic_layer(spec: EngramSpec, layer_id: int, seed: int = 0,
                    raw: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic FP8 rows for one layer (quantised normals, or raw bytes)."""
    from .fp8 import random_rows

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
