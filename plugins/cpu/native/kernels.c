/* Fused kernels of the cpu back end: rms_norm, rotary, hc_pre, hc_post, swiglu, and the bf16
 * decode GEMV.
 *
 * Each function does in one pass over memory what CpuKernels (kernels.py, the reference) does in
 * many torch ops: one call costs microseconds at decode sizes instead of tens of op dispatches.
 * Plain C, no torch headers; called through ctypes (native.py builds and loads this file).
 *
 * Conventions: row-major inputs, the last dimension contiguous; `dtype` 0 = fp32, 1 = bf16 (bf16 is
 * stored as uint16_t). All arithmetic is fp32. bf16 results are rounded to nearest-even exactly like
 * torch. Rows are split over OpenMP threads (the same libgomp as torch) when there is enough work.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DT_F32 0
#define DT_BF16 1

/* DEEPINFER_CPU_NATIVE_ISA=no-avx512 builds with -mno-avx512f -DDEEPINFER_NO_AVX512: if the compiler
 * still targets AVX-512 (a flag that re-enables it, e.g. a newer AVX10 option), fail the build
 * instead of producing a library that is not what was asked for. */
#if defined(DEEPINFER_NO_AVX512) && (defined(__AVX512F__) || defined(__AVX512BF16__) || defined(__AMX_TILE__))
#error "DEEPINFER_CPU_NATIVE_ISA=no-avx512, but the compiler still targets AVX-512 or AMX"
#endif

/* What this build was compiled for (bits: 1 AVX2, 2 FMA, 4 AVX-512F, 8 AVX512-BF16 dot products,
 * 16 the AMX tile path): native.build_isa() reports it, the tests check it against the CPU and
 * against the build switch. */
int build_isa(void) {
    int bits = 0;
#if defined(__AVX2__)
    bits |= 1;
#endif
#if defined(__FMA__)
    bits |= 2;
#endif
#if defined(__AVX512F__)
    bits |= 4;
#endif
#if defined(__AVX512BF16__)
    bits |= 8;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    bits |= 16;
#endif
    return bits;
}

/* Below this many elements of work a call stays on the calling thread (fork/join costs more). */
#define PARALLEL_MIN_WORK 65536L

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u; /* rounding could carry a NaN's payload into Inf */
    return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? quiet_nan : rounded);
}

/* n values of `src` (fp32 or bf16) -> fp32 `dst` */
static void load_row(const void *src, int dtype, float *restrict dst, long n) {
    if (dtype == DT_BF16) {
        const uint16_t *restrict s = (const uint16_t *)src;
        for (long i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* n fp32 values -> `dst` in `dtype` */
static void store_row(const float *restrict src, void *dst, int dtype, long n) {
    if (dtype == DT_BF16) {
        uint16_t *restrict d = (uint16_t *)dst;
        for (long i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline size_t elem_size(int dtype) { return dtype == DT_BF16 ? 2 : 4; }

static float sum_squares(const float *restrict x, long n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* exp(x) in branch-free arithmetic that gcc vectorises (libm's expf stays a scalar call per element
 * without -ffast-math, and so does floorf without -fno-trapping-math): x = n*ln2 + r, n rounded to
 * nearest by the 1.5*2^23 trick, ln2 split in two so r is exact, e^r by its degree-6 Taylor
 * polynomial on |r| <= ln2/2, 2^n through the exponent bits. Relative error < 3e-7 (measured
 * against float64 over [-120, 120]); x is clamped to [-87, 88.5], so tiny results are ~1e-38,
 * not 0, and large ones saturate near 2^127.7. */
static inline float vexpf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.5f ? 88.5f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* ----- rms_norm: y = x * rsqrt(mean(x^2) + eps) [* w], in x's dtype ----- */

void rms_norm(const void *x, long x_row_stride, const void *w, int w_dtype, void *out, long rows, long D,
              float eps, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
#pragma omp parallel num_threads(num_threads) if (rows * D > PARALLEL_MIN_WORK && rows > 1)
    {
        float *row = malloc((size_t)D * sizeof(float));
        float *wf = NULL;
        if (w) {
            wf = malloc((size_t)D * sizeof(float));
            load_row(w, w_dtype, wf, D);
        }
#pragma omp for schedule(static)
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
    }
}

/* ----- rotary: the last 2*half features as interleaved (even, odd) pairs, rotated per token -----
 * x [T, M, d] with strides (x_stride_t, x_stride_m, 1); out contiguous [T, M, d]; cos/sin fp32
 * [T, half], the same for all M middle rows; `inverse` rotates by -angle. */

void rotary(const void *x, long x_stride_t, long x_stride_m, const float *cos_t, const float *sin_t, void *out,
            long T, long M, long d, long half, int inverse, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const long r = 2 * half, keep = d - r;
    const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel num_threads(num_threads) if (T * M * d > PARALLEL_MIN_WORK && T > 1)
    {
        float *pairs = malloc((size_t)(r > 0 ? r : 1) * sizeof(float));
#pragma omp for schedule(static)
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
    }
}

/* ----- hc_pre: mHC mixing weights and the collapsed input of one unit, per token -----
 * streams [T, n, D]; fn [n*(n+2), n*D] fp32; base [n*(n+2)] fp32; scale [3] fp32.
 * Outputs: collapsed [T, D] (streams' dtype), post [T, n] fp32, comb [T, n, n] fp32. */

/* Token rows that share one pass over fn (fn is read once per block instead of once per row). */
#define HC_ROW_BLOCK 4

static void hc_mixing(const float *restrict mix, const float *restrict base, const float *restrict scale, long n,
                      int sinkhorn_iters, float eps, float *restrict pre, float *restrict post,
                      float *restrict comb) {
    for (long j = 0; j < n; j++) {
        pre[j] = sigmoid(mix[j] * scale[0] + base[j]) + eps;
        post[j] = 2.0f * sigmoid(mix[n + j] * scale[1] + base[n + j]);
    }
    /* comb = softmax over each row of the n x n block, plus eps */
    for (long i = 0; i < n; i++) {
        float *row = comb + i * n;
        float mx = -INFINITY;
        for (long k = 0; k < n; k++) {
            row[k] = mix[2 * n + i * n + k] * scale[2] + base[2 * n + i * n + k];
            mx = row[k] > mx ? row[k] : mx;
        }
        float total = 0.0f;
        for (long k = 0; k < n; k++) {
            row[k] = expf(row[k] - mx);
            total += row[k];
        }
        for (long k = 0; k < n; k++) row[k] = row[k] / total + eps;
    }
    /* column normalisation, then (sinkhorn_iters - 1) rounds of rows then columns */
    for (int it = 0; it < (sinkhorn_iters > 1 ? sinkhorn_iters : 1); it++) {
        if (it > 0) {
            for (long i = 0; i < n; i++) {
                float total = 0.0f;
                for (long k = 0; k < n; k++) total += comb[i * n + k];
                total += eps;
                for (long k = 0; k < n; k++) comb[i * n + k] /= total;
            }
        }
        for (long k = 0; k < n; k++) {
            float total = 0.0f;
            for (long i = 0; i < n; i++) total += comb[i * n + k];
            total += eps;
            for (long i = 0; i < n; i++) comb[i * n + k] /= total;
        }
    }
}

/* Features per pass of the dot products below: the 4 row pieces (8 KiB) stay in L1 while every fn row
 * passes over them. */
#define HC_CHUNK 512

/* mix[r][m] = inv[r] * <row_r, fn_m> for the HC_ROW_BLOCK (4) token rows of a block, four fn rows
 * at a time (each loaded value feeds several multiply-adds) and over L1-sized pieces of the rows. */
static void mix_full_block(const float *restrict rows, const float *restrict fn, long width, long mixes,
                           const float *restrict inv, float *restrict mix) {
    for (long k = 0; k < HC_ROW_BLOCK * mixes; k++) mix[k] = 0.0f;
    for (long i0 = 0; i0 < width; i0 += HC_CHUNK) {
        const long len = width - i0 < HC_CHUNK ? width - i0 : HC_CHUNK;
        const float *restrict x0 = rows + i0, *restrict x1 = rows + width + i0;
        const float *restrict x2 = rows + 2 * width + i0, *restrict x3 = rows + 3 * width + i0;
        long m = 0;
        for (; m + 3 < mixes; m += 4) {
            const float *restrict f = fn + m * width + i0, *restrict g = f + width;
            const float *restrict h = g + width, *restrict e = h + width;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
            float c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, c3 = 0.0f, d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)
            for (long i = 0; i < len; i++) {
                a0 += f[i] * x0[i];
                a1 += f[i] * x1[i];
                a2 += f[i] * x2[i];
                a3 += f[i] * x3[i];
                b0 += g[i] * x0[i];
                b1 += g[i] * x1[i];
                b2 += g[i] * x2[i];
                b3 += g[i] * x3[i];
                c0 += h[i] * x0[i];
                c1 += h[i] * x1[i];
                c2 += h[i] * x2[i];
                c3 += h[i] * x3[i];
                d0 += e[i] * x0[i];
                d1 += e[i] * x1[i];
                d2 += e[i] * x2[i];
                d3 += e[i] * x3[i];
            }
            mix[m] += a0, mix[mixes + m] += a1, mix[2 * mixes + m] += a2, mix[3 * mixes + m] += a3;
            mix[m + 1] += b0, mix[mixes + m + 1] += b1, mix[2 * mixes + m + 1] += b2, mix[3 * mixes + m + 1] += b3;
            mix[m + 2] += c0, mix[mixes + m + 2] += c1, mix[2 * mixes + m + 2] += c2, mix[3 * mixes + m + 2] += c3;
            mix[m + 3] += d0, mix[mixes + m + 3] += d1, mix[2 * mixes + m + 3] += d2, mix[3 * mixes + m + 3] += d3;
        }
        for (; m < mixes; m++) {
            const float *restrict f = fn + m * width + i0;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (long i = 0; i < len; i++) {
                a0 += f[i] * x0[i];
                a1 += f[i] * x1[i];
                a2 += f[i] * x2[i];
                a3 += f[i] * x3[i];
            }
            mix[m] += a0, mix[mixes + m] += a1, mix[2 * mixes + m] += a2, mix[3 * mixes + m] += a3;
        }
    }
    for (long r = 0; r < HC_ROW_BLOCK; r++)
        for (long m = 0; m < mixes; m++) mix[r * mixes + m] *= inv[r];
}

void hc_pre(const void *streams, const float *fn, const float *base, const float *scale, void *collapsed,
            float *post, float *comb, long T, long n, long D, int sinkhorn_iters, float eps, float norm_eps,
            int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const long width = n * D, mixes = n * (n + 2);
    const long blocks = (T + HC_ROW_BLOCK - 1) / HC_ROW_BLOCK;
#pragma omp parallel num_threads(num_threads) if (T * width > PARALLEL_MIN_WORK && blocks > 1)
    {
        float *rows = malloc((size_t)HC_ROW_BLOCK * width * sizeof(float));
        float *mix = malloc((size_t)HC_ROW_BLOCK * mixes * sizeof(float));
        float *acc = malloc((size_t)D * sizeof(float));
        float *pre = malloc((size_t)n * sizeof(float));
#pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            const long t0 = b * HC_ROW_BLOCK;
            const long nb = T - t0 < HC_ROW_BLOCK ? T - t0 : HC_ROW_BLOCK;
            float inv[HC_ROW_BLOCK];
            for (long r = 0; r < nb; r++) {
                float *row = rows + r * width;
                load_row((const char *)streams + (size_t)(t0 + r) * width * es, dtype, row, width);
                inv[r] = 1.0f / sqrtf(sum_squares(row, width) / (float)width + norm_eps);
            }
            /* mix[r][m] = inv_r * <row_r, fn_m> */
            if (nb == HC_ROW_BLOCK) {
                mix_full_block(rows, fn, width, mixes, inv, mix);
            } else {
                for (long m = 0; m < mixes; m++) {
                    const float *restrict f = fn + m * width;
                    for (long r = 0; r < nb; r++) {
                        const float *restrict x = rows + r * width;
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (long i = 0; i < width; i++) s += f[i] * x[i];
                        mix[r * mixes + m] = s * inv[r];
                    }
                }
            }
            for (long r = 0; r < nb; r++) {
                const long t = t0 + r;
                hc_mixing(mix + r * mixes, base, scale, n, sinkhorn_iters, eps, pre, post + t * n, comb + t * n * n);
                /* collapsed = sum_j pre_j * X_j */
                const float *restrict row = rows + r * width;
                for (long i = 0; i < D; i++) acc[i] = pre[0] * row[i];
                for (long j = 1; j < n; j++) {
                    const float pj = pre[j];
                    const float *restrict xj = row + j * D;
                    for (long i = 0; i < D; i++) acc[i] += pj * xj[i];
                }
                store_row(acc, (char *)collapsed + (size_t)t * D * es, dtype, D);
            }
        }
        free(pre);
        free(acc);
        free(mix);
        free(rows);
    }
}

/* ----- hc_post: X'_k = post_k * y + sum_j comb[j, k] * X_j, per token -----
 * y [T, D] (y_dtype); streams [T, n, D] and out [T, n, D] (dtype); post [T, n], comb [T, n, n] fp32. */

void hc_post(const void *y, int y_dtype, const void *streams, const float *post, const float *comb, void *out,
             long T, long n, long D, int dtype, int num_threads) {
    const size_t es = elem_size(dtype), y_es = elem_size(y_dtype);
#pragma omp parallel num_threads(num_threads) if (T * n * D > PARALLEL_MIN_WORK && T > 1)
    {
        float *src = malloc((size_t)(n + 1) * D * sizeof(float)); /* X_0 .. X_{n-1}, y */
        float *acc = malloc((size_t)D * sizeof(float));
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            load_row((const char *)streams + (size_t)t * n * D * es, dtype, src, n * D);
            load_row((const char *)y + (size_t)t * D * y_es, y_dtype, src + n * D, D);
            const float *restrict yf = src + n * D;
            const float *restrict c = comb + t * n * n;
            for (long k = 0; k < n; k++) {
                const float ck0 = c[k];
                for (long i = 0; i < D; i++) acc[i] = ck0 * src[i];
                for (long j = 1; j < n; j++) {
                    const float cjk = c[j * n + k];
                    const float *restrict xj = src + j * D;
                    for (long i = 0; i < D; i++) acc[i] += cjk * xj[i];
                }
                const float pk = post[t * n + k];
                for (long i = 0; i < D; i++) acc[i] += pk * yf[i];
                store_row(acc, (char *)out + (size_t)(t * n + k) * D * es, dtype, D);
            }
        }
        free(acc);
        free(src);
    }
}

/* ----- swiglu: silu(min(gate, limit)) * clamp(up, -limit, limit), limit <= 0: no clamps -----
 * gate and up [rows, I] with a common row stride (the two halves of a fused gate/up product), out
 * contiguous [rows, I]; fp32 arithmetic, one rounding to the output dtype. */

static void swiglu_row(float *restrict g, const float *restrict u, long I, float hi, float lo) {
    for (long i = 0; i < I; i++) {
        const float gi = g[i] > hi ? hi : g[i];
        const float ui = u[i] > hi ? hi : (u[i] < lo ? lo : u[i]);
        g[i] = gi / (1.0f + vexpf(-gi)) * ui;
    }
}

void swiglu(const void *gate, const void *up, long row_stride, void *out, long rows, long I, float limit,
            int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
#pragma omp parallel num_threads(num_threads) if (rows * I > PARALLEL_MIN_WORK && rows > 1)
    {
        float *g = malloc((size_t)I * sizeof(float));
        float *u = malloc((size_t)I * sizeof(float));
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            load_row((const char *)gate + (size_t)r * row_stride * es, dtype, g, I);
            load_row((const char *)up + (size_t)r * row_stride * es, dtype, u, I);
            swiglu_row(g, u, I, hi, lo);
            store_row(g, (char *)out + (size_t)r * I * es, dtype, I);
        }
        free(u);
        free(g);
    }
}

/* ----- gemv_bf16: y = W x for one token; W [N, K] bf16 row-major, x [K] bf16, y [N] bf16 -----
 * Decode is weight-streaming bound: four weight rows per step share each load of x, with four
 * independent accumulators, and rows are split over the threads. With AVX512-BF16 each instruction
 * multiplies 32 bf16 pairs exactly into fp32 sums; elsewhere x is widened to fp32 once and the
 * compiler vectorises the fp32 dot products. Results are rounded to bf16 once, like torch. */

#if defined(__AVX512BF16__)
#include <immintrin.h>

static inline float dot_bf16(const uint16_t *restrict w, const uint16_t *restrict x, long K) {
    __m512 acc = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                               (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
    float s = _mm512_reduce_add_ps(acc);
    for (; k < K; k++) s += bf16_to_float(w[k]) * bf16_to_float(x[k]);
    return s;
}

static void gemv_rows(const uint16_t *restrict W, const uint16_t *restrict x, const float *restrict xf,
                      uint16_t *restrict y, long n0, long n1, long K) {
    (void)xf;
    long n = n0;
    for (; n + 4 <= n1 && K % 32 == 0; n += 4) {
        const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long k = 0; k < K; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w0 + k)), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w1 + k)), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(w2 + k)), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(w3 + k)), xv);
        }
        y[n] = float_to_bf16(_mm512_reduce_add_ps(a0));
        y[n + 1] = float_to_bf16(_mm512_reduce_add_ps(a1));
        y[n + 2] = float_to_bf16(_mm512_reduce_add_ps(a2));
        y[n + 3] = float_to_bf16(_mm512_reduce_add_ps(a3));
    }
    for (; n < n1; n++) y[n] = float_to_bf16(dot_bf16(W + n * K, x, K));
}

#else
static void gemv_rows(const uint16_t *restrict W, const uint16_t *restrict x, const float *restrict xf,
                      uint16_t *restrict y, long n0, long n1, long K) {
    (void)x;
    for (long n = n0; n < n1; n++) {
        const uint16_t *restrict w = W + n * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (long k = 0; k < K; k++) s += bf16_to_float(w[k]) * xf[k];
        y[n] = float_to_bf16(s);
    }
}

#endif

/* gemv_rows for m tokens (X [m, K], Y rows ldy apart), one token after another: the weight rows stay
 * in L1/L2 between tokens. */
static void gemv_rows_tokens(const uint16_t *restrict W, const uint16_t *restrict X, const float *restrict Xf,
                             uint16_t *restrict Y, long ldy, long m, long n0, long n1, long K) {
    for (long t = 0; t < m; t++) gemv_rows(W, X + t * K, Xf + t * K, Y + t * ldy, n0, n1, K);
}

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

/* ----- AMX (Intel Advanced Matrix Extensions) for the expert products, where the CPU has it -----
 * A tile multiply-add takes 16 weight rows x 32 k-values against 32 k-values x 16 tokens, so the
 * vector units no longer bound decode batches of several tokens per expert; the weights are read
 * straight from their [N, K] layout, the tokens are repacked into AMX's pair-interleaved layout.
 * Linux hands out the AMX register state on request (arch_prctl); without it, or without AMX,
 * amx_usable() is 0 and the dot-product path runs. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_REQUEST_PERMISSION 0x1023 /* ARCH_REQ_XCOMP_PERM */
#define AMX_TILE_DATA 18              /* XFEATURE_XTILEDATA */

int amx_usable(void) {
    static int state = -1; /* asked once per process, from the calling (main) thread */
    if (state < 0) state = syscall(SYS_arch_prctl, AMX_REQUEST_PERMISSION, AMX_TILE_DATA) == 0;
    return state;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_tile_config;

/* tiles 0-1: fp32 results (16 weight rows x 16 tokens); 4, 6: tokens; 5, 7: weights */
static void amx_configure(void) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) { config.rows[t] = 16; config.bytes_per_row[t] = 64; }
    _tile_loadconfig(&config);
}

static void amx_release(void) { _tile_release(); }

/* X [m <= 16, K] -> [K/2][16][2]: each 32-bit word a (k, k+1) pair of one token, zero past m */
static void amx_pack_tokens(const uint16_t *X, long m, long K, uint16_t *packed) {
    const int *x = (const int *)X;
    int *p = (int *)packed;
    /* word kk of the 16 tokens in one gather (stride K/2 words), lanes t >= m zero */
    const __m512i token = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)(K / 2)));
    const __mmask16 present = (__mmask16)((1u << m) - 1u);
    for (long kk = 0; kk < K / 2; kk++)
        _mm512_storeu_si512(p + kk * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, token, x + kk, 4));
}

/* Y[t, n0 .. n0+63] = W[n0 .. n0+63, :] . X[t, :] for the m tokens packed in `packed`: 16 weight
 * rows at a time (16 sequential streams for the prefetchers), even and odd k-steps in two result
 * tiles so consecutive tile products do not wait on each other */
static void amx_rows64(const uint16_t *W, long K, const uint16_t *packed, uint16_t *Y, long ldy, long m, long n0) {
    float C[2][16][16];
    for (long r0 = n0; r0 < n0 + 64; r0 += 16) {
        const uint16_t *w = W + r0 * K;
        _tile_zero(0);
        _tile_zero(1);
        long k = 0;
        for (; k + 64 <= K; k += 64) {
            _tile_loadd(4, packed + k * 16, 64);
            _tile_loadd(5, w + k, K * 2);
            _tile_loadd(6, packed + (k + 32) * 16, 64);
            _tile_loadd(7, w + k + 32, K * 2);
            _tile_dpbf16ps(0, 5, 4);
            _tile_dpbf16ps(1, 7, 6);
        }
        if (k < K) {
            _tile_loadd(4, packed + k * 16, 64);
            _tile_loadd(5, w + k, K * 2);
            _tile_dpbf16ps(0, 5, 4);
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        /* C[.][i][t] (weight row i, token t) -> Y[t][r0 + i]: a token's 16 values are a column of the
         * tiles, gathered (stride 16 floats), summed and rounded to bf16 sixteen at a time */
        const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(16));
        for (long t = 0; t < m; t++) {
            const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, &C[0][0][t], 4),
                                           _mm512_i32gather_ps(column, &C[1][0][t], 4));
            _mm256_storeu_si256((__m256i *)(Y + t * ldy + r0), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* expert_products on AMX: chunk c of 16 tokens of expert e is packed at packed + c * K * 16, the
 * expert's first chunk being first_chunk[e]; a work item is one expert's 64-row weight block,
 * applied to all its chunks while it sits in L2. Needs N % 64 == 0 and K % 32 == 0. */
static void expert_products_amx(const uint16_t *W, long N, long K, const long *active, long num_active,
                                const long *offsets, const long *first_chunk, long num_chunks, const uint16_t *X,
                                uint16_t *packed, uint16_t *Y, long ldy) {
#pragma omp for schedule(static)
    for (long c = 0; c < num_chunks; c++) {
        long e = 0;  /* the expert of chunk c (few experts: a linear search) */
        while (first_chunk[e + 1] <= c) e++;
        const long t0 = offsets[e] + (c - first_chunk[e]) * 16, m = offsets[e + 1] - t0 < 16 ? offsets[e + 1] - t0 : 16;
        amx_pack_tokens(X + t0 * K, m, K, packed + c * K * 16);
    }
    const long blocks = N / 64;
#pragma omp for schedule(static)
    for (long it = 0; it < num_active * blocks; it++) {
        const long e = active[it / blocks], n0 = (it % blocks) * 64;
        const uint16_t *We = W + (size_t)e * N * K;
        for (long c = first_chunk[e]; c < first_chunk[e + 1]; c++) {
            const long t0 = offsets[e] + (c - first_chunk[e]) * 16;
            const long m = offsets[e + 1] - t0 < 16 ? offsets[e + 1] - t0 : 16;
            amx_rows64(We, K, packed + c * K * 16, Y + t0 * ldy, ldy, m, n0);
        }
    }
}

#else
/* Without AMX at build time: amx_usable() is 0, and every caller checks it before using these. */
int amx_usable(void) { return 0; }
static void amx_configure(void) {}
static void amx_release(void) {}
static void expert_products_amx(const uint16_t *W, long N, long K, const long *active, long num_active,
                                const long *offsets, const long *first_chunk, long num_chunks, const uint16_t *X,
                                uint16_t *packed, uint16_t *Y, long ldy) {
    (void)W, (void)N, (void)K, (void)active, (void)num_active, (void)offsets, (void)first_chunk, (void)num_chunks;
    (void)X, (void)packed, (void)Y, (void)ldy;
    abort();
}
#endif

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

/* ----- experts_bf16: the routed experts of a decode-sized batch, streaming each weight once -----
 * rows [n, D] grouped by expert (expert e owns rows offsets[e] .. offsets[e+1]), w13 [E, 2I, D]
 * (gate rows then up rows), w2 [E, D, I]; out [n, D]. Each block of 16 weight rows is read from
 * memory once and applied to all of its expert's rows while it sits in L1. Only the experts that
 * have rows are visited, and their blocks are dealt to the threads evenly. Roundings follow the
 * reference: gate/up and the output of w2 to bf16 (as torch's bf16 products), swiglu in fp32 with
 * one rounding (as the swiglu kernel above). gate_up [n, 2I] and hidden [n, I] are scratch. */

static void expert_products(const uint16_t *W, long N, long K, const long *active, long num_active,
                            const long *offsets, const uint16_t *X, const float *Xf, uint16_t *Y, long ldy) {
    const long blocks = (N + 15) / 16;
#pragma omp for schedule(static)
    for (long it = 0; it < num_active * blocks; it++) {
        const long e = active[it / blocks], n0 = (it % blocks) * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        const long t = offsets[e];
        gemv_rows_tokens(W + (size_t)e * N * K, X + (size_t)t * K, Xf + (size_t)t * K, Y + (size_t)t * ldy, ldy,
                         offsets[e + 1] - t, n0, n1, K);
    }
}

void experts_bf16(const uint16_t *rows, long n, long D, const long *offsets, long E, const uint16_t *w13,
                  const uint16_t *w2, long I, float limit, uint16_t *gate_up, uint16_t *hidden, uint16_t *out,
                  int num_threads) {
    long *active = malloc((size_t)E * sizeof(long));
    long num_active = 0;
    for (long e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) active[num_active++] = e;
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
    const int amx = amx_usable() && D % 64 == 0 && I % 32 == 0;
    /* AMX: chunks of 16 tokens per expert and their packed copies; else fp32 copies of the inputs
     * for the portable dot product (unused with AVX512-BF16) */
    long *first_chunk = malloc((size_t)(E + 1) * sizeof(long));
    first_chunk[0] = 0;
    for (long e = 0; e < E; e++) first_chunk[e + 1] = first_chunk[e] + (offsets[e + 1] - offsets[e] + 15) / 16;
    const long num_chunks = first_chunk[E];
    const long K_max = D > I ? D : I;
    uint16_t *packed = amx ? aligned_alloc(64, (size_t)num_chunks * K_max * 16 * sizeof(uint16_t) + 64) : NULL;
    float *rows_f = amx ? NULL : malloc((size_t)n * D * sizeof(float));
    float *hidden_f = amx ? NULL : malloc((size_t)n * I * sizeof(float));
#pragma omp parallel num_threads(num_threads) if (n * D * I > PARALLEL_MIN_WORK)
    {
        float *g = malloc((size_t)I * sizeof(float));
        float *u = malloc((size_t)I * sizeof(float));
        if (amx) {
            amx_configure();
            expert_products_amx(w13, 2 * I, D, active, num_active, offsets, first_chunk, num_chunks, rows, packed,
                                gate_up, 2 * I);
        } else {
#pragma omp for schedule(static)
            for (long t = 0; t < n; t++) load_row(rows + (size_t)t * D, DT_BF16, rows_f + (size_t)t * D, D);
            expert_products(w13, 2 * I, D, active, num_active, offsets, rows, rows_f, gate_up, 2 * I);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            load_row(gate_up + (size_t)t * 2 * I, DT_BF16, g, I);
            load_row(gate_up + (size_t)t * 2 * I + I, DT_BF16, u, I);
            swiglu_row(g, u, I, hi, lo);
            store_row(g, hidden + (size_t)t * I, DT_BF16, I);
            if (!amx) load_row(hidden + (size_t)t * I, DT_BF16, hidden_f + (size_t)t * I, I);
        }
        if (amx) {
            expert_products_amx(w2, D, I, active, num_active, offsets, first_chunk, num_chunks, hidden, packed,
                                out, D);
            amx_release();
        } else {
            expert_products(w2, D, I, active, num_active, offsets, hidden, hidden_f, out, D);
        }
        free(u);
        free(g);
    }
    free(packed);
    free(hidden_f);
    free(rows_f);
    free(first_chunk);
    free(active);
}

/* ----- argmax_logsumexp: per row of fp32 logits [L, V] (row stride `stride`), the first maximal
 * index and log(sum(exp(x))): greedy decoding's token and log-normaliser in two vectorised passes
 * (max, then the sum of exp(x - max)) and a short scan for the index. Rows with an infinite or NaN
 * maximum give a non-finite log_norm; the caller recomputes those with torch. */

void argmax_logsumexp(const float *logits, long L, long V, long stride, int64_t *index, float *log_norm,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (L > 1 && L * V > PARALLEL_MIN_WORK)
    for (long r = 0; r < L; r++) {
        const float *restrict x = logits + (size_t)r * stride;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (long v = 0; v < V; v++) m = x[v] > m ? x[v] : m;
        long at = 0;
        while (at < V && x[at] != m) at++;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (long v = 0; v < V; v++) s += vexpf(x[v] - m);
        index[r] = at < V ? at : 0;
        log_norm[r] = isfinite(m) ? m + logf(s) : NAN;
    }
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

/* ----- moe_dispatch_rows: group the (token, choice) pairs by expert, then gather their rows -----
 * ids [T, k]; a stable counting sort (the order of argsort(ids.flatten(), stable=True)): counts
 * [E], source_token and source_slot [T*k], rows [T*k, D] = x[source_token] (row_bytes each).
 * *status = 1 (and nothing else written) when an id is outside [0, E). */

void moe_dispatch_rows(const int64_t *ids, long T, long k, long E, const void *x, long row_bytes, int64_t *counts,
                       int64_t *source_token, int64_t *source_slot, void *rows, int *status, int num_threads) {
    const long n = T * k;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= E) { *status = 1; return; }
    *status = 0;
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (long i = 0; i < n; i++) counts[ids[i]]++;
    int64_t *next = malloc((size_t)E * sizeof(int64_t));
    int64_t start = 0;
    for (long e = 0; e < E; e++) { next[e] = start; start += counts[e]; }
    for (long i = 0; i < n; i++) {
        const int64_t pos = next[ids[i]]++;
        source_token[pos] = i / k;
        source_slot[pos] = i % k;
    }
    free(next);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * row_bytes > 4 * PARALLEL_MIN_WORK)
    for (long i = 0; i < n; i++)
        memcpy((char *)rows + (size_t)i * row_bytes, (const char *)x + (size_t)source_token[i] * row_bytes,
               (size_t)row_bytes);
}

/* ----- moe_combine_rows: out[t] = sum_j weights[t, j] * rows[row of (t, j)], fp32 -----
 * rows [T*k, D] grouped by expert (every token owns exactly k of them), source_token/source_slot
 * [T*k] from the dispatch, weights [T, k] fp32, out [T, D] fp32. The k terms are added in
 * choice order, as the reference's [1, k] x [k, D] product. *status = 1 (nothing written) when
 * the rows are not exactly one per (token, choice). */

void moe_combine_rows(const void *rows, int dtype, long D, const int64_t *source_token, const int64_t *source_slot,
                      long T, long k, const float *weights, float *out, int *status, int num_threads) {
    const long n = T * k;
    const size_t es = elem_size(dtype);
    int64_t *where = malloc((size_t)n * sizeof(int64_t));
    for (long i = 0; i < n; i++) where[i] = -1;
    *status = 0;
    for (long i = 0; i < n && !*status; i++) {
        const int64_t t = source_token[i], j = source_slot[i];
        if (t < 0 || t >= T || j < 0 || j >= k || where[t * k + j] >= 0) *status = 1;
        else where[t * k + j] = i;
    }
    if (*status) { free(where); return; }  /* not one row per (token, choice): the caller's fallback */
#pragma omp parallel num_threads(num_threads) if (n * D > PARALLEL_MIN_WORK)
    {
        float *r = malloc((size_t)D * sizeof(float));
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            float *restrict y = out + (size_t)t * D;
            for (long j = 0; j < k; j++) {
                load_row((const char *)rows + (size_t)where[t * k + j] * D * es, dtype, r, D);
                const float w = weights[t * k + j];
                if (j == 0)
                    for (long d = 0; d < D; d++) y[d] = w * r[d];
                else
                    for (long d = 0; d < D; d++) y[d] += w * r[d];
            }
        }
        free(r);
    }
    free(where);
}

/* ----- sink_attention_decode: MQA with a per-head sink, for queries that see few keys (decode) -----
 * q [B, S, H, d], kv [B, L, d] (K = V), mask [B, S, L] (1 = attend), sinks [H] fp32; out [B, S, H, d]
 * in q's dtype. Per query, 16 heads at a time are the lanes of every vector: a key's scores for the
 * 16 heads are d multiply-adds with the key's elements broadcast, the softmax (the sink's logit
 * included) runs lane-wise over the keys, and the output accumulates p * v the same way, so there
 * are no horizontal sums. fp32 throughout; a query that sees no key gets 0 (the sink takes all). */

#define ATTN_LANES 16
typedef float lanes16 __attribute__((vector_size(ATTN_LANES * sizeof(float))));

static inline size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

void sink_attention_decode(const void *q, const void *kv, const uint8_t *mask, const float *sinks, float scale,
                           void *out, long B, long S, long H, long L, long d, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const long head_blocks = (H + ATTN_LANES - 1) / ATTN_LANES;
#pragma omp parallel num_threads(num_threads) if (B * S * H * L * d > PARALLEL_MIN_WORK)
    {
        lanes16 *qt = aligned_alloc(64, round64((size_t)d * sizeof(lanes16)));         /* [d], scaled */
        lanes16 *acc = aligned_alloc(64, round64((size_t)d * sizeof(lanes16)));        /* [d] */
        lanes16 *probs = aligned_alloc(64, round64((size_t)(L + 1) * sizeof(lanes16))); /* [L] */
        float *row = malloc((size_t)d * sizeof(float));
        float *keys_f = malloc((size_t)4 * d * sizeof(float));
#pragma omp for schedule(static)
        for (long item = 0; item < B * S * head_blocks; item++) {
            const long bs = item / head_blocks, b = bs / S, h0 = (item % head_blocks) * ATTN_LANES;
            const long nh = H - h0 < ATTN_LANES ? H - h0 : ATTN_LANES;
            for (long h = 0; h < ATTN_LANES; h++) {
                if (h < nh) load_row((const char *)q + (size_t)(bs * H + h0 + h) * d * es, dtype, row, d);
                for (long i = 0; i < d; i++) qt[i][h] = h < nh ? row[i] * scale : 0.0f;
            }
            const uint8_t *visible = mask + (size_t)bs * L;
            const char *keys = (const char *)kv + (size_t)b * L * d * es;
            lanes16 sink, top, sum;
            for (long h = 0; h < ATTN_LANES; h++) sink[h] = h < nh ? sinks[h0 + h] : 0.0f;
            top = sink;
            /* scores: four visible keys at a time share each load of qt */
            long l = 0;
            while (l < L) {
                long idx[4], n = 0;
                for (; l < L && n < 4; l++)
                    if (visible[l]) idx[n++] = l;
                for (long j = 0; j < n; j++) load_row(keys + (size_t)idx[j] * d * es, dtype, keys_f + j * d, d);
                for (long j = n; j < 4; j++) memset(keys_f + j * d, 0, (size_t)d * sizeof(float));
                lanes16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
                const float *k0 = keys_f, *k1 = keys_f + d, *k2 = keys_f + 2 * d, *k3 = keys_f + 3 * d;
                for (long i = 0; i < d; i++) {
                    const lanes16 qi = qt[i];
                    s0 += qi * k0[i];
                    s1 += qi * k1[i];
                    s2 += qi * k2[i];
                    s3 += qi * k3[i];
                }
                const lanes16 scores[4] = {s0, s1, s2, s3};
                for (long j = 0; j < n; j++) {
                    probs[idx[j]] = scores[j];
                    for (long h = 0; h < ATTN_LANES; h++) top[h] = scores[j][h] > top[h] ? scores[j][h] : top[h];
                }
            }
            for (long h = 0; h < ATTN_LANES; h++) sum[h] = vexpf(sink[h] - top[h]);
            for (long j = 0; j < L; j++) {
                if (!visible[j]) continue;
                lanes16 p;
#pragma omp simd
                for (long h = 0; h < ATTN_LANES; h++) p[h] = vexpf(probs[j][h] - top[h]);
                probs[j] = p;
                sum += p;
            }
            /* output: four visible keys per pass over the accumulators */
            for (long i = 0; i < d; i++) acc[i] = (lanes16){0};
            l = 0;
            while (l < L) {
                long idx[4], n = 0;
                for (; l < L && n < 4; l++)
                    if (visible[l]) idx[n++] = l;
                const lanes16 zero = {0};
                lanes16 p[4] = {zero, zero, zero, zero};
                for (long j = 0; j < n; j++) {
                    load_row(keys + (size_t)idx[j] * d * es, dtype, keys_f + j * d, d);
                    p[j] = probs[idx[j]];
                }
                for (long j = n; j < 4; j++) memset(keys_f + j * d, 0, (size_t)d * sizeof(float));
                const float *v0 = keys_f, *v1 = keys_f + d, *v2 = keys_f + 2 * d, *v3 = keys_f + 3 * d;
                for (long i = 0; i < d; i++) acc[i] += p[0] * v0[i] + p[1] * v1[i] + p[2] * v2[i] + p[3] * v3[i];
            }
            for (long h = 0; h < nh; h++) {
                const float inv = 1.0f / sum[h];
                for (long i = 0; i < d; i++) row[i] = acc[i][h] * inv;
                store_row(row, (char *)out + (size_t)(bs * H + h0 + h) * d * es, dtype, d);
            }
        }
        free(keys_f);
        free(row);
        free(probs);
        free(acc);
        free(qt);
    }
}
