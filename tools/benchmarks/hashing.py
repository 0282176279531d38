"""n-gram hashing: whole sequences, a serving batch, decode steps."""

from __future__ import annotations

import numpy as np

from numa_engram.bindings import hashkernels

from .harness import best_interleaved


def bench_hashing(tokens: int) -> None:
    from numa_engram import EngramSpec, ngram_hashes
    from numa_engram.model.hashing import ngram_hashes_numpy
    from tests.support.engram_reference import reference_hashes

    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    ids = np.random.default_rng(0).integers(0, spec.compressed_vocab_size, size=(1, tokens))
    m, p = spec.multipliers(1), spec.bucket_sizes(1)
    rows = np.ascontiguousarray(ids, dtype=np.int64)
    batches = [np.ascontiguousarray(rows[:, a:a + 8192]) for a in range(0, tokens, 8192)]
    mult, primes = np.asarray(m, np.int64), np.asarray(p, np.int64)
    best = best_interleaved({
        # serving-sized calls (8192 tokens), whose outputs malloc reuses: the
        # compute, not the page faults of a fresh 190 MB output
        "old1": lambda: _each(batches, lambda b: hashkernels.ngram_hashes(
            b, spec.pad_id, mult, 4, primes, 8, hardware_division=True)),
        "new1": lambda: _each(batches, lambda b: hashkernels.ngram_hashes(
            b, spec.pad_id, mult, 4, primes, 8)),
        "native1": lambda: ngram_hashes(spec, ids, 1),
        "native2": lambda: ngram_hashes(spec, ids, 1, threads=2),
        "numpy": lambda: ngram_hashes_numpy(spec, ids, 1),
        "ref": lambda: reference_hashes(ids, m, p, 4, 8, spec.pad_id)}, 3)
    same = np.array_equal(ngram_hashes(spec, ids, 1), reference_hashes(ids, m, p, 4, 8, 2))
    print(f"== hashing: {tokens / 1e6:.1f} M tokens, 24 hash columns (V4-like spec)")
    for name, label in (("native1", "native, 1 thread"), ("native2", "native, 2 threads"),
                        ("numpy", "vectorised numpy"), ("ref", "reference formula")):
        print(f"  {label:<18}: {tokens / best[name] / 1e6:6.2f} M tokens/s -> "
              f"{best['ref'] / best[name]:.2f}x the reference (target >= 1x)")
    print(f"  reciprocals vs hardware division (native, 1 thread): "
          f"{best['old1'] / best['new1']:.2f}x (target >= 1.8)")
    print(f"  identical to the reference: {same}")


def _each(batches, fn) -> None:
    for batch in batches:
        fn(batch)  # each output dropped at once: malloc hands the next call the same memory


def serving_batch(rng, tokens: int = 8192, requests: int = 64):
    """A packed batch of `requests` requests: mixed prefill chunks and
    1-token decode steps, interleaved in a random order."""
    lengths = rng.multinomial(tokens - requests, np.ones(requests) / requests) + 1
    lengths[: requests // 2] = 1  # half the requests are decode steps
    lengths[requests // 2:] += (tokens - lengths.sum()) // (requests - requests // 2)
    lengths[-1] += tokens - lengths.sum()
    starts = rng.integers(1, 4000, requests) * (lengths == 1)  # decodes continue a history
    slots = np.repeat(np.arange(requests), lengths)
    positions = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)])
    chunks = np.split(np.arange(tokens), np.cumsum(lengths)[:-1])  # each request in order
    rng.shuffle(chunks)  # requests packed in a random order
    order = np.concatenate(chunks)
    return slots[order], positions[order], starts


def bench_serving_hashing(tokens: int = 8192, requests: int = 64) -> None:
    """HashState on a packed batch (all layers) vs ngram_hashes on one row
    of the same length once per layer, one thread each, turns interleaved."""
    from numa_engram import EngramSpec, HashState, ngram_hashes

    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.compressed_vocab_size, tokens)
    slots, positions, starts = serving_batch(rng, tokens, requests)
    state = HashState(spec, max_requests=requests)

    for slot, start in enumerate(starts):  # decode steps continue a history
        if start:
            state.restore(slot, int(start), ids[:3])

    def packed():  # commit=False: the state is the same for every turn
        state.hash(ids, slots, positions, commit=False)

    def whole_rows():
        for layer in spec.layer_ids:
            ngram_hashes(spec, ids, layer)
    best = best_interleaved({"packed": packed, "rows": whole_rows}, 9)
    print(f"== serving hashes: packed batch of {tokens} tokens, {requests} requests "
          f"(prefill chunks and decode steps), {len(spec.layer_ids)} layers, 1 thread")
    print(f"  HashState.hash       : {tokens / best['packed'] / 1e6:6.2f} M tokens/s")
    print(f"  ngram_hashes per layer: {tokens / best['rows'] / 1e6:6.2f} M tokens/s")
    print(f"  ratio packed / whole rows: {best['rows'] / best['packed']:.2f} (target >= 0.8)")


def _decode_step_times(spec, n: int, rng, id_sets: int, calls: int) -> dict:
    """Microseconds per call: HashState.hash of one decode token for each of
    n requests, and the native window hashing of the same number of tokens."""
    from numa_engram import HashState

    state = HashState(spec, max_requests=n, token_map=np.arange(129_280) % 99_092)
    history = rng.integers(0, 129_280, (n, 8))
    for slot in range(n):  # each request 8 tokens in
        state.restore(slot, 8, history[slot])
    sets = [rng.integers(0, 129_280, n) for _ in range(id_sets)]
    slots, positions = np.arange(n, dtype=np.int64), np.full(n, 8, dtype=np.int64)
    wins = [rng.integers(0, 99_092, (n, 4)) for _ in range(id_sets)]
    out = np.empty((n, 2, spec.n_hash_cols), dtype=np.int64)
    turn = iter(range(1 << 62))

    def state_calls():
        for _ in range(calls):
            state.hash(sets[next(turn) % id_sets], slots, positions, commit=False)

    def native_calls():
        for _ in range(calls):
            hashkernels.hash_window_batch(wins[next(turn) % id_sets], spec.pad_id,
                                          state._multipliers, state._primes, None,
                                          spec.n_head_per_ngram, out, 1)
    best = best_interleaved({"state": state_calls, "native": native_calls}, 9)
    return {k: v / calls * 1e6 for k, v in best.items()}


def bench_decode_hashing(requests: tuple[int, ...] = (1, 8, 64, 256), id_sets: int = 16,
                         calls: int = 200) -> None:
    """HashState.hash for one decode token of each of N requests (2 layers,
    commit=False so every call sees the same history) vs the native hashing
    of the same tokens (the window kernel on windows built once): the
    per-call Python and casts are the difference.  Variants interleaved, id
    sets rotated, ``calls`` calls per timing (a call is microseconds)."""
    from numa_engram import EngramSpec

    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    rng = np.random.default_rng(0)
    print("== decode hashing: one token per request, 2 layers, 1 thread")
    print("  requests   HashState.hash   native windows   ratio (goal <= 1.2 at 64)")
    for n in requests:
        us = _decode_step_times(spec, n, rng, id_sets, calls)
        print(f"  {n:8d}   {us['state']:11.2f} us   {us['native']:11.2f} us   "
              f"{us['state'] / us['native']:5.2f}x")
