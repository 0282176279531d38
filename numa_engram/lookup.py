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
