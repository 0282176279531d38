/* rows.c: FP8 e4m3 rows with ue8m0 block scales -> BF16 rows, one row
 * function per ISA (portable, AVX2, AVX-512BW, AVX-512 VBMI), with
 * streaming stores for large outputs.
 * The values are bit-exact with numa_engram.model.fp8.dequantize_rows,
 * the reference every path is tested against. */
#include "core.h"

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

/* 32 values sharing scale byte s, 10 <= s <= 246: every product is a normal
 * fp32 with at most 4 significant bits, so its bf16 is exact: the e4m3 bits
 * re-biased plus (s - 127) in the exponent field.  Branch-free with a
 * constant trip count, so GCC vectorises it (16 or 32 lanes). */
static inline void dequant_fast32(const uint8_t *restrict w, uint16_t shift, uint16_t *restrict out)
{
    for (int i = 0; i < 32; i++) {
        uint16_t v = w[i];
        uint16_t mag = v & 0x7F;
        uint16_t m = v & 7;
        /* subnormal e4m3: m * 2^-9, as bf16 bits before the scale */
        uint16_t sub = m >= 4   ? (uint16_t)((120 << 7) | ((m & 3) << 5))
                       : m >= 2 ? (uint16_t)((119 << 7) | ((m & 1) << 6))
                                : (uint16_t)(118 << 7);
        uint16_t normal = (uint16_t)((mag << 4) + (120 << 7));
        uint16_t r = (uint16_t)(((mag >> 3) ? normal : sub) + shift);
        r = mag == 0 ? 0 : r;
        r |= (uint16_t)((v & 0x80) << 8);
        out[i] = mag == 0x7F ? 0x7FC0 : r;
    }
}

/* Scale bytes whose blocks take the branch-free formulas (every path's
 * fast range); the others read the exact table. */
static inline int fast_scale(uint8_t s)
{
    return s >= 10 && s <= 246;
}

static inline void
dequant_block(const uint8_t *restrict w, uint8_t s, int64_t n, uint16_t *restrict out)
{
    if (n == 32 && fast_scale(s)) {
        dequant_fast32(w, (uint16_t)(((int)s - 127) << 7), out);
        return;
    }
    const uint16_t *lut = exact_lut[s]; /* scales near the fp32 range edges, NaN */
    for (int64_t i = 0; i < n; i++)
        out[i] = lut[w[i]];
}

typedef void (*row_fn)(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block,
                       uint16_t *out);

/* Portable row: one clone per ISA, picked when the module loads (GCC
 * vectorises dequant_fast32 for each); nothing assumes the build host. */
__attribute__((target_clones("arch=x86-64-v3", "default"))) static void
row_generic(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block, uint16_t *out)
{
    for (int64_t b = 0; b < dim / block; b++)
        dequant_block(w + b * block, s[b], block, out + b * block);
}

#if defined(__x86_64__)
/* The AVX2 rows work on bytes, 32 values an instruction: in the fast scale
 * range every bf16 is exact and splits into a high byte that depends only
 * on the e4m3 exponent e (and the sign) and a low byte that depends only on
 * the low nibble (e's last bit and the mantissa m); subnormals (e = 0)
 * depend only on m.  So four 16-byte shuffle tables per scale byte give
 * every value: high by e, low by nibble, and both for subnormals by m.
 * They are read off exact_lut, so they say what the reference says.
 * ~23 instructions for 32 values where the 16-bit formula took ~44. */
static uint8_t byte_tables[256][4][16] __attribute__((aligned(16)));

static void build_byte_tables(void)
{
    for (int s = 0; s < 256; s++)
        for (int i = 0; i < 16; i++) {
            byte_tables[s][0][i] = (uint8_t)(exact_lut[s][(i ? i : 1) << 3] >> 8); /* e = i */
            byte_tables[s][1][i] = (uint8_t)exact_lut[s][i < 8 ? 16 + i : i];      /* e even/odd */
            byte_tables[s][2][i] = (uint8_t)(exact_lut[s][i & 7] >> 8);            /* subnormal m */
            byte_tables[s][3][i] = (uint8_t)exact_lut[s][i & 7];
        }
}

/* 32 values sharing scale byte s (10 <= s <= 246) as bf16: the first 16
 * in *first, the others in *second. */
__attribute__((target("avx2"))) static inline void
dequant32_avx2(const uint8_t *w, uint8_t s, __m256i *first, __m256i *second)
{
    const __m128i *t = (const __m128i *)byte_tables[s];
    const __m256i high_by_e = _mm256_broadcastsi128_si256(_mm_load_si128(t));
    const __m256i low_by_nibble = _mm256_broadcastsi128_si256(_mm_load_si128(t + 1));
    const __m256i sub_high = _mm256_broadcastsi128_si256(_mm_load_si128(t + 2));
    const __m256i sub_low = _mm256_broadcastsi128_si256(_mm_load_si128(t + 3));
    const __m256i k0f = _mm256_set1_epi8(0x0F), k07 = _mm256_set1_epi8(7);
    const __m256i k7f = _mm256_set1_epi8(0x7F), k80 = _mm256_set1_epi8((char)0x80);
    /* quads 0 2 1 3: the in-lane unpacks below then give values in order */
    __m256i x = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)w), 0xD8);
    __m256i e = _mm256_and_si256(_mm256_srli_epi16(x, 3), k0f);
    __m256i m = _mm256_and_si256(x, k07);
    __m256i sub = _mm256_cmpeq_epi8(e, _mm256_setzero_si256());
    __m256i high = _mm256_blendv_epi8(_mm256_shuffle_epi8(high_by_e, e),
                                      _mm256_shuffle_epi8(sub_high, m), sub);
    __m256i low = _mm256_blendv_epi8(_mm256_shuffle_epi8(low_by_nibble, _mm256_and_si256(x, k0f)),
                                     _mm256_shuffle_epi8(sub_low, m), sub);
    high = _mm256_or_si256(high, _mm256_and_si256(x, k80));
    __m256i nan = _mm256_cmpeq_epi8(_mm256_and_si256(x, k7f), k7f); /* -> 0x7FC0 */
    high = _mm256_blendv_epi8(high, k7f, nan);
    low = _mm256_blendv_epi8(low, _mm256_set1_epi8((char)0xC0), nan);
    *first = _mm256_unpacklo_epi8(low, high);
    *second = _mm256_unpackhi_epi8(low, high);
}

/* AVX2 row for block 32.  stream: the output row is 32-byte aligned and
 * large enough a gather that its lines should not be read for ownership
 * (non-temporal stores: the scattered output lines of a table-order gather
 * of a 48 MiB output); a small output stays in cache for its reader.
 * Blocks with a scale near the fp32 range edges take the exact table, as
 * everywhere. */
__attribute__((target("avx2"))) static inline void row_avx2_any(const uint8_t *w, const uint8_t *s,
                                                                int64_t dim, int64_t block,
                                                                uint16_t *out, int stream)
{
    (void)block; /* job_row_fn picks this row for block 32 only */
    for (int64_t b = 0; b < dim / 32; b++) {
        uint16_t *dst = out + b * 32;
        if (!fast_scale(s[b])) {
            uint16_t line[32] __attribute__((aligned(32)));
            dequant_block(w + b * 32, s[b], 32, line);
            memcpy(dst, line, sizeof line);
            continue;
        }
        __m256i lo, hi;
        dequant32_avx2(w + b * 32, s[b], &lo, &hi);
        if (stream) {
            _mm256_stream_si256((__m256i *)dst, lo);
            _mm256_stream_si256((__m256i *)(dst + 16), hi);
        } else {
            _mm256_storeu_si256((__m256i *)dst, lo);
            _mm256_storeu_si256((__m256i *)(dst + 16), hi);
        }
    }
}

/* An ISA's pair of row functions over its name##_any(..., stream): plain
 * stores, and (name##_stream) streaming stores for a large output; row_fn
 * has no stream argument, job_row_fn picks one of the pair per job. */
#define ROW_FN_PAIR(name, isa)                                                                     \
    __attribute__((target(isa))) static void name(const uint8_t *w, const uint8_t *s, int64_t dim, \
                                                  int64_t block, uint16_t *out)                    \
    {                                                                                              \
        name##_any(w, s, dim, block, out, 0);                                                      \
    }                                                                                              \
    __attribute__((target(isa))) static void name##_stream(                                        \
        const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block, uint16_t *out)             \
    {                                                                                              \
        name##_any(w, s, dim, block, out, 1);                                                      \
    }

ROW_FN_PAIR(row_avx2, "avx2")

/* AVX-512BW row (block 32): 32 values per instruction, the subnormal e4m3
 * table in one vpermw.  stream: streaming stores for a large gather's
 * 64-byte aligned output, whose lines are not read back by this thread (no
 * read-for-ownership: a third of the traffic); a small output stays in
 * cache for its reader, as on the AVX2 path (job_row_fn picks). */
__attribute__((target("avx512f,avx512bw"))) static inline void
row_avx512_any(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block, uint16_t *out,
               int stream)
{
    const __m512i sub_table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, (120 << 7) | 0x60,
        (120 << 7) | 0x40, (120 << 7) | 0x20, 120 << 7, (119 << 7) | 0x40, 119 << 7, 118 << 7, 0);
    const __m512i k7f = _mm512_set1_epi16(0x7F), k7 = _mm512_set1_epi16(7);
    const __m512i k80 = _mm512_set1_epi16(0x80), bias = _mm512_set1_epi16(120 << 7);
    const __m512i nan = _mm512_set1_epi16(0x7FC0), eight = _mm512_set1_epi16(8);
    const int aligned = stream && ((uintptr_t)out & 63) == 0;
    if (block != 32) {
        row_generic(w, s, dim, block, out);
        return;
    }
    for (int64_t b = 0; b < dim / 32; b++) {
        uint8_t sb = s[b];
        uint16_t *dst = out + b * 32;
        if (!fast_scale(sb)) {
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

ROW_FN_PAIR(row_avx512, "avx512f,avx512bw")

/* AVX-512 VBMI row (block 32, dim a multiple of 64), 64 values a step: in
 * the fast scale range a value's bf16 is its unscaled one (scale byte
 * 127's) plus (s - 127) in the exponent field, except for zeros and NaN,
 * which no scale changes.  The unscaled bf16 of each of the 128 e4m3
 * magnitudes is a low and a high byte, two 128-entry tables that vpermi2b
 * reads 64 bytes at a time; the sign is the e4m3 sign bit.  ~18
 * instructions for 64 values, 6 of them on port 5 (4 byte permutes, one
 * compare, one mask shift), where row_avx512's formula takes ~34
 * (measured, rows in cache, 8 tokens x 24 heads on one thread: 20 ns a
 * row over the packed copy's time, row_avx512 40 ns; one compare and
 * broadcasts from memory instead of two compares, a NaN blend and
 * broadcasts from registers, with a stage's rows in one call: 0.84-0.92x
 * that kernel's time, 1-64 tokens in cache). */
static uint8_t vbmi_tables[2][128] __attribute__((aligned(64)));    /* low, high byte */
static uint8_t vbmi_interleave[2][64] __attribute__((aligned(64))); /* words 0-31, 32-63 */
/* Each scale byte's exponent shift, (s - 127) << 7, twice in a 32-bit
 * word: a step reads its blocks' with a broadcast from this table (a load:
 * a broadcast from a register is a port-5 shuffle, the port the byte
 * permutes keep busy).  A table built per row in a stack array would make
 * the broadcasts read back its stores: this one takes 0.89x that row's
 * time (rows in cache, one thread, bit-exact). */
static int32_t vbmi_shift[256] __attribute__((aligned(64)));

static void build_vbmi_tables(void)
{
    for (int m = 0; m < 128; m++) {
        vbmi_tables[0][m] = (uint8_t)exact_lut[127][m];
        vbmi_tables[1][m] = (uint8_t)(exact_lut[127][m] >> 8);
    }
    /* NaN's high byte flagged in its (otherwise clear) bit 7: the sign is
     * not merged into it, so either sign's NaN reads 0x7FC0 (exact_lut's) */
    vbmi_tables[1][127] |= 0x80;
    for (int sc = 0; sc < 256; sc++) {
        const uint32_t word = (uint32_t)(((sc - 127) * 128) & 0xFFFF);
        vbmi_shift[sc] = (int32_t)(word | word << 16);
    }
    for (int half = 0; half < 2; half++)
        for (int i = 0; i < 32; i++) { /* word i: low byte from the low table's, high from 64 on */
            vbmi_interleave[half][2 * i] = (uint8_t)(32 * half + i);
            vbmi_interleave[half][2 * i + 1] = (uint8_t)(64 + 32 * half + i);
        }
}

#define VBMI_ISA "avx512f,avx512bw,avx512vl,avx512vbmi"

/* What every vbmi row reads: the tables and constants, loaded once per
 * call of a stage of rows (a row is 4 steps at 256 values: loaded per row,
 * with the call around it, they cost ~5% of a decode step's kernel time in
 * cache, A/B in one process). */
struct vbmi_consts {
    __m512i lo0, lo1, hi0, hi1, first, second, one, k7e, k80;
};

__attribute__((target(VBMI_ISA))) static inline __attribute__((always_inline)) void
vbmi_load(struct vbmi_consts *c)
{
    c->lo0 = _mm512_load_si512(vbmi_tables[0]);
    c->lo1 = _mm512_load_si512(vbmi_tables[0] + 64);
    c->hi0 = _mm512_load_si512(vbmi_tables[1]);
    c->hi1 = _mm512_load_si512(vbmi_tables[1] + 64);
    c->first = _mm512_load_si512(vbmi_interleave[0]);
    c->second = _mm512_load_si512(vbmi_interleave[1]);
    c->one = _mm512_set1_epi8(1);
    c->k7e = _mm512_set1_epi8(0x7E);
    c->k80 = _mm512_set1_epi8((char)0x80);
}

/* Whether a row of dim values in blocks of `block` takes the vbmi steps
 * (else row_avx512's). */
static inline int vbmi_fits(int64_t dim, int64_t block)
{
    return block == 32 && dim % 64 == 0;
}

/* One row (vbmi_fits): 64 values a step.  Zeros and NaN (magnitude 0 or
 * 0x7F: (x + 1) & 0x7E == 0, one compare for both) keep their unscaled
 * bits; NaN's table entry is flagged so that no sign is merged into it. */
__attribute__((target(VBMI_ISA))) static inline __attribute__((always_inline)) void
vbmi_row(const struct vbmi_consts *c, const uint8_t *w, const uint8_t *s, int64_t dim,
         uint16_t *out, int stream)
{
    const int aligned = stream && ((uintptr_t)out & 63) == 0;
    for (int64_t b = 0; b < dim / 64; b++) {
        const uint8_t sa = s[2 * b], sb = s[2 * b + 1];
        uint16_t *dst = out + b * 64;
        if (!fast_scale(sa) || !fast_scale(sb)) {
            dequant_block(w + b * 64, sa, 32, dst);
            dequant_block(w + b * 64 + 32, sb, 32, dst + 32);
            continue;
        }
        const __m512i x = _mm512_loadu_si512(w + b * 64);
        const __m512i lo = _mm512_permutex2var_epi8(c->lo0, x, c->lo1); /* bit 7 ignored */
        __m512i hi = _mm512_permutex2var_epi8(c->hi0, x, c->hi1);
        /* bits 0-6: the table's; bit 7: the sign, unless the table flagged
         * NaN there (then clear) */
        hi = _mm512_ternarylogic_epi32(hi, x, c->k80, 0x58);
        const __mmask64 scaled = _mm512_test_epi8_mask(_mm512_add_epi8(x, c->one), c->k7e);
        __m512i r0 = _mm512_permutex2var_epi8(lo, c->first, hi);
        __m512i r1 = _mm512_permutex2var_epi8(lo, c->second, hi);
        r0 = _mm512_mask_add_epi16(r0, (__mmask32)scaled, r0, _mm512_set1_epi32(vbmi_shift[sa]));
        r1 = _mm512_mask_add_epi16(r1, (__mmask32)(scaled >> 32), r1,
                                   _mm512_set1_epi32(vbmi_shift[sb]));
        if (aligned) {
            _mm512_stream_si512((__m512i *)dst, r0);
            _mm512_stream_si512((__m512i *)(dst + 32), r1);
        } else {
            _mm512_storeu_si512(dst, r0);
            _mm512_storeu_si512(dst + 32, r1);
        }
    }
}

__attribute__((target(VBMI_ISA))) static inline void
row_vbmi_any(const uint8_t *w, const uint8_t *s, int64_t dim, int64_t block, uint16_t *out,
             int stream)
{
    if (!vbmi_fits(dim, block)) {
        row_avx512_any(w, s, dim, block, out, stream);
        return;
    }
    struct vbmi_consts c;
    vbmi_load(&c);
    vbmi_row(&c, w, s, dim, out, stream);
}

/* n rows stored one after another (w: dim bytes each, s: dim / block
 * scale bytes each), row r to out + pos[r] * dim: a lookup's stage in one
 * call, the constants loaded once. */
__attribute__((target(VBMI_ISA))) static void
rows_vbmi(const uint8_t *w, const uint8_t *s, int64_t n, int64_t dim, int64_t block, uint16_t *out,
          const int64_t *pos, int stream)
{
    const int64_t n_scales = dim / block;
    if (!vbmi_fits(dim, block)) {
        for (int64_t r = 0; r < n; r++)
            row_avx512_any(w + r * dim, s + r * n_scales, dim, block, out + pos[r] * dim, stream);
        return;
    }
    struct vbmi_consts c;
    vbmi_load(&c);
    for (int64_t r = 0; r < n; r++)
        vbmi_row(&c, w + r * dim, s + r * n_scales, dim, out + pos[r] * dim, stream);
}

ROW_FN_PAIR(row_vbmi, VBMI_ISA)
#endif

/* The row function: picked from the CPU's features, which are read once
 * per process (core.h). */
static row_fn pick_row_fn(void)
{
#if defined(__x86_64__)
    if (ne_cpu()->avx512vbmi)
        return row_vbmi;
    if (ne_cpu()->avx512bw)
        return row_avx512;
#endif
    return row_generic;
}

/* The AVX2 rows may stand in for the portable one. */
static int have_avx2(void)
{
    return ne_cpu()->avx2;
}

/* The exact table and (x86) the AVX2 rows' byte tables read off it, built
 * once before the first BF16 lookup. */
static void build_tables(void)
{
    build_exact_lut();
#if defined(__x86_64__)
    build_byte_tables();
    build_vbmi_tables();
#endif
}

static void rows_ready(void)
{
    pthread_once(&lut_once, build_tables);
}
