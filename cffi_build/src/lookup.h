/* lookup.h: a shard's rows for a batch of hash ids, BF16 or packed.
 * Each id is -1 (DEAD: a zero row) or inside its head; a bad one gives a
 * zero row and is counted (ne_lookup's result), the first kept for ne_last_bad.
 *
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after core.h. */

struct ne_pool;
/* A kernel's thresholds (benchmarks and tests pass others; NULL: the
 * defaults above): calls of at most small_rows rows read in token order
 * (0..NE_MAX_SMALL_ROWS); a call split only where each thread gets
 * split_rows rows (>= 1), in jobs of job_rows rows (1..NE_SHARE_ROWS);
 * outputs from stream_bytes on written with streaming stores; rows
 * prefetched prefetch_ahead ahead (0..NE_MAX_PREFETCH_AHEAD) with locality
 * hint prefetch_hint (0..3).  Bound with the kernel: a call never sees
 * another's change.  ne_tuning_check: 0, or -1 with EINVAL. */
struct ne_tuning {
    int64_t small_rows, split_rows, job_rows, stream_bytes;
    int prefetch_ahead, prefetch_hint;
};
int ne_tuning_check(const struct ne_tuning *t);
int64_t ne_first_bad_id(const int64_t *ids, int64_t n_tokens, int64_t stride, int64_t n_heads,
                        const int64_t *bucket_sizes, const int64_t *id_base);
/* A shard's fixed lookup arguments, filled once per table (the rows, each
 * head's first shard row and bucket count, each head's first global row or
 * NULL). */
struct ne_geometry {
    const uint8_t *weights, *scales;
    int64_t dim, block, n_heads;
    const int64_t *head_offsets, *bucket_sizes, *id_base;
};
/* A table's lookups as the kernel sees them, shared by every kernel bound
 * to the table (a new thread count binds a new kernel, the counts go on):
 * once closed, a call is refused (ne_lookup returns -2) and
 * ne_table_close waits until no call is inside; a call that read its rows
 * (no bad id, no error) is counted with its rows and its time in ns, in
 * the first bucket whose bound (bounds_ns, ascending) it does not pass,
 * or the last.  The Python side reads the counts as they are (each
 * updated atomically), not per call: counting in Python takes two lock
 * round trips (docs/design.md, "The decode budget"). */
struct ne_table_state {
    int closed;
    int64_t active;
    int64_t lookups, rows, nanos;
    int64_t bounds_ns[16];
    int64_t buckets[17];
};
void ne_table_close(struct ne_table_state *st);
/* A shard's lookup with all but the ids and the output bound once per
 * table (and process): its geometry, the first id column it reads, at
 * most n_threads threads, the CPUs fresh ones are bound to, the pool
 * of persistent ones (NULL: none), the bytes of the table's mapping
 * [map_lo, map_hi), which no output may share (0, 0: none), and the ids'
 * columns per token, whose whole rows no output may share either (0: the
 * shard's own, col0 + n_heads).  A call then passes seven arguments,
 * not twelve: each costs ~50 ns through cffi (docs/design.md, "The
 * decode budget"). */
struct ne_kernel {
    const struct ne_geometry *g;
    int64_t col0;
    int n_threads;
    const int *cpus;
    int n_cpus;
    struct ne_pool *pool;
    struct ne_table_state *state;   /* NULL: a one-off call, not a table's */
    const struct ne_tuning *tuning; /* NULL: the defaults */
    uintptr_t map_lo, map_hi;
    int64_t ids_cols; /* a token's ids (whole tokens are checked apart from outputs) */
};
int64_t ne_lookup(const struct ne_kernel *k, const void *ids, int64_t n_tokens, int64_t stride,
                  int global_ids, void *out, void *out_scales);
/* (flat index t*n_heads+h, value) of the first bad id of the calling
 * thread's last lookup that had bad ids */
void ne_last_bad(int64_t *flat_and_value);
