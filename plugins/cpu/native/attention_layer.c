/* The attention sub-layer of a decode step in two calls:
 * - attention_projections (the interface's attention_projections): the fused input projection, the
 *   query's low-rank norm, the fused query projection, the norms and rotaries of the query heads and the
 *   key, and the indexer query's rotary;
 * - attention_output (decode_attention_output): each query's own key into the window ring, the sink
 *   attention over the ring rows and the compressed entries read in place, the inverse rotary, the
 *   grouped output projection wo_a and the output projection wo_b.
 * (the compressors and the indexer's top-k run between them, as before). Each stage is the kernel the
 * composed path calls (attention.c, norm_rope.c, gemv.c, packed_gemm.c), with its roundings to bf16
 * between them, so the results are the composed path's bits; what the calls save is the Python between
 * them (ten wrapper calls and ~20 torch ops per layer). Each of the four weights is bf16 or kept as
 * FP8-block or FP4 codes (weight_ref): such a product is quant_gemv.c's, rounded to bf16 as the composed
 * linear / grouped_linear round it.
 * DeepSeek-V4.1 runs them too: without the query heads' norm (`q_head_norm` 0), and with `coded_keys` 1,
 * its caches as it stores them (kv_codes.h): the own keys written as FP8 window codes, the window and
 * the compressed entries (NVFP4) read through sink_attention_coded_rows. */
#include "common.h"
#include "kv_codes.h"

/* the stages, defined in the other C files of the library */
int sink_attention_coded_rows(const void *q, const void *cache0, const long *rows0, const uint8_t *mask0, long n0,
                              long L0, int code0, const void *cache1, const long *rows1, const uint8_t *mask1,
                              long n1, long L1, int code1, const float *sinks, float scale, void *out, long B, long S,
                              long H, long d, int dtype, int num_threads);
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
void fp4_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long out, void *y, int y_dtype, int portable, int num_threads);
void fp8_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long block, long out, void *y, int y_dtype, int portable, int num_threads);
void quant_grouped_linear(int fp4, const void *x, int x_dtype, long rows, long G, long in, const uint8_t *w,
                          const void *scale, long scale_group, int scale_e8m0, long block, long out, void *y,
                          int y_dtype, int num_threads);

/* A weight of the sub-layer's products: bf16 (`w`, or its packed copy `packed` where not NULL) or the
 * codes `w` of an FP8-block / FP4 weight as stored with their `scale` (ue8m0 bytes or fp32); the
 * calls take it by pointer (attention_layer.py's WeightRef, the same fields) */
enum { W_BF16 = 0, W_FP8 = 1, W_FP4 = 2 };
typedef struct {
    int format;
    const void *w;
    const uint16_t *packed;
    const void *scale;
    int scale_e8m0;
    long block;
} weight_ref;

#define FP4_SCALE_GROUP 32 /* FP4 weights per scale (quant.h's FP4_GROUP) */

/* Y [T, N] = X [T, K] W^T rounded to bf16: on the codes (quant_gemv.c), on W's packed copy, or for one
 * token on W itself (the GEMV) */
static void product(const weight_ref *W, const uint16_t *X, uint16_t *Y, long T, long N, long K, int num_threads) {
    if (W->format == W_FP8)
        fp8_linear(X, DT_BF16, K, T, K, W->w, W->scale, W->scale_e8m0, W->block, N, Y, DT_BF16, 0, num_threads);
    else if (W->format == W_FP4)
        fp4_linear(X, DT_BF16, K, T, K, W->w, W->scale, W->scale_e8m0, N, Y, DT_BF16, 0, num_threads);
    else if (W->packed)
        packed_gemm_bf16(W->packed, X, Y, T, N, K, num_threads);
    else
        gemv_bf16(W->w, X, Y, N, K, num_threads);
}

/* grouped [B, G, R] = the products of rot [B, G, K] by wo_a [G, R, K] group by group: on the codes (one
 * quant_grouped_linear), on the packed copy of each group (`pa_size` elements apart), or for one token
 * on wo_a itself (grouped_gemv_bf16) */
static void grouped_product(const weight_ref *A, long pa_size, const uint16_t *rot, uint16_t *grouped, long B,
                            long G, long R, long K, int num_threads) {
    if (A->format != W_BF16) {
        const int fp4 = A->format == W_FP4;
        const long scale_group = fp4 ? R * (K / FP4_SCALE_GROUP)
                                     : ((R + A->block - 1) / A->block) * ((K + A->block - 1) / A->block);
        quant_grouped_linear(fp4, rot, DT_BF16, B, G, K, A->w, A->scale, scale_group, A->scale_e8m0, A->block, R,
                             grouped, DT_BF16, num_threads);
    } else if (A->packed) { /* one packed product per group, its rows gathered as the composed path's x[:, g] */
        uint16_t *xg = malloc((size_t)B * K * 2), *yg = malloc((size_t)B * R * 2);
        for (long g = 0; g < G; g++) {
            for (long b = 0; b < B; b++) memcpy(xg + b * K, rot + (b * G + g) * K, (size_t)K * 2);
            packed_gemm_bf16(A->packed + (size_t)g * pa_size, xg, yg, B, R, K, num_threads);
            for (long b = 0; b < B; b++) memcpy(grouped + (b * G + g) * R, yg + b * R, (size_t)R * 2);
        }
        free(yg);
        free(xg);
    } else {
        grouped_gemv_bf16(A->w, rot, grouped, G, R, K, num_threads);
    }
}

/* x [T, D]; fused_x [Nx, D], fused_qr [Nqr, rank] (weight_ref); q_norm, kv_norm [rank], [d] of dtype code
 * qn_dtype, kv_dtype; cos/sin [T, half], icos/isin [T, ihalf] fp32 (Hi = 0: no indexer query). Out: px
 * [T, Nx], q [T, H, d], kv [T, d], iq [T, Hi, (Nqr - H d) / Hi], all bf16. */
void attention_projections(const uint16_t *x, long T, long D, const weight_ref *fx, long Nx, long rank,
                           const void *q_norm, int qn_dtype, const weight_ref *fqr, long Nqr, long H, long d,
                           int q_head_norm, const void *kv_norm, int kv_dtype, float eps, const float *cos_t,
                           const float *sin_t, long half, long Hi, const float *icos, const float *isin, long ihalf,
                           uint16_t *px, uint16_t *q, uint16_t *kv, uint16_t *iq, int num_threads) {
    uint16_t *qr = malloc((size_t)T * rank * 2), *pqr = malloc((size_t)T * Nqr * 2);
    product(fx, x, px, T, Nx, D, num_threads);
    rms_norm(px, Nx, q_norm, qn_dtype, qr, T, rank, eps, DT_BF16, num_threads);
    product(fqr, qr, pqr, T, Nqr, rank, num_threads);
    if (q_head_norm) {
        for (long t = 0; t < T; t++) /* a token's heads are evenly spaced rows; the tokens are Nqr apart */
            rms_norm_rotary(pqr + t * Nqr, d, NULL, 0, cos_t + t * half, sin_t + t * half, q + t * H * d, 1, H, d,
                            half, eps, DT_BF16, num_threads);
    } else {
        rotary(pqr, Nqr, d, cos_t, sin_t, q, T, H, d, half, 0, DT_BF16, num_threads);
    }
    rms_norm_rotary(px + rank, Nx, kv_norm, kv_dtype, cos_t, sin_t, kv, T, 1, d, half, eps, DT_BF16, num_threads);
    if (Hi) {
        const long di = (Nqr - H * d) / Hi;
        rotary(pqr + H * d, Nqr, di, icos, isin, iq, T, Hi, di, ihalf, 0, DT_BF16, num_threads);
    }
    free(pqr);
    free(qr);
}

/* q [B, H, d], kv [B, d] (the queries' own keys), window [n0, d] (written at key_rows [B]); the key
 * parts as sink_attention_rows takes them (S = 1); cos/sin [B, half] fp32. wo_a [G, R, K] (K = H d / G)
 * and wo_b [D, G R] as grouped_product and product take them (pa_size: the elements of one group's
 * packed copy). out [B, D]. With coded_keys the window holds FP8 window codes [n0, kv_row_bytes] (the
 * own keys encoded into it) and cache1 NVFP4 entries. Returns 0; -1 (nothing written) for a key row
 * outside the window; -2 (the keys written, as the composed path leaves them) for a key part's row
 * outside its cache. */
int attention_output(const uint16_t *q, const uint16_t *kv, void *window, long n0, const long *key_rows,
                     const long *rows0, const uint8_t *mask0, long L0, const void *cache1, const long *rows1,
                     const uint8_t *mask1, long n1, long L1, int coded_keys, const float *sinks, float scale,
                     const float *cos_t, const float *sin_t, long half, const weight_ref *wo_a, long pa_size, long G,
                     long R, const weight_ref *wo_b, long D, uint16_t *out, long B, long H, long d, int num_threads) {
    for (long b = 0; b < B; b++)
        if (key_rows[b] < 0 || key_rows[b] >= n0) return -1;
    if (coded_keys) {
        const long bytes = kv_row_bytes(KV_FP8, d);
        float *row = malloc((size_t)d * sizeof(float));
        for (long b = 0; b < B; b++) {
            load_row(kv + (size_t)b * d, DT_BF16, row, d);
            kv_encode_row(KV_FP8, row, d, (uint8_t *)window + (size_t)key_rows[b] * bytes);
        }
        free(row);
    } else {
        for (long b = 0; b < B; b++)
            memcpy((uint16_t *)window + (size_t)key_rows[b] * d, kv + (size_t)b * d, (size_t)d * 2);
    }
    const long K = H * d / G;
    uint16_t *att = malloc((size_t)B * H * d * 2), *rot = malloc((size_t)B * H * d * 2);
    uint16_t *grouped = malloc((size_t)B * G * R * 2);
    const int code0 = coded_keys ? KV_FP8 : -1, code1 = coded_keys ? KV_NVFP4 : -1; /* -1: attention.c's KEYS_PLAIN */
    int status = sink_attention_coded_rows(q, window, rows0, mask0, n0, L0, code0, cache1, rows1, mask1, n1, L1, code1,
                                           sinks, scale, att, B, 1, H, d, DT_BF16, num_threads);
    if (status == 0) {
        rotary(att, H * d, d, cos_t, sin_t, rot, B, H, d, half, 1, DT_BF16, num_threads);
        grouped_product(wo_a, pa_size, rot, grouped, B, G, R, K, num_threads);
        product(wo_b, grouped, out, B, D, G * R, num_threads);
    }
    free(grouped);
    free(rot);
    free(att);
    return status ? -2 : 0;
}
