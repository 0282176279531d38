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
 * Run once per byte value, into the shard's table (ne_ple_shard_init). */
static uint16_t ple_bf16(uint32_t b, float scale)
{
    uint32_t e = (b >> 3) & 15, m = b & 7;
    uint32_t normal_bits = ((e + 120) << 23) | (m << 20), sub_bits, bits;
    float sub = (float)m * 0x1p-9f, magnitude, product;
    memcpy(&sub_bits, &sub, 4);
    bits = e ? normal_bits : sub_bits;
    memcpy(&magnitude, &bits, 4);
    product = magnitude * scale;
    memcpy(&bits, &product, 4);
    bits ^= (b & 0x80) << 24;
    if ((bits & 0x7FFFFFFF) > 0x7F800000 || (b & 0x7F) == 0x7F)
        return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

void ne_ple_shard_init(struct ne_ple_shard *s)
{
    for (uint32_t b = 0; b < 256; b++) {
        s->lut[b] = ple_bf16(b, s->scale);
        s->lut_lo[b] = (uint8_t)(s->lut[b] & 0xFF);
        s->lut_hi[b] = (uint8_t)(s->lut[b] >> 8);
    }
}

/* dst[j] = lut[src[j]]: the portable path. */
static void ple_row_lut(const uint8_t *restrict src, int64_t n, const uint16_t *restrict lut,
                        uint16_t *restrict dst)
{
    for (int64_t j = 0; j < n; j++)
        dst[j] = lut[src[j]];
}

#if defined(__x86_64__)
/* ple_row_lut, 32 bytes at a time: the 256 entries in eight registers,
 * four two-register word permutes (64 entries each) chosen by bits 6 and
 * 7.  A 1-token lookup's 2,560 values: 0.37 us against 0.65 us for the
 * scalar table and 0.75 us for the vectorised arithmetic it replaced
 * (16 cold rows, prefetched; 2-CPU EPYC guest). */
__attribute__((target("avx512bw"))) static void
ple_row_lut512(const uint8_t *restrict src, int64_t n, const uint16_t *restrict lut,
               uint16_t *restrict dst)
{
    __m512i t[8];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_loadu_si512(lut + 32 * k);
    const __m512i bit6 = _mm512_set1_epi16(0x40), bit7 = _mm512_set1_epi16(0x80);
    for (int64_t j = 0; j < n; j += 32) {
        __mmask32 m = n - j >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (n - j)) - 1;
        __m512i idx = _mm512_cvtepu8_epi16(
            _mm512_castsi512_si256(_mm512_maskz_loadu_epi8((__mmask64)m, src + j)));
        __mmask32 hi6 = _mm512_test_epi16_mask(idx, bit6), hi7 = _mm512_test_epi16_mask(idx, bit7);
        __m512i low = _mm512_mask_blend_epi16(hi6, _mm512_permutex2var_epi16(t[0], idx, t[1]),
                                              _mm512_permutex2var_epi16(t[2], idx, t[3]));
        __m512i high = _mm512_mask_blend_epi16(hi6, _mm512_permutex2var_epi16(t[4], idx, t[5]),
                                               _mm512_permutex2var_epi16(t[6], idx, t[7]));
        _mm512_mask_storeu_epi16(dst + j, m, _mm512_mask_blend_epi16(hi7, low, high));
    }
}

/* dst[j] = lut[src[j]] for n bytes, 64 at a time, where the CPU has
 * AVX-512 VBMI: the entries' low and high bytes in four registers each,
 * two two-register byte permutes (128 entries each) chosen by bit 7, the
 * bytes interleaved into words.  A call converts a block of rows at once
 * (the tables loaded once): a 1-token lookup's 2,560 values in 40 steps
 * of 64, where the word permutes took 80 of 32 and a table load a row. */
__attribute__((target("avx512bw,avx512vbmi"))) static void
ple_lut_vbmi(const uint8_t *restrict src, int64_t n, const uint8_t *restrict lo_tab,
             const uint8_t *restrict hi_tab, uint16_t *restrict dst)
{
    const __m512i l0 = _mm512_loadu_si512(lo_tab), l1 = _mm512_loadu_si512(lo_tab + 64);
    const __m512i l2 = _mm512_loadu_si512(lo_tab + 128), l3 = _mm512_loadu_si512(lo_tab + 192);
    const __m512i h0 = _mm512_loadu_si512(hi_tab), h1 = _mm512_loadu_si512(hi_tab + 64);
    const __m512i h2 = _mm512_loadu_si512(hi_tab + 128), h3 = _mm512_loadu_si512(hi_tab + 192);
    /* unpacklo/hi give values 16k..16k+7 and 16k+8..16k+15 in lane k */
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t j = 0; j < n; j += 64) {
        const __mmask64 m = n - j >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (n - j)) - 1;
        const __m512i idx = _mm512_maskz_loadu_epi8(m, src + j);
        const __mmask64 top = _mm512_movepi8_mask(idx);
        const __m512i lo = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(l0, idx, l1),
                                                  _mm512_permutex2var_epi8(l2, idx, l3));
        const __m512i hi = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(h0, idx, h1),
                                                  _mm512_permutex2var_epi8(h2, idx, h3));
        const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
        _mm512_mask_storeu_epi16(dst + j, (__mmask32)m, _mm512_permutex2var_epi64(a, first, b));
        _mm512_mask_storeu_epi16(dst + j + 32, (__mmask32)(m >> 32),
                                 _mm512_permutex2var_epi64(a, second, b));
    }
}
#endif

/* Rows prefetched ahead of the one read: a 1-token call's 16 rows all at
 * once (they are random: each a miss), a larger call's 16 rows on.  8
 * tokens (128 cold rows): 3.5 us against 4.3 us 4 rows ahead. */
enum { PLE_AHEAD = 16 };

/* One thread's part of a row lookup: ids[begin..end). */
struct ple_job {
    const uint8_t *table;
    int64_t n_rows, row_bytes, row_start, total_rows;
    const int64_t *ids;
    int64_t begin, end;
    int scaled, wide, vbmi; /* wide: ple_row_lut512; vbmi: ple_lut_vbmi */
    const uint16_t *lut;
    const uint8_t *lut_lo, *lut_hi;
    uint8_t *out;
    int64_t first_bad;
    uint64_t fault; /* the address a SIGBUS stopped the job at, or 0 */
};

static inline void ple_prefetch(const struct ple_job *j, int64_t i)
{
    int64_t local = j->ids[i] - j->row_start; /* (a hint: a changed id reads nothing) */
    if (local >= 0 && local < j->n_rows)
        for (int64_t off = 0; off < j->row_bytes; off += 64)
            __builtin_prefetch(j->table + local * j->row_bytes + off, 0, 0);
}

/* n FP8 bytes from src converted into dst (a row, or a block of rows
 * together). */
static void ple_convert_n(const struct ple_job *j, const uint8_t *src, int64_t n, uint16_t *dst)
{
#if defined(__x86_64__)
    if (j->vbmi) {
        ple_lut_vbmi(src, n, j->lut_lo, j->lut_hi, dst);
        return;
    }
    if (j->wide) {
        ple_row_lut512(src, n, j->lut, dst);
        return;
    }
#endif
    ple_row_lut(src, n, j->lut, dst);
}

static void ple_convert(const struct ple_job *j, const uint8_t *src, uint16_t *dst)
{
    ple_convert_n(j, src, j->row_bytes, dst);
}

/* Rows of a block copied raw before any is converted: the copies' loads
 * overlap (a 4 KiB-page table's rows each miss the TLB, where a prefetch
 * does little), a conversion's would wait for its row.  8 tokens x 16
 * heads of a 2 GiB table: 17 us converted row by row, the packed copy's
 * 7.3 us. */
enum { PLE_SCRATCH = 16384 };

/* Rows begin..end of the job: copied, zeroed, or (scratch) copied there,
 * ``inside[k]`` saying which, to be converted after. */
static void
ple_rows_block(struct ple_job *j, int64_t begin, int64_t end, uint8_t *scratch, uint8_t *inside)
{
    const size_t out_bytes = (size_t)j->row_bytes * (j->scaled ? 2 : 1);
    for (int64_t i = begin; i < end; i++) {
        if (i + PLE_AHEAD < j->end)
            ple_prefetch(j, i + PLE_AHEAD);
        /* read once: a caller thread changing ids cannot move a read outside */
        int64_t id = __atomic_load_n(&j->ids[i], __ATOMIC_RELAXED);
        int64_t local = id - j->row_start;
        uint8_t *dst = j->out + i * out_bytes;
        const uint8_t *src = j->table + local * j->row_bytes;
        if ((id < 0 || id >= j->total_rows) && j->first_bad < 0)
            j->first_bad = i;
        if (scratch)
            inside[i - begin] = local >= 0 && local < j->n_rows;
        if (local < 0 || local >= j->n_rows)
            memset(dst, 0, out_bytes);
        else if (scratch)
            memcpy(scratch + (i - begin) * j->row_bytes, src, (size_t)j->row_bytes);
        else if (j->scaled)
            ple_convert(j, src, (uint16_t *)dst);
        else
            memcpy(dst, src, (size_t)j->row_bytes);
    }
}

static void ple_rows_run(struct ple_job *j)
{
    uint8_t scratch[PLE_SCRATCH], inside[PLE_SCRATCH];
    const int64_t per_block = j->scaled ? PLE_SCRATCH / j->row_bytes : 0;
    j->first_bad = -1;
    for (int64_t i = j->begin; i < j->end && i < j->begin + PLE_AHEAD; i++)
        ple_prefetch(j, i);
    if (per_block < 2) { /* raw rows, or rows too wide to gather first */
        ple_rows_block(j, j->begin, j->end, NULL, NULL);
        return;
    }
    for (int64_t b = j->begin; b < j->end; b += per_block) {
        int64_t e = b + per_block < j->end ? b + per_block : j->end, all = 1;
        ple_rows_block(j, b, e, scratch, inside);
        for (int64_t i = b; i < e; i++)
            all &= inside[i - b];
        if (all) { /* the block's rows are one run of bytes, in and out */
            ple_convert_n(j, scratch, (e - b) * j->row_bytes,
                          (uint16_t *)(j->out + b * j->row_bytes * 2));
            continue;
        }
        for (int64_t i = b; i < e; i++)
            if (inside[i - b])
                ple_convert(j, scratch + (i - b) * j->row_bytes,
                            (uint16_t *)(j->out + i * j->row_bytes * 2));
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
 * times s->scale (s->lut); else the raw bytes (FP8 packed, or BF16
 * rows).  With a pool of this process, a call of at least 2 x split_rows
 * ids is split into parts its threads and the caller claim.  Returns the
 * position of the first id outside the layer's total_rows (its row zeros
 * too), -1 when there is none, -2 with errno for a bad shard, or
 * NE_FAULTED when a row's page could not be read (ne_last_fault). */
static int64_t
ple_lookup_run(const struct ne_ple_shard *s, const void *ids, int64_t n_ids, int scaled, void *out)
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
                                  .wide = ne_cpu()->avx512bw,
                                  .vbmi = ne_cpu()->avx512vbmi,
                                  .lut = s->lut,
                                  .lut_lo = s->lut_lo,
                                  .lut_hi = s->lut_hi,
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

/* Whether a call's output meets its ids or the table's mapping. */
static int ple_overlaps(const struct ne_ple_shard *s, const void *ids, int64_t n_ids, int scaled,
                        const void *out)
{
    const uintptr_t n = n_ids > 0 ? (uintptr_t)n_ids : 0;
    const uintptr_t out_n = n * (uintptr_t)s->row_bytes * (scaled ? 2 : 1);
    return spans_meet((uintptr_t)out, out_n, (uintptr_t)ids, n * 8) ||
           spans_meet((uintptr_t)out, out_n, s->map_lo, s->map_hi - s->map_lo);
}

/* ple_lookup_run counted in s->state (a call with no id outside the layer:
 * its rows and time), PLE_CLOSED (-4) once the table is closed, or
 * NE_OVERLAP when out shares bytes with the ids or the table's mapping:
 * nothing read. */
int64_t
ne_ple_lookup(const struct ne_ple_shard *s, const void *ids, int64_t n_ids, int scaled, void *out)
{
    struct ne_table_state *st = s->state;
    if (ple_overlaps(s, ids, n_ids, scaled, out))
        return NE_OVERLAP;
    if (st && !table_enter(st))
        return -4;
    const int64_t started = st ? now_ns() : 0;
    const int64_t found = ple_lookup_run(s, ids, n_ids, scaled, out);
    if (st)
        table_leave(st, found == -1 ? n_ids : -1, now_ns() - started);
    return found;
}
