"""N-gram hash ids, bit-exact with DeepSeek's reference demo.

For position t, token k back is ``pad_id`` before the start of each row.
For order n: mix = XOR_k (tok_k * m_k) in wrapping int64, and head j of that
order takes the floor modulo ``mix mod prime_j`` (numpy's ``%``).  The mix of
order n+1 extends that of order n, so each product is computed once.
``ngram_hashes`` is the native pass (every column of a token at once,
threaded); ``ngram_hashes_numpy`` is the same in vectorised numpy.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ..bindings import hashkernels
from ..errors import SpecError
from .spec import EngramSpec


def compress_ids(token_ids: np.ndarray, compression: np.ndarray) -> np.ndarray:
    """Map tokenizer ids through the compression table (old id -> new id);
    negative ids pass through unchanged."""
    ids = np.asarray(token_ids, dtype=np.int64)
    table = np.asarray(compression, dtype=np.int64)
    if ids.size and ids.max(initial=-1) >= len(table):
        raise SpecError(f"token id {int(ids.max())} is outside the compression table of "
                        f"{len(table)} ids")
    return np.where(ids >= 0, table[np.clip(ids, 0, None)], ids)


def ngram_hashes(spec: EngramSpec, compressed_ids: ArrayLike, layer_id: int, *,
                 threads: int = 1) -> np.ndarray:
    """int64 ``[..., T, n_hash_cols]`` per-head bucket indices for ids
    ``[..., T]`` (a single sequence or a batch of rows): one native pass per
    token computing every column, on ``threads`` threads."""
    rows, lead = _as_rows(compressed_ids)
    out = hashkernels.ngram_hashes(rows, spec.pad_id, spec.multipliers(layer_id),
                                   spec.max_ngram_size, np.asarray(spec.bucket_sizes(layer_id)),
                                   spec.n_head_per_ngram, threads)
    return out.reshape(*lead, rows.shape[1], spec.n_hash_cols)


def _as_rows(compressed_ids: ArrayLike) -> tuple[np.ndarray, tuple[int, ...]]:
    x = np.ascontiguousarray(compressed_ids, dtype=np.int64)
    if x.ndim == 0:
        raise SpecError("compressed_ids must have a token axis: shape [..., T]")
    lead, t = x.shape[:-1], x.shape[-1]
    return x.reshape(int(np.prod(lead, dtype=np.int64)), t), lead  # -1 cannot infer 0 tokens


def ngram_hashes_numpy(spec: EngramSpec, compressed_ids: ArrayLike, layer_id: int) -> np.ndarray:
    """The same hashes in vectorised numpy: each product computed once, the
    mix of order n+1 extending that of order n."""
    rows, lead = _as_rows(compressed_ids)
    t = rows.shape[1]
    multipliers = spec.multipliers(layer_id)
    primes = spec.bucket_sizes(layer_id)
    out = np.empty((rows.shape[0], t, spec.n_hash_cols), dtype=np.int64)
    with np.errstate(over="ignore"):
        mix = rows * multipliers[0]
        for n in range(2, spec.max_ngram_size + 1):
            k = n - 1
            term = np.empty_like(rows)
            term[:, :k] = spec.pad_id
            if t > k:
                term[:, k:] = rows[:, : t - k]
            term *= multipliers[k]
            mix ^= term
            base = (n - 2) * spec.n_head_per_ngram
            for j in range(spec.n_head_per_ngram):
                np.remainder(mix, primes[base + j], out=out[:, :, base + j])
    return out.reshape(*lead, t, spec.n_hash_cols)


def table_rows(spec: EngramSpec, hash_ids: np.ndarray, layer_id: int) -> np.ndarray:
    """Row of the layer's whole table for each per-head bucket index."""
    return np.asarray(hash_ids, dtype=np.int64) + spec.head_offsets(layer_id)


def sequence_hashes(spec: EngramSpec, compressed_ids: ArrayLike, layer_id: int) -> np.ndarray:
    """int64 ``[T, n_hash_cols]`` bucket ids of one whole sequence with V4.1's
    DEAD rule (``DEAD`` = -1: an image span, a masked token): a DEAD token
    hashes as all-pad n-grams and the ids after it as a new sequence, since
    no look-back crosses it.  The plain route ``HashState`` must agree with."""
    ids = np.asarray(compressed_ids, dtype=np.int64).reshape(-1)
    out = np.empty((len(ids), spec.n_hash_cols), dtype=np.int64)
    dead = np.flatnonzero(ids < 0)
    pad_row = ngram_hashes(spec, np.array([spec.pad_id]), layer_id)[0]
    start = 0
    for cut in [*dead.tolist(), len(ids)]:
        if cut > start:
            out[start:cut] = ngram_hashes(spec, ids[start:cut], layer_id)
        if cut < len(ids):
            out[cut] = pad_row
        start = cut + 1
    return out
