/* quant_experts: the routed MoE experts of a decode-sized batch on FP4 / FP8-block weights as stored,
 * in one call (experts_bf16's scheme on quant.h's loops, which dequantise the codes in registers).
 *
 * rows [n, D] (fp32 or bf16, `x_dtype`) grouped by expert: expert e owns counts[e] rows, after those
 * of experts < e. w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I], both FP4 (`fp4`) or both
 * FP8 blocks of `block`, with their scales (ue8m0 bytes or fp32, `scale_e8m0`); `*_stride` are the
 * per-expert strides of the codes (bytes) and of the scales (elements). out [n, D] in x_dtype.
 *
 * Roundings follow the per-expert path (one `linear` per product, each rounded to the rows' dtype):
 * gate/up and the down product rounded to x_dtype, swiglu in fp32 with one rounding to x_dtype (as
 * experts_bf16). Work items are (active expert, block of 16 output rows), dealt to the threads
 * evenly; a block's codes are decoded once per 4 of its expert's rows. A row's results do not depend
 * on the other rows. Returns 1 (nothing written) when the counts are negative or do not add up to
 * n, else 0. */
#include "quant.h"

#define QE_BLOCK 16 /* output rows per work item */

/* x rounded to `dtype`'s precision (bf16: nearest-even, as torch), kept in fp32 */
static inline float round_to(float x, int dtype) { return dtype == DT_BF16 ? bf16_to_float(float_to_bf16(x)) : x; }

/* y[t, :N] = x[t, :K] @ W_e^T for the rows of every active expert, W_e = expert e of a stacked weight */
static void expert_products(int fp4, int portable, const uint8_t *w, long w_stride, const void *scale,
                            long scale_stride, int scale_e8m0, long block, long N, long K, const long *active,
                            long num_active, const long *offsets, const float *x, float *y) {
    const long blocks = (N + QE_BLOCK - 1) / QE_BLOCK;
    const size_t scale_size = scale_e8m0 ? 1 : sizeof(float);
#pragma omp for schedule(static)
    for (long it = 0; it < num_active * blocks; it++) {
        const long e = active[it / blocks], n0 = (it % blocks) * QE_BLOCK;
        const long n1 = n0 + QE_BLOCK < N ? n0 + QE_BLOCK : N, t = offsets[e];
        const uint8_t *we = w + (size_t)e * w_stride;
        const void *se = (const char *)scale + (size_t)e * scale_stride * scale_size;
        for (long o = n0; o < n1; o++)
            quant_rows(fp4, portable, x + (size_t)t * K, offsets[e + 1] - t, K, we, se, scale_e8m0, block, o,
                       y + (size_t)t * N, N);
    }
}

int quant_experts(const void *rows, int x_dtype, long n, long D, const int64_t *counts, long E, int fp4,
                  const uint8_t *w13, long w13_stride, const void *s13, long s13_stride, const uint8_t *w2,
                  long w2_stride, const void *s2, long s2_stride, int scale_e8m0, long block, long I, float limit,
                  void *out, int portable, int num_threads) {
    long *offsets = malloc((size_t)(E + 1) * sizeof(long));
    offsets[0] = 0;
    int bad = 0;
    for (long e = 0; e < E; e++) {
        bad |= counts[e] < 0;
        offsets[e + 1] = offsets[e] + (long)counts[e];
    }
    if (bad || offsets[E] != n) {
        free(offsets);
        return 1;
    }
    long *active = malloc((size_t)E * sizeof(long));
    long num_active = 0;
    for (long e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) active[num_active++] = e;
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
    float *xf = malloc((size_t)n * D * sizeof(float));
    float *gate_up = malloc((size_t)n * 2 * I * sizeof(float));
    float *hidden = malloc((size_t)n * I * sizeof(float));
    float *y = malloc((size_t)n * D * sizeof(float));
#pragma omp parallel num_threads(num_threads) if (n * D * I > PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) load_row((const char *)rows + (size_t)t * D * elem_size(x_dtype), x_dtype,
                                              xf + (size_t)t * D, D);
        expert_products(fp4, portable, w13, w13_stride, s13, s13_stride, scale_e8m0, block, 2 * I, D, active,
                        num_active, offsets, xf, gate_up);
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            float *g = gate_up + (size_t)t * 2 * I, *h = hidden + (size_t)t * I;
            for (long i = 0; i < 2 * I; i++) g[i] = round_to(g[i], x_dtype);
            memcpy(h, g, (size_t)I * sizeof(float));
            swiglu_row(h, g + I, I, hi, lo);
            for (long i = 0; i < I; i++) h[i] = round_to(h[i], x_dtype);
        }
        expert_products(fp4, portable, w2, w2_stride, s2, s2_stride, scale_e8m0, block, D, I, active, num_active,
                        offsets, hidden, y);
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++)
            store_row(y + (size_t)t * D, (char *)out + (size_t)t * D * elem_size(x_dtype), x_dtype, D);
    }
    free(y);
    free(hidden);
    free(gate_up);
    free(xf);
    free(active);
    free(offsets);
    return 0;
}
