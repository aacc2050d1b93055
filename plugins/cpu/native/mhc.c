/* The mHC (hyper-connection) kernels: hc_pre (mixing weights with Sinkhorn, collapsed input), hc_post
 * (the unit's output mixed back into the streams), hc_post_pre_norm (one site's hc_post and the next
 * site's hc_pre_norm in one call) and hc_head; and DeepSeek-V4.1's single-pass sites, whose input is
 * the streams collapsed with the PREVIOUS site's pre while they compute their own (hc_mix_collapse_norm,
 * hc_post_mix_collapse_norm). */
#include "common.h"

/* ----- hc_pre: mHC mixing weights and the collapsed input of one unit, per token -----
 * streams [T, n, D]; fn [n*(n+2), n*D] fp32; fn_t: fn transposed [n*D, n*(n+2)] or NULL; base
 * [n*(n+2)] fp32; scale [3] fp32. Outputs: collapsed [T, D] (streams' dtype), post [T, n] fp32,
 * comb [T, n, n] fp32. */

/* Token rows of a mixing tile (fn or fn_t is read once per tile instead of once per row). */
#define HC_ROW_BLOCK 4

/* Features per pass of the dot products below: the 4 row pieces (8 KiB) stay in L1 while every fn row
 * passes over them. */
#define HC_CHUNK 512

/* mix[r][m] = inv[r] * <row_r, fn_m> for the HC_ROW_BLOCK (4) token rows of a tile, four fn rows
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

/* The same for the nb < HC_ROW_BLOCK rows left after a block's tiles (decode at batch 1: the only
 * one), one row at a time, four fn rows per pass (four independent sums instead of one chain). */
static void mix_rows(const float *restrict rows, long nb, const float *restrict fn, long width, long mixes,
                     const float *restrict inv, float *restrict mix) {
    for (long r = 0; r < nb; r++) {
        const float *restrict x = rows + r * width;
        long m = 0;
        for (; m + 3 < mixes; m += 4) {
            const float *restrict f = fn + m * width, *restrict g = f + width;
            const float *restrict h = g + width, *restrict e = h + width;
            float a = 0.0f, b = 0.0f, c = 0.0f, d = 0.0f;
#pragma omp simd reduction(+ : a, b, c, d)
            for (long i = 0; i < width; i++) {
                a += f[i] * x[i];
                b += g[i] * x[i];
                c += h[i] * x[i];
                d += e[i] * x[i];
            }
            mix[r * mixes + m] = a * inv[r], mix[r * mixes + m + 1] = b * inv[r];
            mix[r * mixes + m + 2] = c * inv[r], mix[r * mixes + m + 3] = d * inv[r];
        }
        for (; m < mixes; m++) {
            const float *restrict f = fn + m * width;
            float a = 0.0f;
#pragma omp simd reduction(+ : a)
            for (long i = 0; i < width; i++) a += f[i] * x[i];
            mix[r * mixes + m] = a * inv[r];
        }
    }
}

/* acc [D] = sum_j pre_j * X_j over one token's n streams `row` [n, D] (the collapse of hc_pre and hc_head) */
static void collapse_row(const float *restrict row, const float *restrict pre, long n, long D, float *restrict acc) {
    for (long i = 0; i < D; i++) acc[i] = pre[0] * row[i];
    for (long j = 1; j < n; j++) {
        const float pj = pre[j];
        const float *restrict xj = row + j * D;
        for (long i = 0; i < D; i++) acc[i] += pj * xj[i];
    }
}

/* ----- the 4-row tiles of the mixing product over fn transposed (fn_t [n*D, mixes], mixes = 24: n = 4) -----
 * Each feature's 24 weights are contiguous, so a row's 24 sums are three 8-wide vector accumulators
 * fed by one broadcast of the feature (12 for the tile's 4 rows: 16 registers with the weights and the
 * broadcast, AVX2's whole set), with no horizontal sums; 2.5x faster than the dot products above on
 * the same 4 rows. Each (row, mix) sum runs over the features in order. */
#define HC_T_MIXES 24

static void mix_tile_t(const float *restrict rows, const float *restrict fn_t, long width,
                       const float *restrict inv, float *restrict mix) {
    float a0[HC_T_MIXES] = {0}, a1[HC_T_MIXES] = {0}, a2[HC_T_MIXES] = {0}, a3[HC_T_MIXES] = {0};
    const float *restrict x0 = rows, *restrict x1 = rows + width, *restrict x2 = rows + 2 * width;
    const float *restrict x3 = rows + 3 * width;
    for (long i = 0; i < width; i++) {
        const float *restrict f = fn_t + i * HC_T_MIXES;
        const float v0 = x0[i], v1 = x1[i], v2 = x2[i], v3 = x3[i];
#pragma omp simd
        for (int m = 0; m < HC_T_MIXES; m++) {
            a0[m] += v0 * f[m];
            a1[m] += v1 * f[m];
            a2[m] += v2 * f[m];
            a3[m] += v3 * f[m];
        }
    }
    for (int m = 0; m < HC_T_MIXES; m++) {
        mix[m] = a0[m] * inv[0], mix[HC_T_MIXES + m] = a1[m] * inv[1];
        mix[2 * HC_T_MIXES + m] = a2[m] * inv[2], mix[3 * HC_T_MIXES + m] = a3[m] * inv[3];
    }
}

/* ----- the Sinkhorn rounds of L token rows at once, one vector lane per row -----
 * c [n*n][L]: every step is the same for each row, so the loops over the lanes vectorise, and each
 * lane gets the one-row recurrence's operations in its order (the same bits as one row alone: exact
 * divisions, sums from 0 in index order). Unused lanes hold 1s. L is HC_LANES, or 1 for a lone row
 * (decode at batch 1: 16 lanes of divisions cost it more than the scalar chain). */
#define HC_LANES 16

static inline __attribute__((always_inline)) void sinkhorn_lanes(float *restrict c, long n, int sinkhorn_iters,
                                                                 float eps, const int L) {
    float total[HC_LANES];
    for (int it = 0; it < (sinkhorn_iters > 1 ? sinkhorn_iters : 1); it++) {
        if (it > 0) {
            for (long i = 0; i < n; i++) {
                for (int l = 0; l < L; l++) total[l] = 0.0f;
                for (long k = 0; k < n; k++)
                    for (int l = 0; l < L; l++) total[l] += c[(i * n + k) * L + l];
                for (int l = 0; l < L; l++) total[l] += eps;
                for (long k = 0; k < n; k++)
                    for (int l = 0; l < L; l++) c[(i * n + k) * L + l] /= total[l];
            }
        }
        for (long k = 0; k < n; k++) {
            for (int l = 0; l < L; l++) total[l] = 0.0f;
            for (long i = 0; i < n; i++)
                for (int l = 0; l < L; l++) total[l] += c[(i * n + k) * L + l];
            for (int l = 0; l < L; l++) total[l] += eps;
            for (long i = 0; i < n; i++)
                for (int l = 0; l < L; l++) c[(i * n + k) * L + l] /= total[l];
        }
    }
}

/* pre, post and the softmaxed comb of one row (the steps before the Sinkhorn rounds); comb goes to
 * lane `l` of the L-lane layout */
static inline __attribute__((always_inline)) void hc_logits(const float *restrict mix, const float *restrict base,
                                                            const float *restrict scale, long n, float eps,
                                                            float *restrict pre, float *restrict post,
                                                            float *restrict lanes, long l, const int L) {
    for (long j = 0; j < n; j++) {
        pre[j] = sigmoid(mix[j] * scale[0] + base[j]) + eps;
        post[j] = 2.0f * sigmoid(mix[n + j] * scale[1] + base[n + j]);
    }
    /* comb = softmax over each row of the n x n block, plus eps */
    for (long i = 0; i < n; i++) {
        float *row = lanes + i * n * L + l; /* element k at row[k * L] */
        float mx = -INFINITY;
        for (long k = 0; k < n; k++) {
            row[k * L] = mix[2 * n + i * n + k] * scale[2] + base[2 * n + i * n + k];
            mx = row[k * L] > mx ? row[k * L] : mx;
        }
        float total = 0.0f;
        for (long k = 0; k < n; k++) {
            row[k * L] = expf(row[k * L] - mx);
            total += row[k * L];
        }
        for (long k = 0; k < n; k++) row[k * L] = row[k * L] / total + eps;
    }
}

/* A lone row's pre, post and comb (decode at batch 1), built for 256-bit vectors: at 512 bits gcc
 * turns the one-lane loops into masked zmm code that made the whole hc_pre_norm call ~1 us (~20 %)
 * slower. Element-wise arithmetic only, so the same bits at any vector width. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HC_VECTOR_256 __attribute__((target("prefer-vector-width=256")))
#else
#define HC_VECTOR_256
#endif

__attribute__((noinline)) HC_VECTOR_256 static void hc_coefficients_row(
    const float *restrict mix, const float *restrict base, const float *restrict scale, long n, int sinkhorn_iters,
    float eps, float *restrict pre, float *restrict post, float *restrict comb) {
    hc_logits(mix, base, scale, n, eps, pre, post, comb, 0, 1);
    sinkhorn_lanes(comb, n, sinkhorn_iters, eps, 1);
}

/* ----- hc_post: X'_k = post_k * y + sum_j comb[j, k] * X_j, per token -----
 * y [T, D] (y_dtype); streams [T, n, D] and out [T, n, D] (dtype); post [T, n], comb [T, n, n] fp32. */

/* One token's n = 4 outputs in one pass over its rows (each feature's 5 inputs feed its 4 outputs from
 * registers, instead of a pass over the row per output): the general loop's operations in its order. */
static void hc_post_row4(const float *restrict src, const float *restrict yf, const float *restrict c,
                         const float *restrict p, float *restrict acc, long D) {
    const float *restrict x0 = src, *restrict x1 = src + D, *restrict x2 = src + 2 * D, *restrict x3 = src + 3 * D;
    float *restrict o0 = acc, *restrict o1 = acc + D, *restrict o2 = acc + 2 * D, *restrict o3 = acc + 3 * D;
    for (long i = 0; i < D; i++) {
        float a0 = c[0] * x0[i], a1 = c[1] * x0[i], a2 = c[2] * x0[i], a3 = c[3] * x0[i];
        a0 += c[4] * x1[i], a1 += c[5] * x1[i], a2 += c[6] * x1[i], a3 += c[7] * x1[i];
        a0 += c[8] * x2[i], a1 += c[9] * x2[i], a2 += c[10] * x2[i], a3 += c[11] * x2[i];
        a0 += c[12] * x3[i], a1 += c[13] * x3[i], a2 += c[14] * x3[i], a3 += c[15] * x3[i];
        o0[i] = a0 + p[0] * yf[i], o1[i] = a1 + p[1] * yf[i], o2[i] = a2 + p[2] * yf[i], o3[i] = a3 + p[3] * yf[i];
    }
}

/* The inputs of the hc_post that hc_post_pre_norm runs first (NULL for hc_pre and hc_pre_norm). */
typedef struct {
    const void *y;
    int y_dtype;
    const void *streams;
    const float *post, *comb;
} hc_post_inputs;

/* Token t's n fp32 outputs into acc [n, D]; src: scratch of (n + 1) * D (the streams, then y). */
static void hc_post_token(const hc_post_inputs *in, long t, long n, long D, int dtype, float *restrict src,
                          float *restrict acc) {
    load_row((const char *)in->streams + (size_t)t * n * D * elem_size(dtype), dtype, src, n * D);
    load_row((const char *)in->y + (size_t)t * D * elem_size(in->y_dtype), in->y_dtype, src + n * D, D);
    const float *restrict yf = src + n * D;
    const float *restrict c = in->comb + t * n * n;
    if (n == 4) {
        hc_post_row4(src, yf, c, in->post + t * n, acc, D);
        return;
    }
    for (long k = 0; k < n; k++) {
        float *restrict ak = acc + k * D;
        const float ck0 = c[k];
        for (long i = 0; i < D; i++) ak[i] = ck0 * src[i];
        for (long j = 1; j < n; j++) {
            const float cjk = c[j * n + k];
            const float *restrict xj = src + j * D;
            for (long i = 0; i < D; i++) ak[i] += cjk * xj[i];
        }
        const float pk = in->post[t * n + k];
        for (long i = 0; i < D; i++) ak[i] += pk * yf[i];
    }
}

void hc_post(const void *y, int y_dtype, const void *streams, const float *post, const float *comb, void *out,
             long T, long n, long D, int dtype, int num_threads) {
    const hc_post_inputs in = {y, y_dtype, streams, post, comb};
    PARALLEL_IF(T * n * D > PARALLEL_MIN_WORK && T > 1, {
        float *src = malloc((size_t)(2 * n + 1) * D * sizeof(float)); /* X_0 .. X_{n-1}, y, then the n outputs */
        float *acc = src + (n + 1) * D;
        _Pragma("omp for schedule(static)")
        for (long t = 0; t < T; t++) {
            hc_post_token(&in, t, n, D, dtype, src, acc);
            store_row(acc, (char *)out + (size_t)t * n * D * elem_size(dtype), dtype, n * D);
        }
        free(src);
    });
}

/* ----- hc_pre, and hc_pre_norm with the sub-layer's RMSNorm of the collapse in the same pass -----
 * Blocks of HC_LANES rows: their mixing products in 4-row tiles (over fn_t when given and n = 4,
 * else the dot products; a block's last rows one at a time), their Sinkhorn rounds in the lanes, then
 * each row's collapse (and norm) while the row is still in cache. With `prev` (hc_post_pre_norm) a
 * block's rows are first made by the previous site's hc_post and stored to `streams`; hc_pre then reads
 * them as stored (rounded to dtype), so the call gives the bits of hc_post then hc_pre_norm.
 * With `pre_in` [T, n] (V4.1's single-pass sites) the collapse uses it instead of the pre just computed,
 * which goes to `pre_out` [T, n] (when not NULL).
 * Each thread's scratch holds min(T, HC_LANES) rows (a decode token's ~20 KB at n*D = 2048, not a
 * 16-row block's ~135 KB). */
static void hc_pre_rows(const hc_post_inputs *prev, void *streams, const float *pre_in, const float *fn,
                        const float *fn_t, const float *base, const float *scale, void *out, float *pre_out,
                        float *post, float *comb, long T, long n, long D, int sinkhorn_iters, float eps,
                        float norm_eps, const void *norm_weight, int w_dtype, float rms_eps, int dtype,
                        int rows_alone, int num_threads) {
    const size_t es = elem_size(dtype);
    const long width = n * D, mixes = n * (n + 2);
    const long per_block = rows_alone ? 1 : HC_LANES; /* rows_alone: each row as a call of one row */
    const long blocks = (T + per_block - 1) / per_block, block_rows = T < per_block ? T : per_block;
    const int tiles_t = fn_t != NULL && mixes == HC_T_MIXES;
    PARALLEL_IF(T * width > PARALLEL_MIN_WORK && blocks > 1, {
        const size_t src_size = prev != NULL ? (size_t)(n + 1) * D : 0; /* hc_post's inputs of one token */
        float *rows = malloc(((size_t)block_rows * (width + mixes + n) + (size_t)HC_LANES * n * n + 2 * D + src_size)
                             * sizeof(float));
        float *mix = rows + block_rows * width, *pre = mix + block_rows * mixes, *lanes = pre + block_rows * n;
        float *acc = lanes + HC_LANES * n * n, *wf = acc + D, *src = wf + D;
        const float *w = norm_weight != NULL && w_dtype == DT_F32 ? (const float *)norm_weight : wf;
        if (norm_weight != NULL && w_dtype != DT_F32) load_row(norm_weight, w_dtype, wf, D);
        _Pragma("omp for schedule(static)")
        for (long b = 0; b < blocks; b++) {
            const long t0 = b * per_block;
            const long nb = T - t0 < per_block ? T - t0 : per_block;
            float inv[HC_LANES];
            for (long r = 0; r < nb; r++) {
                float *row = rows + r * width;
                char *stored = (char *)streams + (size_t)(t0 + r) * width * es;
                if (prev == NULL) {
                    load_row(stored, dtype, row, width);
                } else {
                    hc_post_token(prev, t0 + r, n, D, dtype, src, row);
                    store_row(row, stored, dtype, width);
                    if (dtype == DT_BF16) /* as load_row reads it back */
                        for (long i = 0; i < width; i++) row[i] = bf16_to_float(float_to_bf16(row[i]));
                }
                inv[r] = 1.0f / sqrtf(sum_squares(row, width) / (float)width + norm_eps);
            }
            /* mix[r][m] = inv_r * <row_r, fn_m>, 4-row tiles then the last rows */
            long r0 = 0;
            for (; r0 + HC_ROW_BLOCK <= nb; r0 += HC_ROW_BLOCK) {
                if (tiles_t) {
                    mix_tile_t(rows + r0 * width, fn_t, width, inv + r0, mix + r0 * mixes);
                } else {
                    mix_full_block(rows + r0 * width, fn, width, mixes, inv + r0, mix + r0 * mixes);
                }
            }
            if (r0 < nb) mix_rows(rows + r0 * width, nb - r0, fn, width, mixes, inv + r0, mix + r0 * mixes);
            const int L = nb == 1 ? 1 : HC_LANES;
            if (nb == 1) {
                hc_coefficients_row(mix, base, scale, n, sinkhorn_iters, eps, pre, post + t0 * n, lanes);
            } else {
                for (long l = 0; l < n * n * HC_LANES; l++) lanes[l] = 1.0f;
                for (long r = 0; r < nb; r++)
                    hc_logits(mix + r * mixes, base, scale, n, eps, pre + r * n, post + (t0 + r) * n, lanes, r,
                              HC_LANES);
                sinkhorn_lanes(lanes, n, sinkhorn_iters, eps, HC_LANES);
            }
            for (long r = 0; r < nb; r++) {
                const long t = t0 + r;
                for (long e = 0; e < n * n; e++) comb[t * n * n + e] = lanes[e * L + r];
                if (pre_out != NULL) memcpy(pre_out + t * n, pre + r * n, (size_t)n * sizeof(float));
                collapse_row(rows + r * width, pre_in != NULL ? pre_in + t * n : pre + r * n, n, D, acc);
                if (norm_weight != NULL) { /* as rms_norm (norm_rope.c) on the collapse rounded to dtype */
                    if (dtype == DT_BF16)
                        for (long i = 0; i < D; i++) acc[i] = bf16_to_float(float_to_bf16(acc[i]));
                    const float r_inv = 1.0f / sqrtf(sum_squares(acc, D) / (float)D + rms_eps);
                    for (long i = 0; i < D; i++) acc[i] = (acc[i] * r_inv) * w[i];
                }
                store_row(acc, (char *)out + (size_t)t * D * es, dtype, D);
            }
        }
        free(rows);
    });
}

void hc_pre(const void *streams, const float *fn, const float *fn_t, const float *base, const float *scale,
            void *collapsed, float *post, float *comb, long T, long n, long D, int sinkhorn_iters, float eps,
            float norm_eps, int dtype, int num_threads) {
    hc_pre_rows(NULL, (void *)streams, NULL, fn, fn_t, base, scale, collapsed, NULL, post, comb, T, n, D,
                sinkhorn_iters, eps, norm_eps, NULL, DT_F32, 0.0f, dtype, 0, num_threads);
}

/* As the two calls hc_pre then rms_norm (norm_rope.c) in a row: the collapse is rounded to `dtype`
 * before it is normalised; normed [T, D] in `dtype`, norm_weight [D] in w_dtype. */
void hc_pre_norm(const void *streams, const float *fn, const float *fn_t, const float *base, const float *scale,
                 void *normed, float *post, float *comb, long T, long n, long D, int sinkhorn_iters, float eps,
                 float norm_eps, const void *norm_weight, int w_dtype, float rms_eps, int dtype, int num_threads) {
    hc_pre_rows(NULL, (void *)streams, NULL, fn, fn_t, base, scale, normed, NULL, post, comb, T, n, D,
                sinkhorn_iters, eps, norm_eps, norm_weight, w_dtype, rms_eps, dtype, 0, num_threads);
}

/* Between two mHC sites: hc_post of the first (y [T, D] in y_dtype, streams [T, n, D], post_in [T, n],
 * comb_in [T, n, n]) into streams_out [T, n, D], then hc_pre_norm of the second on streams_out, in one
 * pass per token: the bits of the two calls in a row. */
void hc_post_pre_norm(const void *y, int y_dtype, const void *streams, const float *post_in, const float *comb_in,
                      void *streams_out, const float *fn, const float *fn_t, const float *base, const float *scale,
                      void *normed, float *post, float *comb, long T, long n, long D, int sinkhorn_iters, float eps,
                      float norm_eps, const void *norm_weight, int w_dtype, float rms_eps, int dtype,
                      int num_threads) {
    const hc_post_inputs prev = {y, y_dtype, streams, post_in, comb_in};
    hc_pre_rows(&prev, streams_out, NULL, fn, fn_t, base, scale, normed, NULL, post, comb, T, n, D, sinkhorn_iters,
                eps, norm_eps, norm_weight, w_dtype, rms_eps, dtype, 0, num_threads);
}

/* ----- DeepSeek-V4.1's single-pass sites -----
 * hc_mix_collapse_norm: a site's coefficients (pre [T, n], post, comb) from the streams arriving at it,
 * and its sub-layer's input: the streams collapsed with the previous site's pre_in [T, n], then
 * RMS-normalised as hc_pre_norm does (the collapse rounded to dtype first). pre_in must not be pre.
 * Each row is computed alone (hc_pre's one-row path, so no transposed fn): its bits do not depend on
 * the rows beside it, so a step split over context-parallel ranks, a chunk or a batch gives the same values. */
void hc_mix_collapse_norm(const void *streams, const float *pre_in, const float *fn, const float *base,
                          const float *scale, void *normed, float *pre, float *post, float *comb, long T, long n,
                          long D, int sinkhorn_iters, float eps, float norm_eps, const void *norm_weight,
                          int w_dtype, float rms_eps, int dtype, int num_threads) {
    hc_pre_rows(NULL, (void *)streams, pre_in, fn, NULL, base, scale, normed, pre, post, comb, T, n, D,
                sinkhorn_iters, eps, norm_eps, norm_weight, w_dtype, rms_eps, dtype, 1, num_threads);
}

/* Between two single-pass sites: hc_post of the first (as hc_post_pre_norm) into streams_out, then
 * hc_mix_collapse_norm of the second on it, in one pass per token. */
void hc_post_mix_collapse_norm(const void *y, int y_dtype, const void *streams, const float *post_in,
                               const float *comb_in, void *streams_out, const float *pre_in, const float *fn,
                               const float *base, const float *scale, void *normed, float *pre,
                               float *post, float *comb, long T, long n, long D, int sinkhorn_iters, float eps,
                               float norm_eps, const void *norm_weight, int w_dtype, float rms_eps, int dtype,
                               int num_threads) {
    const hc_post_inputs prev = {y, y_dtype, streams, post_in, comb_in};
    hc_pre_rows(&prev, streams_out, pre_in, fn, NULL, base, scale, normed, pre, post, comb, T, n, D, sinkhorn_iters,
                eps, norm_eps, norm_weight, w_dtype, rms_eps, dtype, 1, num_threads);
}

/* ----- hc_head: the output head's collapse, sum_j pre_j * X_j with pre = sigmoid(mix * scale + base) + eps -----
 * streams [T, n, D]; fn [n, n*D], base [n] fp32; scale [1] fp32 (one factor for every stream); mix as
 * hc_pre's (the RMS factor of the flattened row applied to the product); out [T, D] in `dtype`. */
void hc_head(const void *streams, const float *fn, const float *base, const float *scale, void *out, long T, long n,
             long D, float eps, float norm_eps, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    const long width = n * D;
    PARALLEL_IF(T * width > PARALLEL_MIN_WORK && T > 1, {
        float *row = malloc((size_t)width * sizeof(float));
        float *acc = malloc((size_t)D * sizeof(float));
        float *pre = malloc((size_t)n * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (long t = 0; t < T; t++) {
            load_row((const char *)streams + (size_t)t * width * es, dtype, row, width);
            const float inv = 1.0f / sqrtf(sum_squares(row, width) / (float)width + norm_eps);
            for (long m = 0; m < n; m++) {
                const float *restrict f = fn + m * width;
                float dot = 0.0f;
                _Pragma("omp simd reduction(+ : dot)")
                for (long i = 0; i < width; i++) dot += f[i] * row[i];
                pre[m] = sigmoid(dot * inv * scale[0] + base[m]) + eps;
            }
            collapse_row(row, pre, n, D, acc);
            store_row(acc, (char *)out + (size_t)t * D * es, dtype, D);
        }
        free(pre);
        free(acc);
        free(row);
    });
}

