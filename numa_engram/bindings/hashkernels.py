"""Typed Python over the C core's hash kernels: DeepSeek's n-gram hashes
for whole sequences and for the serving state's windows, and Qwen4-Exp's
PLE ids.  No torch here."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SpecError
from .native import ffi, lib, ptr, raise_errno


def ngram_hashes(rows: np.ndarray, pad_id: int, multipliers: np.ndarray, max_ngram: int,
                 primes: np.ndarray, n_head: int, threads: int = 1,
                 hardware_division: bool = False) -> np.ndarray:
    """int64 ``[n_rows, T, (max_ngram-1)*n_head]`` hashes of int64 ids
    ``[n_rows, T]`` (the formula is in hashing.py).  ``hardware_division``:
    the plain ``%`` path, the baseline the reciprocal path is benchmarked
    against (same results)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    multipliers = np.ascontiguousarray(multipliers, dtype=np.int64)
    primes = np.ascontiguousarray(primes, dtype=np.int64)
    if len(multipliers) < max_ngram or len(primes) != (max_ngram - 1) * n_head or \
            (primes <= 0).any():
        raise ValueError(f"{len(multipliers)} multipliers and {len(primes)} primes do not fit "
                         f"max_ngram {max_ngram} x {n_head} heads")
    out = np.empty((rows.shape[0], rows.shape[1], (max_ngram - 1) * n_head), dtype=np.int64)
    if out.size and lib.ne_ngram_hashes(
            ptr(rows, "int64_t *"), rows.shape[0], rows.shape[1], pad_id,
            ptr(multipliers, "int64_t *"), max_ngram, ptr(primes, "int64_t *"), n_head,
            ptr(out, "int64_t *"), threads, int(hardware_division)) != 0:
        raise_errno("pthread_create", f"hashing with {threads} threads")
    return out


MAX_POSITION: int = int(lib.NE_MAX_POSITION)


class WindowState:
    """A HashState's fixed arrays (history, next positions, scratch, the
    layers' multipliers, primes and head offsets, the token map and dead
    ids) in one ``struct ne_hash_state`` cast for the kernel once, so a
    decode step passes only its own few arrays.  The arrays are kept alive
    here and must not be replaced (only written in place)."""

    def __init__(self, hist: np.ndarray, next_pos: np.ndarray, scratch: dict[str, np.ndarray],
                 multipliers: np.ndarray, primes: np.ndarray, offsets: np.ndarray,
                 pad_id: int, n_head: int, token_map: np.ndarray | None = None,
                 dead_ids: np.ndarray | None = None) -> None:
        dead = np.ascontiguousarray(np.sort(dead_ids if dead_ids is not None else []),
                                    dtype=np.int64)
        self._keep = (hist, next_pos, scratch, multipliers, primes, offsets, token_map, dead)
        n_slots, n1 = hist.shape
        if n1 + 1 > 64:
            raise ValueError(f"max_ngram_size {n1 + 1} is above the kernel's 64")
        self.n_slots, self.n1 = n_slots, n1
        self.struct = ffi.new("struct ne_hash_state *", {
            "n_slots": n_slots, "n1": n1, "pad_id": pad_id, "n_layers": multipliers.shape[0],
            "n_head": n_head, "hist": ptr(hist, "int64_t *"),
            "next_pos": ptr(next_pos, "int64_t *"), "cur": ptr(scratch["cur"], "int64_t *"),
            "cur_next": ptr(scratch["cur_next"], "int64_t *"),
            "last": ptr(scratch["last"], "int64_t *"),
            "multipliers": ptr(multipliers, "int64_t *"), "primes": ptr(primes, "int64_t *"),
            "offsets": ptr(offsets, "int64_t *"),
            "token_map": ffi.NULL if token_map is None else ptr(token_map, "int64_t *"),
            "map_len": 0 if token_map is None else len(token_map),
            "dead_ids": ptr(dead, "int64_t *") if len(dead) else ffi.NULL,
            "n_dead": len(dead)})
        self.why = ffi.new("int64_t *")
        self.capacity = 0
        self.reserve(64)

    def reserve(self, n_tokens: int) -> None:
        """Scratch for steps of up to ``n_tokens`` tokens (compressed ids, raw
        windows, all-commit and no-commit flags), grown by doubling, cast
        once."""
        if n_tokens <= self.capacity:
            return
        capacity = max(n_tokens, 2 * self.capacity)
        self._scratch = (np.empty(capacity, np.int64), np.empty((capacity, self.n1 + 1), np.int64),
                         np.ones(capacity, np.uint8), np.zeros(capacity, np.uint8))
        ids, win, all_commit, no_commit = self._scratch
        st = self.struct
        st.ids, st.win = ptr(ids, "int64_t *"), ptr(win, "int64_t *")
        st.all_commit, st.no_commit = ptr(all_commit, "uint8_t *"), ptr(no_commit, "uint8_t *")
        st.capacity = self.capacity = capacity


def hash_step(state: WindowState, tokens: np.ndarray, mask: np.ndarray | None,
              slots: np.ndarray, positions: np.ndarray, commit: bool | np.ndarray,
              out: np.ndarray, global_rows: bool, threads: int = 1,
              out_buffer: Any = None) -> tuple[int, int]:
    """One HashState step in one kernel call: the tokens compressed through
    the state's token map and dead ids (``mask``: uint8 or bool, one per
    token; None: all take part), the sequential window pass (history
    updated in place on success), then every layer's hashes into ``out [T,
    layers, cols]``; ``commit`` a bool for every token, or a uint8 flag per
    token.  (-1, 0), or (index of the first bad token, 1 slot / 2 position
    not the slot's next / 3 position out of range), nothing changed then.
    ``out_buffer``: ``ffi.from_buffer(out)``, when the caller keeps one."""
    n_tokens = len(tokens)
    if n_tokens > state.capacity:
        state.reserve(n_tokens)
    if isinstance(commit, bool):
        flags, commit_all = ffi.NULL, commit
    else:
        flags, commit_all = ffi.from_buffer(commit), False
    bad = lib.ne_hash_step(state.struct, ffi.from_buffer(tokens),
                           ffi.NULL if mask is None else ffi.from_buffer(mask),
                           ffi.from_buffer(slots), ffi.from_buffer(positions), flags, commit_all,
                           n_tokens, global_rows,
                           ffi.from_buffer(out) if out_buffer is None else out_buffer, threads,
                           state.why)
    if bad == -2:
        raise_errno("pthread_create", f"hashing with {threads} threads")
    if bad >= 0:
        return bad, state.why[0]
    return -1, 0


def hash_window_batch(win: np.ndarray, pad_id: int, multipliers: np.ndarray,
                      primes: np.ndarray, offsets: np.ndarray | None, n_head: int,
                      out: np.ndarray, threads: int = 1) -> None:
    """Hash ids of raw windows ``win [T, n]`` for every layer at once into
    ``out [T, layers, cols]`` (global rows when ``offsets`` is given)."""
    n_tokens, n = win.shape
    if n > 64:
        raise ValueError(f"max_ngram_size {n} is above the kernel's 64")
    if n_tokens and lib.ne_hash_window_batch(
            ptr(win, "int64_t *"), n_tokens, n, pad_id, ptr(multipliers, "int64_t *"),
            ptr(primes, "int64_t *"),
            ffi.NULL if offsets is None else ptr(offsets, "int64_t *"), multipliers.shape[0],
            n_head, ptr(out, "int64_t *"), threads) != 0:
        raise_errno("pthread_create", f"hashing with {threads} threads")


def ple_ids(ids: np.ndarray, query_start: np.ndarray, context: np.ndarray, eos: int,
            multipliers: np.ndarray, sizes: np.ndarray, offsets: np.ndarray,
            heads_per_ngram: int) -> np.ndarray:
    """int64 ``[T, n_layers, n_heads]`` PLE rows (model/plehashing.py has
    the rule) of int64 ``ids [T]`` in requests ``query_start [R + 1]``
    with ``context [R, n1]``; multipliers ``[n_layers, n1 + 1]``, sizes and
    offsets ``[n_layers, n_heads]``.  The caller checks every shape; the
    kernel refuses a size below 1 (a division by it), named here."""
    n_layers, n_heads = sizes.shape
    out = np.empty((ids.shape[0], n_layers, n_heads), dtype=np.int64)
    if out.size and lib.ne_ple_ids(
            ptr(ids, "int64_t *"), ids.shape[0], ptr(query_start, "int64_t *"),
            query_start.shape[0] - 1, ptr(context, "int64_t *"), context.shape[1], eos,
            ptr(multipliers, "int64_t *"), ptr(sizes, "int64_t *"),
            ptr(offsets, "int64_t *"), n_layers, n_heads, heads_per_ngram,
            ptr(out, "int64_t *")) != 0:
        _raise_bad_size(sizes)
        raise_errno("ne_ple_ids", "arguments the caller should have refused")
    return out


def _raise_bad_size(sizes: np.ndarray) -> None:
    """SpecError naming the first bucket size below 1, if one is."""
    bad = np.flatnonzero(sizes.reshape(-1) < 1)
    if len(bad):
        layer, head = divmod(int(bad[0]), sizes.shape[1])
        raise SpecError(f"bucket size {int(sizes.reshape(-1)[bad[0]])} of layer {layer}, head "
                        f"{head}: a bucket count must be at least 1 (PLESpec.bucket_sizes "
                        "gives them)")
