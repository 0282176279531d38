/* ple.c: Qwen4-Exp's PLE ids and rows (see ple.h). */
#include "ple.h"

/* The look-back of the token at flat index t: cand[s] for s = 1..n1 is the
 * token s back in its request (this call's tokens, else the request's
 * context row, oldest first), EOS once an EOS was passed walking back. */
static void ple_lookback(const int64_t *ids, int64_t t, int64_t chunk_pos, const int64_t *ctx,
                         int64_t n1, int64_t eos, int64_t *cand)
{
    int crossed = 0;
    for (int64_t s = 1; s <= n1; s++) {
        int64_t c = chunk_pos >= s ? ids[t - s] : ctx[n1 - s + chunk_pos];
        if (crossed)
            c = eos;
        crossed |= c == eos;
        cand[s] = c;
    }
}

/* Floor modulo (torch.remainder) of a wrapped int64 mix by size > 0. */
static inline int64_t ple_mod(int64_t mix, int64_t size)
{
    int64_t r = mix % size;
    return r < 0 ? r + size : r;
}

/* out[t][layer][head] = offsets[layer][head] + (mix mod sizes[layer][head])
 * with mix = XOR over s < order of cand[s] * multipliers[layer][s] in
 * wrapping int64 (cand[0] the token itself); order = head / heads_per_ngram
 * + 2.  Tokens after query_start[n_reqs] belong to the last request, as in
 * vLLM.  query_start is non-decreasing from 0 (checked by the caller). */
int ne_ple_ids(const int64_t *ids, int64_t n_tokens, const int64_t *query_start,
               int64_t n_reqs, const int64_t *context, int64_t n1, int64_t eos,
               const int64_t *multipliers, const int64_t *sizes, const int64_t *offsets,
               int64_t n_layers, int64_t n_heads, int64_t heads_per_ngram, int64_t *out)
{
    int64_t cand[65];
    if (n1 < 1 || n1 > 64 || n_reqs < 1 || heads_per_ngram < 1 ||
        n_heads != n1 * heads_per_ngram) {
        errno = EINVAL;
        return -1;
    }
    int64_t req = 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        while (req + 1 < n_reqs && query_start[req + 1] <= t)
            req++;
        cand[0] = ids[t];
        ple_lookback(ids, t, t - query_start[req], context + req * n1, n1, eos, cand);
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *m = multipliers + l * (n1 + 1);
            int64_t *o = out + (t * n_layers + l) * n_heads;
            uint64_t mix = (uint64_t)cand[0] * (uint64_t)m[0];
            for (int64_t order = 2; order <= n1 + 1; order++) {
                mix ^= (uint64_t)cand[order - 1] * (uint64_t)m[order - 1];
                int64_t h0 = (order - 2) * heads_per_ngram;
                for (int64_t h = h0; h < h0 + heads_per_ngram; h++)
                    o[h] = offsets[l * n_heads + h] +
                           ple_mod((int64_t)mix, sizes[l * n_heads + h]);
            }
        }
    }
    return 0;
}

/* out[i] = lut[table[ids[i] - row_start]] for the rows this shard holds
 * (row_start <= id < row_start + n_rows), zeros for any other id (another
 * shard's row: the ranks' sum is the whole table's row).  lut NULL: the
 * raw bytes (FP8 packed, or BF16 rows of row_bytes bytes). */
int ne_ple_rows(const uint8_t *table, int64_t n_rows, int64_t row_bytes, int64_t row_start,
                const int64_t *ids, int64_t n_ids, const uint16_t *lut, void *out)
{
    if (row_bytes < 1) {
        errno = EINVAL;
        return -1;
    }
    for (int64_t i = 0; i < n_ids; i++) {
        int64_t local = ids[i] - row_start;
        int inside = local >= 0 && local < n_rows;
        const uint8_t *src = table + (inside ? local : 0) * row_bytes;
        if (lut) {
            uint16_t *dst = (uint16_t *)out + i * row_bytes;
            if (!inside) {
                memset(dst, 0, (size_t)row_bytes * 2);
                continue;
            }
            for (int64_t j = 0; j < row_bytes; j++)
                dst[j] = lut[src[j]];
        } else {
            uint8_t *dst = (uint8_t *)out + i * row_bytes;
            if (inside)
                memcpy(dst, src, (size_t)row_bytes);
            else
                memset(dst, 0, (size_t)row_bytes);
        }
    }
    return 0;
}
