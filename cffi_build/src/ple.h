/* ple.h: Qwen4-Exp's PLE n-gram ids (vLLM 0.31.0's rule, numa_engram/model/
 * plehashing.py) and FP8 rows with one per-tensor scale turned into BF16.  Each returns 0, or -1 with errno (EINVAL for
 * arguments the Python side should have refused).  The builder reads this
 * header as the cffi declarations. */
#ifndef NE_PLE_H
#define NE_PLE_H
#include <stdint.h>

int ne_ple_ids(const int64_t *ids, int64_t n_tokens, const int64_t *query_start,
               int64_t n_reqs, const int64_t *context, int64_t n1, int64_t eos,
               const int64_t *multipliers, const int64_t *sizes, const int64_t *offsets,
               int64_t n_layers, int64_t n_heads, int64_t heads_per_ngram, int64_t *out);
int ne_ple_rows(const uint8_t *table, int64_t n_rows, int64_t row_bytes, int64_t row_start,
                int64_t total_rows, const int64_t *ids, int64_t n_ids, int scaled,
                float scale, void *out, int64_t *first_bad);

#endif
