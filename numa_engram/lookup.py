"""Gather + FP8/ue8m0 dequantisation -> BF16 rows for one shard's heads.

``lookup_rows`` runs the fused native kernel (one pass: gather, decode,
scale, round, write into a torch tensor; threads pinned to the shard's node;
GIL released).  ``reference_lookup`` is the plain torch path it must equal
bit for bit; ``staged_lookup`` feeds a GPU through pinned memory, and
``DeviceShard`` (cuda.py) reads registered tables zero-copy.  Every id is
checked before any row is read: DEAD_ID (-1) gives a zero row, anything
else outside its head's bucket range is refused.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import numpy as np

from . import native
from .fp8 import bf16_out, dequantize_rows


def lookup_rows(weights: np.ndarray, scales: np.ndarray, hash_ids, *, head_start: int,
                bucket_sizes: Sequence[int], head_offsets: Sequence[int] | None = None,
                out=None, threads: int = 1, cpus: Sequence[int] = (), dedup: bool = False,
                block: int = 32):
    """BF16 ``[T, n_heads, head_dim]`` rows for heads ``head_start ..
    head_start + len(bucket_sizes)`` of ``hash_ids [T, n_hash_cols]``.

    ``weights``/``scales`` are the shard's uint8 rows; ``head_offsets`` the
    first shard row of each head (prefix sums of bucket_sizes by default)."""
    ids = native.check_hash_ids(hash_ids)
    result, bits = bf16_out(out, (ids.shape[0], len(bucket_sizes), weights.shape[1]))
    native.gather_dequant(weights, scales, ids, head_start=head_start, bucket_sizes=bucket_sizes,
                          head_offsets=head_offsets, out=bits, threads=threads, cpus=cpus,
                          block=block, dedup=dedup)
    return result


def reference_lookup(weights: np.ndarray, scales: np.ndarray, hash_ids, *, head_start: int,
                     bucket_sizes: Sequence[int], block: int = 32):
    """The plain torch path: index rows, dequantise, zero the DEAD ones."""
    import torch

    sizes = np.asarray(bucket_sizes, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    cols = np.asarray(hash_ids)[:, head_start:head_start + len(sizes)]
    rows = np.where(cols >= 0, cols + offsets, 0)
    w = torch.from_numpy(np.asarray(weights)[rows])  # a gathered (writable) copy
    s = torch.from_numpy(np.asarray(scales)[rows])
    out = dequantize_rows(w, s, block)
    out[torch.from_numpy(cols < 0)] = 0
    return out


# ------------------------------------------------------------------ CUDA --

ID_FORMATS = ("bucket", "global")


def id_base(spec, layer_id: int, head_start: int, head_end: int,
            id_format: str) -> np.ndarray | None:
    """What a head's ids are relative to: None for bucket ids; for global
    rows (rows of the layer's whole table) each head's first row."""
    if id_format not in ID_FORMATS:
        raise ValueError(f"id_format must be one of {ID_FORMATS}, got {id_format!r}")
    if id_format == "bucket":
        return None
    return np.ascontiguousarray(spec.head_offsets(layer_id)[head_start:head_end])


class OutputPool:
    """BF16 output buffers reused across lookups, so ``lookup(ids)`` without
    ``out=`` costs what ``lookup(ids, out=buf)`` does (a fresh 48 MiB tensor
    is a new mmap and ~12 k zero-fill faults per call).

    A buffer goes back to the pool only when its storage is freed: each
    call hands out a new numpy view of pooled memory, wrapped by
    ``torch.from_numpy`` (which keeps the view alive as long as the tensor
    or any view of it), and a ``weakref.finalize`` on that numpy view
    returns the memory.  So a returned tensor is never overwritten while
    alive.  Thread-safe; at most ``max_free`` idle buffers are kept."""

    def __init__(self, max_free: int = 4) -> None:
        self.max_free = max_free
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...]):
        """(BF16 tensor of ``shape``, uint16 numpy view of its bits)."""
        import torch

        n = int(np.prod(shape, dtype=np.int64))
        memory = self._reuse(n)
        bits = memory[:n].reshape(shape)
        weakref.finalize(bits, self._give_back, memory)
        return torch.from_numpy(bits).view(torch.bfloat16), bits

    def _reuse(self, n: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, m in enumerate(self._free) if n <= len(m) <= 2 * n]
            if fits:
                return self._free.pop(fits[0])
        import torch

        # torch's allocator, like a caller's out=: it asks for huge pages
        # (MADV_HUGEPAGE) on large buffers, which a 48 MiB output needs
        return torch.empty(max(n, 1), dtype=torch.int16).numpy().view(np.uint16)

    def _give_back(self, memory: np.ndarray) -> None:
        with self._lock:
            self._free.append(memory)
            del self._free[:-self.max_free]


def staged_lookup(weights: np.ndarray, scales: np.ndarray, hash_ids, *, head_start: int,
                  bucket_sizes: Sequence[int], pinned, out, threads: int = 1,
                  cpus: Sequence[int] = (), block: int = 32):
    """For hosts where UVA reads are slow: the native CPU lookup into a
    pinned staging tensor, then an async host-to-device copy on the current
    stream into ``out``."""
    n = int(np.asarray(hash_ids).shape[0])
    lookup_rows(weights, scales, hash_ids, head_start=head_start, bucket_sizes=bucket_sizes,
                out=pinned[:n], threads=threads, cpus=cpus, block=block)
    out[:n].copy_(pinned[:n], non_blocking=True)
    return out[:n]
