"""The exceptions of numa_engram: one base class, one subclass per concern."""

from __future__ import annotations

import errno as _errno
import os


class NumaEngramError(Exception):
    """Base class of every error this library raises on purpose."""


class TopologyError(NumaEngramError, ValueError):
    """A node, GPU, shard count or world layout that the host or the model cannot have."""


class PlacementError(NumaEngramError, ValueError):
    """A placement plan that cannot be applied, or pages that are not where planned."""


class StorageError(NumaEngramError):
    """A backing file that cannot be created, attached or trusted."""


class CapacityError(StorageError):
    """Not enough room (tmpfs, memory) for what was asked."""


class SpecMismatchError(StorageError):
    """A table or checkpoint built for another Engram spec."""


class LookupIdError(NumaEngramError, ValueError):
    """Hash ids that would read outside the shard's rows."""


class SyscallError(NumaEngramError, OSError):
    """A system call failed: carries the call, the arguments that matter and the errno."""

    def __init__(self, call: str, err: int, detail: str = "", hint: str = "") -> None:
        self.call = call
        self.errno_name = _errno.errorcode.get(err, f"errno {err}")
        message = f"{call} failed: {self.errno_name} ({os.strerror(err)})"
        if detail:
            message += f" [{detail}]"
        if hint:
            message += f"; {hint}"
        super().__init__(err, message)

    def __str__(self) -> str:
        return self.strerror or ""


class SpecError(NumaEngramError, ValueError):
    """An Engram configuration that cannot describe a table."""


class CheckpointError(NumaEngramError):
    """A checkpoint tensor that is missing or has the wrong name, dtype or shape."""
