/* The attention sub-layer of a decode step in two calls (bf16):
 * - attention_projections_bf16 (the interface's attention_projections): the fused input projection,
 *   the query's low-rank norm, the fused query projection, the norms and rotaries of the query heads and
 *   the key, and the indexer query's rotary;
 * - attention_output_bf16 (decode_attention_output): each query's own key into the window ring, the
 *   sink attention over the ring rows and the compressed entries read in place, the inverse rotary, the
 *   grouped output projection wo_a and the output projection wo_b.
 * (the compressors and the indexer's top-k run between them, as before). Each stage is the kernel the
 * composed path calls (attention.c, norm_rope.c, gemv.c, packed_gemm.c), with its roundings to bf16
 * between them, so the results are the composed path's bits; what the calls save is the Python between
 * them (ten wrapper calls and ~20 torch ops per layer). */
#include "common.h"

/* the stages, defined in the other C files of the library */
int sink_attention_rows(const void *q, const void *cache0, const long *rows0, const uint8_t *mask0, long n0,
                        long L0, const void *cache1, const long *rows1, const uint8_t *mask1, long n1, long L1,
                        const float *sinks, float scale, void *out, long B, long S, long H, long d, int dtype,
                        int num_threads);
void rms_norm(const void *x, long x_row_stride, const void *w, int w_dtype, void *out, long rows, long D,
              float eps, int dtype, int num_threads);
void rms_norm_rotary(const void *x, long x_row_stride, const void *w, int w_dtype, const float *cos_t,
                     const float *sin_t, void *out, long T, long M, long d, long half, float eps, int dtype,
                     int num_threads);
void rotary(const void *x, long x_stride_t, long x_stride_m, const float *cos_t, const float *sin_t, void *out,
            long T, long M, long d, long half, int inverse, int dtype, int num_threads);
void gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, long N, long K, int num_threads);
void grouped_gemv_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, long G, long N, long K, int num_threads);
void packed_gemm_bf16(const uint16_t *P, const uint16_t *X, uint16_t *Y, long M, long N, long K, int num_threads);

/* Y [T, N] = X [T, K] W^T on W's packed copy P, or for one token on W itself (the GEMV) */
static void product(const uint16_t *W, const uint16_t *P, const uint16_t *X, uint16_t *Y, long T, long N, long K,
                    int num_threads) {
    if (P)
        packed_gemm_bf16(P, X, Y, T, N, K, num_threads);
    else
        gemv_bf16(W, X, Y, N, K, num_threads);
}

/* x [T, D]; fused_x [Nx, D] (or its packed copy pfx), fused_qr [Nqr, rank] (or pfqr); q_norm, kv_norm
 * [rank], [d] of dtype code qn_dtype, kv_dtype; cos/sin [T, half], icos/isin [T, ihalf] fp32 (Hi = 0: no
 * indexer query). Out: px [T, Nx], q [T, H, d], kv [T, d], iq [T, Hi, (Nqr - H d) / Hi], all bf16. */
void attention_projections_bf16(const uint16_t *x, long T, long D, const uint16_t *fused_x, const uint16_t *pfx,
                                long Nx, long rank, const void *q_norm, int qn_dtype, const uint16_t *fused_qr,
                                const uint16_t *pfqr, long Nqr, long H, long d, const void *kv_norm, int kv_dtype,
                                float eps, const float *cos_t, const float *sin_t, long half, long Hi,
                                const float *icos, const float *isin, long ihalf, uint16_t *px, uint16_t *q,
                                uint16_t *kv, uint16_t *iq, int num_threads) {
    uint16_t *qr = malloc((size_t)T * rank * 2), *pqr = malloc((size_t)T * Nqr * 2);
    product(fused_x, pfx, x, px, T, Nx, D, num_threads);
    rms_norm(px, Nx, q_norm, qn_dtype, qr, T, rank, eps, DT_BF16, num_threads);
    product(fused_qr, pfqr, qr, pqr, T, Nqr, rank, num_threads);
    for (long t = 0; t < T; t++) /* a token's heads are evenly spaced rows; the tokens are Nqr apart */
        rms_norm_rotary(pqr + t * Nqr, d, NULL, 0, cos_t + t * half, sin_t + t * half, q + t * H * d, 1, H, d, half,
                        eps, DT_BF16, num_threads);
    rms_norm_rotary(px + rank, Nx, kv_norm, kv_dtype, cos_t, sin_t, kv, T, 1, d, half, eps, DT_BF16, num_threads);
    if (Hi) {
        const long di = (Nqr - H * d) / Hi;
        rotary(pqr + H * d, Nqr, di, icos, isin, iq, T, Hi, di, ihalf, 0, DT_BF16, num_threads);
    }
    free(pqr);
    free(qr);
}

/* q [B, H, d], kv [B, d] (the queries' own keys), window [n0, d] (written at key_rows [B]); the key
 * parts as sink_attention_rows takes them (S = 1); cos/sin [B, half] fp32. wo_a [G, R, K] (K = H d / G):
 * packed per group (pwo_a, pack_bf16 of each group, pa_size elements apart) or, for one token, plain
 * (grouped_gemv_bf16). wo_b [D, G R]: packed (pwo_b) or, for one token, plain (gemv_bf16). out [B, D].
 * Returns 0; -1 (nothing written) for a key row outside the window; -2 (the keys written, as the
 * composed path leaves them) for a key part's row outside its cache. */
int attention_output_bf16(const uint16_t *q, const uint16_t *kv, uint16_t *window, long n0, const long *key_rows,
                          const long *rows0, const uint8_t *mask0, long L0, const uint16_t *cache1, const long *rows1,
                          const uint8_t *mask1, long n1, long L1, const float *sinks, float scale, const float *cos_t,
                          const float *sin_t, long half, const uint16_t *wo_a, const uint16_t *pwo_a, long pa_size,
                          long G, long R, const uint16_t *wo_b, const uint16_t *pwo_b, long D, uint16_t *out, long B,
                          long H, long d, int num_threads) {
    for (long b = 0; b < B; b++)
        if (key_rows[b] < 0 || key_rows[b] >= n0) return -1;
    for (long b = 0; b < B; b++) memcpy(window + (size_t)key_rows[b] * d, kv + (size_t)b * d, (size_t)d * 2);
    const long K = H * d / G;
    uint16_t *att = malloc((size_t)B * H * d * 2), *rot = malloc((size_t)B * H * d * 2);
    uint16_t *grouped = malloc((size_t)B * G * R * 2);
    int status = sink_attention_rows(q, window, rows0, mask0, n0, L0, cache1, rows1, mask1, n1, L1, sinks, scale, att,
                                     B, 1, H, d, DT_BF16, num_threads);
    if (status == 0) {
        rotary(att, H * d, d, cos_t, sin_t, rot, B, H, d, half, 1, DT_BF16, num_threads);
        if (pwo_a) { /* one packed product per group, its rows gathered as the composed path's x[:, g] */
            uint16_t *xg = malloc((size_t)B * K * 2), *yg = malloc((size_t)B * R * 2);
            for (long g = 0; g < G; g++) {
                for (long b = 0; b < B; b++) memcpy(xg + b * K, rot + (b * G + g) * K, (size_t)K * 2);
                packed_gemm_bf16(pwo_a + (size_t)g * pa_size, xg, yg, B, R, K, num_threads);
                for (long b = 0; b < B; b++) memcpy(grouped + (b * G + g) * R, yg + b * R, (size_t)R * 2);
            }
            free(yg);
            free(xg);
        } else {
            grouped_gemv_bf16(wo_a, rot, grouped, G, R, K, num_threads);
        }
        product(wo_b, pwo_b, grouped, out, B, D, G * R, num_threads);
    }
    free(grouped);
    free(rot);
    free(att);
    return status ? -2 : 0;
}
