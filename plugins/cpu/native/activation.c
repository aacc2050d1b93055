/* swiglu (its row loop, swiglu_row, is in common.h: the experts use it too). */
#include "common.h"

/* ----- swiglu: silu(min(gate, limit)) * clamp(up, -limit, limit), limit <= 0: no clamps -----
 * gate and up [rows, I] with a common row stride (the two halves of a fused gate/up product), out
 * contiguous [rows, I]; fp32 arithmetic, one rounding to the output dtype. */

void swiglu(const void *gate, const void *up, long row_stride, void *out, long rows, long I, float limit,
            int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
    PARALLEL_IF(rows * I > PARALLEL_MIN_WORK && rows > 1, {
        float *g = malloc((size_t)I * sizeof(float));
        float *u = malloc((size_t)I * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (long r = 0; r < rows; r++) {
            load_row((const char *)gate + (size_t)r * row_stride * es, dtype, g, I);
            load_row((const char *)up + (size_t)r * row_stride * es, dtype, u, I);
            swiglu_row(g, u, I, hi, lo);
            store_row(g, (char *)out + (size_t)r * I * es, dtype, I);
        }
        free(u);
        free(g);
    });
}
