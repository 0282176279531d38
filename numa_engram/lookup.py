"""Gather + FP8/ue8m0 dequantisation -> BF16 rows for one shard's heads.

``lookup_rows`` is the fused native kernel (one pass: gather, decode, scale,
round, write into a torch tensor; threads pinned to the shard's node; GIL
released).  ``reference_lookup`` is the plain torch path it must equal bit
for bit.  Every id is checked before any row is read: DEAD_ID (-1) gives a
zero row, anything else outside its head's bucket range is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._native import ffi, lib
from .errors import LookupIdError
from .sharding import DEAD_ID


def _torch():
    import torch

    return torch


def check_ids(hash_ids, n_cols: int | None = None) -> np.ndarray:
    """int64, C-contiguous, 2-D ``[T, n_cols]`` hash ids as a numpy array (no
    copy); ``n_cols=None`` accepts any column count."""
    torch = _torch()
    if torch.is_tensor(hash_ids):
        if hash_ids.device.type != "cpu":
            raise LookupIdError(f"hash ids are on {hash_ids.device}; the CPU lookup needs them "
                                "on the CPU")
        if not hash_ids.is_contiguous():
            raise LookupIdError("hash ids tensor is not contiguous; call .contiguous() first")
        hash_ids = hash_ids.numpy()
    ids = hash_ids if isinstance(hash_ids, np.ndarray) else np.asarray(hash_ids)
    if ids.dtype != np.int64:
        raise LookupIdError(f"hash ids have dtype {ids.dtype}; pass int64 (ids.astype(np.int64))"
                            " so no id can be truncated")
    if ids.ndim != 2 or (n_cols is not None and ids.shape[1] != n_cols):
        raise LookupIdError(f"hash ids have shape {list(ids.shape)}; expected "
                            f"[T, {n_cols or 'n_hash_cols'}] (one bucket index per hash column)")
    if not ids.flags.c_contiguous:
        raise LookupIdError("hash ids are not C-contiguous; call np.ascontiguousarray first")
    return ids


def _ptr(array: np.ndarray, ctype: str):
    return ffi.cast(ctype, ffi.from_buffer(array))


def _validate(ids: np.ndarray, head_start: int, bucket_sizes: np.ndarray) -> None:
    n_heads = len(bucket_sizes)
    if ids.shape[0] == 0:
        return
    bad = lib.ne_first_bad_id(_ptr(ids, "int64_t *") + head_start, ids.shape[0], ids.shape[1],
                              n_heads, _ptr(bucket_sizes, "int64_t *"))
    if bad >= 0:
        t, h = divmod(int(bad), n_heads)
        value = int(ids[t, head_start + h])
        raise LookupIdError(
            f"hash id {value} at token {t}, column {head_start + h} is outside head "
            f"{head_start + h}'s buckets [0, {int(bucket_sizes[h])}); use {DEAD_ID} (DEAD_ID) "
            "for padding")


def _out_tensor(out, shape: tuple[int, ...]):
    torch = _torch()
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != shape or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous CPU bfloat16 tensor of shape {list(shape)}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    return out


def lookup_rows(weights: np.ndarray, scales: np.ndarray, hash_ids, *, head_start: int,
                bucket_sizes: Sequence[int], head_offsets: Sequence[int] | None = None,
                out=None, threads: int = 1, cpus: Sequence[int] = (), dedup: bool = False,
                block: int = 32):
    """BF16 ``[T, n_heads, head_dim]`` rows for heads ``head_start ..
    head_start + len(bucket_sizes)`` of ``hash_ids [T, n_hash_cols]``.

    ``weights``/``scales`` are the shard's uint8 rows; ``head_offsets`` the
    first shard row of each head (prefix sums of bucket_sizes by default)."""
    sizes = np.ascontiguousarray(bucket_sizes, dtype=np.int64)
    offsets = (np.concatenate(([0], np.cumsum(sizes)[:-1])) if head_offsets is None
               else np.asarray(head_offsets)).astype(np.int64)
    dim = weights.shape[1]
    if weights.shape[0] < int((offsets + sizes).max(initial=0)):
        raise ValueError(f"weights hold {weights.shape[0]} rows, heads need "
                         f"{int((offsets + sizes).max())}")
    ids = check_ids(hash_ids)
    if not 0 <= head_start <= ids.shape[1] - len(sizes):
        raise LookupIdError(f"heads [{head_start}, {head_start + len(sizes)}) are not columns of "
                            f"hash ids with {ids.shape[1]} columns")
    _validate(ids, head_start, sizes)
    n_tokens, n_heads = ids.shape[0], len(sizes)
    result = _out_tensor(out, (n_tokens, n_heads, dim))
    if n_tokens == 0:
        return result
    if dedup:
        return _lookup_dedup(weights, scales, ids, head_start, offsets, result, threads, cpus,
                             block)
    _run_kernel(weights, scales, ids, head_start, ids.shape[1],
                n_tokens, offsets, result.data_ptr(), threads, cpus, block)
    return result


def _run_kernel(weights, scales, ids, col0, stride, n_tokens, offsets, out_ptr, threads, cpus,
                block) -> None:
    cpu_arr = np.asarray(list(cpus), dtype=np.int32)
    rc = lib.ne_lookup_bf16(
        _ptr(weights, "uint8_t *"), _ptr(scales, "uint8_t *"), weights.shape[1], block,
        _ptr(ids, "int64_t *") + col0, n_tokens, stride, len(offsets),
        _ptr(offsets, "int64_t *"), ffi.cast("uint16_t *", out_ptr), threads,
        _ptr(cpu_arr, "int *") if len(cpu_arr) else ffi.NULL, len(cpu_arr))
    if rc != 0:
        raise OSError(ffi.errno, f"lookup threads could not start ({threads} threads)")


def _lookup_dedup(weights, scales, ids, head_start, offsets, result, threads, cpus, block):
    """Read each distinct row once, then scatter copies (helps batches whose
    tokens repeat n-grams)."""
    torch = _torch()
    cols = ids[:, head_start:head_start + len(offsets)]
    rows = np.where(cols >= 0, cols + offsets, -1)
    unique, inverse = np.unique(rows, return_inverse=True)
    unique = np.ascontiguousarray(unique.reshape(-1, 1))
    staged = torch.empty((len(unique), 1, weights.shape[1]), dtype=torch.bfloat16)
    _run_kernel(weights, scales, unique, 0, 1, len(unique), np.zeros(1, np.int64),
                staged.data_ptr(), threads, cpus, block)
    result.copy_(staged[torch.from_numpy(inverse.reshape(-1))].reshape(result.shape))
    return result


def reference_lookup(weights: np.ndarray, scales: np.ndarray, hash_ids, *, head_start: int,
                     bucket_sizes: Sequence[int], block: int = 32):
    """The plain torch path: index rows, dequantise, zero the DEAD ones."""
    torch = _torch()
    from .fp8 import dequantize_rows

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

class DeviceShard:
    """Zero-copy CUDA views of a registered shard and the GPU lookup on them.

    The views come from ``__cuda_array_interface__`` with the registering
    device; the constructor checks that torch did not copy the table."""

    def __init__(self, weights: np.ndarray, scales: np.ndarray, device: int, head_start: int,
                 bucket_sizes: np.ndarray, block: int = 32) -> None:
        torch = _torch()
        from .cuda import DeviceView

        self.device = torch.device(f"cuda:{device}")
        self.weights = self._view(weights, device, DeviceView)
        self.scales = self._view(scales, device, DeviceView)
        self.head_start, self.block = head_start, block
        sizes = np.asarray(bucket_sizes, dtype=np.int64)
        self.sizes = torch.from_numpy(sizes).to(self.device)
        self.offsets = torch.from_numpy(
            np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)).to(self.device)

    def _view(self, array: np.ndarray, device: int, view_cls):
        torch = _torch()
        view = view_cls(array.ctypes.data, array.shape, device)
        tensor = torch.as_tensor(view, device=self.device)
        if tensor.data_ptr() != view.pointer:
            raise RuntimeError("torch copied the host table instead of viewing it; the device "
                               f"must be the registering one (cuda:{device})")
        return tensor

    def lookup(self, hash_ids, out=None, *, validate: bool = True):
        """BF16 ``[T, heads, head_dim]`` on the device for CUDA int64 ids
        ``[T, n_hash_cols]``; ``validate`` checks ids on the device (one sync)."""
        torch = _torch()
        from .fp8 import dequantize_rows

        if hash_ids.dtype != torch.int64 or hash_ids.dim() != 2:
            raise LookupIdError(f"hash ids must be int64 [T, n_hash_cols], got {hash_ids.dtype} "
                                f"{list(hash_ids.shape)}")
        ids = hash_ids.to(self.device, non_blocking=True)
        heads = len(self.sizes)
        cols = ids[:, self.head_start:self.head_start + heads]
        if validate:
            bad = (cols < -1) | (cols >= self.sizes)
            if bool(bad.any()):
                t, h = (int(x) for x in bad.nonzero()[0])
                raise LookupIdError(f"hash id {int(cols[t, h])} at token {t}, column "
                                    f"{self.head_start + h} is outside its head's buckets "
                                    f"[0, {int(self.sizes[h])})")
        dead = cols < 0
        rows = torch.where(dead, 0, cols + self.offsets).reshape(-1)
        w = self.weights.index_select(0, rows)  # zero-copy reads over PCIe
        s = self.scales.index_select(0, rows)
        vals = dequantize_rows(w, s, self.block).view(cols.shape[0], heads, -1)
        vals.masked_fill_(dead.unsqueeze(-1), 0)
        if out is None:
            return vals
        out.copy_(vals)
        return out


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
