"""Read a layer's row range of FP8 weights and ue8m0 scales from safetensors
files straight into a caller-given buffer (the mapped table).  (Synthetic
checkpoints in the same layout: ``sharing.synthetic``.)

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
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, NumaEngramError, SpecMismatchError
from ..model.spec import EngramSpec
from ..store.chunks import for_each_chunk
from ..userfiles import open_regular, read_regular

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


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# bytes per element of the dtypes safetensors knows (others are not size-checked)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class FileIdentity:
    """What a checkpoint file was when it was resolved: a file replaced
    (``os.replace``) or rewritten since then differs in one of these."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class TensorLocation:
    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offset: int  # absolute byte offset of element 0 in the file
    identity: FileIdentity | None = None


@dataclass(frozen=True)
class CheckpointPlan:
    """A layer's two tensors, resolved once by the leader before anything is
    allocated (files, offsets, dtypes, shapes, the spec metadata checked):
    every loader reads through it and refuses a file that changed since."""

    layer_id: int
    weights: TensorLocation
    scales: TensorLocation


def _check_regular(path: str) -> None:
    """A regular file (symlinks followed: the Hugging Face cache is made of
    them); a FIFO or device is refused without blocking."""
    os.close(_open_regular(path))


def _open_regular(path: str) -> int:
    """An fd of a regular file (symlinks followed), opened without blocking."""
    return open_regular(path, "checkpoint", error=CheckpointError)


def _read_index(index: str) -> dict[str, str]:
    """The index's weight_map, checked for shape: a dict of str -> str, no
    tensor named twice.  Never quotes the file's contents."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict = {}
        for key, value in pairs:
            if key in seen and isinstance(value, str) and isinstance(seen[key], str):
                raise CheckpointError(f"{index}: tensor {key!r} is mapped twice, to "
                                      f"{seen[key]!r} and {value!r}; each tensor lives in one "
                                      "file")
            seen[key] = value
        return seen
    data = read_regular(index, "the checkpoint index", error=CheckpointError)
    try:
        doc = json.loads(data, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{index}: not a safetensors index (not JSON, or nested too "
                              "deeply)") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map' object of "
                              "tensor name -> file name)")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: weight_map entry {name[:200]!r} maps to a "
                                  f"{type(file).__name__}, not a file name")
    return weight_map


def _inside(root: str, index: str, name: str, file: str) -> str:
    """The path of an index entry, which must stay inside the checkpoint
    directory once '..' is resolved (symlinks inside it may point anywhere)."""
    full = os.path.normpath(os.path.join(root, file))
    if os.path.isabs(file) or os.path.commonpath([root, full]) != root:
        raise CheckpointError(f"{index}: entry {name[:200]!r} names {file[:200]!r}, outside the "
                              "checkpoint directory; an index may only name files beside it")
    return full


def checkpoint_files(paths) -> dict[str, str]:
    """tensor name -> file of a checkpoint: a directory with
    model.safetensors.index.json (its weight_map), a directory of
    .safetensors files, one file, or a list of files.  A tensor found in two
    files is a CheckpointError naming both."""
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        root = os.path.abspath(paths)
        index = os.path.join(root, INDEX_FILE)
        if os.path.lexists(index):
            files = {name: _inside(root, index, name, f)
                     for name, f in _read_index(index).items()}
            checkpoint_paths(sorted(set(files.values())))  # each a regular file
            return files
        paths = sorted(str(p) for p in Path(paths).glob("*.safetensors"))
    out: dict[str, str] = {}
    for path in checkpoint_paths(paths):
        header, _, _ = read_header(path)
        for name in header:
            if name == "__metadata__":
                continue
            if name in out and out[name] != path:
                raise CheckpointError(f"tensor {name!r} is in both {out[name]} and {path}; "
                                      "pass the files of one checkpoint")
            out[name] = path
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


def checkpoint_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [str(p) for p in paths]
    if not out:
        raise CheckpointError("no checkpoint files given")
    for path in out:  # before any open: opening a FIFO would block forever
        _check_regular(path)
    return out


def read_header(path: str) -> tuple[dict, int, FileIdentity]:
    """The safetensors JSON header of a file, where its data starts, and the
    file's identity; every tensor entry is checked against the file (its
    bytes inside the file, its offsets matching its dtype and shape)."""
    fd = _open_regular(path)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 8, 0)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= min(MAX_HEADER_BYTES, st.st_size - 8):
            raise CheckpointError(f"{path}: its first 8 bytes are not a safetensors header "
                                  f"length (the file has {st.st_size} bytes); not a "
                                  "safetensors file, or truncated")
        text = os.pread(fd, size, 8)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read a safetensors header "
                              f"({exc.strerror})") from exc
    finally:
        os.close(fd)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{path}: its header is not valid safetensors JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is not a JSON object of tensors")
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, 8 + size, st.st_size)
    _check_disjoint(path, header)
    return header, 8 + size, FileIdentity.of(st)


def _check_disjoint(path: str, header: dict) -> None:
    """No two tensors share a byte (safetensors refuses such a header): one
    layer's rows must never be served as another's."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items()
                   if n != "__metadata__" and e["data_offsets"][1] > e["data_offsets"][0])
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {name[:200]!r} and {other[:200]!r} overlap "
                                  f"(bytes {begin} .. {end} of the data are in both): a "
                                  "corrupt or crafted header; re-export the checkpoint")


def _check_entry(path: str, name: str, entry: Any, base: int, file_size: int) -> None:
    """One tensor's header entry: well formed, its bytes inside the file,
    and exactly as many as its dtype and shape need."""
    ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
          and isinstance(entry.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(type(o) is int for o in entry["data_offsets"]))
    if not ok:
        raise CheckpointError(f"{path}: tensor {name[:200]!r} has a malformed header entry "
                              "(dtype, shape, data_offsets)")
    begin, end = entry["data_offsets"]
    if not 0 <= begin <= end:
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets [{begin}, {end})")
    if base + end > file_size:
        raise CheckpointError(f"{path}: tensor {name!r} needs bytes up to {base + end} but the "
                              f"file has {file_size}: truncated or corrupt")
    itemsize = DTYPE_BYTES.get(entry["dtype"])
    if itemsize is not None:
        want = itemsize * int(np.prod(entry["shape"], dtype=object))
        if end - begin != want:
            raise CheckpointError(f"{path}: tensor {name!r} is {entry['dtype']} "
                                  f"{entry['shape']} ({want} bytes), but its data_offsets "
                                  f"span {end - begin} bytes: a corrupt header")


def locate(files: dict[str, str], name: str,
           headers: dict[str, tuple[dict, int, FileIdentity]] | None = None) -> TensorLocation:
    """Find a tensor in the checkpoint's files (``checkpoint_files``);
    ``headers`` caches each file's parsed header."""
    path = files.get(name)
    if path is None:
        raise CheckpointError(f"tensor {name!r} is in none of {sorted(set(files.values()))}; "
                              "check the layer id and the TensorNames pattern")
    headers = {} if headers is None else headers
    if path not in headers:
        headers[path] = read_header(path)
    header, base, identity = headers[path]
    if name not in header:
        raise CheckpointError(f"the index says {name!r} is in {path}, but it is not there")
    entry = header[name]
    return TensorLocation(path, name, entry["dtype"], tuple(entry["shape"]),
                          base + entry["data_offsets"][0], identity)


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
    headers: dict[str, tuple[dict, int, FileIdentity]] = {}
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
    with _OpenFiles(plan) as fds:
        chunks = [(loc, a, min(n, a + max(1, chunk_bytes // out.shape[1])), out)
                  for loc, out in ((plan.weights, weights_out), (plan.scales, scales_out))
                  for a in range(0, n, max(1, chunk_bytes // out.shape[1]))]

        def one(chunk) -> int:
            loc, a, b, out = chunk
            _pread_rows(fds[loc.path], loc, row_start + a, row_start + b, out[a:b])
            return (b - a) * out.shape[1]

        for_each_chunk(chunks, one, threads=threads,
                       total=n * spec.row_bytes, progress=progress, pin_cpus=cpus,
                       name="numa-engram-load")
        fds.check_unchanged("while the table loaded")


class _OpenFiles(dict):
    """path -> fd of each file a plan reads, opened once and checked to be
    the very file the plan resolved; closed on exit."""

    def __init__(self, plan: CheckpointPlan) -> None:
        super().__init__()
        self._identity = {loc.path: loc.identity for loc in (plan.weights, plan.scales)}

    def __enter__(self) -> _OpenFiles:
        try:
            for path in self._identity:
                self[path] = _open_regular(path)
            self.check_unchanged("since the checkpoint was resolved")
        except BaseException:
            self.__exit__()
            raise
        return self

    def check_unchanged(self, when: str) -> None:
        for path, fd in self.items():
            want, now = self._identity[path], FileIdentity.of(os.fstat(fd))
            if want is not None and now != want:
                raise CheckpointError(
                    f"{path} changed {when} (device/inode, size or mtime differ: "
                    f"{_describe(want)} then, {_describe(now)} now); a checkpoint must not be "
                    "replaced or rewritten while tables load from it: retry once it is complete")

    def __exit__(self, *exc: object) -> None:
        for fd in self.values():
            os.close(fd)
        self.clear()


def _describe(ident: FileIdentity) -> str:
    return f"inode {ident.ino}, {ident.size} bytes, mtime_ns {ident.mtime_ns}"


def _pread_rows(fd: int, loc: TensorLocation, a: int, b: int, out: np.ndarray) -> None:
    width = loc.shape[1]
    view = memoryview(out.reshape(-1).data)
    offset = loc.data_offset + a * width
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CheckpointError(f"{loc.path} ends inside {loc.name} (rows {a}..{b}): "
                                  "truncated checkpoint")
        got += n
