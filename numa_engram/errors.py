"""The exceptions of numa_engram: one base class, one subclass per concern."""

from __future__ import annotations

import errno as _errno
import os


class NumaEngramError(Exception):
    """Base class of every error this library raises on purpose."""

    #: (member, world rank, step, type name, message) of every member that
    #: failed, when the error ends a collective protocol; else empty.
    failures: list[tuple[int, int, str, str, str]] = []

    @classmethod
    def from_message(cls, message: str) -> NumaEngramError:
        """The same class built from a message alone (another member's
        error, re-raised here): no subclass __init__ is called."""
        exc = cls.__new__(cls, message)
        Exception.__init__(exc, message)
        return exc

    def fields(self) -> dict:
        """The structured data a caller may test (beyond the message), as
        plain values that travel to the other members of a group."""
        return {}

    @classmethod
    def rebuild(cls, message: str, fields: dict) -> NumaEngramError:  # noqa: ARG003 (subclasses read it)
        """Another member's error here: ``fields()`` of the original and this
        member's message (naming the member); subclasses with fields
        rebuild through their own constructor."""
        return cls.from_message(message)


class TopologyError(NumaEngramError, ValueError):
    """A node, GPU, shard count or world layout that the host or the model cannot have."""


class PlacementError(NumaEngramError, ValueError):
    """A placement plan that cannot be applied, or pages that are not where planned."""


class StorageError(NumaEngramError):
    """A backing file that cannot be created, attached or trusted."""


class CapacityError(StorageError):
    """Not enough room (tmpfs, memory) for what was asked."""


class NoSuchProcess(StorageError, LookupError):
    """A pid that does not exist (or exited while being read)."""


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
        return self.strerror or super().__str__()

    def fields(self) -> dict:
        return {"call": self.call, "errno": self.errno}

    @classmethod
    def rebuild(cls, message: str, fields: dict) -> SyscallError:
        if not isinstance(fields.get("errno"), int):
            return super().rebuild(message, fields)  # type: ignore[return-value]
        exc = cls(str(fields.get("call", "")), fields["errno"])
        exc.strerror = message  # what __str__ shows: the group's text
        return exc


class SpecError(NumaEngramError, ValueError):
    """An Engram configuration that cannot describe a table."""


class CheckpointError(NumaEngramError):
    """A checkpoint tensor that is missing or has the wrong name, dtype or shape."""


class GroupTimeout(NumaEngramError, TimeoutError):
    """A member did not arrive at a collective in time (or died)."""


class MemberFailure(NumaEngramError):
    """Members of a group failed with exceptions that are not ours;
    ``failures`` lists (member, world rank, step, type name, message) of each."""


class PeerLoadFailed(StorageError):
    """A loader saw another member's load fail (the table is FAILED): an echo,
    never the cause; a group raises the class of the member that failed."""


class PrefetchError(NumaEngramError):
    """Misuse of the prefetch scheduler (unknown layer, double submit, closed)."""


class CudaUnavailable(NumaEngramError):
    """No CUDA runtime or GPU here: the CUDA path cannot run."""


class CudaError(NumaEngramError):
    """A CUDA runtime call failed."""


class ServiceRefusal(StorageError):
    """The table service answered and refused: ``reason`` is one of
    ``store.serviceclient.REASONS`` (no_such_table, not_ready, failed, mismatch,
    refused, bad_request); ``detail`` has e.g. the load's progress."""

    reason: str = ""
    detail: dict = {}

    def __init__(self, message: str, reason: str = "", detail: dict | None = None) -> None:
        super().__init__(message)
        self.reason, self.detail = reason, dict(detail or {})

    def fields(self) -> dict:
        return {"reason": self.reason, "detail": self.detail}

    @classmethod
    def rebuild(cls, message: str, fields: dict) -> ServiceRefusal:
        return cls(message, str(fields.get("reason", "")), fields.get("detail"))
