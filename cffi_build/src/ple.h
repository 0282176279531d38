/* ple.h: Qwen4-Exp's PLE n-gram ids (vLLM 0.31.0's rule,
 * numa_engram/model/plehashing.py) and FP8 rows with one per-tensor scale
 * turned into BF16.
 *
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after core.h. */

int ne_ple_ids(const int64_t *ids, int64_t n_tokens, const int64_t *query_start, int64_t n_reqs,
               const int64_t *context, int64_t n1, int64_t eos, const int64_t *multipliers,
               const int64_t *sizes, const int64_t *offsets, int64_t n_layers, int64_t n_heads,
               int64_t heads_per_ngram, int64_t *out);
struct ne_pool;
/* One PLE shard's fixed lookup arguments, made once per table; lut is
 * filled by ne_ple_shard_init from scale. */
struct ne_ple_shard {
    const uint8_t *table; /* [n_rows, row_bytes] */
    int64_t n_rows, row_bytes, row_start, total_rows;
    float scale;                      /* a BF16 value: the per-tensor scale */
    struct ne_pool *pool;             /* NULL: the caller alone */
    struct ne_table_state *state;     /* the table's: counted, refused once closed; NULL: neither */
    uintptr_t map_lo, map_hi;         /* the table's mapping: no output may share a byte of it */
    uint16_t lut[256];                /* BF16 bits of each FP8 byte times scale */
    uint8_t lut_lo[256], lut_hi[256]; /* their low and high bytes */
};
void ne_ple_shard_init(struct ne_ple_shard *s);
int64_t
ne_ple_lookup(const struct ne_ple_shard *s, const void *ids, int64_t n_ids, int scaled, void *out);
