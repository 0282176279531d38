"""The safetensors files of a checkpoint, for any table family: find them
(an index's ``weight_map``, a directory's ``*.safetensors``, a file or a
list), read the index and each header once (every entry checked against
its file), open regular files only (never blocking on a FIFO), read a
tensor's bytes straight into a caller's buffer, and check each file is
the very one resolved, before and after the read.

The Engram and PLE readers (``checkpoint.py``, ``plecheckpoint.py``) say
which tensors a layer has and what they must look like; everything about
the files is here.  Self-contained: it needs only the library's errors
and ``userfiles``."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..userfiles import open_regular, printable, read_regular

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# bytes per element of the dtypes safetensors knows (others are not size-checked)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8}
Header = tuple[dict, int, "FileIdentity"]  # (the JSON header, where data starts, the file)


@dataclass(frozen=True)
class FileIdentity:
    """What a checkpoint file was when it was resolved: a file replaced
    (``os.replace``), truncated or rewritten since then differs in one of
    these."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def describe(self) -> str:
        return f"inode {self.ino}, {self.size} bytes, mtime_ns {self.mtime_ns}"


@dataclass(frozen=True)
class TensorLocation:
    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offset: int  # absolute byte offset of element 0 in the file
    identity: FileIdentity | None = None


def open_file(path: str) -> int:
    """An fd of a regular checkpoint file (symlinks followed: the Hugging
    Face cache is made of them), opened without blocking; a FIFO, device or
    directory is a CheckpointError naming it."""
    return open_regular(path, "checkpoint", error=CheckpointError)


def read_index(index: str) -> dict[str, str]:
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


def checkpoint_files(paths: Any) -> dict[str, str]:
    """tensor name -> file of a checkpoint: a directory with
    model.safetensors.index.json (its weight_map), a directory of
    .safetensors files, one file, or a list of files.  A tensor found in two
    files is a CheckpointError naming both."""
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        root = os.path.abspath(paths)
        index = os.path.join(root, INDEX_FILE)
        if os.path.lexists(index):
            files = {name: _inside(root, index, name, f)
                     for name, f in read_index(index).items()}
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


def checkpoint_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files as paths, each a regular file (refused before any blocking
    open)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [str(p) for p in paths]
    if not out:
        raise CheckpointError("no checkpoint files given")
    for path in out:
        os.close(open_file(path))
    return out


def read_header(path: str) -> Header:
    """The safetensors JSON header of a file, where its data starts, and the
    file's identity; every tensor entry is checked against the file (its
    bytes inside the file, its offsets matching its dtype and shape)."""
    fd = open_file(path)
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
           headers: dict[str, Header] | None = None) -> TensorLocation:
    """Find a tensor in the checkpoint's files (``checkpoint_files``);
    ``headers`` caches each file's parsed header (each read once)."""
    path = files.get(name)
    if path is None:
        raise CheckpointError(f"tensor {name!r} is in none of {sorted(set(files.values()))}; "
                              "check the layer id and the tensor names")
    headers = {} if headers is None else headers
    if path not in headers:
        headers[path] = read_header(path)
    header, base, identity = headers[path]
    if name not in header:
        raise CheckpointError(f"the index says {name!r} is in {path}, but it is not there")
    entry = header[name]
    return TensorLocation(path, name, entry["dtype"], tuple(entry["shape"]),
                          base + entry["data_offsets"][0], identity)


class OpenFiles(dict):
    """path -> fd of each file a load reads, opened once (regular files
    only) and checked to be the very file resolved; ``check_unchanged``
    again after the read; closed on exit.  Every byte is read through these
    descriptors: a file replaced meanwhile is never half read."""

    def __init__(self, locations: Sequence[TensorLocation]) -> None:
        super().__init__()
        self._identity: Mapping[str, FileIdentity | None] = {
            loc.path: loc.identity for loc in locations}

    def __enter__(self) -> OpenFiles:
        try:
            for path in self._identity:
                self[path] = open_file(path)
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
                    f"{printable(path)} changed {when} (device/inode, size or mtime differ: "
                    f"{want.describe()} then, {now.describe()} now); a checkpoint must not be "
                    "replaced or rewritten while tables load from it: retry once it is complete")

    def read_into(self, loc: TensorLocation, offset: int, out: memoryview) -> None:
        """``len(out)`` bytes of ``loc`` from byte ``offset`` of the tensor;
        a file that ends first is a CheckpointError naming file and tensor."""
        fd, got = self[loc.path], 0
        while got < len(out):
            n = os.preadv(fd, [out[got:]], loc.data_offset + offset + got)
            if n == 0:
                raise CheckpointError(f"{printable(loc.path)} ends inside {loc.name} (bytes "
                                      f"{offset} .. {offset + len(out)} of the tensor): "
                                      "truncated checkpoint")
            got += n

    def __exit__(self, *exc: object) -> None:
        for fd in self.values():
            os.close(fd)
        self.clear()
