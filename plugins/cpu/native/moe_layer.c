/* moe_layer_bf16: the MoE sub-layer of a decode step (a few bf16 tokens) in one call: the router's
 * fp32 product and scores, the top-k (or hash) choice, the dispatch, the routed experts, the combine
 * and the shared expert. Each stage is the kernel the composed path calls (selection.c, moe_rows.c,
 * experts.c, gemv.c, packed_gemm.c), so the composed and the fused path round at the same points; what
 * the call saves is the Python between them (~10 torch ops and 6 wrapper calls per layer). Batches of
 * several rows per expert run the routed experts on the register tiles (experts_packed_bf16): the same
 * roundings as the expert kernel's, the fp32 sums in another order. */
#include "common.h"

/* the stages, defined in the other C files of the library */
int moe_route_rows(const float *scores, const float *bias, const int64_t *hash_ids, int64_t *ids, float *weights,
                   long T, long E, long k, float scaling);
int moe_dispatch_rows(const int64_t *ids, long T, long k, long E, const void *x, long row_bytes, int64_t *counts,
                      int64_t *source_token, int64_t *source_slot, void *rows, int num_threads);
int experts_bf16(const uint16_t *rows, long n, long D, const int64_t *counts, long E, const uint16_t *w13,
                 const uint16_t *w2, long I, float limit, uint16_t *gate_up, uint16_t *hidden, uint16_t *out,
                 int num_threads);
int moe_combine_rows(const void *rows, int dtype, long D, const int64_t *source_token, const int64_t *source_slot,
                     long T, long k, const float *weights, float *out, int num_threads);
void gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, long N, long K, int num_threads);
void gemv_tokens_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, long m, long N, long K, int num_threads);
void packed_gemm_bf16(const uint16_t *P, const uint16_t *X, uint16_t *Y, long M, long N, long K, int num_threads);
int experts_packed_bf16(const uint16_t *rows, long n, long D, const int64_t *counts, long E, const uint16_t *pw13,
                        const uint16_t *pw2, long I, float limit, uint16_t *gate_up, uint16_t *hidden, uint16_t *out,
                        int num_threads);
int quant_experts(const void *rows, int x_dtype, long n, long D, const int64_t *counts, long E, int fp4,
                  const uint8_t *w13, long w13_stride, const void *s13, long s13_stride, const uint8_t *w2,
                  long w2_stride, const void *s2, long s2_stride, int scale_e8m0, long block, long I, float limit,
                  void *out, int portable, int num_threads);
void fp4_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long out, void *y, int y_dtype, int portable, int num_threads);
void fp8_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long block, long out, void *y, int y_dtype, int portable, int num_threads);

/* FP4 / FP8-block weights as stored (quant_gemv.c, quant_experts.c): the routed experts' stacks
 * (`*_stride`: per expert, codes in bytes, scales in elements) or the shared expert's pair */
typedef struct {
    int fp4, scale_e8m0;
    long block;
    const uint8_t *w13, *w2;
    const void *s13, *s2;
    long w13_stride, s13_stride, w2_stride, s2_stride;
} quant_pair;

/* the router's scoring functions (interface.routing_scores) */
#define SCORE_SQRTSOFTPLUS 0
#define SCORE_SIGMOID 1
#define SCORE_SOFTMAX 2

/* scores [T, E] = score_fn(x [T, D] (bf16, widened) @ gate [E, D]^T (fp32)); four experts per pass
 * over x (four independent sums: a single one waits on its own adds), the tokens over the threads */
static void router_scores(const uint16_t *x, const float *gate, float *scores, long T, long D, long E, int scoring,
                          int num_threads) {
#pragma omp parallel num_threads(num_threads) if (T * E * D > 4 * PARALLEL_MIN_WORK)
    {
        float *xf = malloc((size_t)D * sizeof(float));
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            load_row(x + (size_t)t * D, DT_BF16, xf, D);
            float *s = scores + (size_t)t * E;
            long e = 0;
            for (; e + 4 <= E; e += 4) {
                const float *restrict g0 = gate + (size_t)e * D, *restrict g1 = g0 + D, *restrict g2 = g1 + D,
                                      *restrict g3 = g2 + D;
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (long i = 0; i < D; i++) {
                    d0 += g0[i] * xf[i];
                    d1 += g1[i] * xf[i];
                    d2 += g2[i] * xf[i];
                    d3 += g3[i] * xf[i];
                }
                s[e] = d0, s[e + 1] = d1, s[e + 2] = d2, s[e + 3] = d3;
            }
            for (; e < E; e++) {
                const float *restrict g = gate + (size_t)e * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (long i = 0; i < D; i++) dot += g[i] * xf[i];
                s[e] = dot;
            }
            if (scoring == SCORE_SOFTMAX) {
                float top = -INFINITY, total = 0.0f;
                for (long j = 0; j < E; j++) top = s[j] > top ? s[j] : top;
                for (long j = 0; j < E; j++) total += (s[j] = expf(s[j] - top));
                for (long j = 0; j < E; j++) s[j] /= total;
            } else {
                /* softplus as torch's (beta 1, threshold 20: the identity above it) */
                for (long j = 0; j < E; j++)
                    s[j] = scoring == SCORE_SIGMOID ? sigmoid(s[j]) : sqrtf(s[j] > 20.0f ? s[j] : log1pf(expf(s[j])));
            }
        }
        free(xf);
    }
}

/* x @ W^T for T bf16 tokens, as the linear's decode paths compute it: on the weight's packed copy P where
 * given (packed_gemm_bf16), else one token on gemv_bf16, a few on gemv_tokens_bf16 */
static void tokens_product(const uint16_t *W, const uint16_t *P, const uint16_t *X, uint16_t *Y, long T, long N,
                           long K, int num_threads) {
    if (P) packed_gemm_bf16(P, X, Y, T, N, K, num_threads);
    else if (T == 1) gemv_bf16(W, X, Y, N, K, num_threads);
    else gemv_tokens_bf16(W, X, Y, T, N, K, num_threads);
}

/* tokens_product on a quantised weight (`w`, `s`: one of q's pair), rounded to bf16 as the linear's */
static void quant_product(const quant_pair *q, const uint8_t *w, const void *s, const uint16_t *X, uint16_t *Y,
                          long T, long N, long K, int num_threads) {
    if (q->fp4) fp4_linear(X, DT_BF16, K, T, K, w, s, q->scale_e8m0, N, Y, DT_BF16, 0, num_threads);
    else fp8_linear(X, DT_BF16, K, T, K, w, s, q->scale_e8m0, q->block, N, Y, DT_BF16, 0, num_threads);
}

/* ----- moe_layer_bf16 -----
 * x [T, D] bf16; gate [E, D] fp32, bias [E] fp32 or NULL, hash_ids [T, k] int64 or NULL (hash layers);
 * w13 [E, 2I, D], w2 [E, D, I] bf16 (the routed experts); sw13 [2SI, D], sw2 [D, SI] bf16 or NULL
 * (the shared expert); pw13, pw2, psw13, psw2: their copies packed by pack_bf16 (an expert weight: E
 * packed matrices one after the other) or NULL: the routed experts run on the register tiles where pw13
 * and pw2 are given (else experts_bf16's GEMVs), a shared-expert product where its copy is (else the
 * GEMVs); out [T, D] bf16 = bf16(combine (fp32) + shared expert (bf16)). The shared
 * expert's hidden row is rounded once (the swiglu kernel), or, with `round_silu`, where torch's bf16
 * `silu(g) * u` rounds: silu's result, then the product (the composed path's swiglu for a few rows).
 * Returns 0, or 1 (nothing written) at a hash id outside [0, E). */
static int moe_layer(const uint16_t *x, long T, long D, const float *gate, const float *bias, const int64_t *hash_ids,
                     long E, long k, float scaling, int scoring, const uint16_t *w13, const uint16_t *w2,
                     const quant_pair *qe, long I, const uint16_t *sw13, const uint16_t *sw2, const quant_pair *qs,
                     long SI, const uint16_t *pw13, const uint16_t *pw2, const uint16_t *psw13, const uint16_t *psw2,
                     float limit, int round_silu, uint16_t *out, int num_threads) {
    const long n = T * k, wide = I > SI ? I : SI;
    float *scores = malloc((size_t)T * E * sizeof(float));
    float *weights = malloc((size_t)n * sizeof(float));
    float *y = malloc((size_t)T * D * sizeof(float));
    float *g = malloc((size_t)wide * sizeof(float)), *u = malloc((size_t)wide * sizeof(float));
    int64_t *ids = malloc((size_t)n * sizeof(int64_t)), *counts = malloc((size_t)E * sizeof(int64_t));
    int64_t *source_token = malloc((size_t)n * sizeof(int64_t)), *source_slot = malloc((size_t)n * sizeof(int64_t));
    uint16_t *rows = malloc((size_t)n * D * sizeof(uint16_t)), *expert_out = malloc((size_t)n * D * sizeof(uint16_t));
    uint16_t *gate_up = malloc((size_t)n * 2 * wide * sizeof(uint16_t));
    uint16_t *hidden = malloc((size_t)n * wide * sizeof(uint16_t));
    router_scores(x, gate, scores, T, D, E, scoring, num_threads);
    int status = moe_route_rows(scores, bias, hash_ids, ids, weights, T, E, k, scaling) != 0;
    /* with valid ids the three stages below cannot fail: their checks hold by construction */
    if (!status) status = moe_dispatch_rows(ids, T, k, E, x, D * 2, counts, source_token, source_slot, rows, num_threads);
    if (!status && qe)
        status = quant_experts(rows, DT_BF16, n, D, counts, E, qe->fp4, qe->w13, qe->w13_stride, qe->s13,
                               qe->s13_stride, qe->w2, qe->w2_stride, qe->s2, qe->s2_stride, qe->scale_e8m0,
                               qe->block, I, limit, expert_out, 0, num_threads);
    else if (!status)
        status = pw13 && pw2 ? experts_packed_bf16(rows, n, D, counts, E, pw13, pw2, I, limit, gate_up, hidden, expert_out,
                                                   num_threads)
                             : experts_bf16(rows, n, D, counts, E, w13, w2, I, limit, gate_up, hidden, expert_out,
                                            num_threads);
    if (!status) status = moe_combine_rows(expert_out, DT_BF16, D, source_token, source_slot, T, k, weights, y, num_threads);
    if (!status && (sw13 || qs)) {
        /* shared expert: gate_up [T, 2SI] and hidden [T, SI] rounded to bf16 as the linear and swiglu do */
        const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
        if (qs) quant_product(qs, qs->w13, qs->s13, x, gate_up, T, 2 * SI, D, num_threads);
        else tokens_product(sw13, psw13, x, gate_up, T, 2 * SI, D, num_threads);
        for (long t = 0; t < T; t++) {
            load_row(gate_up + (size_t)t * 2 * SI, DT_BF16, g, SI);
            load_row(gate_up + (size_t)t * 2 * SI + SI, DT_BF16, u, SI);
            if (round_silu) {
                for (long i = 0; i < SI; i++) {
                    const float gi = g[i] > hi ? hi : g[i], ui = u[i] > hi ? hi : (u[i] < lo ? lo : u[i]);
                    g[i] = bf16_to_float(float_to_bf16(gi / (1.0f + vexpf(-gi)))) * ui;
                }
            } else {
                swiglu_row(g, u, SI, hi, lo);
            }
            store_row(g, hidden + (size_t)t * SI, DT_BF16, SI);
        }
        if (qs) quant_product(qs, qs->w2, qs->s2, hidden, expert_out, T, D, SI, num_threads);
        else tokens_product(sw2, psw2, hidden, expert_out, T, D, SI, num_threads);
        for (long i = 0; i < T * D; i++) y[i] += bf16_to_float(expert_out[i]);
    }
    if (!status) store_row(y, out, DT_BF16, T * D);
    free(hidden);
    free(gate_up);
    free(expert_out);
    free(rows);
    free(source_slot);
    free(source_token);
    free(counts);
    free(ids);
    free(u);
    free(g);
    free(y);
    free(weights);
    free(scores);
    return status;
}

int moe_layer_bf16(const uint16_t *x, long T, long D, const float *gate, const float *bias, const int64_t *hash_ids,
                   long E, long k, float scaling, int scoring, const uint16_t *w13, const uint16_t *w2, long I,
                   const uint16_t *sw13, const uint16_t *sw2, long SI, const uint16_t *pw13, const uint16_t *pw2,
                   const uint16_t *psw13, const uint16_t *psw2, float limit, int round_silu, uint16_t *out,
                   int num_threads) {
    return moe_layer(x, T, D, gate, bias, hash_ids, E, k, scaling, scoring, w13, w2, NULL, I, sw13, sw2, NULL, SI,
                     pw13, pw2, psw13, psw2, limit, round_silu, out, num_threads);
}

/* ----- moe_layer_quant: moe_layer_bf16 with the routed experts as stored -----
 * The routed experts FP4 or FP8 blocks (quant_experts' arguments, named as there: both stacks one format), the
 * shared expert bf16 (sw13, sw2, their packed copies psw13, psw2 or NULL), quantised (`s_fp4` 0 or 1:
 * FP8 or FP4 codes in sw13/sw2 with scales ss13/ss2, `s_*` their format; `s_fp4` -1: bf16) or absent
 * (sw13 NULL). Each stage is the call the composed path makes (quant_experts for the routed experts,
 * fp8_linear / fp4_linear rounded to bf16 for the shared expert's products), so the two round alike. */
int moe_layer_quant(const uint16_t *x, long T, long D, const float *gate, const float *bias, const int64_t *hash_ids,
                    long E, long k, float scaling, int scoring, int fp4, const uint8_t *w13, long w13_stride,
                    const void *s13, long s13_stride, const uint8_t *w2, long w2_stride, const void *s2,
                    long s2_stride, int scale_e8m0, long block, long I, const void *sw13, const void *sw2,
                    const void *ss13, const void *ss2, int s_fp4, int s_scale_e8m0, long s_block, long SI,
                    const uint16_t *psw13, const uint16_t *psw2, float limit, int round_silu, uint16_t *out,
                    int num_threads) {
    const quant_pair qe = {fp4, scale_e8m0, block, w13, w2, s13, s2, w13_stride, s13_stride, w2_stride,
                           s2_stride};
    const quant_pair qs = {s_fp4 == 1, s_scale_e8m0, s_block, sw13, sw2, ss13, ss2, 0, 0, 0, 0};
    const int quant_shared = sw13 && s_fp4 >= 0;
    return moe_layer(x, T, D, gate, bias, hash_ids, E, k, scaling, scoring, NULL, NULL, &qe, I,
                     quant_shared ? NULL : sw13, quant_shared ? NULL : sw2, quant_shared ? &qs : NULL, SI, NULL, NULL,
                     quant_shared ? NULL : psw13, quant_shared ? NULL : psw2, limit, round_silu, out, num_threads);
}
