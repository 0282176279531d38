/* hashing.c: the n-gram hashes hashing.h declares: division by the
 * invariant primes (fastdiv), one mix loop, whole sequences and the
 * serving state's windows. */
#include "core.h"

#define NE_MAX_POSITION ((int64_t)1 << 62)

/* Division by an invariant integer (Granlund-Montgomery, round-up
 * multiplier): the hashes take 24 remainders per token by the same primes,
 * and a 64-bit hardware division is the bulk of their cost. */
struct fastdiv {
    uint64_t d, m;
    int sh1, sh2;
};

static struct fastdiv fastdiv_of(uint64_t d) /* d >= 1 */
{
    int l = d > 1 ? 64 - __builtin_clzll(d - 1) : 0; /* ceil(log2 d) */
    unsigned __int128 num = ((unsigned __int128)1 << 64) * (((unsigned __int128)1 << l) - d);
    return (struct fastdiv){d, (uint64_t)(num / d) + 1, l < 1 ? l : 1, l > 1 ? l - 1 : 0};
}

static inline uint64_t fast_umod(uint64_t a, const struct fastdiv *f)
{
    uint64_t t = (uint64_t)(((unsigned __int128)a * f->m) >> 64);
    uint64_t q = (t + ((a - t) >> f->sh1)) >> f->sh2;
    return a - q * f->d;
}

/* numpy's floor modulo: in [0, d) for negative x too (~x = -x - 1 >= 0).
 * Branch-free: the mixes' signs are random, and a mispredicted branch per
 * remainder cost more than the remainder itself.  With s = 0 or all ones
 * (x's sign), x ^ s is x or ~x, and (r ^ s) + (d & s) is r or d - 1 - r. */
static inline int64_t floor_mod(int64_t x, const struct fastdiv *f)
{
    uint64_t s = (uint64_t)(x >> 63);
    uint64_t r = fast_umod((uint64_t)x ^ s, f);
    return (int64_t)((r ^ s) + (f->d & s));
}

/* Columns with reciprocals (16 KiB of them, on the heap); a layout with
 * more divides in hardware (slower, same values). */
enum { MAX_FAST_COLS = 512 };

/* Every column's divisor, structure of arrays: the heads of one n-gram
 * order all take the same mix modulo their own primes, 8 at a time in
 * AVX-512 lanes where the CPU has them. */
struct fastdiv_cols {
    uint64_t m[MAX_FAST_COLS], d[MAX_FAST_COLS], sh1[MAX_FAST_COLS], sh2[MAX_FAST_COLS];
};

/* Every column's divisor, or NULL (too many columns, or no memory: the
 * caller then divides in hardware).  16 KiB: on the heap, not on a thread's
 * stack; the caller frees it. */
static struct fastdiv_cols *fastdiv_cols_of(const int64_t *primes, int64_t n)
{
    struct fastdiv_cols *cols = n <= MAX_FAST_COLS ? malloc(sizeof *cols) : NULL;
    for (int64_t c = 0; cols != NULL && c < n; c++) {
        struct fastdiv f = fastdiv_of((uint64_t)primes[c]);
        cols->m[c] = f.m, cols->d[c] = f.d, cols->sh1[c] = (uint64_t)f.sh1;
        cols->sh2[c] = (uint64_t)f.sh2;
    }
    return cols;
}

typedef void (*mods_fn)(int64_t x, const struct fastdiv_cols *v, int64_t c0, int64_t n,
                        int64_t *dst);

/* dst[i] = x modulo primes[i], floored, for i < n: the hardware division,
 * used where reciprocals are not (too many columns, no memory, or asked
 * for as the benchmark's baseline).  C's % truncates: fix negatives. */
static void mods_hardware(int64_t x, const int64_t *primes, int64_t n, int64_t *dst)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t r = x % primes[i];
        dst[i] = r < 0 ? r + primes[i] : r;
    }
}

/* dst[i] = floor_mod(x, column c0 + i) for i < n */
static void
mods_scalar(int64_t x, const struct fastdiv_cols *v, int64_t c0, int64_t n, int64_t *dst)
{
    for (int64_t i = 0; i < n; i++) {
        struct fastdiv f = {v->d[c0 + i], v->m[c0 + i], (int)v->sh1[c0 + i], (int)v->sh2[c0 + i]};
        dst[i] = floor_mod(x, &f);
    }
}

#if defined(__x86_64__)
/* High 64 bits of the 64x64-bit products, lane by lane, from four 32x32
 * multiplies (AVX-512 has no 64-bit high multiply). */
__attribute__((target("avx512f,avx512dq"))) static inline __m512i mulhi_u64(__m512i a, __m512i b)
{
    const __m512i lo32 = _mm512_set1_epi64(0xffffffffLL);
    __m512i a_hi = _mm512_srli_epi64(a, 32), b_hi = _mm512_srli_epi64(b, 32);
    __m512i ll = _mm512_mul_epu32(a, b), hl = _mm512_mul_epu32(a_hi, b);
    __m512i lh = _mm512_mul_epu32(a, b_hi), hh = _mm512_mul_epu32(a_hi, b_hi);
    __m512i cross = _mm512_add_epi64(
        _mm512_add_epi64(_mm512_srli_epi64(ll, 32), _mm512_and_si512(hl, lo32)),
        _mm512_and_si512(lh, lo32));
    return _mm512_add_epi64(
        _mm512_add_epi64(hh, _mm512_srli_epi64(hl, 32)),
        _mm512_add_epi64(_mm512_srli_epi64(lh, 32), _mm512_srli_epi64(cross, 32)));
}

/* mods_scalar, 8 columns per step: the same branch-free floor modulo. */
__attribute__((target("avx512f,avx512dq"))) static void
mods_avx512(int64_t x, const struct fastdiv_cols *v, int64_t c0, int64_t n, int64_t *dst)
{
    const uint64_t sign = (uint64_t)(x >> 63);
    const __m512i s = _mm512_set1_epi64((long long)sign);
    const __m512i u = _mm512_set1_epi64((long long)((uint64_t)x ^ sign));
    for (int64_t i = 0; i < n; i += 8) {
        __mmask8 k = n - i >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (n - i)) - 1);
        __m512i m = _mm512_maskz_loadu_epi64(k, v->m + c0 + i);
        __m512i d = _mm512_maskz_loadu_epi64(k, v->d + c0 + i);
        __m512i sh1 = _mm512_maskz_loadu_epi64(k, v->sh1 + c0 + i);
        __m512i sh2 = _mm512_maskz_loadu_epi64(k, v->sh2 + c0 + i);
        __m512i t = mulhi_u64(u, m);
        __m512i q = _mm512_srlv_epi64(
            _mm512_add_epi64(t, _mm512_srlv_epi64(_mm512_sub_epi64(u, t), sh1)), sh2);
        __m512i r = _mm512_sub_epi64(u, _mm512_mullo_epi64(q, d));
        r = _mm512_add_epi64(_mm512_xor_si512(r, s), _mm512_and_si512(d, s));
        _mm512_mask_storeu_epi64(dst + i, k, r);
    }
}
#endif

/* From the CPU's features, read once per process (core.h). */
static mods_fn pick_mods_fn(void)
{
#if defined(__x86_64__)
    if (ne_cpu()->avx512dq)
        return mods_avx512;
#endif
    return mods_scalar;
}

/* DeepSeek's formula over one window, tok[k] = the id k positions back (the
 * pad id where blocked): the mix of order k+1 is that of order k XOR
 * tok[k] * m[k], in wrapping int64 (computed in uint64: signed overflow is
 * undefined in C); each of the order's n_head heads takes the floor modulo
 * of its prime (column col_base + c of cols, or primes[c] in hardware when
 * cols is NULL), plus offsets[c] when global rows are asked for.  The one
 * mix loop of both hash paths. */
static void hash_window(const int64_t *tok, int64_t n, const int64_t *m, int64_t n_head,
                        const struct fastdiv_cols *cols, int64_t col_base, const int64_t *primes,
                        const int64_t *offsets, mods_fn mods, int64_t *dst)
{
    uint64_t mix = (uint64_t)tok[0] * (uint64_t)m[0];
    for (int64_t k = 1; k < n; k++) {
        mix ^= (uint64_t)tok[k] * (uint64_t)m[k];
        const int64_t c0 = (k - 1) * n_head;
        if (cols)
            mods((int64_t)mix, cols, col_base + c0, n_head, dst + c0);
        else
            mods_hardware((int64_t)mix, primes + c0, n_head, dst + c0);
        for (int64_t h = 0; offsets && h < n_head; h++)
            dst[c0 + h] += offsets[c0 + h];
    }
}

struct hash_job {
    const int64_t *ids;
    int64_t t, pad_id, max_ngram, n_head, n_cols;
    const int64_t *multipliers, *primes;
    int64_t *out;
    int64_t begin, end;    /* flat (row, position) range */
    int hardware_division; /* the plain % path: the baseline fastdiv is measured against */
};

/* Each (row, position) of the job's range: its window from the sequence
 * (the pad id before the start), hashed. */
static void run_hashes(const struct hash_job *j)
{
    struct fastdiv_cols *cols = j->hardware_division ? NULL : fastdiv_cols_of(j->primes, j->n_cols);
    const mods_fn mods = pick_mods_fn();
    int64_t tok[NE_MAX_NGRAM];
    for (int64_t f = j->begin; f < j->end; f++) {
        int64_t row = f / j->t, pos = f % j->t;
        const int64_t *seq = j->ids + row * j->t;
        for (int64_t k = 0; k < j->max_ngram; k++)
            tok[k] = pos >= k ? seq[pos - k] : j->pad_id;
        hash_window(tok, j->max_ngram, j->multipliers, j->n_head, cols, 0, j->primes, NULL, mods,
                    j->out + f * j->n_cols);
    }
    free(cols);
}

static void *hash_thread(void *arg)
{
    run_hashes(arg);
    return NULL;
}

/* out[row][pos][col] for ids[n_rows][t]; primes > 0 (checked by the caller).
 * Returns 0, or -1 with errno when a thread cannot start. */
int ne_ngram_hashes(const int64_t *ids, int64_t n_rows, int64_t t, int64_t pad_id,
                    const int64_t *multipliers, int64_t max_ngram, const int64_t *primes,
                    int64_t n_head, int64_t *out, int n_threads, int hardware_division)
{
    struct hash_job jobs[NE_MAX_THREADS];
    int64_t total = n_rows * t;
    if (max_ngram < 2 || max_ngram > NE_MAX_NGRAM) {
        errno = EINVAL;
        return -1;
    }
    /* under 4096 positions a thread costs more than it saves */
    n_threads = total < 4096 ? 1 : clamp_threads(n_threads, total);
    for (int i = 0; i < n_threads; i++) {
        jobs[i] = (struct hash_job){
            ids,         t,      pad_id, max_ngram, n_head, (max_ngram - 1) * n_head,
            multipliers, primes, out,    0,         0,      hardware_division};
        split_range(total, n_threads, i, &jobs[i].begin, &jobs[i].end);
    }
    if (n_threads == 1) {
        run_hashes(&jobs[0]);
        return 0;
    }
    return run_threads(hash_thread, jobs, sizeof(jobs[0]), n_threads);
}

/* ---------------------------------------- serving hash state (V4.1) --- */

/* Raw look-back windows of a packed batch, in batch order.  Token i of
 * request slot slots[i] at positions[i] gets win[i][0] = ids[i] and
 * win[i][k] = the id k positions back in its own sequence (from earlier
 * tokens of this call or the slot's history hist[slot][n1 - k]), -1 where
 * that is before the sequence start or DEAD.  Position 0 restarts a slot;
 * any other must be the slot's next.  cur/cur_next/last are scratch of R
 * rows.  On success the slots' history and next position become those
 * after their last committed token (others unchanged) and -1 is
 * returned; else the index of the first bad token, with *why = 1 (slot out
 * of range), 2 (position not the slot's next) or 3 (position outside
 * 0..NE_MAX_POSITION), and nothing changed. */
static int64_t ne_hash_windows(const int64_t *ids, const int64_t *slots, const int64_t *positions,
                               const uint8_t *commit, int64_t n_tokens, int64_t n_slots, int64_t n1,
                               int64_t *hist, int64_t *next_pos, int64_t *cur, int64_t *cur_next,
                               int64_t *last, int64_t *win, int64_t *why)
{
    const int64_t n = n1 + 1;
    memcpy(cur, hist, (size_t)(n_slots * n1) * sizeof(int64_t));
    memcpy(cur_next, next_pos, (size_t)n_slots * sizeof(int64_t));
    for (int64_t s = 0; s < n_slots; s++)
        last[s] = -1;
    for (int64_t i = 0; i < n_tokens; i++) {
        int64_t s = slots[i], p = positions[i];
        if (s < 0 || s >= n_slots) {
            *why = 1;
            return i;
        }
        if (p < 0 || p > NE_MAX_POSITION) {
            *why = 3;
            return i;
        }
        int64_t *h = cur + s * n1; /* h[n1 - 1] is the most recent */
        if (p == 0) {
            for (int64_t k = 0; k < n1; k++)
                h[k] = -1;
        } else if (p != cur_next[s]) {
            *why = 2;
            return i;
        }
        int64_t *w = win + i * n;
        w[0] = ids[i] < 0 ? -1 : ids[i];
        for (int64_t k = 1; k < n; k++)
            w[k] = h[n1 - k];
        for (int64_t k = 0; k + 1 < n1; k++) /* a few words: no memmove call per token */
            h[k] = h[k + 1];
        if (n1 > 0)
            h[n1 - 1] = w[0];
        cur_next[s] = p + 1;
        if (commit[i])
            last[s] = i;
    }
    for (int64_t s = 0; s < n_slots; s++) {
        int64_t i = last[s];
        if (i < 0)
            continue;
        const int64_t *w = win + i * n; /* the history after token i: w[n1-1] .. w[0] */
        for (int64_t k = 0; k < n1; k++)
            hist[s * n1 + k] = w[n1 - 1 - k];
        next_pos[s] = positions[i] + 1;
    }
    return -1;
}

struct window_job {
    const int64_t *win;
    int64_t n, pad_id, n_layers, n_head, n_cols;
    const int64_t *multipliers, *primes, *offsets;
    int64_t *out;
    int64_t begin, end;
};

/* V4.1's rule on a raw window: the look-back is blocked from the first
 * negative (before the start, or DEAD) on, and blocked ids are pad_id. */
static void run_window_hashes(const struct window_job *j)
{
    struct fastdiv_cols *cols = fastdiv_cols_of(j->primes, j->n_layers * j->n_cols);
    const mods_fn mods = pick_mods_fn();
    int64_t tok[NE_MAX_NGRAM];
    for (int64_t t = j->begin; t < j->end; t++) {
        const int64_t *w = j->win + t * j->n;
        int blocked = 0;
        for (int64_t k = 0; k < j->n; k++) {
            blocked |= w[k] < 0;
            tok[k] = blocked ? j->pad_id : w[k];
        }
        for (int64_t l = 0; l < j->n_layers; l++)
            hash_window(tok, j->n, j->multipliers + l * j->n, j->n_head, cols, l * j->n_cols,
                        j->primes + l * j->n_cols, j->offsets ? j->offsets + l * j->n_cols : NULL,
                        mods, j->out + (t * j->n_layers + l) * j->n_cols);
    }
    free(cols);
}

static void *window_thread(void *arg)
{
    run_window_hashes(arg);
    return NULL;
}

/* Hash ids of raw windows win[T][n] for n_layers layers at once:
 * out[T][n_layers][n_cols] (bucket ids, or global rows when offsets is not
 * NULL).  n <= 64.  Returns 0, or -1 with errno when a thread cannot start. */
int ne_hash_window_batch(const int64_t *win, int64_t n_tokens, int64_t n, int64_t pad_id,
                         const int64_t *multipliers, const int64_t *primes, const int64_t *offsets,
                         int64_t n_layers, int64_t n_head, int64_t *out, int n_threads)
{
    struct window_job jobs[NE_MAX_THREADS];
    if (n < 2 || n > NE_MAX_NGRAM) {
        errno = EINVAL;
        return -1;
    }
    n_threads = clamp_threads(n_threads, n_tokens);
    for (int i = 0; i < n_threads; i++) {
        jobs[i] = (struct window_job){
            win,         n,      pad_id,  n_layers, n_head, (n - 1) * n_head,
            multipliers, primes, offsets, out,      0,      0};
        split_range(n_tokens, n_threads, i, &jobs[i].begin, &jobs[i].end);
    }
    if (n_threads == 1) {
        run_window_hashes(&jobs[0]);
        return 0;
    }
    return run_threads(window_thread, jobs, sizeof(jobs[0]), n_threads);
}

/* ------------------------------------------------- one serving step --- */

/* A token's compressed id, or -1 (DEAD): masked out, negative, in the
 * sorted dead_ids, outside the token map or mapped to a negative id.  The
 * rules of HashState.compressed, per token, with no array pass. */
static inline int64_t compress_token(const struct ne_hash_state *st, int64_t id, int masked_out)
{
    if (masked_out || id < 0)
        return -1;
    int64_t lo = 0, hi = st->n_dead; /* binary search: dead_ids are sorted */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (st->dead_ids[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < st->n_dead && st->dead_ids[lo] == id)
        return -1;
    if (!st->token_map)
        return id;
    if (id >= st->map_len)
        return -1;
    return st->token_map[id] < 0 ? -1 : st->token_map[id];
}

/* A whole HashState step in one call: the tokens compressed (mask: a flag
 * per token, NULL for all), the window pass (ne_hash_windows: history
 * updated in place only when every token is good) and every layer's hashes
 * into out [n_tokens][n_layers][cols] (global rows when global_rows).
 * commit: a flag per token, or NULL for commit_all.  Returns -1, or the
 * index of the first bad token with *why = 1 slot / 2 position not the
 * slot's next / 3 position out of range (nothing changed then); -2 with
 * errno when n_tokens is beyond the scratch (EINVAL) or a thread cannot
 * start. */
int64_t ne_hash_step(const struct ne_hash_state *st, const void *tokens_, const void *mask_,
                     const void *slots_, const void *positions_, const void *commit_,
                     int commit_all, int64_t n_tokens, int global_rows, void *out_, int n_threads,
                     int64_t *why)
{
    /* untyped pointers: the binding passes numpy buffers as they are */
    const int64_t *tokens = tokens_, *slots = slots_, *positions = positions_;
    const uint8_t *mask = mask_, *commit = commit_;
    int64_t *out = out_;
    if (n_tokens > st->capacity) {
        errno = EINVAL;
        return -2;
    }
    for (int64_t i = 0; i < n_tokens; i++)
        st->ids[i] = compress_token(st, tokens[i], mask && !mask[i]);
    const uint8_t *flags = commit ? commit : commit_all ? st->all_commit : st->no_commit;
    int64_t bad = ne_hash_windows(st->ids, slots, positions, flags, n_tokens, st->n_slots, st->n1,
                                  st->hist, st->next_pos, st->cur, st->cur_next, st->last, st->win,
                                  why);
    if (bad >= 0)
        return bad;
    if (n_tokens && ne_hash_window_batch(st->win, n_tokens, st->n1 + 1, st->pad_id, st->multipliers,
                                         st->primes, global_rows ? st->offsets : NULL, st->n_layers,
                                         st->n_head, out, n_threads) != 0)
        return -2;
    return -1;
}
