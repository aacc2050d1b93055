/* Decode-sized products on weights kept in their checkpoint format: the codes are dequantised in
 * registers, never written back, so a product streams the stored bytes (FP4: 0.5 byte a weight plus
 * one scale byte per 32; FP8: 1 byte a weight) instead of bf16's 2.
 *
 *   fp4_linear  y[r, o] = sum_i x[r, i] * e2m1(w[o, i]) * scale[o, i / 32]
 *   fp8_linear  y[r, o] = sum_i x[r, i] * e4m3(w[o, i]) * scale[o / B, i / B]
 *
 * Layouts (quantized_weight.py): FP4 `w` [out, in/2], two codes a byte, the LOW nibble the even
 * (lower-index) element; FP8 `w` [out, in] e4m3 bytes. Scales are ue8m0 bytes (2^(b-127)) or fp32
 * (`scale_e8m0` says which). x is fp32 or bf16 `[rows, in]` (row stride `x_stride` elements), y
 * fp32 `[rows, out]`. All arithmetic is fp32; a code times a power of two is exact in fp32, so the
 * only rounding is the sums'.
 *
 * Each output row's sum runs in the same order whatever `rows` is, and threads split the output
 * rows only. The loops are quant.h's (shared with quant_experts.c): AVX2 + FMA where compiled, and
 * in every build the portable versions (plain C), which the tests run too.
 */
#include "quant.h"

/* ------------------------------------------------------------------------------ entry points */

/* `portable`: 1 forces the plain C loops (also on a CPU with AVX2). */
static void quant_linear(int fp4, int portable, const void *x, int x_dtype, long x_stride, long rows, long in,
                         const uint8_t *w, const void *scale, int scale_e8m0, long block, long out, float *y,
                         int num_threads) {
    float *xf = load_x(x, x_dtype, x_stride, rows, in);
#pragma omp parallel for schedule(static, 8) num_threads(num_threads) if (out * in > PARALLEL_MIN_WORK)
    for (long o = 0; o < out; o++) quant_rows(fp4, portable, xf, rows, in, w, scale, scale_e8m0, block, o, y, out);
    free(xf);
}

void fp4_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long out, float *y, int portable, int num_threads) {
    quant_linear(1, portable, x, x_dtype, x_stride, rows, in, w, scale, scale_e8m0, FP4_GROUP, out, y, num_threads);
}

void fp8_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long block, long out, float *y, int portable, int num_threads) {
    quant_linear(0, portable, x, x_dtype, x_stride, rows, in, w, scale, scale_e8m0, block, out, y, num_threads);
}

/* 1 when the fast (AVX2 + FMA) loops were compiled in, else 0: only the portable ones exist */
int quant_simd(void) {
#ifdef QUANT_AVX2
    return 1;
#else
    return 0;
#endif
}
