"""Where lookup rows are written: the one allocator for the CPU paths.

``bf16_out`` checks a caller's BF16 output (or makes one), ``packed_out``
a caller's pair of FP8 rows and scales (or makes them), and ``OutputPool``
reuses BF16 buffers across calls; all hand the kernel numpy views of the
bytes it writes.  ``aligned_empty`` is the memory under the pool.
``check_apart`` keeps a caller's outputs apart from each other, from the
ids the kernel reads and from the table's mapping (spans of bytes).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

try:  # numpy >= 2.0 moved it here and off numpy's namespace
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy 1.24-1.26 (the lower bound in pyproject.toml)
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

from ..bindings import lookupkernel, native
from ..errors import CapacityError, SpecError

if TYPE_CHECKING:
    import torch

_getrefcount = sys.getrefcount  # (a global, not an attribute: idle checks run every call)

#: A buffer's bytes as addresses ``[start, end)``.
Span = tuple[int, int]
#: (what the message calls the buffer, its span)
Named = tuple[str, Span]

_cast = native.ffi.cast


def tensor_span(tensor: Any) -> Span:
    """The bytes of a contiguous tensor (CPU or device addresses)."""
    start = tensor.data_ptr()
    return start, start + tensor.nbytes


def array_span(array: np.ndarray) -> Span:
    """The bytes a numpy array's elements lie in, strides and all."""
    return byte_bounds(array) if array.size else (0, 0)


def ids_span(address: Any, tokens: int, stride: int, n_cols: int) -> Span:
    """The bytes the kernel reads of int64 ids at ``address`` (a cffi
    pointer or buffer): ``tokens`` rows ``stride`` ids apart, ``n_cols``
    each."""
    if not tokens:
        return 0, 0
    start = int(_cast("uintptr_t", address))
    return start, start + ((tokens - 1) * stride + n_cols) * 8


def check_apart(written: Sequence[Named], read: Sequence[Named] = ()) -> None:
    """No buffer a lookup writes (``written``) shares a byte with another it
    writes or with one it reads (``read``: the ids, the table's mapping):
    the kernel would write rows over ids it has not read yet, over the
    other output, or into the table (a read-only mapping: a SIGSEGV)."""
    for i, (name, (start, end)) in enumerate(written):
        if start == end:
            continue
        for other, (o_start, o_end) in (*written[i + 1:], *read):
            if o_start < end and start < o_end:
                raise SpecError(
                    f"{name} and {other} share bytes (they overlap in memory at "
                    f"[{max(start, o_start):#x}, {min(end, o_end):#x})); a lookup writes every "
                    f"byte of {name}: pass a buffer of its own (e.g. torch.empty)")


def aligned_empty(n: int, dtype: Any = np.uint16) -> np.ndarray:
    """``n`` items of ``dtype``, 64-byte aligned (the kernel's streaming
    stores need whole cache lines), from numpy's allocator: it asks for
    transparent huge pages (MADV_HUGEPAGE) on large arrays, and a lookup
    writes its rows to scattered places in a 48 MiB output, one TLB miss per
    row on 4 KiB pages (torch's CPU allocator does not ask)."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + n * itemsize].view(dtype)


def bf16_out(out: torch.Tensor | None,
             shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """A contiguous CPU BF16 tensor of ``shape`` (``out`` checked, or a new
    one) and a uint16 numpy view of its bits for the native kernel."""
    import torch

    if out is None:
        try:
            out = torch.empty(shape, dtype=torch.bfloat16)
        except (RuntimeError, MemoryError) as exc:
            raise CapacityError(f"the output of {list(shape)} BF16 values ({2 * math.prod(shape)}"
                                f" bytes) cannot be allocated ({str(exc).splitlines()[0][:120]});"
                                " look up fewer tokens per call") from exc
    else:
        check_bf16_out(out, shape)
    return out, out.view(torch.int16).numpy().view(np.uint16)


# (torch.Tensor, torch.bfloat16) once torch is imported: check_bf16_out runs
# every lookup(ids, out=) call, and an import statement there is ~60 ns
_bf16_types: list[Any] = []


def check_bf16_out(out: Any, shape: tuple[int, ...]) -> None:
    """``out`` must be a contiguous CPU BF16 tensor of ``shape``.  The
    cheapest of torch's reads (a plain tensor's type compared, ``is_cpu``
    rather than ``device.type``; ``shape`` compared as it is):
    ``lookup(ids, out=)`` runs this every call."""
    if not _bf16_types:
        import torch

        _bf16_types[:] = [torch.Tensor, torch.bfloat16]
    tensor, bf16 = _bf16_types
    if type(out) is tensor and out.dtype is bf16 and out.shape == shape and out.is_cpu \
            and out.is_contiguous():
        return
    import torch

    if not (torch.is_tensor(out) and out.dtype is torch.bfloat16 and out.shape == shape
            and out.is_cpu and out.is_contiguous()):
        described = f"{out.dtype} {list(out.shape)} on {out.device}" if torch.is_tensor(out) \
            else type(out).__name__
        raise SpecError(f"out must be a contiguous CPU bfloat16 tensor of shape {list(shape)}, "
                        f"got {described}")


def scales_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The scale bytes' shape of packed rows of ``shape`` [T, heads, dim]."""
    return (*shape[:2], shape[2] // block)


def packed_out(out: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, ...],
               block: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                    tuple[np.ndarray, np.ndarray]]:
    """A caller's (rows, scales) pair for a packed lookup of ``shape``
    [T, heads, dim], checked, and their numpy views (a table's own come
    from its pools).  Each must be a contiguous CPU uint8 tensor of exactly
    its shape, and the two must not overlap: the kernel writes every byte
    of both, so anything less would be a write past the caller's buffer."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise SpecError("out must be a (rows, scales) pair of uint8 CPU tensors for "
                        f"packed=True, got {type(out).__name__}")
    check_packed_pair(out[0], out[1], tuple(shape), block)
    return out, (out[0].numpy(), out[1].numpy())


def check_packed_pair(rows: Any, scales: Any, shape: tuple[int, ...], block: int,
                      device: Any = None) -> None:
    """``rows`` and ``scales`` as a packed lookup of ``shape`` writes them:
    contiguous uint8 tensors of exactly their shapes on ``device`` (None:
    the CPU), not overlapping.  The kernels write every byte of both, so
    anything smaller, strided or shared would be a write past the caller's
    buffer (or one part over the other)."""
    _check_packed_part("rows", rows, shape, device)
    _check_packed_part("scales", scales, scales_shape(shape, block), device)
    check_apart(packed_spans(rows, scales))


def packed_spans(rows: Any, scales: Any) -> tuple[Named, Named]:
    """A checked packed pair's spans, named as messages name them."""
    return ("out's rows", tensor_span(rows)), ("out's scales", tensor_span(scales))


def _check_packed_part(name: str, part: Any, shape: tuple[int, ...], device: Any) -> None:
    import torch

    where = "CPU" if device is None else str(device)
    if not (torch.is_tensor(part) and part.dtype == torch.uint8
            and (part.is_cpu if device is None else part.device == device)
            and tuple(part.shape) == shape and part.is_contiguous()):
        described = type(part).__name__
        if torch.is_tensor(part):
            described = f"{part.dtype} {list(part.shape)} on {part.device}" + (
                "" if part.is_contiguous() else ", not contiguous")
        raise SpecError(f"out's {name} must be a contiguous uint8 tensor of shape "
                        f"{list(shape)} on {where} for packed=True, got {described}")


class PreparedOutput:
    """A caller's output checked and cast for the kernel once, to be passed
    as ``out=`` call after call (a static staging buffer): the per-call
    dtype, shape and device checks and the numpy and buffer casts are
    skipped (~6 us, a third of a decode step's lookup).  Made by
    ``prepare_out``; ``result`` is what the lookup returns; ``spans`` the
    bytes it writes (a call's kernel checks them apart from its ids and
    the table's mapping, in C: NE_OVERLAP, named after by ``check_apart``)."""

    __slots__ = ("result", "bits", "buffer", "shape", "packed", "spans", "args")

    def __init__(self, result: Any, bits: Any, buffer: Any, shape: tuple[int, ...],
                 packed: bool, spans: tuple[Named, ...]) -> None:
        self.result, self.bits, self.buffer = result, bits, buffer
        self.shape, self.packed, self.spans = shape, packed, spans
        # the kernel's (rows, scales) outputs, cast once
        self.args = lookupkernel.kernel_outputs(bits, buffer)

    def check_table(self, mapped: Span) -> None:
        """``check_apart`` of these spans and a table's ``mapped`` bytes
        (a call's kernel checks them again, and the ids, in C)."""
        check_apart(self.spans, (("the table's mapping", mapped),))


def prepare_out(out: Any, shape: tuple[int, ...], packed: bool = False,
                block: int = 32, read: Sequence[Named] = ()) -> PreparedOutput:
    """``out`` (a BF16 tensor of ``shape``, or for ``packed`` a (rows,
    scales) pair) checked once for lookups into it, apart from ``read``
    (the table's mapping)."""
    if packed:
        pair, pair_bits = packed_out(out, tuple(shape), block)
        spans: tuple[Named, ...] = packed_spans(*pair)
        check_apart(spans, read)
        return PreparedOutput(pair, pair_bits, None, tuple(shape), True, spans)
    rows, bits = bf16_out(out, shape)
    spans = (("out", tensor_span(rows)),)
    check_apart(spans, read)
    return PreparedOutput(rows, bits, native.ffi.from_buffer(bits), tuple(shape), False, spans)


class OutputPool:
    """Output buffers reused across lookups (BF16 rows; uint8 ones with
    ``packed=True``, for the packed rows and scales), so ``lookup(ids)`` without
    ``out=`` costs what ``lookup(ids, out=buf)`` does (a fresh 48 MiB tensor
    is a new mmap and ~12 k zero-fill faults per call).

    A buffer is reused only when nothing else refers to its memory.  Every
    numpy view of a buffer holds a reference to its owning array, and every
    tensor made from one shares the storage ``torch.from_numpy`` made, which
    holds that view: so the owner's reference count, the handed-out
    tensor's own count and its storage's use count together say whether any
    result of an earlier call is still alive (a slice of a result shares the
    storage).  No finalizer per call (a ``weakref.finalize`` cost 20 us,
    more than a decode step's lookup).  A buffer asked for the shape it last
    served hands out the same tensor again (making one is ~3 us, a decode
    step's lookup is ~20).  Thread-safe; at most ``max_free`` idle buffers
    are kept."""

    def __init__(self, max_free: int = 4, *, packed: bool = False) -> None:
        self.max_free, self.packed = max_free, packed
        self._buffers: list[_Pooled] = []
        self._last: _Pooled | None = None
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """(BF16 tensor of ``shape``, uint16 numpy view of its bits)."""
        tensor, bits, _ = self.take_with_buffer(shape)
        return tensor, bits

    def take_with_buffer(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray, Any]:
        """(BF16 tensor of ``shape`` (uint8 for a packed pool), the bits'
        numpy view, the kernel's buffer of them).  Returned under the lock,
        so the caller's references make the buffer busy before another
        thread can look at it."""
        lock = self._lock
        lock.acquire()  # (not `with`: twice its cost, a tenth of a 1-token lookup's Python)
        try:
            last = self._last  # the common case: the buffer of the last call, free again
            if last is not None and last.shape == shape:
                # last.idle(), inline (the decode budget, docs/design.md)
                owner, tensor, storage = last._idle_refs
                if _getrefcount(last.owner) == owner and _getrefcount(last.tensor) == tensor \
                        and last._use_count(last._storage) == storage:
                    return last.tensor, last.bits, last.pointer
            n = math.prod(shape)
            for entry in self._buffers:
                if n <= entry.size <= 2 * n and entry.idle():
                    break
            else:
                entry = self._new_entry(n)
            entry.shape_as(shape)
            self._last = entry
            return entry.tensor, entry.bits, entry.pointer
        finally:
            lock.release()

    def _new_entry(self, n: int) -> _Pooled:
        free = [e for e in self._buffers if e.idle()]
        entry = _Pooled(max(n, 1), self.packed)
        # idle buffers beyond max_free are dropped, oldest first
        for old in free[:max(0, len(free) - self.max_free + 1)]:
            self._buffers.remove(old)
        self._buffers.append(entry)
        return entry


class _Pooled:
    """One pooled buffer: its memory (64-byte aligned), the kernel's buffer
    of it, and the tensor (and bits) of the shape it last served."""

    def __init__(self, n: int, packed: bool = False) -> None:
        self.packed = packed
        self.memory = aligned_empty(n, np.uint8 if packed else np.uint16)
        self.size = n
        self.owner = self.memory.base if self.memory.base is not None else self.memory
        self.pointer = native.ffi.from_buffer(self.memory)  # the bits start where the memory does
        self.shape: tuple[int, ...] | None = None
        self.tensor: Any = None
        self.bits: Any = None
        self._storage = 0  # the tensor's storage (its address: the tensor keeps it alive)
        self._use_count: Any = None  # torch's count of the tensors sharing a storage
        self._idle_refs = (0, 0, 0)

    def shape_as(self, shape: tuple[int, ...]) -> None:
        """Make ``tensor``/``bits`` the memory as ``shape`` (kept when it is
        the shape they have), and note what idle counts are then."""
        if shape == self.shape:  # before the import (the decode budget)
            return
        import torch

        self.tensor = self.bits = None
        bits = self.memory[:math.prod(shape)].reshape(shape)
        # (no other tensor of the storage may be alive when the counts are noted)
        self.tensor = torch.from_numpy(bits) if self.packed else \
            torch.from_numpy(bits).view(torch.bfloat16)
        self.bits, self.shape = bits, shape
        self._storage = self.tensor.untyped_storage()._cdata
        self._use_count = torch._C._storage_Use_Count  # found once: idle() runs every call
        self._idle_refs = (_getrefcount(self.owner), _getrefcount(self.tensor),
                           self._use_count(self._storage))

    def idle(self) -> bool:
        """Nothing but the pool refers to the memory (no result of an earlier
        call, nor a view or slice of one, is alive)."""
        if self.tensor is None:
            return True
        owner, tensor, storage = self._idle_refs
        return _getrefcount(self.owner) == owner and _getrefcount(self.tensor) == tensor \
            and self._use_count(self._storage) == storage
