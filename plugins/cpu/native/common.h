/* Shared by the C kernels of the cpu back end (one file per op family, compiled together into one
 * library by build.py): the dtype codes, the bf16 conversions, row loads and stores, and the small
 * math helpers.
 *
 * Conventions: row-major inputs, the last dimension contiguous; `dtype` 0 = fp32, 1 = bf16 (bf16 is
 * stored as uint16_t). All arithmetic is fp32. bf16 results are rounded to nearest-even exactly like
 * torch. Rows are split over OpenMP threads (the same libgomp as torch) when there is enough work.
 */
#ifndef DEEPINFER_CPU_NATIVE_COMMON_H
#define DEEPINFER_CPU_NATIVE_COMMON_H

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

/* Below this many elements of work a call stays on the calling thread (fork/join costs more). */
#define PARALLEL_MIN_WORK 65536L

/* `#pragma omp parallel num_threads(num_threads) if (cond)` around the block `...`, except that when
 * `cond` is false the block runs on the calling thread without entering the OpenMP runtime: a
 * serialised parallel region still costs ~1.5 us (libgomp sets up a team of one), as much as a decode
 * row's whole work in the small kernels. The block's `omp for` loops (written `_Pragma("omp for ...")`,
 * as a macro argument cannot hold a directive) then run orphaned, every iteration on this thread. */
#define PARALLEL_IF(cond, ...) \
    do { \
        if (cond) { \
            _Pragma("omp parallel num_threads(num_threads)") { __VA_ARGS__ } \
        } else { \
            __VA_ARGS__ \
        } \
    } while (0)

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

/* The experts' row ranges from the dispatch's counts (experts.c, quant_experts.c): expert e owns rows
 * [offsets[e], offsets[e + 1]); `active` lists the experts with rows. Returns 1 (nothing allocated)
 * when a count is negative or the counts do not add up to n, else 0 (the caller frees both arrays). */
static int expert_ranges(const int64_t *counts, long E, long n, long **offsets_out, long **active_out,
                         long *num_active) {
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
    *num_active = 0;
    for (long e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) active[(*num_active)++] = e;
    *offsets_out = offsets, *active_out = active;
    return 0;
}

/* silu(min(g, hi)) * clamp(u, lo, hi) in place of g (activation.c's swiglu, experts.c's hidden rows) */
static void swiglu_row(float *restrict g, const float *restrict u, long I, float hi, float lo) {
    for (long i = 0; i < I; i++) {
        const float gi = g[i] > hi ? hi : g[i];
        const float ui = u[i] > hi ? hi : (u[i] < lo ? lo : u[i]);
        g[i] = gi / (1.0f + vexpf(-gi)) * ui;
    }
}

#endif
