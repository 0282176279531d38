"""Where lookup rows are written: the one allocator for the CPU paths.

``bf16_out`` checks a caller's BF16 output (or makes one), ``packed_out``
a caller's pair of FP8 rows and scales (or makes them), and ``OutputPool``
reuses BF16 buffers across calls; all hand the kernel numpy views of the
bytes it writes.  ``aligned_empty`` is the memory under the pool.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CapacityError

if TYPE_CHECKING:
    import torch


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
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(shape) \
            or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous CPU bfloat16 tensor of shape {list(shape)}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    return out, out.view(torch.int16).numpy().view(np.uint16)


def packed_out(out: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int, ...],
               block: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                    tuple[np.ndarray, np.ndarray]]:
    """(rows, scales) uint8 CPU tensors for a packed lookup (``out`` checked,
    or new ones) and their numpy views."""
    import torch

    if out is None:
        out = (torch.empty(shape, dtype=torch.uint8),
               torch.empty((*shape[:2], shape[2] // block), dtype=torch.uint8))
    if not (isinstance(out, tuple) and len(out) == 2 and all(
            torch.is_tensor(t) and t.dtype == torch.uint8 and t.device.type == "cpu"
            for t in out)):
        raise ValueError("out must be a (rows, scales) pair of uint8 CPU tensors for "
                         "packed=True")
    return out, (out[0].numpy(), out[1].numpy())


class OutputPool:
    """BF16 output buffers reused across lookups, so ``lookup(ids)`` without
    ``out=`` costs what ``lookup(ids, out=buf)`` does (a fresh 48 MiB tensor
    is a new mmap and ~12 k zero-fill faults per call).

    A buffer is reused only when nothing else refers to its memory: every
    numpy view and every tensor made from one (``torch.from_numpy`` keeps its
    view alive) holds a reference to the buffer's owning array, so the
    owner's reference count says whether any result of an earlier call is
    still alive.  No finalizer per call (a ``weakref.finalize`` cost 20 us,
    more than a decode step's lookup).  Thread-safe; at most ``max_free``
    idle buffers are kept."""

    def __init__(self, max_free: int = 4) -> None:
        self.max_free = max_free
        self._buffers: list[tuple[np.ndarray, np.ndarray]] = []  # (memory, its owner)
        self._lock = threading.Lock()
        self._free_refs: int | None = None

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """(BF16 tensor of ``shape``, uint16 numpy view of its bits)."""
        import torch

        n = math.prod(shape)
        memory = self._reuse(n)
        bits = memory[:n].reshape(shape)
        return torch.from_numpy(bits).view(torch.bfloat16), bits

    def _refs(self, entry: tuple[np.ndarray, np.ndarray]) -> int:
        return sys.getrefcount(entry[1])

    def _reuse(self, n: int) -> np.ndarray:
        with self._lock:
            for entry in self._buffers:  # the common case: the first idle one fits
                if n <= len(entry[0]) <= 2 * n and self._refs(entry) == self._free_refs:
                    return entry[0]
            free = [e for e in self._buffers if self._refs(e) == self._free_refs]
            memory = aligned_empty(max(n, 1), np.uint16)
            entry = (memory, memory.base if memory.base is not None else memory)
            if self._free_refs is None:  # what an idle buffer's owner counts, measured once
                self._free_refs = self._refs(entry)
            # idle buffers beyond max_free are dropped, oldest first
            for old in free[:max(0, len(free) - self.max_free + 1)]:
                self._buffers.remove(old)
            self._buffers.append(entry)
            return memory
