"""A table's arrays mapped read-only from its checkpoint's files: the
"mapped" tier's storage (docs/design.md, "Tiers").

Each array (an Engram shard's weights or scales, a PLE shard's rows) is a
run of tensor byte ranges that must read as one contiguous array: the
ranges byte-adjacent in one file are merged, and what remains is mapped
page-aligned side by side in one reserved range, which works where every
boundary between ranges falls on a page in the file (else refused, naming
the tensors).  The pages are the page cache's: nothing is copied at
start, one copy per host serves every process, the kernel may evict them.
The files are opened as regular files only, checked to be the ones
resolved, and kept open: a SIGBUS of a page the file lost (truncated under
the table) is caught by the lookup kernel and named here."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..bindings import native
from ..errors import CheckpointError, SyscallError
from ..userfiles import printable
from .safetensorsfiles import FileIdentity, OpenFiles, TensorLocation

PAGE = native.PAGE_SIZE


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of tensor ``loc`` from its byte ``start``."""

    loc: TensorLocation
    start: int
    length: int

    @property
    def file_offset(self) -> int:
        return self.loc.data_offset + self.start


@dataclass(frozen=True)
class _Span:
    """One mapped span: file bytes [page, page + length) at ``va`` of the range."""

    path: str
    fd: int
    page: int
    length: int
    va: int


def _runs(segments: Sequence[Segment]) -> list[tuple[str, int, int, str]]:
    """(path, file offset, length, tensor names) of the segments, those
    byte-adjacent in one file merged."""
    runs: list[tuple[str, int, int, str]] = []
    for seg in segments:
        if seg.length <= 0:
            continue
        if runs and runs[-1][0] == seg.loc.path and runs[-1][1] + runs[-1][2] == seg.file_offset:
            path, offset, length, names = runs[-1]
            runs[-1] = (path, offset, length + seg.length, names)
            continue
        runs.append((seg.loc.path, seg.file_offset, seg.length, seg.loc.name))
    return runs


def _check_boundaries(name: str, runs: list[tuple[str, int, int, str]]) -> None:
    """Ranges that are not byte-adjacent read as one array only when each
    boundary is a page boundary in its file (the spans then meet in memory)."""
    for (path, offset, length, tensor), (path2, offset2, _, tensor2) in zip(runs, runs[1:]):
        if (offset + length) % PAGE or offset2 % PAGE:
            raise CheckpointError(
                f"the mapped tier cannot lay out {name}: its rows continue from {tensor} "
                f"({printable(path)}, bytes up to {offset + length}) into {tensor2} "
                f"({printable(path2)}, from byte {offset2}), neither adjacent in one file nor "
                f"meeting at a {PAGE}-byte page boundary, and the lookup kernels read one "
                "contiguous array; use tier='resident' (a copy), or shards each inside one "
                "tensor")


class MappedArrays:
    """Named arrays (uint8, read-only) mapped from checkpoint files;
    ``close()`` drops the views' owner and closes the files (the memory
    goes with the last view)."""

    def __init__(self, arrays: Mapping[str, Sequence[Segment]], what: str) -> None:
        self.what = what
        locations = [seg.loc for segs in arrays.values() for seg in segs]
        self._files = OpenFiles(locations).__enter__()  # regular, the ones resolved; kept open
        try:
            self._spans, self._starts, self._lengths = [], {}, {}
            va = 0
            for name, segments in arrays.items():
                runs = _runs(segments)
                if not runs:
                    raise CheckpointError(f"{what}: {name} has no bytes to map")
                _check_boundaries(name, runs)
                self._starts[name] = va + runs[0][1] % PAGE
                self._lengths[name] = sum(r[2] for r in runs)
                for path, offset, length, _ in runs:
                    page = offset - offset % PAGE
                    span = -(-(offset + length - page) // PAGE) * PAGE
                    self._spans.append(_Span(path, self._files[path], page, span, va))
                    va += span
            self.mapping = self._map()
        except BaseException:
            self._files.__exit__()
            raise
        self.identity = {path: os.fstat(fd) for path, fd in self._files.items()}

    def _map(self) -> native.FileMapping:
        try:
            return native.FileMapping([(s.fd, s.page, s.length) for s in self._spans],
                                      self.describe_fault)
        except SyscallError as exc:
            path = self._spans[0].path if len(self.identity_paths()) == 1 else \
                ", ".join(printable(p) for p in self.identity_paths())
            if exc.errno in (errno.ENODEV, errno.EACCES, errno.EPERM, errno.EINVAL):
                kind = _fs_type(self._spans[0].path)
                raise CheckpointError(
                    f"{printable(path)} cannot be mapped ({os.strerror(exc.errno)}): its file "
                    f"system ({kind}) does not map files read-only and shared, or the mount "
                    "forbids it (noexec does not matter; a FUSE or network mount without mmap "
                    "support does); copy the checkpoint to a local disk, or use "
                    "tier='resident'") from None
            raise CheckpointError(f"{printable(path)}: mapping the {self.what} failed: "
                                  f"{exc}") from None

    def identity_paths(self) -> list[str]:
        return list(self._files)

    def array(self, name: str) -> np.ndarray:
        """The read-only uint8 view of array ``name``."""
        return self.mapping.array(self._starts[name], self._lengths[name])

    def offset(self, name: str) -> int:
        """Where array ``name`` starts in the mapping."""
        return self._starts[name]

    def describe_fault(self, offset: int) -> str:
        """What a SIGBUS at ``offset`` of the mapping means, the file named."""
        span = next((s for s in self._spans if s.va <= offset < s.va + s.length), None)
        if span is None:
            return f"{self.what}: a mapped page could not be read (SIGBUS)"
        at = span.page + offset - span.va
        try:
            now = os.fstat(span.fd).st_size
        except OSError:
            now = -1
        was = self.identity[span.path].st_size
        return (f"{printable(span.path)}: byte {at} of this checkpoint file, which the "
                f"{self.what} reads in place (tier='mapped'), could not be read (SIGBUS): the "
                f"file was truncated under the table ({was} bytes when mapped, {now} now); a "
                "mapped checkpoint must stay as it was while its tables are open: restore it "
                "and create the table again, or use tier='resident'")

    def check_unchanged(self) -> None:
        """CheckpointError naming a file that was truncated or rewritten
        (its open descriptor's size or mtime) or replaced at its path since
        it was mapped: a replaced file's old pages still serve this table."""
        for path, fd in self._files.items():
            was, held = FileIdentity.of(self.identity[path]), FileIdentity.of(os.fstat(fd))
            if held != was:
                raise CheckpointError(
                    f"{printable(path)} was {'truncated' if held.size < was.size else 'rewritten'}"
                    f" under the {self.what} ({was.describe()} when mapped, {held.describe()} "
                    "now): its rows may be lost (a lookup of them fails) or other bytes; "
                    "restore the checkpoint and create the table again")
        for path, then in self.identity.items():
            try:
                now = os.stat(path)
            except OSError as exc:
                raise CheckpointError(f"{printable(path)} is gone ({exc.strerror}) from under "
                                      f"the {self.what}; it serves the file it mapped until "
                                      "closed") from None
            if (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
                raise CheckpointError(f"{printable(path)} was replaced under the {self.what} "
                                      "(another file at the path now); the table serves the "
                                      "rows of the file it mapped until closed: create it "
                                      "again to serve the new one")

    def readahead(self, name: str, rows: np.ndarray, row_bytes: int, *,
                  advise: bool = True) -> tuple[int, int]:
        """(pages resident before, pages) of ``rows`` (ascending, unique)
        of array ``name``; ``advise``: the pages not resident asked for."""
        return native.rows_readahead(self.mapping, self._starts[name], row_bytes, rows, advise)

    def close(self) -> None:
        self._files.__exit__()
        self.mapping.close()


def _fs_type(path: str) -> str:
    try:
        return f"statfs type {native.statfs_type(path):#x}"
    except SyscallError:
        return "unknown"
