/* The bf16 product building blocks shared by gemv.c (GEMV, grouped projections, AMX linears) and
 * experts.c: four-row dot products (AVX512-BF16 or portable) and the AMX tile products. */
#ifndef DEEPINFER_CPU_NATIVE_GEMV_H
#define DEEPINFER_CPU_NATIVE_GEMV_H

#include "common.h"

/* gemv.c: the CPU has AMX, this build uses it, and Linux granted this process the tile state */
int amx_usable(void);

/* ----- gemv_bf16: y = W x for one token; W [N, K] bf16 row-major, x [K] bf16, y [N] bf16 -----
 * Decode is weight-streaming bound: four weight rows per step share each load of x, with four
 * independent accumulators, and rows are split over the threads. With AVX512-BF16 each instruction
 * multiplies 32 bf16 pairs exactly into fp32 sums; elsewhere x is widened to fp32 once and the
 * compiler vectorises the fp32 dot products. Results are rounded to bf16 once, like torch. */

#if defined(__AVX512BF16__)
#include <immintrin.h>

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
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long k = 0; k < K; k += 32) {
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

#else
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
