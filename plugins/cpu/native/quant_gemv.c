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
 * rows only. The loops are quant.h's (shared with quant_experts.c): for bf16 x on AVX512-BF16 the
 * codes decoded to bf16 and multiplied exactly by vdpbf16ps (FP4; FP8 where the build also has
 * AVX512-VBMI for its byte look-ups), else AVX2 + FMA fp32 loops where compiled, and in every build
 * the portable versions (plain C), which the tests run too. y is fp32 or bf16 (rounded once).
 */
#include "quant.h"

/* ------------------------------------------------------------------------------ entry points */

#ifdef QUANT_AVX512BF16
/* output rows o .. o + no - 1 on the bf16 loops: FP4 (x in fp4_lane_order, contiguous) or FP8 */
static inline void rows_bf16(int fp4, const uint16_t *xb, long x_stride, long rows, long in, const uint8_t *w,
                             const void *scale, int scale_e8m0, long block, long o, long no, float *y, long out) {
#ifdef QUANT_FP8_BF16
    if (!fp4) {
        fp8_rows_bf16(xb, x_stride, rows, in, w, scale, scale_e8m0, block, o, no, y, out);
        return;
    }
#endif
    (void)x_stride, (void)block;
    fp4_rows_bf16(xb, rows, in, w, scale, scale_e8m0, o, no, y, out);
}
#endif

/* Where the library has AVX512-BF16 and x is bf16 (not `portable`): the bf16 loops (quant.h), four
 * output rows at a time: FP8 (AVX512-VBMI builds, blocks a multiple of 32 that tile `in`) reads x in
 * place, FP4 a copy of it in fp4_lane_order. Returns 0 (nothing done) where they do not apply. */
static int quant_linear_bf16(int fp4, int portable, const void *x, int x_dtype, long x_stride, long rows, long in,
                             const uint8_t *w, const void *scale, int scale_e8m0, long block, long out, float *y,
                             int num_threads) {
#ifdef QUANT_AVX512BF16
    if (portable || x_dtype != DT_BF16) return 0;
#ifdef QUANT_FP8_BF16
    if (!fp4 && (!fp8_chunk(block) || in % block)) return 0;
#else
    if (!fp4) return 0;
#endif
    const uint16_t *xb = x;
    uint16_t *ordered = NULL;
    if (fp4) {
        ordered = malloc((size_t)rows * in * sizeof(uint16_t));
        for (long r = 0; r < rows; r++) fp4_lane_order_bf16(xb + (size_t)r * x_stride, ordered + (size_t)r * in, in);
        xb = ordered, x_stride = in;
    }
    const long quads = out / 4;
    PARALLEL_IF(num_threads > 1 && rows * out * in > PARALLEL_MIN_WORK,
        _Pragma("omp for schedule(static)")
        for (long q = 0; q < quads + out % 4; q++) {
            const long o = q < quads ? 4 * q : 4 * quads + (q - quads);
            rows_bf16(fp4, xb, x_stride, rows, in, w, scale, scale_e8m0, block, o, q < quads ? 4 : 1, y, out);
        });
    free(ordered);
    return 1;
#else
    (void)fp4, (void)portable, (void)x, (void)x_dtype, (void)x_stride, (void)rows, (void)in, (void)w, (void)scale;
    (void)scale_e8m0, (void)block, (void)out, (void)y, (void)num_threads;
    return 0;
#endif
}

/* `portable`: 1 forces the plain C loops (also on a CPU with AVX2). y [rows, out] in `y_dtype`
 * (fp32, or bf16 rounded once from the fp32 sums, as torch rounds). */
static void quant_linear(int fp4, int portable, const void *x, int x_dtype, long x_stride, long rows, long in,
                         const uint8_t *w, const void *scale, int scale_e8m0, long block, long out, void *y,
                         int y_dtype, int num_threads) {
    float *yf = y_dtype == DT_F32 ? y : malloc((size_t)rows * out * sizeof(float));
    if (!quant_linear_bf16(fp4, portable, x, x_dtype, x_stride, rows, in, w, scale, scale_e8m0, block, out, yf,
                           num_threads)) {
        float *xf = load_x(x, x_dtype, x_stride, rows, in);
#pragma omp parallel for schedule(static, 8) num_threads(num_threads) if (rows * out * in > PARALLEL_MIN_WORK)
        for (long o = 0; o < out; o++)
            quant_rows(fp4, portable, xf, rows, in, w, scale, scale_e8m0, block, o, yf, out);
        free(xf);
    }
    if (yf != y) {
        store_row(yf, y, y_dtype, rows * out);
        free(yf);
    }
}

void fp4_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long out, void *y, int y_dtype, int portable, int num_threads) {
    quant_linear(1, portable, x, x_dtype, x_stride, rows, in, w, scale, scale_e8m0, FP4_GROUP, out, y, y_dtype,
                 num_threads);
}

void fp8_linear(const void *x, int x_dtype, long x_stride, long rows, long in, const uint8_t *w, const void *scale,
                int scale_e8m0, long block, long out, void *y, int y_dtype, int portable, int num_threads) {
    quant_linear(0, portable, x, x_dtype, x_stride, rows, in, w, scale, scale_e8m0, block, out, y, y_dtype,
                 num_threads);
}

/* quant_linear per group: x [rows, G, in], w [G, out, in] (FP4 codes [G, out, in/2]) with scales
 * [G, ...] (`scale_group` elements a group), y [rows, G, out] in `y_dtype`; each group's products are
 * quant_linear's on that group (the same bits as one call per group). */
void quant_grouped_linear(int fp4, const void *x, int x_dtype, long rows, long G, long in, const uint8_t *w,
                          const void *scale, long scale_group, int scale_e8m0, long block, long out, void *y,
                          int y_dtype, int num_threads) {
    const size_t w_group = (size_t)out * (fp4 ? in / 2 : in), y_size = elem_size(y_dtype);
    const size_t s_size = scale_e8m0 ? 1 : sizeof(float);
    void *yg = rows == 1 ? NULL : malloc((size_t)rows * out * y_size);
    for (long g = 0; g < G; g++) {
        const void *xg = (const char *)x + (size_t)g * in * elem_size(x_dtype);
        const void *sg = (const char *)scale + (size_t)g * scale_group * s_size;
        void *dst = yg ? yg : (char *)y + (size_t)g * out * y_size;
        quant_linear(fp4, 0, xg, x_dtype, G * in, rows, in, w + g * w_group, sg, scale_e8m0, fp4 ? FP4_GROUP : block,
                     out, dst, y_dtype, num_threads);
        for (long r = 0; yg && r < rows; r++)
            memcpy((char *)y + ((size_t)r * G + g) * out * y_size, (char *)yg + (size_t)r * out * y_size, out * y_size);
    }
    free(yg);
}

/* 1 when the fast (AVX2 + FMA) loops were compiled in, else 0: only the portable ones exist */
int quant_simd(void) {
#ifdef QUANT_AVX2
    return 1;
#else
    return 0;
#endif
}
