/* ple.c: Qwen4-Exp's PLE ids and rows (see ple.h). */

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
 * vLLM.  query_start is non-decreasing from 0 (checked by the caller); a
 * size below 1 is refused (EINVAL). */
int ne_ple_ids(const int64_t *ids, int64_t n_tokens, const int64_t *query_start, int64_t n_reqs,
               const int64_t *context, int64_t n1, int64_t eos, const int64_t *multipliers,
               const int64_t *sizes, const int64_t *offsets, int64_t n_layers, int64_t n_heads,
               int64_t heads_per_ngram, int64_t *out)
{
    int64_t cand[65];
    if (n1 < 1 || n1 > 64 || n_reqs < 1 || heads_per_ngram < 1 || n_heads != n1 * heads_per_ngram) {
        errno = EINVAL;
        return -1;
    }
    for (int64_t i = 0; i < n_layers * n_heads; i++) {
        if (sizes[i] < 1) { /* ple_mod divides by it: SIGFPE at 0 (and INT64_MIN % -1) */
            errno = EINVAL;
            return -1;
        }
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
                    o[h] = offsets[l * n_heads + h] + ple_mod((int64_t)mix, sizes[l * n_heads + h]);
            }
        }
    }
    return 0;
}

/* BF16 bits of bf16(e4m3(b)) * scale (scale: a BF16 value), as torch
 * computes it: the fp32 product is exact (4 x 8 significant bits, no
 * exponent below 2^-142), rounded once to nearest even; NaN is 0x7FC0.
 * Branch-free, so GCC vectorises a row's loop. */
static inline uint16_t ple_bf16(uint32_t b, float scale)
{
    uint32_t e = (b >> 3) & 15, m = b & 7;
    uint32_t normal_bits = ((e + 120) << 23) | (m << 20), sub_bits, bits;
    float sub = (float)m * 0x1p-9f, magnitude, product;
    memcpy(&sub_bits, &sub, 4);
    uint32_t is_normal = -(uint32_t)(e != 0); /* masks, not branches: it vectorises */
    bits = (normal_bits & is_normal) | (sub_bits & ~is_normal);
    memcpy(&magnitude, &bits, 4);
    product = magnitude * scale;
    memcpy(&bits, &product, 4);
    bits ^= (b & 0x80) << 24;
    uint32_t rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
    uint32_t nan = -(uint32_t)(((bits & 0x7FFFFFFF) > 0x7F800000) | ((b & 0x7F) == 0x7F));
    return (uint16_t)((rounded & ~nan) | (0x7FC0 & nan));
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) static void
ple_row_bf16(const uint8_t *restrict src, int64_t n, float scale, uint16_t *restrict dst)
{
    for (int64_t j = 0; j < n; j++)
        dst[j] = ple_bf16(src[j], scale);
}

/* One thread's part of a row lookup: ids[begin..end). */
struct ple_job {
    const uint8_t *table;
    int64_t n_rows, row_bytes, row_start, total_rows;
    const int64_t *ids;
    int64_t begin, end;
    int scaled;
    float scale;
    uint8_t *out;
    int64_t first_bad;
    uint64_t fault; /* the address a SIGBUS stopped the job at, or 0 */
};

static void ple_rows_run(struct ple_job *j)
{
    const size_t out_bytes = (size_t)j->row_bytes * (j->scaled ? 2 : 1);
    j->first_bad = -1;
    for (int64_t i = j->begin; i < j->end; i++) {
        if (i + 4 < j->end) { /* rows are random: ask for the next ones early */
            int64_t ahead = j->ids[i + 4] - j->row_start;
            if (ahead >= 0 && ahead < j->n_rows)
                for (int64_t off = 0; off < j->row_bytes; off += 64)
                    __builtin_prefetch(j->table + ahead * j->row_bytes + off, 0, 0);
        }
        /* read once: a caller thread changing ids cannot move a read outside */
        int64_t id = __atomic_load_n(&j->ids[i], __ATOMIC_RELAXED);
        int64_t local = id - j->row_start;
        uint8_t *dst = j->out + i * out_bytes;
        if ((id < 0 || id >= j->total_rows) && j->first_bad < 0)
            j->first_bad = i;
        if (local < 0 || local >= j->n_rows)
            memset(dst, 0, out_bytes);
        else if (j->scaled)
            ple_row_bf16(j->table + local * j->row_bytes, j->row_bytes, j->scale, (uint16_t *)dst);
        else
            memcpy(dst, j->table + local * j->row_bytes, (size_t)j->row_bytes);
    }
}

static void ple_run_of(void *job)
{
    ple_rows_run(job);
}

/* ple_rows_run with a SIGBUS of its reads caught (filemap.c). */
static void ple_job_of(void *job)
{
    struct ple_job *j = job;
    uint64_t fault;
    if (guarded(ple_run_of, j, &fault) != 0)
        j->fault = fault ? fault : 1;
}

/* The first job's fault, kept for ne_last_fault; 0 when none faulted. */
static int ple_faulted(const struct ple_job *jobs, int n_jobs)
{
    for (int i = 0; i < n_jobs; i++)
        if (jobs[i].fault) {
            last_fault = jobs[i].fault;
            return 1;
        }
    return 0;
}

/* out[i] = the row ids[i] - row_start of shard s (row_start <= id <
 * row_start + n_rows), zeros for any other id (another shard's row: the
 * ranks' sum is the whole table's row).  scaled: FP8 bytes to BF16 bits
 * times s->scale (ple_bf16); else the raw bytes (FP8 packed, or BF16
 * rows).  With a pool of this process, a call of at least 2 x split_rows
 * ids is split into parts its threads and the caller claim.  Returns the
 * position of the first id outside the layer's total_rows (its row zeros
 * too), -1 when there is none, -2 with errno for a bad shard, or
 * NE_FAULTED when a row's page could not be read (ne_last_fault). */
int64_t ne_ple_lookup(const struct ne_ple_shard *s, const int64_t *ids, int64_t n_ids, int scaled,
                      void *out)
{
    if (s->row_bytes < 1 || s->n_rows < 0) {
        errno = EINVAL;
        return -2;
    }
    struct ple_job jobs[NE_MAX_THREADS];
    const struct ple_job proto = {.table = s->table,
                                  .n_rows = s->n_rows,
                                  .row_bytes = s->row_bytes,
                                  .row_start = s->row_start,
                                  .total_rows = s->total_rows,
                                  .ids = ids,
                                  .begin = 0,
                                  .end = n_ids,
                                  .scaled = scaled,
                                  .scale = s->scale,
                                  .out = out,
                                  .first_bad = -1};
    int n_jobs = ne_pool_size(s->pool) + 1;
    if (n_jobs > n_ids / NE_SPLIT_ROWS) /* (the Engram kernel's default split) */
        n_jobs = (int)(n_ids / NE_SPLIT_ROWS);
    n_jobs = clamp_threads(n_jobs, n_ids);
    if (n_jobs == 1) { /* the decode-sized call: no copies of the job */
        jobs[0] = proto;
        ple_job_of(&jobs[0]);
        return ple_faulted(jobs, 1) ? NE_FAULTED : jobs[0].first_bad;
    }
    for (int i = 0; i < n_jobs; i++) {
        jobs[i] = proto;
        split_range(n_ids, n_jobs, i, &jobs[i].begin, &jobs[i].end);
    }
    pool_run(s->pool, ple_job_of, jobs, sizeof(jobs[0]), n_jobs);
    if (ple_faulted(jobs, n_jobs))
        return NE_FAULTED;
    for (int i = 0; i < n_jobs; i++) /* jobs are in id order */
        if (jobs[i].first_bad >= 0)
            return jobs[i].first_bad;
    return -1;
}
