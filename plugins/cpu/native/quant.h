/* The FP4 / FP8-block product loops on weights as stored, shared by quant_gemv.c (one linear) and
 * quant_experts.c (all routed experts of a step in one call): the codes are dequantised in registers,
 * never written back.
 *
 * A `*_rows_*` function computes output row `o` of `w` (FP4 [out, in/2], two codes a byte, the LOW
 * nibble the even element; FP8 [out, in] e4m3 bytes) against `rows` fp32 activation rows `xf`
 * ([rows, in], contiguous), writing y[r * out + o]. Scales are ue8m0 bytes (2^(b-127)) or fp32
 * (`scale_e8m0` says which), indexed from `scale` as the whole weight's (FP4 [out, in/32], FP8
 * [ceil(out/B), ceil(in/B)]). All arithmetic is fp32; a code times a power of two is exact in fp32,
 * so the only rounding is the sums'. Each output row's sum runs in the same order whatever `rows` is.
 * The AVX2 versions need AVX2 and FMA (QUANT_AVX2); the portable ones (plain C) are always there. The
 * AVX512-BF16 ones (QUANT_AVX512BF16; FP8's also AVX512-VBMI, QUANT_FP8_BF16) take bf16 activations and
 * decode the codes to bf16 (exact), so that vdpbf16ps forms the exact products 32 at a time.
 */
#ifndef DEEPINFER_CPU_NATIVE_QUANT_H
#define DEEPINFER_CPU_NATIVE_QUANT_H

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

#define FP4_GROUP 32

/* e2m1 codes (bit 3 = sign) times 2, as integers: {0, .5, 1, 1.5, 2, 3, 4, 6} x 2 */
static const int8_t FP4_TIMES2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_to_float(uint8_t b) {
    if (b == 0) return 0x1p-127f; /* the one subnormal power of two */
    if (b == 255) return NAN;
    union { uint32_t u; float f; } v = {.u = (uint32_t)b << 23};
    return v.f;
}

static inline float scale_at(const void *scale, int scale_e8m0, size_t index) {
    return scale_e8m0 ? e8m0_to_float(((const uint8_t *)scale)[index]) : ((const float *)scale)[index];
}

/* e4m3fn byte -> float: its exponent and mantissa bits placed in fp32's, times 2^(127-7); subnormal
 * codes land on fp32 subnormals, which the multiply scales back exactly. NaN codes are not expected
 * in weights and come out as 480 (they are not checked). */
static inline float e4m3_to_float(uint8_t b) {
    union { uint32_t u; float f; } v = {.u = ((uint32_t)(b & 0x7F) << 20) | ((uint32_t)(b & 0x80) << 24)};
    return v.f * 0x1p120f;
}

/* x rows -> fp32 [rows, in] (a private copy: rows are few) */
static float *load_x(const void *x, int x_dtype, long x_stride, long rows, long in) {
    float *xf = malloc((size_t)rows * in * sizeof(float));
    for (long r = 0; r < rows; r++)
        load_row((const char *)x + (size_t)r * x_stride * elem_size(x_dtype), x_dtype, xf + r * in, in);
    return xf;
}

/* ------------------------------------------------------------------------------ portable */

static void fp4_rows_portable(const float *xf, long rows, long in, const uint8_t *w, const void *scale,
                              int scale_e8m0, long o, float *y, long out) {
    const long groups = in / FP4_GROUP;
    const uint8_t *wo = w + (size_t)o * (in / 2);
    for (long r = 0; r < rows; r++) {
        const float *xr = xf + r * in;
        float acc = 0.0f;
        for (long g = 0; g < groups; g++) {
            float part = 0.0f;
            for (long j = 0; j < FP4_GROUP / 2; j++) {
                const uint8_t b = wo[g * (FP4_GROUP / 2) + j];
                part += xr[g * FP4_GROUP + 2 * j] * FP4_TIMES2[b & 15] + xr[g * FP4_GROUP + 2 * j + 1] * FP4_TIMES2[b >> 4];
            }
            acc += part * (0.5f * scale_at(scale, scale_e8m0, (size_t)o * groups + g));
        }
        y[r * out + o] = acc;
    }
}

static void fp8_rows_portable(const float *xf, long rows, long in, const uint8_t *w, const void *scale,
                              int scale_e8m0, long block, long o, float *y, long out) {
    const long blocks = (in + block - 1) / block;
    const uint8_t *wo = w + (size_t)o * in;
    for (long r = 0; r < rows; r++) {
        const float *xr = xf + r * in;
        float acc = 0.0f;
        for (long b = 0; b < blocks; b++) {
            const long end = (b + 1) * block < in ? (b + 1) * block : in;
            float part = 0.0f;
            for (long i = b * block; i < end; i++) part += xr[i] * e4m3_to_float(wo[i]);
            acc += part * scale_at(scale, scale_e8m0, (size_t)(o / block) * blocks + b);
        }
        y[r * out + o] = acc;
    }
}

/* ------------------------------------------------------------------------------ AVX2 + FMA */

#ifdef QUANT_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define QUANT_ROW_TILE 4 /* activation rows sharing one decode of a weight group */

/* One output row o against `nr` (<= QUANT_ROW_TILE) activation rows from r0: each group of 32 codes is
 * decoded once (nibbles -> 2 x e2m1 as int8 by a byte shuffle -> fp32) and used by every row of the
 * tile. Always inlined with a constant `nr`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void fp4_tile_avx2(const float *xf, long r0, const long nr, long in,
                                                                const uint8_t *wo, const void *scale, int scale_e8m0,
                                                                size_t scale_row, float *y, long o, long out) {
    const long groups = in / FP4_GROUP;
    const __m128i lut = _mm_loadu_si128((const __m128i *)FP4_TIMES2), low4 = _mm_set1_epi8(0x0F);
    __m256 acc[QUANT_ROW_TILE];
    for (long t = 0; t < nr; t++) acc[t] = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(wo + g * (FP4_GROUP / 2)));
        const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi)); /* elements 0..15 */
        const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi)); /* elements 16..31 */
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
        const __m256 s = _mm256_set1_ps(0.5f * scale_at(scale, scale_e8m0, scale_row + g));
        for (long t = 0; t < nr; t++) {
            const float *xg = xf + (r0 + t) * in + g * FP4_GROUP;
            __m256 part = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
            part = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), part);
            part = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), part);
            part = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), part);
            acc[t] = _mm256_fmadd_ps(part, s, acc[t]);
        }
    }
    for (long t = 0; t < nr; t++) y[(r0 + t) * out + o] = hsum8(acc[t]);
}

static void fp4_rows_avx2(const float *xf, long rows, long in, const uint8_t *w, const void *scale,
                          int scale_e8m0, long o, float *y, long out) {
    const uint8_t *wo = w + (size_t)o * (in / 2);
    const size_t scale_row = (size_t)o * (in / FP4_GROUP);
    for (long r0 = 0; r0 < rows; r0 += QUANT_ROW_TILE) {
        switch (rows - r0 < QUANT_ROW_TILE ? rows - r0 : QUANT_ROW_TILE) {
            case 1: fp4_tile_avx2(xf, r0, 1, in, wo, scale, scale_e8m0, scale_row, y, o, out); break;
            case 2: fp4_tile_avx2(xf, r0, 2, in, wo, scale, scale_e8m0, scale_row, y, o, out); break;
            case 3: fp4_tile_avx2(xf, r0, 3, in, wo, scale, scale_e8m0, scale_row, y, o, out); break;
            default: fp4_tile_avx2(xf, r0, 4, in, wo, scale, scale_e8m0, scale_row, y, o, out); break;
        }
    }
}

/* 8 e4m3 bytes -> 8 floats (see e4m3_to_float) */
static inline __m256 e4m3x8(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20),
                                         _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

/* fp4_tile_avx2's scheme for FP8 blocks: `block` codes decoded once per tile of `nr` rows */
static inline __attribute__((always_inline)) void fp8_tile_avx2(const float *xf, long r0, const long nr, long in,
                                                                const uint8_t *wo, const void *scale, int scale_e8m0,
                                                                long block, size_t scale_row, float *y, long o,
                                                                long out) {
    const long blocks = in / block;
    __m256 acc[QUANT_ROW_TILE];
    for (long t = 0; t < nr; t++) acc[t] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256 part[QUANT_ROW_TILE];
        for (long t = 0; t < nr; t++) part[t] = _mm256_setzero_ps();
        for (long i = b * block; i < (b + 1) * block; i += 8) { /* block % 8 == 0, in % block == 0 */
            const __m256 wv = e4m3x8(wo + i);
            for (long t = 0; t < nr; t++)
                part[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + (r0 + t) * in + i), part[t]);
        }
        const __m256 s = _mm256_set1_ps(scale_at(scale, scale_e8m0, scale_row + b));
        for (long t = 0; t < nr; t++) acc[t] = _mm256_fmadd_ps(part[t], s, acc[t]);
    }
    for (long t = 0; t < nr; t++) y[(r0 + t) * out + o] = hsum8(acc[t]);
}

static void fp8_rows_avx2(const float *xf, long rows, long in, const uint8_t *w, const void *scale,
                          int scale_e8m0, long block, long o, float *y, long out) {
    const uint8_t *wo = w + (size_t)o * in;
    const size_t scale_row = (size_t)(o / block) * (in / block);
    for (long r0 = 0; r0 < rows; r0 += QUANT_ROW_TILE) {
        switch (rows - r0 < QUANT_ROW_TILE ? rows - r0 : QUANT_ROW_TILE) {
            case 1: fp8_tile_avx2(xf, r0, 1, in, wo, scale, scale_e8m0, block, scale_row, y, o, out); break;
            case 2: fp8_tile_avx2(xf, r0, 2, in, wo, scale, scale_e8m0, block, scale_row, y, o, out); break;
            case 3: fp8_tile_avx2(xf, r0, 3, in, wo, scale, scale_e8m0, block, scale_row, y, o, out); break;
            default: fp8_tile_avx2(xf, r0, 4, in, wo, scale, scale_e8m0, block, scale_row, y, o, out); break;
        }
    }
}
#endif

/* ------------------------------------------------------------------------------ AVX512-BF16 */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define QUANT_AVX512BF16 1

/* e2m1 values as bf16 bits by code (bit 3 = sign), every one exact in bf16: low and high bytes */
static const uint8_t FP4_BF16_LO[16] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                        0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};
static const uint8_t FP4_BF16_HI[16] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                        0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};

/* The order in which fp4_bf16x32 yields a group's 32 weights, and in which the activations must be
 * given: each 16-element half as its 8 even elements, then its 8 odd ones (byte shuffles and unpacks
 * stay inside 128-bit lanes; the dot product does not care about the order). */
static inline long fp4_lane_order(long k) { return (k & ~15L) + ((k & 8) ? 2 * (k & 7) + 1 : 2 * (k & 7)); }

/* n bf16 values (n a multiple of 16) -> `dst` in fp4_lane_order */
static void fp4_lane_order_bf16(const uint16_t *restrict src, uint16_t *restrict dst, long n) {
    for (long k = 0; k < n; k++) dst[k] = src[fp4_lane_order(k)];
}

/* 16 bytes (32 codes) -> 32 bf16 weights in fp4_lane_order: the low nibbles (even elements) and the
 * high ones side by side in 32 bytes, two byte look-ups (the bf16 bits' low and high bytes), and the
 * two interleaved into words */
static inline __m512i fp4_bf16x32(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), low4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
    const __m256i lo_table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_BF16_LO));
    const __m256i hi_table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_BF16_HI));
    const __m256i lo = _mm256_shuffle_epi8(lo_table, nib), hi = _mm256_shuffle_epi8(hi_table, nib);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(lo, hi)), _mm256_unpackhi_epi8(lo, hi), 1);
}

/* Sums of four output rows' accumulators: [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 reduce4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
    return _mm512_castps512_ps128(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), s));
}

/* fp4_tile_avx2 for bf16 activation rows `xb` given in fp4_lane_order, `no` (1 or 4) output rows from
 * o at a time (their sums are independent dependency chains, share each load of x and one final
 * reduction): a group of 32 codes is decoded once into one register of bf16 weights, then each row
 * takes one vdpbf16ps (32 exact products summed in pairs into 16 fp32 lanes). `folded` (ue8m0
 * scales, all in [2, 252]): the scale 2^(s-127) is added to the nonzero weights' bf16 exponents (0.5..6
 * times it stays a normal bf16, exactly) and the products accumulate straight into the sums; else one
 * FMA per group and row applies the scale. */
static inline __attribute__((always_inline)) void fp4_tile_bf16(const uint16_t *xb, long r0, const long nr, long in,
                                                                const uint8_t *w, const void *scale, int scale_e8m0,
                                                                long o, const long no, float *y, long out,
                                                                const int folded) {
    const long groups = in / FP4_GROUP;
    __m512 acc[4][QUANT_ROW_TILE];
    for (long j = 0; j < no; j++)
        for (long t = 0; t < nr; t++) acc[j][t] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m512bh xv[QUANT_ROW_TILE];
        for (long t = 0; t < nr; t++)
            xv[t] = (__m512bh)_mm512_loadu_si512((const void *)(xb + (r0 + t) * in + g * FP4_GROUP));
        for (long j = 0; j < no; j++) {
            const size_t at = (size_t)(o + j) * groups + g;
            __m512i wi = fp4_bf16x32(w + at * (FP4_GROUP / 2));
            if (folded) {
                const int shift = ((int)((const uint8_t *)scale)[at] - 127) * 128;
                wi = _mm512_mask_add_epi16(wi, _mm512_test_epi16_mask(wi, _mm512_set1_epi16(0x7FFF)), wi,
                                           _mm512_set1_epi16((short)shift));
                for (long t = 0; t < nr; t++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], (__m512bh)wi, xv[t]);
            } else {
                const __m512 s = _mm512_set1_ps(scale_at(scale, scale_e8m0, at));
                for (long t = 0; t < nr; t++)
                    acc[j][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wi, xv[t]), s,
                                                acc[j][t]);
            }
        }
    }
    for (long t = 0; t < nr; t++) {
        float *yt = y + (r0 + t) * out + o;
        if (no == 4) _mm_storeu_ps(yt, reduce4_ps(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
        else *yt = _mm512_reduce_add_ps(acc[0][t]);
    }
}

#define FP4_TILES_BF16(no, folded)                                                                             \
    switch (rows - r0 < QUANT_ROW_TILE ? rows - r0 : QUANT_ROW_TILE) {                                       \
        case 1: fp4_tile_bf16(xb, r0, 1, in, w, scale, scale_e8m0, o, no, y, out, folded); break;            \
        case 2: fp4_tile_bf16(xb, r0, 2, in, w, scale, scale_e8m0, o, no, y, out, folded); break;            \
        case 3: fp4_tile_bf16(xb, r0, 3, in, w, scale, scale_e8m0, o, no, y, out, folded); break;            \
        default: fp4_tile_bf16(xb, r0, 4, in, w, scale, scale_e8m0, o, no, y, out, folded); break;           \
    }

#if defined(__AVX512VBMI__)
#define QUANT_FP8_BF16 1

/* e4m3 magnitudes (code & 0x7F) as bf16 bits, every one exact: low and high bytes. Normal codes are
 * their exponent and mantissa bits in bf16's places, the exponent rebased by +120; the subnormal ones
 * (magnitude 1..7: m * 2^-9) are normal bf16 numbers. */
static const uint8_t FP8_BF16_LO[128] = {
    0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0};
static const uint8_t FP8_BF16_HI[128] = {
    0x00, 0x3B, 0x3B, 0x3B, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C,
    0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D,
    0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E,
    0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43};

/* 64 e4m3 codes -> two registers of 32 bf16 weights (each the low 8 codes of every 16, then the high 8): each byte's bf16 low and high bytes by two 128-entry
 * byte look-ups on the magnitude (vpermi2b ignores the sign bit), the sign put back, the two interleaved */
static inline void fp8_bf16x64(const uint8_t *p, __m512i lo0, __m512i lo1, __m512i hi0, __m512i hi1, __m512i *a,
                               __m512i *b) {
    const __m512i codes = _mm512_loadu_si512((const void *)p);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, codes, hi1), codes,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* a | (b & c) */
    *a = _mm512_unpacklo_epi8(lo, hi), *b = _mm512_unpackhi_epi8(lo, hi);
}

/* the same for 32 codes (blocks of 32) into one register (the look-ups on 512-bit registers: the
 * 256-bit vpermi2b indexes 64 entries only) */
static inline __m512i fp8_bf16x32(const uint8_t *p, __m512i lo0, __m512i lo1, __m512i hi0, __m512i hi1) {
    const __m512i codes = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    const __m256i lo = _mm512_castsi512_si256(_mm512_permutex2var_epi8(lo0, codes, lo1));
    const __m256i hi = _mm512_castsi512_si256(_mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, codes, hi1),
                                                                        codes, _mm512_set1_epi8((char)0x80), 0xF8));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(lo, hi)), _mm256_unpackhi_epi8(lo, hi), 1);
}

/* fp8_tile_avx2 on AVX512-BF16 for bf16 activation rows `xb` (x_stride elements apart, read in place)
 * and `no` (1 or 4) output rows from o (o a multiple of 4 when no is 4 and the block a multiple of 32,
 * so the four rows share their scales' row), `chunk` codes at a time (64 where the block is a multiple
 * of 64, else 32): each chunk is decoded once into bf16 weights, the activations' 128-bit quarters put in
 * the same order (one shuffle per register of x, shared by the output rows), then one vdpbf16ps per 32
 * weights and row (exact products summed in pairs into 16 fp32 lanes); a block's sums times its scale
 * are added up in fp32, then the 16 lanes. While four rows are summed, the four rows 8 further on are
 * prefetched (short rows: too short for the hardware prefetchers). */
static inline __attribute__((always_inline)) void fp8_tile_bf16(const uint16_t *xb, long x_stride, long r0,
                                                                const long nr, long in,
                                                                const uint8_t *w, const void *scale, int scale_e8m0,
                                                                long block, const long chunk, long o, const long no,
                                                                float *y, long out) {
    const __m512i lo0 = _mm512_loadu_si512((const void *)FP8_BF16_LO);
    const __m512i lo1 = _mm512_loadu_si512((const void *)(FP8_BF16_LO + 64));
    const __m512i hi0 = _mm512_loadu_si512((const void *)FP8_BF16_HI);
    const __m512i hi1 = _mm512_loadu_si512((const void *)(FP8_BF16_HI + 64));
    const long blocks = in / block;
    const size_t scale_row = (size_t)(o / block) * blocks;
    const char *ahead = (const char *)(w + (size_t)(o + 8) * in);
    __m512 acc[4][QUANT_ROW_TILE];
    for (long j = 0; j < no; j++)
        for (long t = 0; t < nr; t++) acc[j][t] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512 part[4][QUANT_ROW_TILE];
        for (long j = 0; j < no; j++)
            for (long t = 0; t < nr; t++) part[j][t] = _mm512_setzero_ps();
        for (long i = b * block; i < (b + 1) * block; i += chunk) {
            if (no == 4)
                for (long line = 0; line < 4 * chunk; line += 64) _mm_prefetch(ahead + 4 * i + line, _MM_HINT_T0);
            /* x in the decoders' order: 64 codes -> {0-7, 16-23, 32-39, 48-55} and {8-15, 24-31, ...};
             * 32 -> {0-7, 16-23, 8-15, 24-31} (8 bf16 per 128-bit quarter) */
            __m512bh xa[QUANT_ROW_TILE], xz[QUANT_ROW_TILE];
            for (long t = 0; t < nr; t++) {
                const uint16_t *xt = xb + (size_t)(r0 + t) * x_stride + i;
                const __m512i x0 = _mm512_loadu_si512((const void *)xt);
                if (chunk == 64) {
                    const __m512i x1 = _mm512_loadu_si512((const void *)(xt + 32));
                    xa[t] = (__m512bh)_mm512_shuffle_i64x2(x0, x1, 0x88), xz[t] = (__m512bh)_mm512_shuffle_i64x2(x0, x1, 0xDD);
                } else {
                    xa[t] = (__m512bh)_mm512_shuffle_i64x2(x0, x0, 0xD8);
                }
            }
            for (long j = 0; j < no; j++) {
                const uint8_t *codes = w + (size_t)(o + j) * in + i;
                if (chunk == 64) {
                    __m512i wa, wz;
                    fp8_bf16x64(codes, lo0, lo1, hi0, hi1, &wa, &wz);
                    for (long t = 0; t < nr; t++) {
                        part[j][t] = _mm512_dpbf16_ps(part[j][t], (__m512bh)wa, xa[t]);
                        part[j][t] = _mm512_dpbf16_ps(part[j][t], (__m512bh)wz, xz[t]);
                    }
                } else {
                    const __m512i wv = fp8_bf16x32(codes, lo0, lo1, hi0, hi1);
                    for (long t = 0; t < nr; t++) part[j][t] = _mm512_dpbf16_ps(part[j][t], (__m512bh)wv, xa[t]);
                }
            }
        }
        const __m512 s = _mm512_set1_ps(scale_at(scale, scale_e8m0, scale_row + b));
        for (long j = 0; j < no; j++)
            for (long t = 0; t < nr; t++) acc[j][t] = _mm512_fmadd_ps(part[j][t], s, acc[j][t]);
    }
    for (long t = 0; t < nr; t++) {
        float *yt = y + (r0 + t) * out + o;
        if (no == 4) _mm_storeu_ps(yt, reduce4_ps(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
        else *yt = _mm512_reduce_add_ps(acc[0][t]);
    }
}

/* The chunk fp8_rows_bf16 decodes a weight of `block`s by (0: not one it takes, block not a multiple of 32) */
static inline long fp8_chunk(long block) { return block % 64 == 0 ? 64 : block % 32 == 0 ? 32 : 0; }

/* Output rows o .. o + no - 1 (`no` 1 or 4) of an FP8-block weight (block a multiple of 32 that tiles
 * `in`) against `rows` bf16 rows (x_stride elements apart): tiles of up to 2 rows with four output rows
 * (their accumulators fill the registers), of up to 4 with one */
static void fp8_rows_bf16(const uint16_t *xb, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                          int scale_e8m0, long block, long o, long no, float *y, long out) {
#define FP8_TILE(nr, no, chunk) fp8_tile_bf16(xb, x_stride, r0, nr, in, w, scale, scale_e8m0, block, chunk, o, no, y, out)
#define FP8_TILES(chunk)                                                                                  \
    if (no == 4) {                                                                                        \
        for (; r0 + 2 <= rows; r0 += 2) FP8_TILE(2, 4, chunk);                                            \
        if (r0 < rows) FP8_TILE(1, 4, chunk);                                                             \
    } else {                                                                                              \
        for (; r0 < rows; r0 += QUANT_ROW_TILE) {                                                         \
            switch (rows - r0 < QUANT_ROW_TILE ? rows - r0 : QUANT_ROW_TILE) {                            \
                case 1: FP8_TILE(1, 1, chunk); break;                                                     \
                case 2: FP8_TILE(2, 1, chunk); break;                                                     \
                case 3: FP8_TILE(3, 1, chunk); break;                                                     \
                default: FP8_TILE(4, 1, chunk); break;                                                    \
            }                                                                                             \
        }                                                                                                 \
    }
    long r0 = 0;
    if (fp8_chunk(block) == 64) {
        FP8_TILES(64)
    } else {
        FP8_TILES(32)
    }
#undef FP8_TILES
#undef FP8_TILE
}
#endif

/* Output rows o .. o + no - 1 (`no` 1 or 4) of an FP4 weight against `rows` bf16 rows in fp4_lane_order */
static void fp4_rows_bf16(const uint16_t *xb, long rows, long in, const uint8_t *w, const void *scale,
                          int scale_e8m0, long o, long no, float *y, long out) {
    const long groups = in / FP4_GROUP;
    int folded = scale_e8m0;
    if (folded) { /* branch-free: the compiler vectorises it */
        const uint8_t *s = (const uint8_t *)scale;
        for (long i = o * groups; i < (o + no) * groups; i++) folded &= (uint8_t)(s[i] - 2) <= 250;
    }
    for (long r0 = 0; r0 < rows; r0 += QUANT_ROW_TILE) {
        if (no == 4) {
            if (folded) FP4_TILES_BF16(4, 1) else FP4_TILES_BF16(4, 0)
        } else {
            if (folded) FP4_TILES_BF16(1, 1) else FP4_TILES_BF16(1, 0)
        }
    }
}
#endif

/* Output row `o` of an FP4 (`fp4`) or FP8-block weight against `rows` rows: the AVX2 loops unless
 * `portable` (1 forces the plain C ones) or the FP8 blocks are not whole multiples of 8 inputs (the
 * AVX2 loop reads whole blocks of 8). FP4: `in` a multiple of 32 (the bindings check). */
static inline void quant_rows(int fp4, int portable, const float *xf, long rows, long in, const uint8_t *w,
                              const void *scale, int scale_e8m0, long block, long o, float *y, long out) {
#ifdef QUANT_AVX2
    if (!portable && (fp4 || (in % block == 0 && block % 8 == 0))) {
        if (fp4) fp4_rows_avx2(xf, rows, in, w, scale, scale_e8m0, o, y, out);
        else fp8_rows_avx2(xf, rows, in, w, scale, scale_e8m0, block, o, y, out);
        return;
    }
#endif
    (void)portable;
    if (fp4) fp4_rows_portable(xf, rows, in, w, scale, scale_e8m0, o, y, out);
    else fp8_rows_portable(xf, rows, in, w, scale, scale_e8m0, block, o, y, out);
}

#endif
