"""Gather + FP8/ue8m0 dequantisation -> BF16 rows for one shard's heads.

``lookup_rows`` runs the fused native kernel (one pass: gather, decode,
scale, round, write into a torch tensor; threads pinned to the shard's node;
GIL released).  ``reference_lookup`` is the plain torch path it must equal
bit for bit (``DeviceShard`` in ``lookup/gpu.py`` reads registered tables
zero-copy on a GPU).  Every id is
checked before any row is read: DEAD_ID (-1) gives a zero row, anything
else outside its head's bucket range is refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..bindings import lookupkernel, native
from ..errors import LookupIdError
from ..literals import IdFormat, check_id_format
from ..model.fp8 import dequantize_rows
from ..model.sharding import prefix_offsets
from ..model.spec import EngramSpec
from .outputs import array_span, bf16_out, check_apart, scales_shape, tensor_span

if TYPE_CHECKING:
    import torch


# A table's lookups use at most this many threads by default: random rows
# are latency bound, and a few cores' misses in flight are what one node's
# memory serves a gather; more would take cores the serving stack uses.
MAX_DEFAULT_LOOKUP_THREADS = 4


def default_lookup_threads(cpus: Sequence[int] = ()) -> int:
    """Threads a table looks up with unless told: one per CPU of ``cpus``
    (the rows' node; all this process may use when empty) that this
    process may run on, at most MAX_DEFAULT_LOOKUP_THREADS.  A call only
    splits when each thread gets ``lib.NE_SPLIT_ROWS`` rows, so small calls
    stay on the caller whatever this says."""
    allowed = os.sched_getaffinity(0)
    usable = [c for c in cpus if c in allowed] if cpus else allowed
    return max(1, min(MAX_DEFAULT_LOOKUP_THREADS, len(usable)))


def lookup_rows(weights: np.ndarray, scales: np.ndarray, hash_ids: Any, *, head_start: int,
                bucket_sizes: Sequence[int], head_offsets: Sequence[int] | None = None,
                out: torch.Tensor | None = None, threads: int = 1, cpus: Sequence[int] = (),
                block: int = 32, tuning: lookupkernel.Tuning | None = None) -> torch.Tensor:
    """BF16 ``[T, n_heads, head_dim]`` rows for heads ``head_start ..
    head_start + len(bucket_sizes)`` of ``hash_ids [T, n_hash_cols]``.

    ``weights``/``scales`` are the shard's uint8 rows; ``head_offsets`` the
    first shard row of each head (prefix sums of bucket_sizes by default);
    ``tuning``: the kernel's thresholds (benchmarks and tests)."""
    ids = check_hash_ids(hash_ids)
    result, bits = bf16_out(out, (ids.shape[0], len(bucket_sizes), weights.shape[1]))
    if out is not None:
        check_apart((("out", tensor_span(out)),), (
            ("the ids", array_span(ids)), ("the weights", array_span(weights)),
            ("the scales", array_span(scales))))
    gather(weights, scales, ids, head_start=head_start, bucket_sizes=bucket_sizes,
           head_offsets=head_offsets, out=bits, threads=threads, cpus=cpus, block=block,
           tuning=tuning)
    return result


_INT64 = np.dtype(np.int64)  # numpy's one int64 descriptor: what arrays of int64 carry


def check_hash_ids(hash_ids: Any, n_cols: int | None = None) -> np.ndarray:
    """2-D ``[T, n_cols]`` int64 hash ids as a numpy array, without a copy (a
    CPU torch tensor is viewed through ``__array__``; rows may be strided,
    e.g. ``out[:, layer]`` of ``HashState.hash``; columns must be adjacent).
    int32 ids (as vLLM passes global rows) are widened, which copies.
    ``n_cols=None`` accepts any column count."""
    # the common case in a few attribute reads (the decode budget,
    # docs/design.md): the general checks below take a microsecond
    if type(hash_ids) is np.ndarray and hash_ids.dtype is _INT64 and hash_ids.ndim == 2 \
            and (n_cols is None or hash_ids.shape[1] == n_cols) and hash_ids.flags.c_contiguous:
        return hash_ids
    device = getattr(hash_ids, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise LookupIdError(f"hash ids are on {device}; the CPU lookup needs them on the CPU")
    ids = hash_ids if isinstance(hash_ids, np.ndarray) else np.asarray(hash_ids)
    if ids.dtype == np.int32:
        ids = ids.astype(np.int64)
    if ids.dtype != np.int64:
        raise LookupIdError(f"hash ids have dtype {ids.dtype}; pass int64 or int32 "
                            "(ids.astype(np.int64)) so no id can be truncated")
    if ids.ndim != 2 or (n_cols is not None and ids.shape[1] != n_cols):
        raise LookupIdError(f"hash ids have shape {list(ids.shape)}; expected "
                            f"[T, {n_cols or 'n_hash_cols'}] (one bucket index per hash column)")
    if ids.size and (ids.shape[0] > 1 and (ids.strides[0] % 8 or
                                           ids.strides[0] < 8 * ids.shape[1]) or
                     ids.shape[1] > 1 and ids.strides[1] != 8):
        raise LookupIdError(f"hash ids have strides {ids.strides}: a token's columns must be "
                            "adjacent and tokens must not overlap; call np.ascontiguousarray "
                            "(or .contiguous() on a tensor) first")
    return ids


_from_buffer = native.ffi.from_buffer


def ids_for_kernel(hash_ids: Any, n_cols: int) -> tuple[np.ndarray, Any, int, int]:
    """``check_hash_ids`` and ``lookupkernel.ids_args`` in one: (the ids, the
    kernel's view of them, their row stride, their token count); the
    caller keeps the ids alive while the kernel reads them (a widened or
    strided array's view does not).  A decode step's ids are nearly always
    a C-contiguous int64 array: that case is a few attribute reads and the
    buffer (the decode budget, docs/design.md; cffi refuses a strided
    array with ValueError, which takes the general path)."""
    if type(hash_ids) is np.ndarray and hash_ids.dtype is _INT64:
        shape = hash_ids.shape
        if len(shape) == 2 and shape[1] == n_cols:
            try:
                return hash_ids, _from_buffer(hash_ids), n_cols, shape[0]
            except ValueError:
                pass
    ids = check_hash_ids(hash_ids, n_cols)
    return (ids, *lookupkernel.ids_args(ids), ids.shape[0])


def check_ids_in_range(ids: np.ndarray, head_start: int, sizes: np.ndarray,
                       id_base: np.ndarray | None = None) -> None:
    """Every id of heads ``head_start ..`` is -1 (DEAD) or in its head's
    buckets (global rows: in ``[id_base[h], id_base[h] + sizes[h])``)."""
    bad = lookupkernel.first_bad_id(ids, head_start, sizes, id_base)
    if bad >= 0:
        t, h = divmod(bad, len(sizes))
        raise LookupIdError(bad_id_text(int(ids[t, head_start + h]), t, head_start + h,
                                         int(sizes[h]), id_base, h))


def bad_id_text(value: int, token: int, column: int, size: int, id_base: np.ndarray | None,
                h: int, count: int = 1) -> str:
    """The one message for an id outside its head (CPU and GPU paths)."""
    low = 0 if id_base is None else int(id_base[h])
    what = "buckets" if id_base is None else "global rows"
    more = f" ({count} bad ids in all)" if count > 1 else ""
    return (f"hash id {value} at token {token}, column {column} is outside head {column}'s "
            f"{what} [{low}, {low + size}){more}; use -1 (DEAD_ID) for padding")


def gather(weights: np.ndarray, scales: np.ndarray, ids: np.ndarray, *, head_start: int,
           bucket_sizes: Sequence[int] | np.ndarray,
           out: np.ndarray | tuple[np.ndarray, np.ndarray],
           head_offsets: Sequence[int] | np.ndarray | None = None, threads: int = 1,
           cpus: Sequence[int] = (), block: int = 32, id_base: np.ndarray | None = None,
           tuning: lookupkernel.Tuning | None = None) -> None:
    """The one lookup path (tables, DP-sharded exchange, lookup_rows): rows
    of heads ``head_start .. +len(bucket_sizes)`` of checked ``ids [T, cols]``
    gathered from uint8 ``weights``/``scales`` into ``out``: BF16 bits
    (uint16 ``[T, heads, head_dim]``), or, packed, the rows as stored
    ``(uint8 [T, heads, head_dim], uint8 [T, heads, head_dim/block])``.
    -1 gives a zero row; any other id outside its head is a LookupIdError
    (``id_base``: each head's first global row, when ids are global rows)."""
    sizes = np.ascontiguousarray(bucket_sizes, dtype=np.int64)
    offsets = np.ascontiguousarray(prefix_offsets(sizes) if head_offsets is None else head_offsets,
                                   dtype=np.int64)
    if not 0 <= head_start <= ids.shape[1] - len(sizes):
        raise LookupIdError(f"heads [{head_start}, {head_start + len(sizes)}) are not columns of "
                            f"hash ids with {ids.shape[1]} columns")
    if weights.shape[0] < int((offsets + sizes).max(initial=0)):
        raise ValueError(f"weights hold {weights.shape[0]} rows, heads need "
                         f"{int((offsets + sizes).max())}")
    if weights.shape[1] % block or scales.shape != (weights.shape[0], weights.shape[1] // block):
        raise ValueError(f"weights {weights.shape} and scales {scales.shape} do not match with "
                         f"{block} values per scale")
    _check_out(out, (ids.shape[0], len(sizes), weights.shape[1]), block)
    if ids.shape[0] == 0:
        return
    base = None if id_base is None else np.ascontiguousarray(id_base, dtype=np.int64)
    geometry = lookupkernel.Geometry.of(weights, scales, offsets, sizes, base, block)
    count, first, value = lookupkernel.run_geometry_lookup(
        geometry, ids, head_start, base is not None, out, threads, lookupkernel.cpu_list(cpus),
        tuning)
    if count:
        t, h = divmod(first, len(sizes))
        raise LookupIdError(bad_id_text(value, t, head_start + h, int(sizes[h]), base, h,
                                         count))


def _check_out(out: np.ndarray | tuple[np.ndarray, np.ndarray], shape: tuple[int, ...],
               block: int) -> None:
    """uint16 BF16 bits ``shape``, or (uint8 rows ``shape``, uint8 scales)."""
    want = [(np.uint16, shape)] if not isinstance(out, tuple) else [
        (np.uint8, shape), (np.uint8, scales_shape(shape, block))]
    arrays = out if isinstance(out, tuple) else (out,)
    for arr, (dtype, dims) in zip(arrays, want):
        if arr.dtype != dtype or arr.shape != dims or not arr.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous {np.dtype(dtype).name} {list(dims)}, got "
                             f"{arr.dtype} {list(arr.shape)}")


def reference_lookup(weights: np.ndarray, scales: np.ndarray, hash_ids: Any, *,
                     head_start: int, bucket_sizes: Sequence[int] | np.ndarray,
                     block: int = 32) -> torch.Tensor:
    """The plain torch path: index rows, dequantise, zero the DEAD ones."""
    import torch

    sizes = np.asarray(bucket_sizes, dtype=np.int64)
    offsets = prefix_offsets(sizes)
    cols = np.asarray(hash_ids)[:, head_start:head_start + len(sizes)]
    rows = np.where(cols >= 0, cols + offsets, 0)
    w = torch.from_numpy(np.asarray(weights)[rows])  # a gathered (writable) copy
    s = torch.from_numpy(np.asarray(scales)[rows])
    out = dequantize_rows(w, s, block)
    out[torch.from_numpy(cols < 0)] = 0
    return out


# ------------------------------------------------------------ id formats --

def id_base(spec: EngramSpec, layer_id: int, head_start: int, head_end: int,
            id_format: IdFormat) -> np.ndarray | None:
    """What a head's ids are relative to: None for bucket ids; for global
    rows (rows of the layer's whole table) each head's first row."""
    if check_id_format(id_format) == "bucket":
        return None
    return np.ascontiguousarray(spec.head_offsets(layer_id)[head_start:head_end])
