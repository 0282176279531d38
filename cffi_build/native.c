/* numa_engram native core: thin syscall wrappers and the hot kernels.
 *
 * Every wrapper returns -1 (or NULL) and leaves errno set on failure; the
 * Python side (numa_engram/native.py) is the only caller and turns errno into
 * an exception.  Nothing here allocates memory that outlives a call. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* ------------------------------------------------------------ memory --- */

void *ne_map_shared(int fd, size_t length, int writable)
{
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    void *p = mmap(NULL, length, prot, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

int ne_unmap(void *addr, size_t length) { return munmap(addr, length); }

int ne_protect_read(void *addr, size_t length) { return mprotect(addr, length, PROT_READ); }

int ne_madvise(void *addr, size_t length, int advice)
{
    return madvise(addr, length, advice);
}

long ne_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask,
              unsigned long maxnode, unsigned int flags)
{
    return syscall(SYS_mbind, addr, length, mode, nodemask, maxnode, flags);
}

long ne_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode,
                      void *addr, unsigned long flags)
{
    return syscall(SYS_get_mempolicy, mode, nodemask, maxnode, addr, flags);
}

/* Node of every page in [addr, addr + length): status[i] gets the node or a
 * negative errno (-ENOENT: page not mapped in this process).  Queries in
 * chunks so the pointer array stays on the stack. */
long ne_page_nodes(void *addr, size_t length, size_t page_size, int *status)
{
    enum { CHUNK = 1024 };
    void *pages[CHUNK];
    size_t count = (length + page_size - 1) / page_size;
    for (size_t done = 0; done < count; done += CHUNK) {
        size_t n = count - done < CHUNK ? count - done : CHUNK;
        for (size_t i = 0; i < n; i++)
            pages[i] = (char *)addr + (done + i) * page_size;
        long rc = syscall(SYS_move_pages, 0, n, pages, NULL, status + done, 0);
        if (rc < 0)
            return -1;
    }
    return 0;
}

int ne_fallocate(int fd, int64_t offset, int64_t length)
{
    int rc = posix_fallocate(fd, (off_t)offset, (off_t)length);
    if (rc != 0) {
        errno = rc;
        return -1;
    }
    return 0;
}

int ne_statvfs(const char *path, uint64_t *free_bytes, uint64_t *total_bytes)
{
    struct statvfs st;
    if (statvfs(path, &st) != 0)
        return -1;
    *free_bytes = (uint64_t)st.f_bavail * st.f_frsize;
    *total_bytes = (uint64_t)st.f_blocks * st.f_frsize;
    return 0;
}

/* The file system's magic number (TMPFS_MAGIC, HUGETLBFS_MAGIC, ...). */
int ne_statfs_type(const char *path, int64_t *fs_type)
{
    struct statfs st;
    if (statfs(path, &st) != 0)
        return -1;
    *fs_type = (int64_t)st.f_type;
    return 0;
}

long ne_page_size(void) { return sysconf(_SC_PAGESIZE); }

/* The package version this core was built for (checked at import). */
const char *ne_core_version(void) { return NE_CORE_VERSION; }

/* ---------------------------------------------- FP8 rows -> BF16 rows --- */

/* bf16 of fp8_e4m3fn(w) * 2^(s - 127) for every (s, w): the exact value,
 * built once from fp32 arithmetic and round-to-nearest-even, NaN -> 0x7FC0
 * (what torch does).  Blocks whose scale could leave the normal fp32 range
 * read this table; the others use the branch-free formula below. */
static uint16_t exact_lut[256][256];
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static float e4m3_to_float(uint8_t w)
{
    int sign = w >> 7, exp = (w >> 3) & 0xF, mant = w & 7;
    float v;
    if (exp == 0xF && mant == 7)
        return __builtin_nanf("");
    if (exp == 0)
        v = (float)mant / 8.0f / 64.0f; /* subnormal: mant/8 * 2^-6 */
    else
        v = (1.0f + (float)mant / 8.0f) * __builtin_ldexpf(1.0f, exp - 7);
    return sign ? -v : v;
}

static float e8m0_to_float(uint8_t s)
{
    uint32_t bits;
    float f;
    if (s == 255)
        return __builtin_nanf("");
    bits = s == 0 ? 0x00400000u : (uint32_t)s << 23; /* 2^-127 is subnormal */
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_bf16(float f)
{
    uint32_t u;
    if (f != f)
        return 0x7FC0;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

static void build_exact_lut(void)
{
    for (int s = 0; s < 256; s++) {
        float scale = e8m0_to_float((uint8_t)s);
        for (int w = 0; w < 256; w++) {
            volatile float product = e4m3_to_float((uint8_t)w) * scale;
            exact_lut[s][w] = float_to_bf16(product);
        }
    }
}

uint16_t ne_dequant_one(uint8_t weight, uint8_t scale)
{
    pthread_once(&lut_once, build_exact_lut);
    return exact_lut[scale][weight];
}

/* 32 values sharing scale byte s, 10 <= s <= 246: every product is a normal
 * fp32 with at most 4 significant bits, so its bf16 is exact: the e4m3 bits
 * re-biased plus (s - 127) in the exponent field.  Branch-free with a
 * constant trip count, so GCC vectorises it (16 or 32 lanes). */
static inline void dequant_fast32(const uint8_t *restrict w, uint16_t shift,
                                  uint16_t *restrict out)
{
    for (int i = 0; i < 32; i++) {
        uint16_t v = w[i];
        uint16_t mag = v & 0x7F;
        uint16_t m = v & 7;
        /* subnormal e4m3: m * 2^-9, as bf16 bits before the scale */
        uint16_t sub = m >= 4 ? (uint16_t)((120 << 7) | ((m & 3) << 5))
                     : m >= 2 ? (uint16_t)((119 << 7) | ((m & 1) << 6))
                              : (uint16_t)(118 << 7);
        uint16_t normal = (uint16_t)((mag << 4) + (120 << 7));
        uint16_t r = (uint16_t)(((mag >> 3) ? normal : sub) + shift);
        r = mag == 0 ? 0 : r;
        r |= (uint16_t)((v & 0x80) << 8);
        out[i] = mag == 0x7F ? 0x7FC0 : r;
    }
}

static inline void dequant_block(const uint8_t *restrict w, uint8_t s, int64_t n,
                                 uint16_t *restrict out)
{
    if (n == 32 && s >= 10 && s <= 246) {
        dequant_fast32(w, (uint16_t)(((int)s - 127) << 7), out);
        return;
    }
    const uint16_t *lut = exact_lut[s]; /* scales near the fp32 range edges, NaN */
    for (int64_t i = 0; i < n; i++)
        out[i] = lut[w[i]];
}

/* Every id in ids[t * stride + h] (t < n_tokens, h < n_heads) must be -1
 * (DEAD) or in [0, bucket_sizes[h]) after subtracting id_base[h] (the
 * head's first global row; NULL for bucket ids).  Returns the flat index
 * t*n_heads+h of the first that is not, or -1 when all are good. */
int64_t ne_first_bad_id(const int64_t *ids, int64_t n_tokens, int64_t stride,
                        int64_t n_heads, const int64_t *bucket_sizes, const int64_t *id_base)
{
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t h = 0; h < n_heads; h++) {
            int64_t id = ids[t * stride + h];
            int64_t bucket = id_base ? id - id_base[h] : id;
            if (id != -1 && (bucket < 0 || bucket >= bucket_sizes[h]))
                return t * n_heads + h;
        }
    return -1;
}

struct lookup_job {
    const uint8_t *weights, *scales;
    int64_t dim, block;
    const int64_t *ids;
    int64_t stride, n_heads;
    const int64_t *head_offsets, *bucket_sizes, *id_base;
    uint16_t *out;
    uint8_t *raw_w, *raw_s; /* packed output instead of out: the rows as stored */
    int64_t t_begin, t_end;
    int cpu;
    /* ids outside their head's buckets (neither DEAD nor valid): written
     * as zero rows, counted, the first one (flat index, value) kept */
    int64_t bad_count, first_bad, first_bad_id;
    int error; /* errno of a job that could not run (ENOMEM for its scratch) */
};

/* Rows some lookups ahead are prefetched: random 264-byte rows are
 * memory-latency bound, not compute bound.  How far ahead and with which
 * locality hint is tunable (ne_tune_prefetch) so tools/bench.py can measure
 * the choice; the defaults are what it measured best (64 rows ahead, hint 1
 * = PREFETCHT2).  The helpers that issue prefetches are always_inline: a
 * call to a function whose only effect is __builtin_prefetch is one GCC
 * may drop as having no effect (it did at -O3 without -fwrapv). */
#define NE_PREFETCH_AHEAD 64
#define NE_PREFETCH_HINT 1
enum { MAX_PREFETCH_AHEAD = 256 };
static int prefetch_ahead = NE_PREFETCH_AHEAD, prefetch_hint = NE_PREFETCH_HINT;

int ne_tune_prefetch(int ahead, int hint)
{
    if (ahead < 0 || ahead > MAX_PREFETCH_AHEAD || hint < 0 || hint > 3) {
        errno = EINVAL;
        return -1;
    }
    prefetch_ahead = ahead;
    prefetch_hint = hint;
    return 0;
}

/* __builtin_prefetch takes its hint as a constant */
static inline __attribute__((always_inline)) void
prefetch_row(const char *p, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64) {
        switch (prefetch_hint) {
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
static inline int64_t cursor_row(const struct lookup_job *j, const struct cursor *c,
                                 int64_t *id_out)
{
    int64_t id = __atomic_load_n(&j->ids[c->t * j->stride + c->h], __ATOMIC_RELAXED);
    *id_out = id;
    if (id == -1)
        return -1;
    /* global rows (id_base = the head's first row in the layer's table) or
     * bucket ids (id_base NULL): the bucket is checked either way */
    int64_t bucket = j->id_base ? id - j->id_base[c->h] : id;
    return bucket >= 0 && bucket < j->bucket_sizes[c->h] ? bucket + j->head_offsets[c->h] : -1;
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
 * libc memcpy call per 256-byte row was a quarter of a gather's time. */
static inline void copy_row(uint8_t *dst, const uint8_t *src, int64_t bytes)
{
    if (bytes == 256)
        memcpy(dst, src, 256);
    else if (bytes == 8)
        memcpy(dst, src, 8);
    else
        memcpy(dst, src, (size_t)bytes);
}

typedef void (*row_fn)(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block,
                       uint16_t *out);

/* Portable row: one clone per ISA, picked when the module loads (GCC
 * vectorises dequant_fast32 for each); nothing assumes the build host. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void row_generic(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block,
                        uint16_t *out)
{
    for (int64_t b = 0; b < dim / block; b++)
        dequant_block(w + b * block, s[b], block, out + b * block);
}

#if defined(__x86_64__)
/* AVX2 row for block 32 with streaming stores: each block is dequantised
 * into a cache-line scratch (GCC vectorises dequant_fast32 for AVX2 here)
 * and written with two 32-byte non-temporal stores, so the scattered
 * output lines of a table-order gather are not read for ownership first
 * (the AVX-512 row's trick, for CPUs without AVX-512).  Blocks with a scale
 * near the fp32 range edges take the exact table, as everywhere.  Needs a
 * 32-byte aligned output row (checked by the caller). */
__attribute__((target("avx2")))
static void row_avx2_stream(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block,
                            uint16_t *out)
{
    uint16_t line[32] __attribute__((aligned(32)));
    for (int64_t b = 0; b < dim / 32; b++) {
        if (s[b] >= 10 && s[b] <= 246)
            dequant_fast32(w + b * 32, (uint16_t)(((int)s[b] - 127) << 7), line);
        else
            dequant_block(w + b * 32, s[b], 32, line);
        _mm256_stream_si256((__m256i *)(out + b * 32), _mm256_load_si256((const __m256i *)line));
        _mm256_stream_si256((__m256i *)(out + b * 32 + 16),
                            _mm256_load_si256((const __m256i *)(line + 16)));
    }
    (void)block;
}

/* AVX-512BW row (block 32): 32 values per instruction, the subnormal e4m3
 * table in one vpermw, and streaming stores: the BF16 output is twice the
 * bytes read and is not read back by this thread, so skipping the
 * read-for-ownership of its cache lines saves a third of the traffic. */
__attribute__((target("avx512f,avx512bw")))
static void row_avx512(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block,
                       uint16_t *out)
{
    const __m512i sub_table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0,
        (120 << 7) | 0x60, (120 << 7) | 0x40, (120 << 7) | 0x20, 120 << 7,
        (119 << 7) | 0x40, 119 << 7, 118 << 7, 0);
    const __m512i k7f = _mm512_set1_epi16(0x7F), k7 = _mm512_set1_epi16(7);
    const __m512i k80 = _mm512_set1_epi16(0x80), bias = _mm512_set1_epi16(120 << 7);
    const __m512i nan = _mm512_set1_epi16(0x7FC0), eight = _mm512_set1_epi16(8);
    const int aligned = ((uintptr_t)out & 63) == 0;
    if (block != 32) {
        row_generic(w, s, dim, block, out);
        return;
    }
    for (int64_t b = 0; b < dim / 32; b++) {
        uint8_t sb = s[b];
        uint16_t *dst = out + b * 32;
        if (sb < 10 || sb > 246) {
            dequant_block(w + b * 32, sb, 32, dst);
            continue;
        }
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + b * 32)));
        __m512i mag = _mm512_and_si512(v, k7f);
        __m512i sub = _mm512_permutexvar_epi16(_mm512_and_si512(v, k7), sub_table);
        __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), bias);
        __mmask32 is_normal = _mm512_cmpge_epu16_mask(mag, eight);
        __m512i r = _mm512_mask_blend_epi16(is_normal, sub, normal);
        r = _mm512_add_epi16(r, _mm512_set1_epi16((short)(((int)sb - 127) << 7)));
        r = _mm512_maskz_mov_epi16(_mm512_cmpneq_epu16_mask(mag, _mm512_setzero_si512()), r);
        r = _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(v, k80), 8));
        r = _mm512_mask_blend_epi16(_mm512_cmpeq_epu16_mask(mag, k7f), r, nan);
        if (aligned)
            _mm512_stream_si512((__m512i *)dst, r);
        else
            _mm512_storeu_si512(dst, r);
    }
}
#endif

/* The row function is picked once per process (CPU dispatch and the
 * environment are not re-read per call: a small lookup is a few us). */
static row_fn picked_row = NULL;
static int have_avx2_stream = 0; /* the AVX2 streaming row may stand in for the portable one */
static pthread_once_t pick_once = PTHREAD_ONCE_INIT;

static void pick_row_init(void)
{
    picked_row = row_generic;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bw") && getenv("NUMA_ENGRAM_NO_AVX512") == NULL)
        picked_row = row_avx512;
    have_avx2_stream = __builtin_cpu_supports("avx2") && getenv("NUMA_ENGRAM_NO_AVX2") == NULL;
#endif
}

static row_fn pick_row_fn(void)
{
    pthread_once(&pick_once, pick_row_init);
    return picked_row;
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

struct order {
    int64_t *rows;    /* the table row of each id in token order, -1 for none */
    int64_t *row;     /* valid rows in table order ... */
    int64_t *pos;     /* ... and their index in the chunk (output place) */
    int64_t *counts;  /* 1 << ORDER_BITS buckets */
    int64_t n;        /* valid rows in the chunk */
    int shift;        /* row >> shift is the bucket */
};

static void order_free(struct order *o)
{
    free(o->rows);
    free(o->row);
    free(o->pos);
    free(o->counts);
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
static void order_chunk(struct lookup_job *j, struct cursor *cur, int64_t k0, int64_t n,
                        struct order *o)
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
 * it would starve the out-of-order window of memory parallelism (measured:
 * interleaving prefetches with the dequant was 0.6-0.7x these phases). */
enum { STAGE_ROWS = 64, MAX_STAGE_BYTES = 1024, MAX_STAGE_SCALES = 64 };

/* Row q + ahead of the chunk, weights and scale bytes, on its way to cache. */
static inline __attribute__((always_inline)) void
prefetch_ahead_of(const struct lookup_job *j, const struct order *o, int64_t q, int ahead_n,
                  int64_t n_scales)
{
    if (ahead_n > 0 && q + ahead_n < o->n) {
        int64_t row = o->row[q + ahead_n];
        prefetch_row((const char *)(j->weights + row * j->dim), j->dim);
        prefetch_row((const char *)(j->scales + row * n_scales), 1);
    }
}

/* The chunk's rows dequantised, STAGE_ROWS at a time: copied (prefetched
 * ahead) into the stage, then dequantised from there with the row's
 * scales.  The scale bytes are read in the same loop as the weights: in
 * table order they are close together (measured: 1.1-1.4x a separate pass
 * over them). */
__attribute__((target_clones("arch=x86-64-v4", "default")))
static void dequant_chunk(const struct lookup_job *j, const struct order *o, int64_t k0,
                          row_fn row_dequant)
{
    const int64_t n_scales = j->dim / j->block;
    const int staged = j->dim <= MAX_STAGE_BYTES && n_scales <= MAX_STAGE_SCALES;
    const int ahead_n = prefetch_ahead;
#if defined(__x86_64__)
    const int avx2_stream = have_avx2_stream && row_dequant == row_generic && j->block == 32 &&
                            j->dim % 32 == 0 && ((uintptr_t)j->out & 31) == 0;
#else
    const int avx2_stream = 0;
#endif
    uint8_t w_stage[STAGE_ROWS * MAX_STAGE_BYTES] __attribute__((aligned(64)));
    uint8_t s_stage[STAGE_ROWS * MAX_STAGE_SCALES] __attribute__((aligned(64)));
    for (int64_t q0 = 0; q0 < o->n; q0 += STAGE_ROWS) {
        int64_t n = o->n - q0 < STAGE_ROWS ? o->n - q0 : STAGE_ROWS;
        for (int64_t q = q0; q < q0 + n; q++) {
            prefetch_ahead_of(j, o, q, ahead_n, n_scales);
            if (!staged) /* rows too wide for the stage: read in place below */
                continue;
            copy_row(w_stage + (q - q0) * j->dim, j->weights + o->row[q] * j->dim, j->dim);
            copy_row(s_stage + (q - q0) * n_scales, j->scales + o->row[q] * n_scales, n_scales);
        }
        for (int64_t q = q0; q < q0 + n; q++) {
            const uint8_t *w = staged ? w_stage + (q - q0) * j->dim
                                      : j->weights + o->row[q] * j->dim;
            const uint8_t *s = staged ? s_stage + (q - q0) * n_scales
                                      : j->scales + o->row[q] * n_scales;
            uint16_t *out = j->out + (k0 + o->pos[q]) * j->dim;
#if defined(__x86_64__)
            if (row_dequant == row_avx512) /* a direct call the AVX-512 clone inlines */
                row_avx512(w, s, j->dim, j->block, out);
            else if (avx2_stream)
                row_avx2_stream(w, s, j->dim, j->block, out);
            else
#else
            (void)avx2_stream;
#endif
                row_dequant(w, s, j->dim, j->block, out);
        }
    }
}

#if defined(__x86_64__)
/* Whole cache lines with streaming stores: rows in table order land at
 * scattered output places, where plain stores would first read each line
 * (measured on 2 MiB pages: 1.2x plain copies). */
__attribute__((target("avx512f")))
static void stream_lines(uint8_t *dst, const uint8_t *src, int64_t bytes)
{
    for (int64_t off = 0; off < bytes; off += 64)
        _mm512_stream_si512((__m512i *)(dst + off), _mm512_loadu_si512(src + off));
}
#endif

/* The packed variant: each row's FP8 bytes and scale bytes copied as they
 * are stored, prefetched ahead like the lookup.  No stage here: the plain
 * copies overlap the misses (measured: staged phases were 0.75-0.8x). */
__attribute__((target_clones("arch=x86-64-v4", "default")))
static void gather_chunk(const struct lookup_job *j, const struct order *o, int64_t k0,
                         int stream)
{
    const int64_t n_scales = j->dim / j->block;
    const int ahead_n = prefetch_ahead;
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
 * the same stage) from stack scratch.  The threshold is tunable
 * (ne_tune_small_rows) so tools/bench.py can measure it and tests can run
 * both sides; the default is what bench measured. */
#define NE_SMALL_ROWS 2048
enum { MAX_SMALL_ROWS = 4096 };
static int64_t small_rows = NE_SMALL_ROWS;

int ne_tune_small_rows(int64_t rows)
{
    if (rows < 0 || rows > MAX_SMALL_ROWS) {
        errno = EINVAL;
        return -1;
    }
    small_rows = rows;
    return 0;
}

/* The n rows from flat index k0 on, in token order: DEAD and bad ids get
 * zero rows (bad ones noted), the others go to o->row / o->pos. */
static void direct_chunk(struct lookup_job *j, struct cursor *cur, int64_t k0, int64_t n,
                         struct order *o)
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

static int use_streaming(const struct lookup_job *j, row_fn row_dequant)
{
#if defined(__x86_64__)
    /* streaming needs AVX-512 (the picked row function says whether it is
     * there and allowed) and whole 64-byte lines at every output row */
    return row_dequant == row_avx512 && j->dim % 64 == 0 && ((uintptr_t)j->raw_w & 63) == 0;
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
    if (n_rows > 0 && n_rows <= small_rows) {
        const row_fn row_dequant = pick_row_fn();
        int64_t row[MAX_SMALL_ROWS], pos[MAX_SMALL_ROWS];
        struct order o = {.row = row, .pos = pos};
        struct cursor cur = {j->t_begin, 0};
        direct_chunk(j, &cur, j->t_begin * j->n_heads, n_rows, &o);
        if (j->raw_w)
            gather_chunk(j, &o, j->t_begin * j->n_heads, use_streaming(j, row_dequant));
        else
            dequant_chunk(j, &o, j->t_begin * j->n_heads, row_dequant);
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
    struct order o;
    if (cap <= 0)
        return;
    if (order_alloc(&o, j, cap) != 0) {
        j->error = ENOMEM;
        return;
    }
    for (int64_t k0 = k_begin; k0 < k_end; k0 += cap) {
        order_chunk(j, &cur, k0, k_end - k0 < cap ? k_end - k0 : cap, &o);
        if (j->raw_w)
            gather_chunk(j, &o, k0, stream);
        else
            dequant_chunk(j, &o, k0, row_dequant);
    }
    order_free(&o);
    finish_stores();
}

/* Threads to use: at least 1, at most max_threads and one per item. */
static int clamp_threads(int n_threads, int max_threads, int64_t n_items)
{
    if (n_threads > max_threads)
        n_threads = max_threads;
    if (n_threads > n_items)
        n_threads = (int)n_items;
    return n_threads < 1 ? 1 : n_threads;
}

/* Run fn on each of n jobs (an array of job_size-byte structs), one thread
 * each, and join them all.  0, or -1 with errno when a thread cannot start
 * (the ones started are still joined). */
static int run_threads(void *(*fn)(void *), void *jobs, size_t job_size, int n)
{
    pthread_t threads[256];
    int started = 0, err = 0;
    for (; started < n && started < 256; started++) {
        err = pthread_create(&threads[started], NULL, fn, (char *)jobs + started * job_size);
        if (err)
            break;
    }
    for (int i = 0; i < started; i++)
        pthread_join(threads[i], NULL);
    if (err) {
        errno = err;
        return -1;
    }
    return 0;
}

static void *lookup_thread(void *arg)
{
    struct lookup_job *j = arg;
    if (j->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(j->cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    run_job(j);
    return NULL;
}

/* ---------------------------------------------- persistent workers --- */

/* Lookup threads that live as long as their table: pinned once to the
 * rows' node's CPUs, woken per call (a condition variable, no thread
 * creation: creating, pinning and joining a pthread cost ~50 us a call).
 * One call at a time per pool; a caller that finds it busy waits.  A
 * forked child inherits the memory but not the threads: every entry point
 * checks the pid, and the child's Python side makes a pool of its own. */
enum { MAX_POOL = 256 };

struct ne_pool {
    pid_t pid;
    int n;
    int cpu[MAX_POOL];
    pthread_t thread[MAX_POOL];
    pthread_mutex_t call;     /* one dispatch at a time */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation;      /* bumped per dispatch (guarded by mu) */
    int n_jobs, remaining, stop;
    struct lookup_job *jobs;
};

struct pool_worker_arg {
    struct ne_pool *pool;
    int index;
};

static void *pool_worker(void *arg)
{
    struct pool_worker_arg *a = arg;
    struct ne_pool *p = a->pool;
    const int me = a->index;
    free(a);
    if (p->cpu[me] >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(p->cpu[me], &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        if (me < p->n_jobs) {
            struct lookup_job *job = &p->jobs[me];
            pthread_mutex_unlock(&p->mu);
            run_job(job);
            pthread_mutex_lock(&p->mu);
            if (--p->remaining == 0)
                pthread_cond_signal(&p->done);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void ne_pool_free(struct ne_pool *p);

/* A pool of n threads, thread i pinned to cpus[i % n_cpus] (n_cpus 0: not
 * pinned).  NULL with errno when a thread cannot start. */
struct ne_pool *ne_pool_new(int n, const int *cpus, int n_cpus)
{
    if (n < 1 || n > MAX_POOL) {
        errno = EINVAL;
        return NULL;
    }
    struct ne_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->pid = getpid();
    pthread_mutex_init(&p->call, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 0; i < n; i++) {
        p->cpu[i] = n_cpus > 0 ? cpus[i % n_cpus] : -1;
        struct pool_worker_arg *a = malloc(sizeof *a);
        if (a)
            *a = (struct pool_worker_arg){p, i};
        int err = a ? pthread_create(&p->thread[i], NULL, pool_worker, a) : ENOMEM;
        if (err) {
            free(a);
            ne_pool_free(p);
            errno = err;
            return NULL;
        }
        p->n = i + 1;
    }
    return p;
}

/* Stop and join the threads (in the process that made them; a forked
 * child only frees the memory: it has none of the threads). */
void ne_pool_free(struct ne_pool *p)
{
    if (!p)
        return;
    if (p->pid == getpid()) {
        pthread_mutex_lock(&p->mu);
        p->stop = 1;
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->n; i++)
            pthread_join(p->thread[i], NULL);
    }
    free(p);
}

int ne_pool_size(const struct ne_pool *p)
{
    return p && p->pid == getpid() ? p->n : 0;
}

/* Run n jobs on the pool's first n threads and wait for them. */
static void pool_run(struct ne_pool *p, struct lookup_job *jobs, int n)
{
    pthread_mutex_lock(&p->call);
    pthread_mutex_lock(&p->mu);
    p->jobs = jobs;
    p->n_jobs = n;
    p->remaining = n;
    p->generation++;
    pthread_cond_broadcast(&p->go);
    while (p->remaining > 0)
        pthread_cond_wait(&p->done, &p->mu);
    p->jobs = NULL;
    p->n_jobs = 0;
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->call);
}

/* One job on the calling thread.  A large one runs on a CPU of the rows'
 * node (cpus) when the caller is not on one and is allowed there: its
 * affinity is set for the call and put back after (two syscalls, nothing
 * next to a large gather); a small one runs where the caller is. */
static void run_on_caller(struct lookup_job *j, const int *cpus, int n_cpus)
{
    const int64_t n_rows = (j->t_end - j->t_begin) * j->n_heads;
    cpu_set_t saved, want;
    int moved = 0;
    if (n_cpus > 0 && n_rows > small_rows) {
        int here = sched_getcpu(), local = 0;
        CPU_ZERO(&want);
        for (int i = 0; i < n_cpus; i++) {
            local |= cpus[i] == here;
            if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE)
                CPU_SET(cpus[i], &want);
        }
        if (!local && pthread_getaffinity_np(pthread_self(), sizeof saved, &saved) == 0)
            moved = pthread_setaffinity_np(pthread_self(), sizeof want, &want) == 0;
    }
    run_job(j);
    if (moved)
        pthread_setaffinity_np(pthread_self(), sizeof saved, &saved);
}

/* Split proto's tokens over n_threads jobs and run them: on the pool's
 * threads when a pool of this process is given and more than one job is
 * worth it, else on the calling thread (one job) or on fresh threads
 * (thread i pinned to cpus[i % n_cpus] when n_cpus > 0).  Report bad ids
 * in bad[0..2] = (count, first flat index t*n_heads+h, its value). */
static int run_lookup_jobs(const struct lookup_job *proto, int64_t n_tokens, int n_threads,
                           const int *cpus, int n_cpus, int64_t *bad, struct ne_pool *pool)
{
    enum { MAX_THREADS = 256 };
    struct lookup_job jobs[MAX_THREADS];
    int rc = 0;
    const int pooled = pool != NULL && ne_pool_size(pool) > 0;
    if (pooled && n_threads > pool->n)
        n_threads = pool->n;
    n_threads = clamp_threads(n_threads, MAX_THREADS, n_tokens);
    int64_t per = (n_tokens + n_threads - 1) / n_threads;
    for (int i = 0; i < n_threads; i++) {
        jobs[i] = *proto;
        jobs[i].t_begin = i * per < n_tokens ? i * per : n_tokens;
        jobs[i].t_end = (i + 1) * per < n_tokens ? (i + 1) * per : n_tokens;
        jobs[i].cpu = n_cpus > 0 ? cpus[i % n_cpus] : -1;
    }
    if (n_threads == 1)
        run_on_caller(&jobs[0], cpus, n_cpus); /* a thread handoff costs more than it saves */
    else if (pooled)
        pool_run(pool, jobs, n_threads);
    else
        rc = run_threads(lookup_thread, jobs, sizeof(jobs[0]), n_threads);
    bad[0] = 0;
    bad[1] = -1;
    for (int i = 0; i < n_threads; i++)   /* jobs are in token order */
        if (jobs[i].bad_count) {
            if (bad[0] == 0) {
                bad[1] = jobs[i].first_bad;
                bad[2] = jobs[i].first_bad_id;
            }
            bad[0] += jobs[i].bad_count;
        }
    for (int i = 0; i < n_threads && rc == 0; i++)
        if (jobs[i].error) {
            errno = jobs[i].error;
            rc = -1;
        }
    return rc;
}

/* Gather + dequantise the rows of n_heads heads for n_tokens tokens into
 * out[n_tokens][n_heads][dim] (bf16 bits).  Each id is checked against its
 * head's bucket_sizes as it is read (after subtracting id_base[h], the
 * head's first global row, when ids are global rows; NULL for bucket ids);
 * -1 is DEAD; bad ones give zero rows and are
 * reported in bad[0..2] = (count, first flat index t*n_heads+h, its value).
 * Work is split by token over n_threads threads, thread i pinned to
 * cpus[i % n_cpus] when n_cpus > 0.  Returns 0, or -1 with errno when a
 * thread cannot be started (EAGAIN) or its scratch (ENOMEM) allocated. */
int ne_lookup_bf16(const uint8_t *weights, const uint8_t *scales, int64_t dim,
                   int64_t block, const int64_t *ids, int64_t n_tokens,
                   int64_t stride, int64_t n_heads, const int64_t *head_offsets,
                   const int64_t *bucket_sizes, const int64_t *id_base, uint16_t *out,
                   int n_threads, const int *cpus, int n_cpus, int64_t *bad,
                   struct ne_pool *pool)
{
    pthread_once(&lut_once, build_exact_lut);
    struct lookup_job proto = {weights, scales, dim, block, ids, stride, n_heads, head_offsets,
                               bucket_sizes, id_base, out, NULL, NULL, 0, 0, -1, 0, -1, 0, 0};
    return run_lookup_jobs(&proto, n_tokens, n_threads, cpus, n_cpus, bad, pool);
}

/* The same rows as ne_lookup_bf16, packed: out_w[n_tokens][n_heads][dim]
 * FP8 bytes and out_s[n_tokens][n_heads][dim / block] scale bytes, as the
 * table stores them (half the output bytes; dequantised later, e.g. on the
 * GPU after the copy).  Same checks, threads and return values. */
int ne_gather_fp8(const uint8_t *weights, const uint8_t *scales, int64_t dim, int64_t block,
                  const int64_t *ids, int64_t n_tokens, int64_t stride, int64_t n_heads,
                  const int64_t *head_offsets, const int64_t *bucket_sizes,
                  const int64_t *id_base, uint8_t *out_w, uint8_t *out_s, int n_threads,
                  const int *cpus, int n_cpus, int64_t *bad, struct ne_pool *pool)
{
    struct lookup_job proto = {weights, scales, dim, block, ids, stride, n_heads, head_offsets,
                               bucket_sizes, id_base, NULL, out_w, out_s, 0, 0, -1, 0, -1, 0, 0};
    return run_lookup_jobs(&proto, n_tokens, n_threads, cpus, n_cpus, bad, pool);
}

/* ------------------------------------------- the random-read limit --- */

/* What the memory system gives a plain gather: read every cache line of
 * rows[i] (dim bytes each) with `ahead` rows prefetched, summing one word
 * per line so nothing is optimised away.  Rows/s of this is the ceiling a
 * lookup kernel is measured against (tools/bench.py). */
struct read_job {
    const uint8_t *table;
    int64_t dim;
    const int64_t *rows;
    int64_t begin, end;
    int ahead;
    uint64_t sum;
};

static void *read_thread(void *arg)
{
    struct read_job *j = arg;
    uint64_t sum = 0;
    for (int64_t i = j->begin; i < j->end; i++) {
        if (i + j->ahead < j->end) {
            const uint8_t *q = j->table + j->rows[i + j->ahead] * j->dim;
            for (int64_t off = 0; off < j->dim; off += 64)
                __builtin_prefetch(q + off, 0, 3);
        }
        const uint8_t *p = j->table + j->rows[i] * j->dim;
        for (int64_t off = 0; off < j->dim; off += 64) {
            uint64_t word;
            memcpy(&word, p + off, sizeof word);
            sum += word;
        }
    }
    j->sum = sum;
    return NULL;
}

int ne_read_rows(const uint8_t *table, int64_t dim, const int64_t *rows, int64_t n, int ahead,
                 int n_threads, uint64_t *sum)
{
    enum { MAX_THREADS = 64 };
    struct read_job jobs[MAX_THREADS];
    n_threads = clamp_threads(n_threads, MAX_THREADS, n);
    int64_t per = (n + n_threads - 1) / n_threads;
    for (int i = 0; i < n_threads; i++) {
        int64_t b = i * per < n ? i * per : n, e = b + per < n ? b + per : n;
        jobs[i] = (struct read_job){table, dim, rows, b, e, ahead, 0};
    }
    int rc = n_threads == 1 ? (read_thread(&jobs[0]), 0)
                            : run_threads(read_thread, jobs, sizeof(jobs[0]), n_threads);
    *sum = 0;
    for (int i = 0; i < n_threads; i++)
        *sum += jobs[i].sum;
    return rc;
}

/* ----------------------------------------------------- n-gram hashing --- */

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
static void mods_scalar(int64_t x, const struct fastdiv_cols *v, int64_t c0, int64_t n,
                        int64_t *dst)
{
    for (int64_t i = 0; i < n; i++) {
        struct fastdiv f = {v->d[c0 + i], v->m[c0 + i], (int)v->sh1[c0 + i],
                            (int)v->sh2[c0 + i]};
        dst[i] = floor_mod(x, &f);
    }
}

#if defined(__x86_64__)
/* High 64 bits of the 64x64-bit products, lane by lane, from four 32x32
 * multiplies (AVX-512 has no 64-bit high multiply). */
__attribute__((target("avx512f,avx512dq")))
static inline __m512i mulhi_u64(__m512i a, __m512i b)
{
    const __m512i lo32 = _mm512_set1_epi64(0xffffffffLL);
    __m512i a_hi = _mm512_srli_epi64(a, 32), b_hi = _mm512_srli_epi64(b, 32);
    __m512i ll = _mm512_mul_epu32(a, b), hl = _mm512_mul_epu32(a_hi, b);
    __m512i lh = _mm512_mul_epu32(a, b_hi), hh = _mm512_mul_epu32(a_hi, b_hi);
    __m512i cross = _mm512_add_epi64(_mm512_add_epi64(_mm512_srli_epi64(ll, 32),
                                                      _mm512_and_si512(hl, lo32)),
                                     _mm512_and_si512(lh, lo32));
    return _mm512_add_epi64(_mm512_add_epi64(hh, _mm512_srli_epi64(hl, 32)),
                            _mm512_add_epi64(_mm512_srli_epi64(lh, 32),
                                             _mm512_srli_epi64(cross, 32)));
}

/* mods_scalar, 8 columns per step: the same branch-free floor modulo. */
__attribute__((target("avx512f,avx512dq")))
static void mods_avx512(int64_t x, const struct fastdiv_cols *v, int64_t c0, int64_t n,
                        int64_t *dst)
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

static mods_fn pick_mods_fn(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        getenv("NUMA_ENGRAM_NO_AVX512") == NULL)
        return mods_avx512;
#endif
    return mods_scalar;
}

struct hash_job {
    const int64_t *ids;
    int64_t t, pad_id, max_ngram, n_head, n_cols;
    const int64_t *multipliers, *primes;
    int64_t *out;
    int64_t begin, end; /* flat (row, position) range */
    int hardware_division; /* the plain % path: the baseline fastdiv is measured against */
};

/* DeepSeek's formula: mix of order n = XOR over k < n of tok_k * m_k in
 * wrapping int64 (done in uint64: signed overflow is undefined in C), each
 * head taking the floor modulo of its prime. */
static void run_hashes(const struct hash_job *j)
{
    struct fastdiv_cols *cols = j->hardware_division ? NULL
                                                     : fastdiv_cols_of(j->primes, j->n_cols);
    const int fast = cols != NULL;
    const mods_fn mods = pick_mods_fn();
    for (int64_t f = j->begin; f < j->end; f++) {
        int64_t row = f / j->t, pos = f % j->t;
        const int64_t *seq = j->ids + row * j->t;
        uint64_t mix = (uint64_t)seq[pos] * (uint64_t)j->multipliers[0];
        int64_t *dst = j->out + f * j->n_cols;
        for (int64_t n = 2; n <= j->max_ngram; n++) {
            int64_t k = n - 1;
            int64_t tok = pos >= k ? seq[pos - k] : j->pad_id;
            mix ^= (uint64_t)tok * (uint64_t)j->multipliers[k];
            int64_t smix = (int64_t)mix;
            const int64_t c0 = (n - 2) * j->n_head;
            if (fast)
                mods(smix, cols, c0, j->n_head, dst + c0);
            else
                mods_hardware(smix, j->primes + c0, j->n_head, dst + c0);
        }
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
    enum { MAX_THREADS = 64 };
    struct hash_job jobs[MAX_THREADS];
    int64_t total = n_rows * t;
    if (n_threads < 1)
        n_threads = 1;
    if (n_threads > MAX_THREADS)
        n_threads = MAX_THREADS;
    if (total < 4096)
        n_threads = 1; /* not worth a thread */
    int64_t per = (total + n_threads - 1) / n_threads;
    for (int i = 0; i < n_threads; i++) {
        int64_t b = i * per < total ? i * per : total;
        int64_t e = b + per < total ? b + per : total;
        jobs[i] = (struct hash_job){ids, t, pad_id, max_ngram, n_head,
                                    (max_ngram - 1) * n_head, multipliers, primes, out, b, e,
                                    hardware_division};
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
 * of range) or 2 (position not the slot's next), and nothing changed. */
int64_t ne_hash_windows(const int64_t *ids, const int64_t *slots, const int64_t *positions,
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
        if (n1 > 0) {
            memmove(h, h + 1, (size_t)(n1 - 1) * sizeof(int64_t));
            h[n1 - 1] = w[0];
        }
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
    const int fast = cols != NULL;
    const mods_fn mods = pick_mods_fn();
    for (int64_t t = j->begin; t < j->end; t++) {
        const int64_t *w = j->win + t * j->n;
        int64_t tok[64];
        int blocked = 0;
        for (int64_t k = 0; k < j->n; k++) {
            blocked |= w[k] < 0;
            tok[k] = blocked ? j->pad_id : w[k];
        }
        for (int64_t l = 0; l < j->n_layers; l++) {
            const int64_t *m = j->multipliers + l * j->n;
            const int64_t *primes = j->primes + l * j->n_cols;
            const int64_t *off = j->offsets ? j->offsets + l * j->n_cols : NULL;
            int64_t *dst = j->out + (t * j->n_layers + l) * j->n_cols;
            uint64_t mix = (uint64_t)tok[0] * (uint64_t)m[0];
            for (int64_t k = 1; k < j->n; k++) {
                mix ^= (uint64_t)tok[k] * (uint64_t)m[k];
                int64_t smix = (int64_t)mix;
                const int64_t c0 = (k - 1) * j->n_head;
                if (fast)
                    mods(smix, cols, l * j->n_cols + c0, j->n_head, dst + c0);
                else
                    mods_hardware(smix, primes + c0, j->n_head, dst + c0);
                for (int64_t h = 0; off && h < j->n_head; h++)
                    dst[c0 + h] += off[c0 + h];
            }
        }
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
                         const int64_t *multipliers, const int64_t *primes,
                         const int64_t *offsets, int64_t n_layers, int64_t n_head,
                         int64_t *out, int n_threads)
{
    enum { MAX_THREADS = 256 };
    struct window_job jobs[MAX_THREADS];
    n_threads = clamp_threads(n_threads, MAX_THREADS, n_tokens);
    int64_t per = (n_tokens + n_threads - 1) / n_threads;
    for (int i = 0; i < n_threads; i++) {
        int64_t b = i * per, e = (i + 1) * per < n_tokens ? (i + 1) * per : n_tokens;
        jobs[i] = (struct window_job){win, n, pad_id, n_layers, n_head, (n - 1) * n_head,
                                      multipliers, primes, offsets, out, b < e ? b : e, e};
    }
    if (n_threads == 1) {
        run_window_hashes(&jobs[0]);
        return 0;
    }
    return run_threads(window_thread, jobs, sizeof(jobs[0]), n_threads);
}
