"""Serving-grade n-gram hashing with DeepSeek V4.1's semantics.

A serving stack hashes packed batches that mix prefill chunks and 1-token
decode steps of many requests.  ``HashState`` keeps, per request slot, the
last ``max_ngram_size - 1`` compressed ids of its sequence and the next
position, so every token looks back through its own sequence across calls:

- the token at position p looks back at positions p-1 .. p-(N-1) of its own
  sequence, from earlier tokens of this call (committed or not) or from the
  slot's history;
- the look-back stops at the sequence start and at any DEAD token (a
  ``token_mask`` False, a negative id, an id outside the token map, one of
  ``dead_ids``): from there on the pad id is used; a DEAD token itself
  hashes as all-pad n-grams;
- in batch order a slot's positions run next, next+1, ...; position 0
  restarts the slot;
- after the call a slot keeps the history as of its last committed token;
  uncommitted tokens after it (speculative ones) leave it as it was.

Output ``[T, len(spec.layer_ids), n_hash_cols]``: per-head bucket ids, or
rows of each layer's whole table (``id_format="global"``), as the model and
vLLM use them.  The sequential look-back pass and the hashing of every
layer are native (the hashing threaded, GIL released).  No torch here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TypeGuard

import numpy as np
from numpy.typing import ArrayLike

from ..bindings import hashkernels, native
from ..errors import SpecError
from ..literals import IdFormat, check_id_format
from .spec import EngramSpec, strict_int

DEAD = -1
# the slot's next position is position + 1: it must not wrap int64
MAX_POSITION = hashkernels.MAX_POSITION  # 2**62, the kernel's bound (cffi_build/src/hashing.h)


def integer_array(values: ArrayLike, name: str) -> np.ndarray:
    """int64 array of ``values`` (Python ints or an integer array); floats,
    bools and objects are refused, never truncated, and so are values
    beyond int64."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError, OverflowError) as exc:
            raise SpecError(f"{name} must be integers: {exc}") from None
    if arr.size == 0 and arr.dtype == np.float64 and not isinstance(values, np.ndarray):
        arr = arr.astype(np.int64)  # [] is an empty list of ints
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise SpecError(f"{name} must be integers (Python ints or an integer array), got "
                        f"{arr.dtype}; floats are not truncated")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise SpecError(f"{name} holds {int(arr.max())}, beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


_INT64 = np.dtype(np.int64)


def _is_int64_vector(values: object) -> TypeGuard[np.ndarray]:
    """A 1-D contiguous int64 numpy array: what the kernel reads as it is."""
    # (`is`: numpy's int64 dtype is one object, and the test a third of ==)
    return type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1 \
        and values.flags.c_contiguous


class HashState:
    """Per-request hashing state for ``max_requests`` slots.

    ``token_map`` (tokenizer id -> compressed id, e.g. from
    ``build_token_map``): ``hash`` then takes tokenizer ids.  ``dead_ids``
    (e.g. an image placeholder id) are DEAD wherever they appear.  Methods
    are not thread-safe: one state per scheduler thread."""

    def __init__(self, spec: EngramSpec, max_requests: int, token_map: np.ndarray | None = None,
                 dead_ids: Sequence[int] = ()) -> None:
        if max_requests < 1:
            raise SpecError(f"max_requests must be >= 1, got {max_requests}")
        self.spec, self.max_requests = spec, int(max_requests)
        # read-only after this: the kernel holds them
        self._token_map = None if token_map is None else np.ascontiguousarray(token_map,
                                                                              dtype=np.int64)
        self._dead_ids = np.asarray(sorted(set(int(i) for i in dead_ids)), dtype=np.int64)
        n1 = spec.max_ngram_size - 1
        self._hist = np.full((self.max_requests, n1), DEAD, dtype=np.int64)
        self._next = np.zeros(self.max_requests, dtype=np.int64)
        self._scratch = {"cur": np.empty_like(self._hist), "cur_next": np.empty_like(self._next),
                         "last": np.empty_like(self._next)}
        layers = spec.layer_ids
        self._multipliers = np.ascontiguousarray(
            [spec.multipliers(layer)[:spec.max_ngram_size] for layer in layers], dtype=np.int64)
        self._primes = np.ascontiguousarray([spec.bucket_sizes(layer) for layer in layers],
                                            dtype=np.int64)
        self._offsets = np.ascontiguousarray([spec.head_offsets(layer) for layer in layers],
                                             dtype=np.int64)
        # cast once: per call the casts would be half of a one-token decode step
        self._native = hashkernels.WindowState(self._hist, self._next, self._scratch,
                                               self._multipliers, self._primes, self._offsets,
                                               spec.pad_id, spec.n_head_per_ngram, self.token_map,
                                               self.dead_ids)
        self._n_layers, self._n_cols = len(layers), spec.n_hash_cols
        # hash()'s last result and its buffer, reused once the caller dropped it
        self._last_out: tuple[np.ndarray, object] | None = None
        self._idle_refs = 0

    @property
    def token_map(self) -> np.ndarray | None:
        """tokenizer id -> compressed id (None: ``hash`` takes compressed ids)."""
        return self._token_map

    @property
    def dead_ids(self) -> np.ndarray:
        """The ids that are DEAD wherever they appear, sorted."""
        return self._dead_ids

    # ------------------------------------------------------------- api --
    def hash(self, token_ids: ArrayLike, slots: ArrayLike, positions: ArrayLike,
             token_mask: ArrayLike | None = None, *, commit: bool | ArrayLike = True,
             id_format: IdFormat = "bucket", threads: int = 1) -> np.ndarray:
        """int64 ``[T, layers, n_hash_cols]`` for a packed batch (see the
        module docstring for the rules).  A position that does not continue
        its slot, a slot out of range or arrays of different lengths raise
        SpecError naming the token; the state is then unchanged."""
        if id_format != "bucket":
            check_id_format(id_format)
        tokens = token_ids if _is_int64_vector(token_ids) else self._tokens(token_ids)
        n = len(tokens)
        # what a scheduler passes is used as it is: no copy, no check to repeat
        if not (_is_int64_vector(slots) and len(slots) == n):
            slots = self._column(slots, n, "slots")
        if not (_is_int64_vector(positions) and len(positions) == n):
            positions = self._column(positions, n, "positions")  # bounds: in the kernel
        mask = None if token_mask is None else self._token_mask(token_mask, n)
        commits = commit if commit is True or commit is False else self._commit_mask(commit, n)
        out, out_buffer = self._output(n)
        # one kernel call: the token map and dead ids, the windows, the hashes
        bad, why = hashkernels.hash_step(self._native, tokens, mask, slots, positions, commits, out,
                                         id_format == "global", threads, out_buffer)
        if bad >= 0:
            raise SpecError(self._misuse(bad, why, slots, positions))
        return out

    def _output(self, n: int) -> tuple[np.ndarray, object]:
        """``[n, layers, cols]`` int64 for ``hash`` and the kernel's buffer
        of it: the last call's again when nothing else refers to the array
        (the caller dropped it and every view of it: a numpy view, a tensor
        from_numpy or a memoryview holds it), else a new one.  Making the
        array and its buffer would be half of a 64-token decode step's Python."""
        last = self._last_out
        if last is not None and last[0].shape[0] == n and \
                sys.getrefcount(last[0]) == self._idle_refs:
            return last
        # (a dtype object, not np.int64: numpy resolves that every call, 2x the empty)
        out = np.empty((n, self._n_layers, self._n_cols), _INT64)
        last = (out, native.ffi.from_buffer(out))
        del out
        # the array's count with no caller holding it: the pair's, its
        # buffer's (cffi's), getrefcount's argument
        self._idle_refs = sys.getrefcount(last[0])
        self._last_out = last
        return last

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished: its next token must be position 0."""
        self._check_slot(slot)
        self._hist[slot] = DEAD
        self._next[slot] = 0

    def restore(self, slot: int, position: int, prefix_ids: ArrayLike,
                prefix_mask: ArrayLike | None = None, *, unknown_id: int | None = None) -> None:
        """A request resumed at ``position`` > 0 (a prefix-cache hit, a
        preemption, a P/D hand-over): ``prefix_ids`` are its ids before
        ``position``, in the id space ``hash`` takes: at least the last
        ``max_ngram_size - 1`` (or all of them when fewer), more is fine
        (only the last ones count; ids a runner's fixed-size look-back window
        holds before the sequence start are ignored).

        DEAD ids (``prefix_mask`` False, negative, outside the token map, in
        ``dead_ids``) stop the look-back there, as in ``hash``.
        ``unknown_id``: the id a runner puts where it does not know the id
        (vLLM's ``lookback_token_ids`` hold -1 there): such an id is hashed as
        the pad id and the look-back goes on past it to older ids, as vLLM's
        hashing does; it is not DEAD."""
        self._check_slot(slot)
        position = strict_int(position, "position")
        if not 0 <= position <= MAX_POSITION:
            raise SpecError(f"restore position must be in 0..{MAX_POSITION}, got {position}")
        n1 = self.spec.max_ngram_size - 1
        raw = integer_array(prefix_ids, "prefix_ids").reshape(-1)
        prefix = self.compressed(raw, prefix_mask)
        if unknown_id is not None:
            known_dead = np.zeros(len(raw), dtype=bool) if prefix_mask is None else \
                ~np.asarray(prefix_mask, dtype=bool)
            prefix[(raw == strict_int(unknown_id, "unknown_id")) & ~known_dead] = \
                self.spec.pad_id
        need = min(position, n1)
        if len(prefix) < need:
            raise SpecError(f"restore(slot {slot}, position {position}) needs the ids before "
                            f"that position (at least the last {need}), got {len(prefix)}")
        last = prefix[len(prefix) - need:] if need else prefix[:0]
        self._hist[slot] = DEAD
        if need:
            self._hist[slot, n1 - need:] = last
        self._next[slot] = position

    def next_position(self, slot: int) -> int:
        """The position the slot's next token must have (0: a new request)."""
        self._check_slot(slot)
        return int(self._next[slot])

    def compressed(self, token_ids: ArrayLike, token_mask: ArrayLike | None = None) -> np.ndarray:
        """int64 compressed ids with DEAD (-1) for every token that takes no
        part: masked, negative, outside the token map, or in ``dead_ids``."""
        ids = self._tokens(token_ids)
        # few whole-array passes: a decode step's ids are a handful of tokens,
        # where each numpy call's fixed cost is the whole cost
        dead = ids < 0
        if self.token_map is not None:
            dead |= ids >= len(self.token_map)
            out = self.token_map.take(ids, mode="clip")  # a fresh array, ours to write
            dead |= out < 0
        else:
            out = ids.copy()
        if len(self.dead_ids):
            dead |= np.isin(ids, self.dead_ids)
        if token_mask is not None:
            mask = np.asarray(token_mask, dtype=bool)
            if mask.shape != ids.shape:
                raise SpecError(f"token_mask has shape {list(mask.shape)}, token ids "
                                f"{list(ids.shape)}: pass one flag per token")
            dead |= ~mask
        out[dead] = DEAD
        return out

    # --------------------------------------------------------- internals --
    def _check_slot(self, slot: int) -> None:
        slot = strict_int(slot, "slot")
        if not 0 <= slot < self.max_requests:
            raise SpecError(f"slot {slot} is outside 0..{self.max_requests - 1} "
                            "(max_requests)")

    @staticmethod
    def _tokens(token_ids: ArrayLike) -> np.ndarray:
        """The step's token ids as 1-D contiguous int64."""
        ids = np.asarray(token_ids)
        if ids.size == 0 and not isinstance(token_ids, np.ndarray):
            ids = ids.astype(np.int64)  # [] is an empty step (an idle replica)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise SpecError(f"token ids must be a 1-D integer array [T], got {ids.dtype} "
                            f"{list(ids.shape)}")
        if ids.dtype == np.uint64 and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
            raise SpecError(f"token ids hold {int(ids.max())}, beyond int64")
        return np.ascontiguousarray(ids, dtype=np.int64)

    @staticmethod
    def _token_mask(token_mask: ArrayLike, n: int) -> np.ndarray:
        mask = np.ascontiguousarray(token_mask, dtype=bool)
        if mask.shape != (n,):
            raise SpecError(f"token_mask has shape {list(mask.shape)}, token ids "
                            f"[{n}]: pass one flag per token")
        return mask.view(np.uint8)

    @staticmethod
    def _column(values: ArrayLike, n: int, name: str) -> np.ndarray:
        arr = values if _is_int64_vector(values) else integer_array(values, name)
        if arr.shape != (n,):
            raise SpecError(f"{name} has shape {list(arr.shape)} but there are {n} tokens: "
                            "pass one per token")
        return arr

    @staticmethod
    def _commit_mask(commit: bool | ArrayLike, n: int) -> bool | np.ndarray:
        """A bool for every token (the kernel's own flags), or a flag each."""
        if isinstance(commit, (bool, np.bool_)):
            return bool(commit)
        mask = np.asarray(commit)
        if mask.shape != (n,) or mask.dtype != bool:
            raise SpecError(f"commit must be a bool or a bool array of {n} (one per token), "
                            f"got {mask.dtype} {list(mask.shape)}")
        return np.ascontiguousarray(mask, dtype=np.uint8)

    def _misuse(self, index: int, why: int, slots: np.ndarray, positions: np.ndarray) -> str:
        slot, pos = int(slots[index]), int(positions[index])
        if why == 3:
            return (f"positions must be in 0..{MAX_POSITION}, got "
                    f"{int(positions.min())}..{int(positions.max())}")
        if why == 1:
            return (f"token {index}: slot {slot} is outside 0..{self.max_requests - 1} "
                    "(max_requests)")
        expected = int(self._expected_next(index, slots, positions))
        kind = "a gap" if pos > expected else "a replay"
        return (f"token {index}: slot {slot} position {pos} does not continue its sequence "
                f"({kind}: expected {expected}, or 0 to start a new request; restore() a "
                "request resumed elsewhere)")

    def _expected_next(self, index: int, slots: np.ndarray, positions: np.ndarray) -> int:
        slot = slots[index]
        earlier = np.flatnonzero(slots[:index] == slot)
        return positions[earlier[-1]] + 1 if len(earlier) else self._next[slot]
