"""Independent re-statements of DeepSeek's reference formulas, for tests only.

Written the plain way the reference demo computes them (pad by shifting,
recompute each order's mix from scratch, sympy-free prime search by trial
division), so the library's faster code is checked against another route.
"""

import numpy as np


def is_prime_trial(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def reference_primes(layer_ids, vocab_sizes, n_head):
    seen, out = set(), {}
    for layer in layer_ids:
        heads = []
        for size in vocab_sizes:
            start = size - 1
            for _ in range(n_head):
                c = start + 1
                while not (is_prime_trial(c) and c not in seen):
                    c += 1
                seen.add(c)
                heads.append(c)
                start = c
        out[layer] = heads
    return out


def reference_multipliers(seed, layer_id, max_ngram, compressed_vocab):
    max_long = np.iinfo(np.int64).max
    half_bound = max(1, int(max_long // compressed_vocab) // 2)
    g = np.random.default_rng(int(seed + 10007 * int(layer_id)))
    r = g.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
    return r * 2 + 1


def reference_hashes(ids_bt, multipliers, primes, max_ngram, n_head, pad_id):
    x = np.asarray(ids_bt, dtype=np.int64)
    _, t = x.shape

    def shift_k(k):
        if k == 0:
            return x
        return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=pad_id)[:, :t]

    shifts = [shift_k(k) for k in range(max_ngram)]
    all_hashes = []
    with np.errstate(over="ignore"):
        for n in range(2, max_ngram + 1):
            mix = shifts[0] * multipliers[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * multipliers[k])
            for j in range(n_head):
                all_hashes.append((mix % int(primes[(n - 2) * n_head + j])).astype(np.int64))
    return np.stack(all_hashes, axis=2)


def scalar_hash(tokens_back, multipliers, prime):
    """One hash with Python ints: wrap to int64 by hand, floor modulo."""
    def wrap(v):
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    mix = 0
    for tok, m in zip(tokens_back, multipliers):
        mix ^= wrap(int(tok) * int(m))
    return wrap(mix) % prime
