"""Qwen4-Exp's PLE n-gram ids, bit-exact with vLLM 0.31.0's ``ops/ple.py``.

A packed batch holds the chunks of several requests (``query_start``:
request r's tokens are ``query_start[r] .. query_start[r + 1]``; tokens
after the last boundary belong to the last request, as in vLLM) and each
request's ``context``: the ``ngram_size - 1`` tokens before its chunk,
oldest first, EOS before the sequence start.  For token t and head h of
order n = h // heads_per_ngram + 2:

    mix = XOR_{s < n} cand_s * multiplier[s]      (wrapping int64)
    row = offset[h] + (mix mod size[h])            (floor modulo)

where cand_0 is the token and cand_s the token s back; walking back, once
an EOS has been read every older position reads as EOS (an EOS ends a
segment).  ``ple_ids`` is the native pass; ``ple_ids_numpy`` the same in
numpy; ``PLEHistory`` keeps each request slot's context across steps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from ..bindings import hashkernels
from ..errors import SpecError
from .hashstate import integer_array
from .ple import PLESpec
from .spec import _check_range, strict_int

#: PLEHistory's most request slots (vLLM's max_num_seqs is far below): a
#: typo's 2**40 would ask for terabytes
MAX_REQUESTS = 1 << 20


def _layer_arrays(spec: PLESpec, layer_ids: Sequence[int]) -> tuple[np.ndarray, ...]:
    if isinstance(layer_ids, (str, bytes)) or not hasattr(layer_ids, "__iter__"):
        raise SpecError(f"layer_ids must be a sequence of PLE layer numbers, got "
                        f"{type(layer_ids).__name__} {layer_ids!r}")
    # (checked before the cache: 2.0 == 2 would find 2's arrays there)
    layers = tuple(layer if type(layer) is int else strict_int(layer, "layer_ids entry")
                   for layer in layer_ids)
    if not layers:
        raise SpecError(f"layer_ids must name at least one PLE layer (of {spec.layer_ids}), "
                        "got none")
    return _layer_arrays_of(spec, layers)


@functools.lru_cache(maxsize=64)
def _layer_arrays_of(spec: PLESpec, layer_ids: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Multipliers, bucket sizes and head offsets of the layers (read-only:
    kept per spec and layers, a decode step's call reads them as they are)."""
    mult = np.stack([spec.multipliers(layer) for layer in layer_ids])
    sizes = np.array([spec.bucket_sizes(layer) for layer in layer_ids], dtype=np.int64)
    offsets = np.stack([spec.head_offsets(layer) for layer in layer_ids])
    for array in (mult, sizes, offsets):
        array.flags.writeable = False
    return mult, sizes, offsets


def _batch(spec: PLESpec, input_ids: ArrayLike, query_start: ArrayLike | None,
           context: ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.ascontiguousarray(integer_array(input_ids, "input_ids").reshape(-1))
    if query_start is None:  # one request: nothing to check
        qs = np.array([0, len(ids)], dtype=np.int64)
    else:
        qs = np.ascontiguousarray(integer_array(query_start, "query_start").reshape(-1))
    if query_start is not None and (len(qs) < 2 or qs[0] != 0 or (np.diff(qs) < 0).any()
                                    or qs[-1] > len(ids)):
        raise SpecError(f"query_start must rise from 0 to at most the {len(ids)} tokens, "
                        f"one more entry than requests; got {qs.tolist()[:8]}")
    n1 = spec.ngram_size - 1
    ctx = np.full((len(qs) - 1, n1), spec.eos_token_id, dtype=np.int64) if context is None \
        else np.ascontiguousarray(integer_array(context, "context"))
    if ctx.shape != (len(qs) - 1, n1):
        raise SpecError(f"context must be [requests, ngram_size - 1] = "
                        f"{[len(qs) - 1, n1]}, got {list(ctx.shape)}")
    return ids, qs, ctx


def ple_ids(spec: PLESpec, layer_ids: Sequence[int], input_ids: ArrayLike,
            query_start: ArrayLike | None = None, context: ArrayLike | None = None
            ) -> np.ndarray:
    """int64 ``[T, len(layer_ids), n_heads]`` rows of each layer's table for
    tokens ``input_ids [T]`` (one request when ``query_start`` is None; a
    fresh sequence's context, all EOS, when ``context`` is None)."""
    ids, qs, ctx = _batch(spec, input_ids, query_start, context)
    mult, sizes, offsets = _layer_arrays(spec, layer_ids)
    if not len(ids):
        return np.empty((0, len(layer_ids), spec.n_heads), dtype=np.int64)
    return hashkernels.ple_ids(ids, qs, ctx, spec.eos_token_id, mult, sizes, offsets,
                               spec.heads_per_ngram)


def ple_ids_numpy(spec: PLESpec, layer_id: int, input_ids: ArrayLike,
                  query_start: ArrayLike | None = None, context: ArrayLike | None = None
                  ) -> np.ndarray:
    """int64 ``[T, n_heads]``: the same rule in plain numpy, one layer."""
    layer_id = strict_int(layer_id, "layer_id")
    ids, qs, ctx = _batch(spec, input_ids, query_start, context)
    n1, eos, t = spec.ngram_size - 1, spec.eos_token_id, len(ids)
    req = np.clip(np.searchsorted(qs, np.arange(t), side="right") - 1, 0, len(qs) - 2)
    pos = np.arange(t) - qs[req]
    cand = np.empty((n1 + 1, t), dtype=np.int64)
    cand[0] = ids
    crossed = np.zeros(t, dtype=bool)
    for s in range(1, n1 + 1):
        in_chunk = pos >= s
        back = np.where(in_chunk, ids[np.maximum(np.arange(t) - s, 0)],
                        ctx[req, np.clip(n1 - s + pos, 0, n1 - 1)])
        back = np.where(crossed, eos, back)
        crossed |= back == eos
        cand[s] = back
    mult = spec.multipliers(layer_id)
    sizes = np.asarray(spec.bucket_sizes(layer_id), dtype=np.int64)
    offsets = spec.head_offsets(layer_id)
    out = np.empty((t, spec.n_heads), dtype=np.int64)
    with np.errstate(over="ignore"):
        mix = cand[0] * mult[0]
        for order in range(2, n1 + 2):
            mix = mix ^ (cand[order - 1] * mult[order - 1])
            first = (order - 2) * spec.heads_per_ngram
            for h in range(first, first + spec.heads_per_ngram):
                out[:, h] = np.remainder(mix, sizes[h]) + offsets[h]
    return out


class PLEHistory:
    """Each request slot's last ``ngram_size - 1`` tokens across steps, so
    that chunked prefill and decode hash as one sequence does.  Not
    thread-safe: one caller per step."""

    def __init__(self, spec: PLESpec, max_requests: int) -> None:
        max_requests = strict_int(max_requests, "max_requests")
        _check_range("max_requests", max_requests, 1, MAX_REQUESTS)
        self.spec = spec
        self._ctx = np.full((max_requests, spec.ngram_size - 1), spec.eos_token_id,
                            dtype=np.int64)

    def ids(self, layer_ids: Sequence[int], input_ids: ArrayLike, query_start: ArrayLike,
            slots: ArrayLike, *, restart: ArrayLike | None = None) -> np.ndarray:
        """``ple_ids`` for a step whose request r is slot ``slots[r]``
        (``restart[r]`` True: a new sequence in that slot), then each slot's
        history moved past its chunk."""
        ids = np.ascontiguousarray(integer_array(input_ids, "input_ids").reshape(-1))
        qs = integer_array(query_start, "query_start").reshape(-1)
        where = integer_array(slots, "slots").reshape(-1)
        if len(where) != len(qs) - 1 or len(set(where.tolist())) != len(where) or (
                len(where) and not 0 <= where.min() <= where.max() < len(self._ctx)):
            raise SpecError(f"slots must be {len(qs) - 1} distinct slots in "
                            f"0..{len(self._ctx) - 1}, got {where.tolist()[:8]}")
        if restart is not None:
            self._ctx[where[self._restart_flags(restart, len(where))]] = self.spec.eos_token_id
        context = self._ctx[where]
        out = ple_ids(self.spec, layer_ids, ids, qs, context)
        self._advance(where, ids, qs, context)
        return out

    @staticmethod
    def _restart_flags(restart: ArrayLike, requests: int) -> np.ndarray:
        try:
            fresh = np.asarray(restart, dtype=bool).reshape(-1)
        except (ValueError, TypeError) as exc:
            raise SpecError(f"restart must hold one flag per request ({requests}): "
                            f"{str(exc).splitlines()[0][:120]}") from None
        if len(fresh) != requests:
            raise SpecError(f"restart must hold one flag per request ({requests}), got "
                            f"{len(fresh)}: {fresh.tolist()[:8]}")
        return fresh

    def _advance(self, slots: np.ndarray, ids: np.ndarray, qs: np.ndarray,
                 context: np.ndarray) -> None:
        n1 = self.spec.ngram_size - 1
        ends = np.append(qs[1:-1], len(ids))  # the last request takes any tail
        for r, slot in enumerate(slots.tolist()):
            seq = np.concatenate((context[r], ids[qs[r]:ends[r]]))
            self._ctx[slot] = seq[-n1:]
