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
 * evenly; a block's codes are decoded once per 4 of its expert's rows: to fp32 (AVX2, portable), or,
 * with bf16 rows on AVX512-BF16 (FP4; FP8 where the build has AVX512-VBMI and the blocks tile D and I
 * by multiples of 32), to registers of bf16 weights that vdpbf16ps multiplies with each row's bf16
 * values exactly (FP4: the rows copied once in the order the decoder yields the weights).
 * A row's results do not depend on the other rows. Returns 1 (nothing written) when the counts are
 * negative or do not add up to n, else 0. */
#include "quant.h"

#define QE_BLOCK 16 /* output rows per work item */

/* x rounded to `dtype`'s precision (bf16: nearest-even, as torch), kept in fp32 */
static inline float round_to(float x, int dtype) { return dtype == DT_BF16 ? bf16_to_float(float_to_bf16(x)) : x; }

/* y[t, :N] = x[t, :K] @ W_e^T for the rows of every active expert, W_e = expert e of a stacked weight;
 * `xb`: the same rows in bf16 for the AVX512-BF16 FP4 loop, or NULL (the fp32 rows `xf`) */
static void expert_products(int fp4, int portable, const uint8_t *w, long w_stride, const void *scale,
                            long scale_stride, int scale_e8m0, long block, long N, long K, const long *active,
                            long num_active, const long *offsets, const float *xf, const uint16_t *xb, float *y) {
    const long blocks = (N + QE_BLOCK - 1) / QE_BLOCK;
    const size_t scale_size = scale_e8m0 ? 1 : sizeof(float);
#pragma omp for schedule(static)
    for (long it = 0; it < num_active * blocks; it++) {
        const long e = active[it / blocks], n0 = (it % blocks) * QE_BLOCK;
        const long n1 = n0 + QE_BLOCK < N ? n0 + QE_BLOCK : N, t = offsets[e], count = offsets[e + 1] - t;
        const uint8_t *we = w + (size_t)e * w_stride;
        const void *se = (const char *)scale + (size_t)e * scale_stride * scale_size;
#ifdef QUANT_AVX512BF16
        if (xb) {
            for (long o = n0; o < n1;) {
                const long no = o + 4 <= n1 ? 4 : 1;
#ifdef QUANT_FP8_BF16
                if (!fp4)
                    fp8_rows_bf16(xb + (size_t)t * K, K, count, K, we, se, scale_e8m0, block, o, no, y + (size_t)t * N,
                                  N);
                else
#endif
                    fp4_rows_bf16(xb + (size_t)t * K, count, K, we, se, scale_e8m0, o, no, y + (size_t)t * N, N);
                o += no;
            }
            continue;
        }
#endif
        for (long o = n0; o < n1; o++)
            quant_rows(fp4, portable, xf + (size_t)t * K, count, K, we, se, scale_e8m0, block, o, y + (size_t)t * N,
                       N);
    }
}

int quant_experts(const void *rows, int x_dtype, long n, long D, const int64_t *counts, long E, int fp4,
                  const uint8_t *w13, long w13_stride, const void *s13, long s13_stride, const uint8_t *w2,
                  long w2_stride, const void *s2, long s2_stride, int scale_e8m0, long block, long I, float limit,
                  void *out, int portable, int num_threads) {
    long *offsets, *active, num_active;
    if (expert_ranges(counts, E, n, &offsets, &active, &num_active)) return 1;
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
    float *xf = malloc((size_t)n * D * sizeof(float));
    float *gate_up = malloc((size_t)n * 2 * I * sizeof(float));
    float *hidden = malloc((size_t)n * I * sizeof(float));
    float *y = malloc((size_t)n * D * sizeof(float));
    /* bf16 rows on AVX512-BF16 (FP4; FP8 on AVX512-VBMI builds, blocks of a multiple of 32 that tile D
     * and I): the products take them as they are, exactly; FP4 in fp4_lane_order, FP8 in order */
#ifdef QUANT_AVX512BF16
    int bf16_dot = fp4 && !portable && x_dtype == DT_BF16;
#ifdef QUANT_FP8_BF16
    bf16_dot |= !fp4 && !portable && x_dtype == DT_BF16 && fp8_chunk(block) && D % block == 0 && I % block == 0;
#endif
#else
    const int bf16_dot = 0;
#endif
    uint16_t *hidden_b = bf16_dot ? malloc((size_t)n * I * sizeof(uint16_t)) : NULL;
    uint16_t *rows_b = bf16_dot && fp4 ? malloc((size_t)n * D * sizeof(uint16_t)) : NULL;
#pragma omp parallel num_threads(num_threads) if (n * D * I > PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            const void *row = (const char *)rows + (size_t)t * D * elem_size(x_dtype);
#ifdef QUANT_AVX512BF16
            if (bf16_dot) { /* FP8: the rows as they are */
                if (rows_b) fp4_lane_order_bf16(row, rows_b + (size_t)t * D, D);
                continue;
            }
#endif
            load_row(row, x_dtype, xf + (size_t)t * D, D);
        }
        expert_products(fp4, portable, w13, w13_stride, s13, s13_stride, scale_e8m0, block, 2 * I, D, active,
                        num_active, offsets, xf, bf16_dot && !fp4 ? (const uint16_t *)rows : rows_b, gate_up);
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            float *g = gate_up + (size_t)t * 2 * I, *h = hidden + (size_t)t * I;
            for (long i = 0; i < 2 * I; i++) g[i] = round_to(g[i], x_dtype);
            memcpy(h, g, (size_t)I * sizeof(float));
            swiglu_row(h, g + I, I, hi, lo);
            for (long i = 0; i < I; i++) h[i] = round_to(h[i], x_dtype);
#ifdef QUANT_AVX512BF16
            if (hidden_b)
                for (long i = 0; i < I; i++) hidden_b[(size_t)t * I + i] = float_to_bf16(h[fp4 ? fp4_lane_order(i) : i]);
#endif
        }
        expert_products(fp4, portable, w2, w2_stride, s2, s2_stride, scale_e8m0, block, D, I, active, num_active,
                        offsets, hidden, hidden_b, y);
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++)
            store_row(y + (size_t)t * D, (char *)out + (size_t)t * D * elem_size(x_dtype), x_dtype, D);
    }
    free(rows_b);
    free(hidden_b);
    free(y);
    free(hidden);
    free(gate_up);
    free(xf);
    free(active);
    free(offsets);
    return 0;
}
