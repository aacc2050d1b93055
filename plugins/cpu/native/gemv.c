/* The bf16 decode products: gemv_bf16, grouped_gemv_bf16, grouped_amx_bf16 (and amx_usable). */
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

void gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, long N, long K, int num_threads) {
    float *xf = malloc((size_t)K * sizeof(float));
    load_row(x, DT_BF16, xf, K);
    const long blocks = (N + 15) / 16;  /* 16-row blocks: whole cache lines of y per thread */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K > PARALLEL_MIN_WORK)
    for (long b = 0; b < blocks; b++) {
        const long n0 = b * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        gemv_rows(W, x, xf, y, n0, n1, K);
    }
    free(xf);
}

/* ----- grouped_gemv_bf16: Y[g] = W[g] X[g] for one token; W [G, N, K], X [G, K], Y [G, N] bf16 -----
 * The attention output's grouped projection at decode: the G GEMVs as one parallel loop. */

void grouped_gemv_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, long G, long N, long K, int num_threads) {
    float *xf = malloc((size_t)G * K * sizeof(float));
    load_row(X, DT_BF16, xf, G * K);
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
