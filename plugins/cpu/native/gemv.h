/* The bf16 product building blocks shared by gemv.c (GEMV, grouped projections, AMX linears) and
 * experts.c: four-row dot products (AVX512-BF16 or portable) and the AMX tile products. */
#ifndef DEEPINFER_CPU_NATIVE_GEMV_H
#define DEEPINFER_CPU_NATIVE_GEMV_H

#include "common.h"

/* gemv.c: the CPU has AMX, this build uses it, and Linux granted this process the tile state */
int amx_usable(void);

/* ----- gemv_bf16: y = W x for one token; W [N, K] bf16 row-major, x [K] bf16, y [N] bf16 -----
 * Decode is weight-streaming bound: four weight rows per step share each load of x, with
 * independent accumulators, and rows are split over the threads. Three tiers, picked at compile
 * time (the library is built for the CPU it runs on, build.py):
 * - AVX512-BF16: each instruction multiplies 32 bf16 pairs exactly into fp32 sums;
 * - AVX2 + FMA: x is widened to fp32 once per token in "lane order" (each 16-element block as its 8
 *   even elements, then its 8 odd ones), so a 256-bit load of 16 bf16 weights becomes two fp32
 *   vectors by one shift (the even elements) and one mask (the odd ones), no cross-lane shuffles;
 * - elsewhere x is widened to fp32 in plain order and the compiler vectorises the fp32 dot products.
 * gemv_widen_x writes the fp32 x that gemv_rows reads (nothing with AVX512-BF16, which reads x).
 * Results are rounded to bf16 once, like torch.
 * Four rows of a few hundred elements are four short streams inside one or two pages, too short for
 * the hardware prefetchers to pick up (measured: ~5 GB/s from memory on one core): while a block of
 * four rows is summed, the block GEMV_PREFETCH_ROWS rows further on is prefetched as one sequential
 * range, the bytes in step with the bytes consumed (prefetches never fault, past the end included). */
#define GEMV_PREFETCH_ROWS 8

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define GEMV_TIER "avx512-bf16"

static void gemv_widen_x(const uint16_t *restrict x, float *restrict xf, long K) { (void)x, (void)xf, (void)K; }

static inline float dot_bf16(const uint16_t *restrict w, const uint16_t *restrict x, long K) {
    __m512 acc = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                               (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
    float s = _mm512_reduce_add_ps(acc);
    for (; k < K; k++) s += bf16_to_float(w[k]) * bf16_to_float(x[k]);
    return s;
}

static void gemv_rows(const uint16_t *restrict W, const uint16_t *restrict x, const float *restrict xf,
                      uint16_t *restrict y, long n0, long n1, long K) {
    (void)xf;
    long n = n0;
    for (; n + 4 <= n1 && K % 32 == 0; n += 4) {
        const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        const char *ahead = (const char *)(W + (n + GEMV_PREFETCH_ROWS) * K);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long k = 0; k < K; k += 32) {
            for (int line = 0; line < 256; line += 64) _mm_prefetch(ahead + k * 8 + line, _MM_HINT_T0);
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w0 + k)), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w1 + k)), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(w2 + k)), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(w3 + k)), xv);
        }
        y[n] = float_to_bf16(_mm512_reduce_add_ps(a0));
        y[n + 1] = float_to_bf16(_mm512_reduce_add_ps(a1));
        y[n + 2] = float_to_bf16(_mm512_reduce_add_ps(a2));
        y[n + 3] = float_to_bf16(_mm512_reduce_add_ps(a3));
    }
    for (; n < n1; n++) y[n] = float_to_bf16(dot_bf16(W + n * K, x, K));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define GEMV_TIER "avx2-fma"

static void gemv_widen_x(const uint16_t *restrict x, float *restrict xf, long K) {
    long k = 0;
    for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 8; i++) {
            xf[k + i] = bf16_to_float(x[k + 2 * i]);
            xf[k + 8 + i] = bf16_to_float(x[k + 2 * i + 1]);
        }
    for (; k < K; k++) xf[k] = bf16_to_float(x[k]);
}

/* 16 bf16 weights -> their even and odd elements as fp32 (little-endian: element 2i is the low half
 * of 32-bit lane i) */
static inline __m256 bf16_even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 bf16_odd(__m256i w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define GEMV_STEP(w, e, o)                                                        \
    do {                                                                          \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)((w) + k));        \
        e = _mm256_fmadd_ps(bf16_even(wv), xe, e);                                \
        o = _mm256_fmadd_ps(bf16_odd(wv), xo, o);                                 \
    } while (0)

static inline float gemv_tail(const uint16_t *restrict w, const float *restrict xf, long k, long K) {
    float s = 0.0f;
    for (; k < K; k++) s += bf16_to_float(w[k]) * xf[k];
    return s;
}

static void gemv_rows(const uint16_t *restrict W, const uint16_t *restrict x, const float *restrict xf,
                      uint16_t *restrict y, long n0, long n1, long K) {
    (void)x;
    const long K16 = K & ~15L;
    long n = n0;
    for (; n + 4 <= n1; n += 4) {
        const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        const char *ahead = (const char *)(W + (n + GEMV_PREFETCH_ROWS) * K);
        __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
        for (long k = 0; k < K16; k += 16) {
            _mm_prefetch(ahead + k * 8, _MM_HINT_T0);
            _mm_prefetch(ahead + k * 8 + 64, _MM_HINT_T0);
            const __m256 xe = _mm256_loadu_ps(xf + k), xo = _mm256_loadu_ps(xf + k + 8);
            GEMV_STEP(w0, e0, o0);
            GEMV_STEP(w1, e1, o1);
            GEMV_STEP(w2, e2, o2);
            GEMV_STEP(w3, e3, o3);
        }
        y[n] = float_to_bf16(hsum256(_mm256_add_ps(e0, o0)) + gemv_tail(w0, xf, K16, K));
        y[n + 1] = float_to_bf16(hsum256(_mm256_add_ps(e1, o1)) + gemv_tail(w1, xf, K16, K));
        y[n + 2] = float_to_bf16(hsum256(_mm256_add_ps(e2, o2)) + gemv_tail(w2, xf, K16, K));
        y[n + 3] = float_to_bf16(hsum256(_mm256_add_ps(e3, o3)) + gemv_tail(w3, xf, K16, K));
    }
    for (; n < n1; n++) {
        const uint16_t *w0 = W + n * K;
        __m256 e0 = _mm256_setzero_ps(), o0 = e0;
        for (long k = 0; k < K16; k += 16) {
            const __m256 xe = _mm256_loadu_ps(xf + k), xo = _mm256_loadu_ps(xf + k + 8);
            GEMV_STEP(w0, e0, o0);
        }
        y[n] = float_to_bf16(hsum256(_mm256_add_ps(e0, o0)) + gemv_tail(w0, xf, K16, K));
    }
}
#undef GEMV_STEP

#else

#define GEMV_TIER "portable"

static void gemv_widen_x(const uint16_t *restrict x, float *restrict xf, long K) { load_row(x, DT_BF16, xf, K); }

static void gemv_rows(const uint16_t *restrict W, const uint16_t *restrict x, const float *restrict xf,
                      uint16_t *restrict y, long n0, long n1, long K) {
    (void)x;
    for (long n = n0; n < n1; n++) {
        const uint16_t *restrict w = W + n * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (long k = 0; k < K; k++) s += bf16_to_float(w[k]) * xf[k];
        y[n] = float_to_bf16(s);
    }
}

#endif

/* gemv_rows for m tokens (X [m, K], Y rows ldy apart), one token after another: the weight rows stay
 * in L1/L2 between tokens. */
static void gemv_rows_tokens(const uint16_t *restrict W, const uint16_t *restrict X, const float *restrict Xf,
                             uint16_t *restrict Y, long ldy, long m, long n0, long n1, long K) {
    for (long t = 0; t < m; t++) gemv_rows(W, X + t * K, Xf + t * K, Y + t * ldy, n0, n1, K);
}

/* ----- AMX (Intel Advanced Matrix Extensions) for the expert products, where the CPU has it -----
 * A tile multiply-add takes 16 weight rows x 32 k-values against 32 k-values x 16 tokens, so the
 * vector units no longer bound decode batches of several tokens per expert; the weights are read
 * straight from their [N, K] layout, the tokens are repacked into AMX's pair-interleaved layout.
 * Linux hands out the AMX register state on request (arch_prctl); without it, or without AMX,
 * amx_usable() is 0 and the dot-product path runs. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_REQUEST_PERMISSION 0x1023 /* ARCH_REQ_XCOMP_PERM */
#define AMX_TILE_DATA 18              /* XFEATURE_XTILEDATA */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_tile_config;

/* tiles 0-1: fp32 results (16 weight rows x 16 tokens); 4, 6: tokens; 5, 7: weights */
static void amx_configure(void) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) { config.rows[t] = 16; config.bytes_per_row[t] = 64; }
    _tile_loadconfig(&config);
}

static void amx_release(void) { _tile_release(); }

/* X [m <= 16, K] -> [K/2][16][2]: each 32-bit word a (k, k+1) pair of one token, zero past m */
static void amx_pack_tokens(const uint16_t *X, long m, long K, uint16_t *packed) {
    const int *x = (const int *)X;
    int *p = (int *)packed;
    /* word kk of the 16 tokens in one gather (stride K/2 words), lanes t >= m zero */
    const __m512i token = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)(K / 2)));
    const __mmask16 present = (__mmask16)((1u << m) - 1u);
    for (long kk = 0; kk < K / 2; kk++)
        _mm512_storeu_si512(p + kk * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, token, x + kk, 4));
}

/* Y[t, n0 .. n0+63] = W[n0 .. n0+63, :] . X[t, :] for the m tokens packed in `packed`: 16 weight
 * rows at a time (16 sequential streams for the prefetchers), even and odd k-steps in two result
 * tiles so consecutive tile products do not wait on each other */
static void amx_rows64(const uint16_t *W, long K, const uint16_t *packed, uint16_t *Y, long ldy, long m, long n0) {
    float C[2][16][16];
    for (long r0 = n0; r0 < n0 + 64; r0 += 16) {
        const uint16_t *w = W + r0 * K;
        _tile_zero(0);
        _tile_zero(1);
        long k = 0;
        for (; k + 64 <= K; k += 64) {
            _tile_loadd(4, packed + k * 16, 64);
            _tile_loadd(5, w + k, K * 2);
            _tile_loadd(6, packed + (k + 32) * 16, 64);
            _tile_loadd(7, w + k + 32, K * 2);
            _tile_dpbf16ps(0, 5, 4);
            _tile_dpbf16ps(1, 7, 6);
        }
        if (k < K) {
            _tile_loadd(4, packed + k * 16, 64);
            _tile_loadd(5, w + k, K * 2);
            _tile_dpbf16ps(0, 5, 4);
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        /* C[.][i][t] (weight row i, token t) -> Y[t][r0 + i]: a token's 16 values are a column of the
         * tiles, gathered (stride 16 floats), summed and rounded to bf16 sixteen at a time */
        const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(16));
        for (long t = 0; t < m; t++) {
            const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, &C[0][0][t], 4),
                                           _mm512_i32gather_ps(column, &C[1][0][t], 4));
            _mm256_storeu_si256((__m256i *)(Y + t * ldy + r0), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* expert_products on AMX: chunk c of 16 tokens of expert e is packed at packed + c * K * 16, the
 * expert's first chunk being first_chunk[e]; a work item is one expert's 64-row weight block,
 * applied to all its chunks while it sits in L2. Needs N % 64 == 0 and K % 32 == 0. */
static void expert_products_amx(const uint16_t *W, long N, long K, const long *active, long num_active,
                                const long *offsets, const long *first_chunk, long num_chunks, const uint16_t *X,
                                uint16_t *packed, uint16_t *Y, long ldy) {
#pragma omp for schedule(static)
    for (long c = 0; c < num_chunks; c++) {
        long e = 0;  /* the expert of chunk c (few experts: a linear search) */
        while (first_chunk[e + 1] <= c) e++;
        const long t0 = offsets[e] + (c - first_chunk[e]) * 16, m = offsets[e + 1] - t0 < 16 ? offsets[e + 1] - t0 : 16;
        amx_pack_tokens(X + t0 * K, m, K, packed + c * K * 16);
    }
    const long blocks = N / 64;
#pragma omp for schedule(static)
    for (long it = 0; it < num_active * blocks; it++) {
        const long e = active[it / blocks], n0 = (it % blocks) * 64;
        const uint16_t *We = W + (size_t)e * N * K;
        for (long c = first_chunk[e]; c < first_chunk[e + 1]; c++) {
            const long t0 = offsets[e] + (c - first_chunk[e]) * 16;
            const long m = offsets[e + 1] - t0 < 16 ? offsets[e + 1] - t0 : 16;
            amx_rows64(We, K, packed + c * K * 16, Y + t0 * ldy, ldy, m, n0);
        }
    }
}

#else
/* Without AMX at build time: amx_usable() is 0, and every caller checks it before using these. */
static void amx_configure(void) {}
static void amx_release(void) {}
static void expert_products_amx(const uint16_t *W, long N, long K, const long *active, long num_active,
                                const long *offsets, const long *first_chunk, long num_chunks, const uint16_t *X,
                                uint16_t *packed, uint16_t *Y, long ldy) {
    (void)W, (void)N, (void)K, (void)active, (void)num_active, (void)offsets, (void)first_chunk, (void)num_chunks;
    (void)X, (void)packed, (void)Y, (void)ldy;
    abort();
}
#endif

#endif
