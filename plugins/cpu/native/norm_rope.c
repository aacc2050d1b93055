/* rms_norm and rotary, in one pass over memory each, and rms_norm_rotary, the two in one call. */
#include "common.h"

/* ----- rms_norm: y = x * rsqrt(mean(x^2) + eps) [* w], in x's dtype ----- */

void rms_norm(const void *x, long x_row_stride, const void *w, int w_dtype, void *out, long rows, long D,
              float eps, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    PARALLEL_IF(rows * D > PARALLEL_MIN_WORK && rows > 1, {
        float *row = malloc((size_t)D * sizeof(float));
        float *wf = NULL;
        if (w) {
            wf = malloc((size_t)D * sizeof(float));
            load_row(w, w_dtype, wf, D);
        }
        _Pragma("omp for schedule(static)")
        for (long r = 0; r < rows; r++) {
            load_row((const char *)x + (size_t)r * x_row_stride * es, dtype, row, D);
            const float inv = 1.0f / sqrtf(sum_squares(row, D) / (float)D + eps);
            if (wf) {
                for (long i = 0; i < D; i++) row[i] = (row[i] * inv) * wf[i];
            } else {
                for (long i = 0; i < D; i++) row[i] = row[i] * inv;
            }
            store_row(row, (char *)out + (size_t)r * D * es, dtype, D);
        }
        free(wf);
        free(row);
    });
}

/* ----- rotary: the last 2*half features as interleaved (even, odd) pairs, rotated per token -----
 * x [T, M, d] with strides (x_stride_t, x_stride_m, 1); out contiguous [T, M, d]; cos/sin fp32
 * [T, half], the same for all M middle rows; `inverse` rotates by -angle. */

void rotary(const void *x, long x_stride_t, long x_stride_m, const float *cos_t, const float *sin_t, void *out,
            long T, long M, long d, long half, int inverse, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const long r = 2 * half, keep = d - r;
    const float sign = inverse ? -1.0f : 1.0f;
    PARALLEL_IF(T * M * d > PARALLEL_MIN_WORK && T > 1, {
        float *pairs = malloc((size_t)(r > 0 ? r : 1) * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (long t = 0; t < T; t++) {
            const float *restrict c = cos_t + t * half;
            const float *restrict s = sin_t + t * half;
            for (long m = 0; m < M; m++) {
                const char *src = (const char *)x + (size_t)(t * x_stride_t + m * x_stride_m) * es;
                char *dst = (char *)out + (size_t)((t * M + m) * d) * es;
                memcpy(dst, src, (size_t)keep * es); /* the non-rotary features, unchanged */
                load_row(src + (size_t)keep * es, dtype, pairs, r);
                for (long i = 0; i < half; i++) {
                    const float e = pairs[2 * i], o = pairs[2 * i + 1];
                    const float ci = c[i], si = sign * s[i];
                    pairs[2 * i] = e * ci - o * si;
                    pairs[2 * i + 1] = o * ci + e * si;
                }
                store_row(pairs, dst + (size_t)keep * es, dtype, r);
            }
        }
        free(pairs);
    });
}

/* ----- rms_norm_rotary: rotary(rms_norm(x)) as the two calls in a row (the norm rounded to `dtype`) -----
 * x [T*M, d] rows `x_row_stride` apart; out contiguous [T, M, d]; cos/sin fp32 [T, half]. */
void rms_norm_rotary(const void *x, long x_row_stride, const void *w, int w_dtype, const float *cos_t,
                     const float *sin_t, void *out, long T, long M, long d, long half, float eps, int dtype,
                     int num_threads) {
    void *normed = malloc((size_t)T * M * d * elem_size(dtype));
    rms_norm(x, x_row_stride, w, w_dtype, normed, T * M, d, eps, dtype, num_threads);
    rotary(normed, M * d, d, cos_t, sin_t, out, T, M, d, half, 0, dtype, num_threads);
    free(normed);
}
