/* lookup.h: a shard's rows for a batch of hash ids, BF16 or packed, and
 * the plain random-read rate they are measured against.  Each id is -1
 * (DEAD: a zero row) or inside its head; a bad one gives a zero row and is
 * reported in bad[0..2] = (count, first flat index t*n_heads+h, its value).
 * The builder reads this header as the cffi declarations.
 *
 * cffi-constants (the defaults lookup.c tunes from):
 *   #define NE_SMALL_ROWS ...
 *   #define NE_PREFETCH_AHEAD ...
 *   #define NE_PREFETCH_HINT ...
 */
#ifndef NE_LOOKUP_H
#define NE_LOOKUP_H
#include <stdint.h>

struct ne_pool;
int ne_tune_small_rows(int64_t rows);
int ne_tune_prefetch(int ahead, int hint);
int64_t ne_first_bad_id(const int64_t *ids, int64_t n_tokens, int64_t stride,
                        int64_t n_heads, const int64_t *bucket_sizes,
                        const int64_t *id_base);
int ne_lookup_bf16(const uint8_t *weights, const uint8_t *scales, int64_t dim,
                   int64_t block, const int64_t *ids, int64_t n_tokens,
                   int64_t stride, int64_t n_heads, const int64_t *head_offsets,
                   const int64_t *bucket_sizes, const int64_t *id_base, uint16_t *out,
                   int n_threads, const int *cpus, int n_cpus, int64_t *bad,
                   struct ne_pool *pool);
int ne_gather_fp8(const uint8_t *weights, const uint8_t *scales, int64_t dim, int64_t block,
                  const int64_t *ids, int64_t n_tokens, int64_t stride, int64_t n_heads,
                  const int64_t *head_offsets, const int64_t *bucket_sizes,
                  const int64_t *id_base, uint8_t *out_w, uint8_t *out_s, int n_threads,
                  const int *cpus, int n_cpus, int64_t *bad, struct ne_pool *pool);
int ne_read_rows(const uint8_t *table, int64_t dim, const int64_t *rows, int64_t n,
                 int ahead, int n_threads, uint64_t *sum);

#endif
