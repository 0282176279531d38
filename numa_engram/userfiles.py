"""A file a user names (config.json, a checkpoint's index and files, a
``--spec``, tokenizer.json): opened without blocking, refused by name
unless it is a regular file, read under a size bound; and any name the
library prints, escaped.

A FIFO at such a path blocks ``open(2)`` until a writer comes (forever, and
inside a native call no signal ends), a device such as ``/dev/zero`` reads
until memory runs out, and a name holding a newline forges a line of
output.  Every read of a user-named file goes through ``open_regular`` or
``read_regular``; every name printed through ``printable``."""

from __future__ import annotations

import os
import stat

from .errors import NumaEngramError

# Far above any config, index or tokenizer a model ships (a tokenizer.json
# is ~10 MiB), far below what a host holds.
MAX_DOCUMENT_BYTES = 256 << 20
_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO's open returns at once
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def printable(name: str) -> str:
    """``name`` as it may be printed: itself when every character prints,
    else with every control, separator and undecodable character escaped
    as Python writes it (a newline as \\n), so no name forges a line."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in name)


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words ("a FIFO", "a directory", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def open_regular(path: str | os.PathLike[str], what: str, *, follow_symlinks: bool = True,
                 error: type[NumaEngramError] = NumaEngramError) -> int:
    """A read-only descriptor of the regular file ``path`` (``what`` names
    it in errors: "the checkpoint index", ...).  Opened non-blocking, so a
    FIFO or device never holds the open, then refused unless regular;
    ``follow_symlinks=False`` refuses a symlink too.  Every failure is an
    ``error`` naming the path, what it is, and what to pass instead."""
    text = printable(os.fspath(path))
    flags = _OPEN if follow_symlinks else _OPEN | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        mode = _mode(path, follow_symlinks)  # a socket's open fails (ENXIO): say what it is
        if mode is not None and not stat.S_ISREG(mode):
            raise _not_regular(error, what, text, mode) from None
        raise error(f"{what} {text}: cannot open it ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise error(f"{what} {text}: cannot stat it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(error, what, text, mode)
    return fd


def _mode(path: str | os.PathLike[str], follow_symlinks: bool) -> int | None:
    try:
        return os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except OSError:
        return None


def _not_regular(error: type[NumaEngramError], what: str, text: str, mode: int
                 ) -> NumaEngramError:
    return error(f"{what} {text} is {file_kind(mode)}, not a regular file; pass the file itself")


def read_fd(fd: int, path: str | os.PathLike[str], what: str, *,
            limit: int = MAX_DOCUMENT_BYTES,
            error: type[NumaEngramError] = NumaEngramError) -> bytes:
    """Every byte of the open regular file ``fd``, at most ``limit`` of them
    (a file larger, or growing past it while read, is an ``error``)."""
    text = printable(os.fspath(path))
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{what} {text} is {size} bytes, above the {limit} such a file may "
                        f"have; pass the right file")
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise error(f"{what} {text} grew past {limit} bytes while it was read; pass "
                            f"a file that is complete")
    except OSError as exc:
        raise error(f"{what} {text}: cannot read it ({exc.strerror or exc})") from None


def read_regular(path: str | os.PathLike[str], what: str, *, limit: int = MAX_DOCUMENT_BYTES,
                 follow_symlinks: bool = True,
                 error: type[NumaEngramError] = NumaEngramError) -> bytes:
    """The bytes of the regular file ``path``: ``open_regular`` then
    ``read_fd`` under ``limit``."""
    fd = open_regular(path, what, follow_symlinks=follow_symlinks, error=error)
    try:
        return read_fd(fd, path, what, limit=limit, error=error)
    finally:
        os.close(fd)
