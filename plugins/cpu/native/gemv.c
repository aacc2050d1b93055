/* The bf16 decode products: gemv_bf16, gemv_tokens_bf16, grouped_gemv_bf16, grouped_amx_bf16 (and amx_usable); the
 * batch-invariant product linear_rows. */
#include "gemv.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
int amx_usable(void) {
    static int state = -1; /* asked once per process, from the calling (main) thread */
    if (state < 0) state = syscall(SYS_arch_prctl, AMX_REQUEST_PERMISSION, AMX_TILE_DATA) == 0;
    return state;
}
#else
int amx_usable(void) { return 0; }
#endif

/* which gemv_rows this build runs (gemv.h): "avx512-bf16", "avx2-fma" or "portable" */
const char *gemv_tier(void) { return GEMV_TIER; }

void gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, long N, long K, int num_threads) {
    float *xf = malloc((size_t)K * sizeof(float));
    gemv_widen_x(x, xf, K);
    const long blocks = (N + 15) / 16;  /* 16-row blocks: whole cache lines of y per thread */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K > PARALLEL_MIN_WORK)
    for (long b = 0; b < blocks; b++) {
        const long n0 = b * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        gemv_rows(W, x, xf, y, n0, n1, K);
    }
    free(xf);
}

/* ----- gemv_tokens_bf16: Y [m, N] = X [m, K] W [N, K]^T for a few tokens (a decode batch) -----
 * Each block of 16 weight rows is read from memory once and applied to every token while it sits in
 * L1/L2 (gemv_rows_tokens): the weights stream once per step whatever m. */
void gemv_tokens_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, long m, long N, long K, int num_threads) {
    float *xf = malloc((size_t)m * K * sizeof(float));
    for (long t = 0; t < m; t++) gemv_widen_x(X + (size_t)t * K, xf + (size_t)t * K, K);
    const long blocks = (N + 15) / 16;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * N * K > PARALLEL_MIN_WORK)
    for (long b = 0; b < blocks; b++) {
        const long n0 = b * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        gemv_rows_tokens(W, X, xf, Y, N, m, n0, n1, K);
    }
    free(xf);
}

/* ----- grouped_gemv_bf16: Y[g] = W[g] X[g] for one token; W [G, N, K], X [G, K], Y [G, N] bf16 -----
 * The attention output's grouped projection at decode: the G GEMVs as one parallel loop. */

void grouped_gemv_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, long G, long N, long K, int num_threads) {
    float *xf = malloc((size_t)G * K * sizeof(float));
    for (long g = 0; g < G; g++) gemv_widen_x(X + (size_t)g * K, xf + (size_t)g * K, K);
    const long blocks = (N + 15) / 16;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (G * N * K > PARALLEL_MIN_WORK)
    for (long it = 0; it < G * blocks; it++) {
        const long g = it / blocks, n0 = (it % blocks) * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        gemv_rows(W + (size_t)g * N * K, X + (size_t)g * K, xf + (size_t)g * K, Y + (size_t)g * N, n0, n1, K);
    }
    free(xf);
}

/* grouped_amx_bf16: Y[g] = X[g] W[g]^T for G groups of T tokens (X [G, T, K], W [G, N, K],
 * Y [G, T, N]; N % 64 == 0, K % 32 == 0), each group an "expert" of the AMX products above: the
 * attention output's grouped projection of a decode batch, and (G = 1) a decode batch's linear. */
void grouped_amx_bf16(const uint16_t *W, long G, long N, long K, const uint16_t *X, long T, uint16_t *Y,
                      int num_threads) {
    long *offsets = malloc((size_t)(G + 1) * sizeof(long)), *first_chunk = malloc((size_t)(G + 1) * sizeof(long));
    long *groups = malloc((size_t)G * sizeof(long));
    const long chunks = (T + 15) / 16;
    for (long g = 0; g <= G; g++) { offsets[g] = g * T; first_chunk[g] = g * chunks; }
    for (long g = 0; g < G; g++) groups[g] = g;
    uint16_t *packed = aligned_alloc(64, (size_t)G * chunks * K * 16 * sizeof(uint16_t) + 64);
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure();
        expert_products_amx(W, N, K, groups, G, offsets, first_chunk, G * chunks, X, packed, Y, N);
        amx_release();
    }
    free(packed);
    free(groups);
    free(first_chunk);
    free(offsets);
}

/* ----- linear_rows: the batch-invariant product (the batch_invariant feature) -----
 * Y [M, N] (y_dtype) = X [M, K] (x_dtype) W [N, K]^T (w_dtype), every output a dot product of fixed
 * order over K: 8 fp32 lanes, lane i holding the k = i mod 8 terms in increasing k, the lanes summed
 * in a fixed tree, then the tail. Explicit vector types and unaligned loads, so no alignment peeling
 * shifts the lanes with a row's address: one row or a thousand, decode or prefill, any thread count,
 * a row's outputs have the same bits. */
#define INV_LANES 8
typedef float lanes8 __attribute__((vector_size(INV_LANES * sizeof(float))));

static inline float dot_fixed(const float *restrict a, const float *restrict b, long K) {
    lanes8 acc = {0};
    long k = 0;
    for (; k + INV_LANES <= K; k += INV_LANES) {
        lanes8 va, vb;
        memcpy(&va, a + k, sizeof va);
        memcpy(&vb, b + k, sizeof vb);
        acc += va * vb;
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; k < K; k++) s += a[k] * b[k];
    return s;
}

/* Blocks of 16 weight rows are widened to fp32 once and applied to every token while they sit in
 * cache; the blocks are split over the threads (each output is computed by one thread, always by the
 * same code). */
void linear_rows(const void *W, int w_dtype, const void *X, int x_dtype, void *Y, int y_dtype, long M, long N,
                 long K, int num_threads) {
    const size_t wes = elem_size(w_dtype), xes = elem_size(x_dtype), yes = elem_size(y_dtype);
    float *xf = malloc((size_t)M * K * sizeof(float));
    const long blocks = (N + 15) / 16;
#pragma omp parallel num_threads(num_threads) if (M * N * K > PARALLEL_MIN_WORK)
    {
        float *wf = malloc((size_t)16 * K * sizeof(float));
        float *y = malloc((size_t)16 * sizeof(float));
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) load_row((const char *)X + (size_t)m * K * xes, x_dtype, xf + (size_t)m * K, K);
#pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            const long n0 = b * 16, nb = N - n0 < 16 ? N - n0 : 16;
            for (long r = 0; r < nb; r++)
                load_row((const char *)W + (size_t)(n0 + r) * K * wes, w_dtype, wf + (size_t)r * K, K);
            for (long m = 0; m < M; m++) {
                const float *x = xf + (size_t)m * K;
                for (long r = 0; r < nb; r++) y[r] = dot_fixed(wf + (size_t)r * K, x, K);
                store_row(y, (char *)Y + ((size_t)m * N + n0) * yes, y_dtype, nb);
            }
        }
        free(y);
        free(wf);
    }
    free(xf);
}
