/* lookup.c: gathering a shard's rows for a batch of hash ids, BF16
 * (dequantised, rows.c) or packed (the FP8 bytes and scales as stored),
 * split by token over threads: fresh ones, a table's persistent pool
 * (pool.c) or the caller's own. */
#include "core.h"

/* Every id in ids[t * stride + h] (t < n_tokens, h < n_heads) must be -1
 * (DEAD) or in [0, bucket_sizes[h]) after subtracting id_base[h] (the
 * head's first global row; NULL for bucket ids).  Returns the flat index
 * t*n_heads+h of the first that is not, or -1 when all are good. */
/* The bucket of a (not DEAD) id of head h, or -1 when it is outside the
 * head: global rows (id_base = each head's first row in the layer's
 * table) or bucket ids (id_base NULL) are checked alike.  The one check. */
static inline int64_t
bucket_of(int64_t id, int64_t h, const int64_t *bucket_sizes, const int64_t *id_base)
{
    int64_t bucket = id_base ? id - id_base[h] : id;
    return bucket >= 0 && bucket < bucket_sizes[h] ? bucket : -1;
}

int64_t ne_first_bad_id(const int64_t *ids, int64_t n_tokens, int64_t stride, int64_t n_heads,
                        const int64_t *bucket_sizes, const int64_t *id_base)
{
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t h = 0; h < n_heads; h++) {
            int64_t id = ids[t * stride + h];
            if (id != -1 && bucket_of(id, h, bucket_sizes, id_base) < 0)
                return t * n_heads + h;
        }
    return -1;
}

struct order {
    int64_t *rows;   /* the table row of each id in token order, -1 for none */
    int64_t *row;    /* valid rows in table order ... */
    int64_t *pos;    /* ... and their index in the chunk (output place) */
    int64_t *counts; /* 1 << ORDER_BITS buckets */
    int64_t n;       /* valid rows in the chunk */
    int shift;       /* row >> shift is the bucket */
};

struct lookup_job {
    const uint8_t *weights, *scales;
    int64_t dim, block;
    const int64_t *ids;
    int64_t stride, n_heads;
    const int64_t *head_offsets, *bucket_sizes, *id_base;
    uint16_t *out;
    uint8_t *raw_w, *raw_s; /* packed output instead of out: the rows as stored */
    int64_t t_begin, t_end;
    int64_t call_rows;                /* the whole call's rows: whether its output is streamed */
    int64_t small_rows, stream_bytes; /* the call's tuning (struct ne_tuning) */
    int prefetch_ahead, prefetch_hint;
    const int *cpus; /* a fresh thread's affinity: the rows' node's CPUs */
    int n_cpus;
    /* ids outside their head's buckets (neither DEAD nor valid): written
     * as zero rows, counted, the first one (flat index, value) kept */
    int64_t bad_count, first_bad, first_bad_id;
    int error;            /* errno of a job that could not run (ENOMEM for its scratch) */
    struct order scratch; /* a sorted job's, freed by the guard if it faults */
    uint64_t fault;       /* the address a SIGBUS stopped the job at, or 0 */
};

/* Rows some lookups ahead are prefetched: random 264-byte rows are
 * memory-latency bound, not compute bound.  How far ahead and with which
 * locality hint is a kernel's tuning (struct ne_tuning), so tools/bench.py
 * can measure the choice; the defaults are what it measured best (64 rows
 * ahead, hint 1 = PREFETCHT2).  The helpers that issue prefetches are
 * always_inline: a call to a function whose only effect is
 * __builtin_prefetch is one GCC may drop as having no effect (it did at
 * -O3 without -fwrapv). */
#define NE_PREFETCH_AHEAD 64      /* rows ahead: bench's best on 2- and 4-node hosts */
#define NE_PREFETCH_HINT 1        /* PREFETCHT2: rows are read once, not kept in L1 */
#define NE_MAX_PREFETCH_AHEAD 256 /* beyond this the rows are evicted before they are read */

/* __builtin_prefetch takes its hint as a constant */
static inline __attribute__((always_inline)) void
prefetch_row(const char *p, int64_t bytes, int hint)
{
    for (int64_t off = 0; off < bytes; off += 64) {
        switch (hint) {
        case 3: __builtin_prefetch(p + off, 0, 3); break;
        case 2: __builtin_prefetch(p + off, 0, 2); break;
        case 1: __builtin_prefetch(p + off, 0, 1); break;
        default: __builtin_prefetch(p + off, 0, 0); break;
        }
    }
}

/* A (token, head) cursor over the job: rows in output order, no division. */
struct cursor {
    int64_t t, h;
};

/* The table row of the cursor's id, or -1 (DEAD or bad: a zero row).  The
 * id is read exactly once, checked and used from a local: a caller thread
 * that changes the ids meanwhile can get wrong rows, never a read outside
 * the table.  *id_out is the value that was read. */
static inline int64_t
cursor_row(const struct lookup_job *j, const struct cursor *c, int64_t *id_out)
{
    int64_t id = __atomic_load_n(&j->ids[c->t * j->stride + c->h], __ATOMIC_RELAXED);
    *id_out = id;
    if (id == -1)
        return -1;
    int64_t bucket = bucket_of(id, c->h, j->bucket_sizes, j->id_base);
    return bucket >= 0 ? bucket + j->head_offsets[c->h] : -1;
}

static void note_bad(struct lookup_job *j, int64_t flat, int64_t id)
{
    if (j->bad_count++ == 0) {
        j->first_bad = flat;
        j->first_bad_id = id;
    }
}

static inline void cursor_next(const struct lookup_job *j, struct cursor *c)
{
    if (++c->h == j->n_heads) {
        c->h = 0;
        c->t++;
    }
}

/* One row's bytes.  The model's shape (256 FP8 bytes and 8 scale bytes)
 * gets fixed-size copies the compiler inlines as a few vector moves; a
 * libc memcpy call per 256-byte row costs a quarter of a gather's time. */
static inline void copy_row(uint8_t *dst, const uint8_t *src, int64_t bytes)
{
    if (bytes == 256)
        memcpy(dst, src, 256);
    else if (bytes == 8)
        memcpy(dst, src, 8);
    else
        memcpy(dst, src, (size_t)bytes);
}

/* ------------------------------------------------ rows in table order --- */

/* A job reads its rows in table order, not token order: its ids are read
 * (once each) and counting-sorted on the top ORDER_BITS bits of the row, so
 * nearby rows are read one after another.  Random rows cost a TLB miss and
 * a page walk each; rows in address order share page-table cache lines and
 * DRAM pages, and repeated ids become neighbours.  The rows are written to
 * their token's place in the output, so the result is the same.  Measured
 * (tools/bench.py lookup, 2 GiB table, 98 k rows): 1.4-1.5x token order on
 * one thread; chunks of 8-32 k rows sorted apart gained less, so a chunk is
 * 2^18 rows (scratch up to 8 MiB per thread). */
enum { ORDER_BITS = 12, ORDER_CHUNK = 1 << 18 };

static void order_free(struct order *o)
{
    free(o->rows);
    free(o->row);
    free(o->pos);
    free(o->counts);
    o->rows = o->row = o->pos = o->counts = NULL;
}

/* Scratch for chunks of up to `cap` rows; 0, or -1 when out of memory. */
static int order_alloc(struct order *o, const struct lookup_job *j, int64_t cap)
{
    int64_t end = 1;
    for (int64_t h = 0; h < j->n_heads; h++)
        if (j->head_offsets[h] + j->bucket_sizes[h] > end)
            end = j->head_offsets[h] + j->bucket_sizes[h];
    int bits = 64 - __builtin_clzll((uint64_t)end);
    *o = (struct order){0};
    o->shift = bits > ORDER_BITS ? bits - ORDER_BITS : 0;
    o->rows = malloc((size_t)cap * sizeof(int64_t));
    o->row = malloc((size_t)cap * sizeof(int64_t));
    o->pos = malloc((size_t)cap * sizeof(int64_t));
    o->counts = malloc(sizeof(int64_t) << ORDER_BITS);
    if (o->rows && o->row && o->pos && o->counts)
        return 0;
    order_free(o);
    return -1;
}

/* A zero row for a DEAD or bad id at flat output index k. */
static void zero_row(const struct lookup_job *j, int64_t k)
{
    const int64_t n_scales = j->dim / j->block;
    if (j->raw_w) {
        memset(j->raw_w + k * j->dim, 0, (size_t)j->dim);
        memset(j->raw_s + k * n_scales, 0, (size_t)n_scales);
    } else {
        memset(j->out + k * j->dim, 0, (size_t)j->dim * 2);
    }
}

/* Read the n ids from flat index k0 on (the cursor's position), zero the
 * rows of DEAD and bad ids (noting the bad ones in order), and sort the
 * others into o->row / o->pos. */
static void
order_chunk(struct lookup_job *j, struct cursor *cur, int64_t k0, int64_t n, struct order *o)
{
    int64_t *counts = o->counts;
    memset(counts, 0, sizeof(int64_t) << ORDER_BITS);
    for (int64_t i = 0; i < n; i++, cursor_next(j, cur)) {
        int64_t id, row = cursor_row(j, cur, &id);
        o->rows[i] = row;
        if (row >= 0) {
            counts[row >> o->shift]++;
            continue;
        }
        if (id != -1)
            note_bad(j, k0 + i, id);
        zero_row(j, k0 + i);
    }
    int64_t sum = 0;
    for (int64_t b = 0; b < (1 << ORDER_BITS); b++) {
        int64_t c = counts[b];
        counts[b] = sum;
        sum += c;
    }
    o->n = sum;
    for (int64_t i = 0; i < n; i++) {
        int64_t row = o->rows[i];
        if (row >= 0) {
            int64_t at = counts[row >> o->shift]++;
            o->row[at] = row;
            o->pos[at] = i;
        }
    }
}

/* Rows are gathered STAGE_ROWS at a time into a small cache-resident
 * buffer with plain copies (many independent misses in flight, as in a
 * memcpy-style gather), then dequantised from there with streaming stores:
 * the dequant code is long enough per row that, interleaved with the misses,
 * it would starve the out-of-order window of memory parallelism (interleaving
 * prefetches with the dequant runs at 0.6-0.7x these phases). */
enum { STAGE_ROWS = 64, MAX_STAGE_BYTES = 1024, MAX_STAGE_SCALES = 64 };

/* A table row's weights and scale bytes on their way to cache. */
static inline __attribute__((always_inline)) void
prefetch_table_row(const struct lookup_job *j, int64_t row, int64_t n_scales)
{
    prefetch_row((const char *)(j->weights + row * j->dim), j->dim, j->prefetch_hint);
    prefetch_row((const char *)(j->scales + row * n_scales), 1, j->prefetch_hint);
}

/* Row q + ahead of the chunk, weights and scale bytes, on its way to cache. */
static inline __attribute__((always_inline)) void
prefetch_ahead_of(const struct lookup_job *j, const struct order *o, int64_t q, int ahead_n,
                  int64_t n_scales)
{
    if (ahead_n > 0 && q + ahead_n < o->n)
        prefetch_table_row(j, o->row[q + ahead_n], n_scales);
}

/* The chunk's first rows (those no row before them prefetches) on their
 * way to cache before any is read: without this a decode step's chunk of
 * fewer than `ahead` rows had no prefetch at all, and its copies' stores
 * (nine a row) filled the store queue after five rows' misses (measured:
 * 24 rows from DRAM 13.7 us, a numpy take of them 5.9). */
static inline __attribute__((always_inline)) void
prefetch_first(const struct lookup_job *j, const struct order *o, int ahead_n, int64_t n_scales)
{
    for (int64_t q = 0; q < ahead_n && q < o->n; q++)
        prefetch_table_row(j, o->row[q], n_scales);
}

/* The chunk's rows dequantised, STAGE_ROWS at a time: copied (prefetched
 * ahead) into the stage, then dequantised from there with the row's
 * scales.  The scale bytes are read in the same loop as the weights: in
 * table order they are close together (measured: 1.1-1.4x a separate pass
 * over them). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) static void
dequant_chunk(const struct lookup_job *j, const struct order *o, int64_t k0, row_fn row_dequant)
{
    const int64_t dim = j->dim, n_scales = dim / j->block;
    const uint8_t *const weights = j->weights, *const scales = j->scales;
    const int staged = dim <= MAX_STAGE_BYTES && n_scales <= MAX_STAGE_SCALES;
    const int ahead_n = j->prefetch_ahead;
    uint8_t w_stage[STAGE_ROWS * MAX_STAGE_BYTES] __attribute__((aligned(64)));
    uint8_t s_stage[STAGE_ROWS * MAX_STAGE_SCALES] __attribute__((aligned(64)));
    prefetch_first(j, o, ahead_n, n_scales);
    for (int64_t q0 = 0; q0 < o->n; q0 += STAGE_ROWS) {
        int64_t n = o->n - q0 < STAGE_ROWS ? o->n - q0 : STAGE_ROWS;
        for (int64_t q = q0; q < q0 + n; q++) {
            prefetch_ahead_of(j, o, q, ahead_n, n_scales);
            if (!staged) /* rows too wide for the stage: read in place below */
                continue;
            const int64_t row = o->row[q]; /* locals: a store to the stage may alias *j */
            copy_row(w_stage + (q - q0) * dim, weights + row * dim, dim);
            copy_row(s_stage + (q - q0) * n_scales, scales + row * n_scales, n_scales);
        }
#if defined(__x86_64__)
        if (staged && (row_dequant == row_vbmi || row_dequant == row_vbmi_stream)) {
            /* the stage in one call: row_vbmi's ISA is more than the
             * x86-64-v4 clone's, so it is never inlined here, and a call a
             * row (its tables loaded each time) cost ~5% of a decode step's
             * kernel time in cache */
            rows_vbmi(w_stage, s_stage, n, dim, j->block, j->out + k0 * dim, o->pos + q0,
                      row_dequant == row_vbmi_stream);
            continue;
        }
#endif
        for (int64_t q = q0; q < q0 + n; q++) {
            const uint8_t *w = staged ? w_stage + (q - q0) * dim : weights + o->row[q] * dim;
            const uint8_t *s = staged ? s_stage + (q - q0) * n_scales
                                      : scales + o->row[q] * n_scales;
            uint16_t *out = j->out + (k0 + o->pos[q]) * dim;
#if defined(__x86_64__)
            if (row_dequant == row_vbmi) /* direct calls (rows read in place: wider than a stage) */
                row_vbmi(w, s, dim, j->block, out);
            else if (row_dequant == row_avx512)
                row_avx512(w, s, dim, j->block, out);
            else
#endif
                row_dequant(w, s, dim, j->block, out);
        }
    }
}

#if defined(__x86_64__)
/* Whole cache lines with streaming stores: rows in table order land at
 * scattered output places, where plain stores would first read each line
 * (measured on 2 MiB pages: 1.2x plain copies). */
__attribute__((target("avx512f"))) static void
stream_lines(uint8_t *dst, const uint8_t *src, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64)
        _mm512_stream_si512((__m512i *)(dst + off), _mm512_loadu_si512(src + off));
}
#endif

/* The packed variant: each row's FP8 bytes and scale bytes copied as they
 * are stored, prefetched ahead like the lookup.  No stage here: the plain
 * copies overlap the misses (staged phases run at 0.75-0.8x). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) static void
gather_chunk(const struct lookup_job *j, const struct order *o, int64_t k0, int stream)
{
    const int64_t n_scales = j->dim / j->block;
    const int ahead_n = j->prefetch_ahead;
    prefetch_first(j, o, ahead_n, n_scales);
    for (int64_t q = 0; q < o->n; q++) {
        prefetch_ahead_of(j, o, q, ahead_n, n_scales);
        int64_t row = o->row[q], k = k0 + o->pos[q];
#if defined(__x86_64__)
        if (stream)
            stream_lines(j->raw_w + k * j->dim, j->weights + row * j->dim, j->dim);
        else
#endif
            copy_row(j->raw_w + k * j->dim, j->weights + row * j->dim, j->dim);
        copy_row(j->raw_s + k * n_scales, j->scales + row * n_scales, n_scales);
    }
}

static void run_sorted_job(struct lookup_job *j);

/* Small calls (a decode step: 1-256 tokens x 24 heads) skip the sort: its
 * 4,096-bucket histogram and scratch cost more than the page walks it saves
 * there, so rows are read in token order (still prefetched ahead, through
 * the same stage) from stack scratch.  The threshold is a kernel's tuning
 * so tools/bench.py can measure it and tests can run both sides; the
 * default is what bench measured. */
#define NE_STREAM_BYTES (512 << 10) /* a call's output: bench's crossover of plain and streaming */
#define NE_SMALL_ROWS 2048          /* rows: bench's crossover of token order and table order */
#define NE_MAX_SMALL_ROWS 4096      /* the small path's scratch is on the stack (64 KiB) */

/* The n rows from flat index k0 on, in token order: DEAD and bad ids get
 * zero rows (bad ones noted), the others go to o->row / o->pos. */
static void
direct_chunk(struct lookup_job *j, struct cursor *cur, int64_t k0, int64_t n, struct order *o)
{
    o->n = 0;
    for (int64_t i = 0; i < n; i++, cursor_next(j, cur)) {
        int64_t id, row = cursor_row(j, cur, &id);
        if (row >= 0) {
            o->row[o->n] = row;
            o->pos[o->n++] = i;
            continue;
        }
        if (id != -1)
            note_bad(j, k0 + i, id);
        zero_row(j, k0 + i);
    }
}

/* A call's output from this size on is written with streaming stores (the
 * AVX2 and AVX-512 rows, and the packed copy where AVX-512 is), by every
 * job of it: so large an output is mostly out of the core's L2 (2 MiB
 * here, which the rows read pass through too) before its reader comes, so
 * its lines are not worth reading for ownership; a decode step's smaller
 * one stays in cache for that reader (the TP gather, the copy to the GPU).
 * Decided per call, not per job: a call cut into 48-row jobs is large
 * even when each job is small.  In tools/bench.py serving's regime (24
 * heads of 256), 64-256 tokens take 0.68-0.84x numpy take streamed against
 * 0.90-1.08x plain; 8-16 tokens streamed take 1.1x their plain time; the
 * lookup and a CPU reader's copy of its rows take 0.90-1.10x plain at
 * 64-512 tokens.  The size is a kernel's tuning (NE_STREAM_BYTES unless
 * told). */

/* The row function of a job: the picked one (AVX-512 where it is), or on
 * an AVX2 CPU the AVX2 rows, streaming for a large 32-byte aligned output. */
static row_fn job_row_fn(const struct lookup_job *j, row_fn picked)
{
#if defined(__x86_64__)
    const int64_t out_bytes = j->call_rows * j->dim * 2;
    const int64_t stream_bytes = j->stream_bytes;
    if (picked == row_vbmi)
        return out_bytes >= stream_bytes ? row_vbmi_stream : row_vbmi;
    if (picked == row_avx512)
        return out_bytes >= stream_bytes ? row_avx512_stream : row_avx512;
    if (picked == row_generic && have_avx2() && j->block == 32 && j->dim % 32 == 0)
        return out_bytes >= stream_bytes && ((uintptr_t)j->out & 31) == 0 ? row_avx2_stream
                                                                          : row_avx2;
#endif
    (void)j;
    return picked;
}

static int use_streaming(const struct lookup_job *j, row_fn row_dequant)
{
#if defined(__x86_64__)
    /* streaming needs AVX-512 (the picked row function says whether it is
     * there and allowed) and whole 64-byte lines at every output row */
    const int64_t out_bytes = j->call_rows * j->dim;
    const int avx512 = row_dequant == row_avx512 || row_dequant == row_vbmi;
    return avx512 && out_bytes >= j->stream_bytes && j->dim % 64 == 0 &&
           ((uintptr_t)j->raw_w & 63) == 0;
#else
    (void)j;
    (void)row_dequant;
    return 0;
#endif
}

static void finish_stores(void)
{
#if defined(__x86_64__)
    _mm_sfence(); /* streaming stores are visible before the caller reads */
#endif
}

/* A job's tokens, ORDER_CHUNK rows at a time: ordered, then dequantised
 * (or packed); at most small_rows rows: read in token order.  Sets
 * j->error to ENOMEM when the scratch cannot be allocated (this job
 * writes nothing then). */
static void run_job(struct lookup_job *j)
{
    const int64_t n_rows = (j->t_end - j->t_begin) * j->n_heads;
    if (n_rows > 0 && n_rows <= j->small_rows) {
        const row_fn row_dequant = pick_row_fn();
        int64_t row[NE_MAX_SMALL_ROWS], pos[NE_MAX_SMALL_ROWS];
        struct order o = {.row = row, .pos = pos};
        struct cursor cur = {j->t_begin, 0};
        direct_chunk(j, &cur, j->t_begin * j->n_heads, n_rows, &o);
        if (j->raw_w)
            gather_chunk(j, &o, j->t_begin * j->n_heads, use_streaming(j, row_dequant));
        else
            dequant_chunk(j, &o, j->t_begin * j->n_heads, job_row_fn(j, row_dequant));
        finish_stores();
        return;
    }
    run_sorted_job(j);
}

static void run_sorted_job(struct lookup_job *j)
{
    const row_fn row_dequant = pick_row_fn();
    const int64_t k_begin = j->t_begin * j->n_heads, k_end = j->t_end * j->n_heads;
    const int64_t cap = k_end - k_begin < ORDER_CHUNK ? k_end - k_begin : ORDER_CHUNK;
    const int stream = use_streaming(j, row_dequant);
    struct cursor cur = {j->t_begin, 0};
    struct order *o = &j->scratch;
    if (cap <= 0)
        return;
    if (order_alloc(o, j, cap) != 0) {
        j->error = ENOMEM;
        return;
    }
    for (int64_t k0 = k_begin; k0 < k_end; k0 += cap) {
        order_chunk(j, &cur, k0, k_end - k0 < cap ? k_end - k0 : cap, o);
        if (j->raw_w)
            gather_chunk(j, o, k0, stream);
        else
            dequant_chunk(j, o, k0, job_row_fn(j, row_dequant));
    }
    order_free(o);
    finish_stores();
}

static void run_job_of(void *job)
{
    run_job(job);
}

/* run_job with a SIGBUS of its reads caught (filemap.c: a mapped
 * checkpoint's page gone): the job stops there, its scratch freed, the
 * address kept in j->fault.  Every job runs so. */
static void run_guarded_job(struct lookup_job *j)
{
    uint64_t fault;
    if (guarded(run_job_of, j, &fault) != 0) {
        order_free(&j->scratch);
        j->fault = fault ? fault : 1;
    }
}

static void *lookup_thread(void *arg)
{
    struct lookup_job *j = arg;
    pin_to(j->cpus, j->n_cpus);
    run_guarded_job(j);
    return NULL;
}

/* run_guarded_job as the pool's job function. */
static void run_guarded_job_of(void *job)
{
    run_guarded_job(job);
}

/* A large job (more than small_rows rows) runs on a CPU of the rows' node
 * (cpus) when the caller is not on one and is allowed there: its affinity
 * is set for the call (*saved: what to put back) and 1 returned; a small
 * one runs where the caller is (two syscalls are nothing next to a large
 * gather, much next to a decode step's). */
static int
caller_to_node(const int *cpus, int n_cpus, int64_t rows_each, int64_t small_rows, cpu_set_t *saved)
{
    cpu_set_t want;
    if (n_cpus <= 0 || rows_each <= small_rows)
        return 0;
    int here = sched_getcpu(), local = 0;
    CPU_ZERO(&want);
    for (int i = 0; i < n_cpus; i++) {
        local |= cpus[i] == here;
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE)
            CPU_SET(cpus[i], &want);
    }
    if (local || pthread_getaffinity_np(pthread_self(), sizeof *saved, saved) != 0)
        return 0;
    return pthread_setaffinity_np(pthread_self(), sizeof want, &want) == 0;
}

static void caller_back(int moved, const cpu_set_t *saved)
{
    if (moved)
        pthread_setaffinity_np(pthread_self(), sizeof *saved, saved);
}

/* A pooled call of at most NE_SHARE_ROWS rows is cut into jobs of
 * job_rows rows that the caller and the workers claim as they come: a
 * worker still waking up (20-200 us here) claims none, so the caller never
 * waits for it, and one that is awake shares the work.  A larger call is
 * one job per thread (each sorted into table order as a whole).  Measured
 * here with the workers asleep between calls (as between a server's
 * layers), 2 threads: 48-row jobs took 0.60-0.66x numpy take from 64 to
 * 256 tokens, 96-row ones 0.63-0.74x, one job a thread 0.74-0.95x; the
 * job size is a kernel's tuning, for benchmarks and tests. */
#define NE_JOB_ROWS 48
#define NE_SHARE_ROWS 16384

static int pool_jobs(int64_t n_tokens, int64_t n_heads, int n_threads, int64_t job_rows)
{
    const int64_t rows = n_tokens * n_heads;
    const int64_t jobs = rows > NE_SHARE_ROWS ? n_threads : rows / job_rows;
    return clamp_threads(jobs < n_threads ? n_threads : (int)jobs, n_tokens);
}

/* A call is split over threads only when each gets at least split_rows
 * rows: waking a sleeping worker costs the caller a system call (~10 us in
 * this guest, with the IPI), which a decode step of 8 tokens (192 rows,
 * ~60 us) does not win back: split, it took 1.2-1.5x unsplit; 32 tokens
 * split took 0.9x.  A kernel's tuning, for benchmarks and tests. */
#define NE_SPLIT_ROWS 256 /* rows per thread */

/* Threads for a call of n_tokens x n_heads rows: at most n_threads, one
 * per split_rows rows, and no more than the pool serves (its threads and
 * the caller) when a pool is given. */
static int
call_threads(int n_threads, int64_t n_tokens, int64_t n_heads, int pool_threads, int64_t split_rows)
{
    const int64_t by_rows = n_tokens * n_heads / split_rows;
    if (pool_threads > 0 && n_threads > pool_threads + 1)
        n_threads = pool_threads + 1;
    if (n_threads > by_rows)
        n_threads = by_rows < 1 ? 1 : (int)by_rows;
    return clamp_threads(n_threads, n_tokens);
}

/* The first bad id of this thread's last lookup that had one: (flat index
 * t*n_heads+h, its value).  Per thread, so a call needs no out argument
 * (one allocation less per call) and concurrent callers do not mix. */
static __thread int64_t last_bad[2] = {-1, 0};

void ne_last_bad(int64_t *flat_and_value)
{
    flat_and_value[0] = last_bad[0];
    flat_and_value[1] = last_bad[1];
}

/* Split proto's tokens over the call's threads and run them: one thread
 * on the caller; with a pool of this process, jobs (pool_jobs) that the
 * caller and the pool's threads claim (pool_run); else one job a fresh
 * thread (bound to the CPUs cpus[0..n_cpus) when n_cpus > 0).  Returns the number of bad ids (the first one kept for
 * ne_last_bad), or -1 with errno. */
static int64_t run_lookup_jobs(const struct lookup_job *proto, int64_t n_tokens, int n_threads,
                               const int *cpus, int n_cpus, struct ne_pool *pool,
                               const struct ne_tuning *tn)
{
    struct lookup_job jobs[NE_MAX_THREADS];
    int64_t bad = 0;
    int rc = 0;
    const int pool_threads = ne_pool_size(pool);
    n_threads = call_threads(n_threads, n_tokens, proto->n_heads, pool_threads, tn->split_rows);
    const int n_jobs = n_threads > 1 && pool_threads > 0
                           ? pool_jobs(n_tokens, proto->n_heads, n_threads, tn->job_rows)
                           : n_threads;
    for (int i = 0; i < n_jobs; i++) {
        jobs[i] = *proto;
        split_range(n_tokens, n_jobs, i, &jobs[i].t_begin, &jobs[i].t_end);
        jobs[i].cpus = cpus;
        jobs[i].n_cpus = n_cpus;
    }
    if (n_threads == 1 || pool_threads > 0) {
        /* one thread: a handoff costs more than it saves */
        cpu_set_t saved;
        int moved = caller_to_node(cpus, n_cpus, n_tokens * proto->n_heads / n_threads,
                                   tn->small_rows, &saved);
        if (n_threads == 1)
            run_guarded_job(&jobs[0]);
        else
            pool_run(pool, run_guarded_job_of, jobs, sizeof(jobs[0]), n_jobs);
        caller_back(moved, &saved);
    } else {
        rc = run_threads(lookup_thread, jobs, sizeof(jobs[0]), n_threads);
    }
    for (int i = 0; i < n_jobs; i++)
        if (jobs[i].fault) {
            last_fault = jobs[i].fault;
            return NE_FAULTED;
        }
    for (int i = 0; i < n_jobs; i++) /* jobs are in token order */
        if (jobs[i].bad_count) {
            if (bad == 0) {
                last_bad[0] = jobs[i].first_bad;
                last_bad[1] = jobs[i].first_bad_id;
            }
            bad += jobs[i].bad_count;
        }
    for (int i = 0; i < n_jobs && rc == 0; i++)
        if (jobs[i].error) {
            errno = jobs[i].error;
            rc = -1;
        }
    return rc ? -1 : bad;
}

/* The measured defaults, for a kernel without a tuning. */
static const struct ne_tuning default_tuning = {.small_rows = NE_SMALL_ROWS,
                                                .split_rows = NE_SPLIT_ROWS,
                                                .job_rows = NE_JOB_ROWS,
                                                .stream_bytes = NE_STREAM_BYTES,
                                                .prefetch_ahead = NE_PREFETCH_AHEAD,
                                                .prefetch_hint = NE_PREFETCH_HINT};

int ne_tuning_check(const struct ne_tuning *t)
{
    if (t->small_rows < 0 || t->small_rows > NE_MAX_SMALL_ROWS || t->split_rows < 1 ||
        t->job_rows < 1 || t->job_rows > NE_SHARE_ROWS || t->stream_bytes < 0 ||
        t->prefetch_ahead < 0 || t->prefetch_ahead > NE_MAX_PREFETCH_AHEAD ||
        t->prefetch_hint < 0 || t->prefetch_hint > 3) {
        errno = EINVAL;
        return -1;
    }
    return 0;
}

/* ---------------------------------------------- a table's calls, counted --- */

enum { LATENCY_BOUNDS = sizeof(((struct ne_table_state *)0)->bounds_ns) / sizeof(int64_t) };

/* A call enters a table that is not closed (1), or is refused (0).  The
 * count goes up before closed is read, and ne_table_close sets closed
 * before it reads the count (both sequentially consistent): either the
 * call sees closed, or close sees the call and waits for it. */
static int table_enter(struct ne_table_state *st)
{
    __atomic_add_fetch(&st->active, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&st->closed, __ATOMIC_SEQ_CST))
        return 1;
    __atomic_sub_fetch(&st->active, 1, __ATOMIC_SEQ_CST);
    return 0;
}

/* A call leaves; one that read its rows (rows >= 0) is counted first. */
static void table_leave(struct ne_table_state *st, int64_t rows, int64_t nanos)
{
    if (rows >= 0) {
        int b = 0;
        while (b < LATENCY_BOUNDS && nanos > st->bounds_ns[b])
            b++;
        __atomic_add_fetch(&st->buckets[b], 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&st->rows, rows, __ATOMIC_RELAXED);
        __atomic_add_fetch(&st->nanos, nanos, __ATOMIC_RELAXED);
        __atomic_add_fetch(&st->lookups, 1, __ATOMIC_RELAXED);
    }
    __atomic_sub_fetch(&st->active, 1, __ATOMIC_SEQ_CST);
}

/* Refuse the table's later calls and wait until none is inside (they
 * finish normally); then its rows may be unmapped. */
void ne_table_close(struct ne_table_state *st)
{
    __atomic_store_n(&st->closed, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&st->active, __ATOMIC_SEQ_CST) > 0) {
        struct timespec pause = {0, 20000};
        nanosleep(&pause, NULL);
    }
}

/* The bytes of a call's n_tokens tokens of ids: whole tokens (k->ids_cols
 * ids each), the columns of other shards' heads too, which an output over
 * them would overwrite in the caller's ids. */
static void lookup_ids_span(const struct ne_kernel *k, const void *ids, int64_t n_tokens,
                            int64_t stride, uintptr_t *lo, uintptr_t *n)
{
    const int64_t own = k->col0 + k->g->n_heads;
    const int64_t cols = k->ids_cols > own ? k->ids_cols : own;
    *lo = (uintptr_t)ids;
    *n = n_tokens > 0 ? (uintptr_t)((n_tokens - 1) * stride + cols) * 8 : 0;
}

/* The bytes a call of n_tokens tokens writes: BF16 rows into out, or
 * packed rows into out and their scale bytes into out_scales. */
static void lookup_out_spans(const struct ne_kernel *k, int64_t n_tokens, const void *out,
                             const void *out_scales, uintptr_t spans[4])
{
    const struct ne_geometry *g = k->g;
    const uintptr_t rows = n_tokens > 0 ? (uintptr_t)(n_tokens * g->n_heads) : 0;
    spans[0] = (uintptr_t)out;
    spans[1] = rows * (uintptr_t)g->dim * (out_scales ? 1 : 2);
    spans[2] = (uintptr_t)out_scales;
    spans[3] = out_scales ? rows * (uintptr_t)(g->dim / g->block) : 0;
}

/* Whether a call's outputs meet its ids, the table's mapping or each other. */
static int lookup_overlaps(const struct ne_kernel *k, const void *ids, int64_t n_tokens,
                           int64_t stride, const void *out, const void *out_scales)
{
    uintptr_t o[4], id_lo, id_n;
    const uintptr_t map_lo = k->map_lo, map_n = k->map_hi - k->map_lo;
    lookup_out_spans(k, n_tokens, out, out_scales, o);
    lookup_ids_span(k, ids, n_tokens, stride, &id_lo, &id_n);
    return spans_meet(o[0], o[1], id_lo, id_n) || spans_meet(o[2], o[3], id_lo, id_n) ||
           spans_meet(o[0], o[1], map_lo, map_n) || spans_meet(o[2], o[3], map_lo, map_n) ||
           spans_meet(o[0], o[1], o[2], o[3]);
}

/* A shard's rows for n_tokens tokens of ids (ids[t * stride + k->col0 + h]
 * for head h), over the fixed arguments in k (struct ne_kernel, bound once
 * per table): BF16 rows into out[n_tokens][n_heads][dim] when out_scales
 * is NULL, else packed, the FP8 bytes into out and the scale bytes into
 * out_scales[n_tokens][n_heads][dim / block], as the table stores them
 * (half the output bytes; dequantised later, e.g. on the GPU).  Each id is
 * checked against its head's bucket_sizes as it is read (after
 * subtracting id_base[h], the head's first global row, when global_ids is
 * set); -1 is DEAD; bad ones give zero rows.  At most k->n_threads threads
 * (the caller and the pool's, or fresh ones bound to k->cpus).  Counted in
 * k->state when there is one.  Returns the number of bad ids (ne_last_bad
 * gives the first), -1 with errno when a thread cannot be started (EAGAIN)
 * or its scratch (ENOMEM) allocated, -2 when the table is closed
 * (nothing read), NE_FAULTED when a row's page could not be read
 * (SIGBUS: a mapped file truncated; ne_last_fault gives the address), or
 * NE_OVERLAP when an output shares bytes with the ids the call reads, the
 * table's mapping or the other output (nothing read or written). */
int64_t ne_lookup(const struct ne_kernel *k, const void *ids, int64_t n_tokens, int64_t stride,
                  int global_ids, void *out, void *out_scales)
{
    const struct ne_geometry *g = k->g;
    const struct ne_tuning *tn = k->tuning ? k->tuning : &default_tuning;
    struct ne_table_state *st = k->state;
    if (lookup_overlaps(k, ids, n_tokens, stride, out, out_scales))
        return NE_OVERLAP;
    if (st && !table_enter(st))
        return -2;
    const int64_t started = st ? now_ns() : 0;
    struct lookup_job proto = {.weights = g->weights,
                               .scales = g->scales,
                               .dim = g->dim,
                               .block = g->block,
                               .ids = (const int64_t *)ids + k->col0,
                               .stride = stride,
                               .n_heads = g->n_heads,
                               .head_offsets = g->head_offsets,
                               .bucket_sizes = g->bucket_sizes,
                               .id_base = global_ids ? g->id_base : NULL,
                               .call_rows = n_tokens * g->n_heads,
                               .small_rows = tn->small_rows,
                               .stream_bytes = tn->stream_bytes,
                               .prefetch_ahead = tn->prefetch_ahead,
                               .prefetch_hint = tn->prefetch_hint,
                               .first_bad = -1,
                               .first_bad_id = 0};
    if (out_scales) {
        proto.raw_w = out;
        proto.raw_s = out_scales;
    } else {
        rows_ready();
        proto.out = out;
    }
    const int64_t bad = run_lookup_jobs(&proto, n_tokens, k->n_threads, k->cpus, k->n_cpus, k->pool,
                                        tn);
    if (st)
        table_leave(st, bad == 0 ? n_tokens * g->n_heads : -1, now_ns() - started);
    return bad;
}
