/* argmax_logsumexp: greedy sampling's token and log-normaliser. */
#include "common.h"

/* Floats per block of the one-pass scan: 8 KiB, read once from memory, then twice from L1. */
#define LSE_BLOCK 2048L

/* The max, the first index of it, and the sum of exp(x - max) over x[0, n) (an online log-sum-exp).
 * `s` is NaN when a NaN was seen. */
typedef struct {
    float m;
    long at;
    float s;
} lse_part;

/* One pass over memory: per block its max (vectorised); when it raises the running max the sum so far
 * is rescaled once, and the block's exp(x - max) summed while it is in L1. The argmax is searched
 * for only inside the first block that reached the final max (a scalar scan of a whole row would
 * cost as much as the vectorised passes together). Blocks seen while the running max is still -inf
 * are all -inf or NaN: their sum is not taken (-inf - -inf is NaN), only a NaN is looked for. */
static lse_part lse_scan(const float *restrict x, long n) {
    float m = -INFINITY, s = 0.0f;
    long first = -1;
    int nan = 0;
    for (long b = 0; b < n; b += LSE_BLOCK) {
        const long e = b + LSE_BLOCK < n ? b + LSE_BLOCK : n;
        float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
        for (long v = b; v < e; v++) bm = x[v] > bm ? x[v] : bm;
        if (bm > m) {
            s *= expf(m - bm);  /* 0 while m is -inf */
            m = bm;
            first = b;
        }
        if (m == -INFINITY) {
            for (long v = b; v < e; v++) nan |= x[v] != x[v];
            continue;
        }
        float bs = 0.0f;
#pragma omp simd reduction(+ : bs)
        for (long v = b; v < e; v++) bs += vexpf(x[v] - m);
        s += bs;
    }
    long at = 0;
    if (first >= 0) {
        const long e = first + LSE_BLOCK < n ? first + LSE_BLOCK : n;
        for (at = first; at < e && x[at] != m; at++) {}
    }
    lse_part out = {m, at, nan ? NAN : s};
    return out;
}

/* ----- argmax_logsumexp: per row of fp32 logits [L, V] (row stride `stride`), the first maximal
 * index and log(sum(exp(x))): greedy decoding's token and log-normaliser in one pass over the
 * logits. Rows are split over the threads; with fewer rows than threads (batch-1 decode) each row
 * is cut into one part per thread (whole blocks) and the parts combined: the first part holding
 * the max gives the index, the sums are rescaled to it. Rows with an infinite or NaN maximum give
 * a non-finite log_norm; the caller recomputes those with torch. */

void argmax_logsumexp(const float *logits, long L, long V, long stride, int64_t *index, float *log_norm,
                      int num_threads) {
    if (L <= 0 || V <= 0) return;
    long parts = L < num_threads ? num_threads / L : 1;
    const long blocks = (V + LSE_BLOCK - 1) / LSE_BLOCK;
    if (parts > blocks) parts = blocks;
    const long width = (blocks + parts - 1) / parts * LSE_BLOCK;  /* floats per part */
    parts = (V + width - 1) / width;
    lse_part *out = malloc((size_t)(L * parts) * sizeof(lse_part));
    PARALLEL_IF(L * parts > 1 && L * V > PARALLEL_MIN_WORK,
        _Pragma("omp for schedule(static)")
        for (long t = 0; t < L * parts; t++) {
            const long r = t / parts, start = t % parts * width;
            const long n = start + width < V ? width : V - start;
            out[t] = lse_scan(logits + (size_t)r * stride + start, n);
            out[t].at += start;
        }
    );
    for (long r = 0; r < L; r++) {
        const lse_part *p = out + r * parts;
        float m = p[0].m;
        long at = p[0].at;
        for (long k = 1; k < parts; k++)
            if (p[k].m > m) {
                m = p[k].m;
                at = p[k].at;
            }
        float s = 0.0f;
        for (long k = 0; k < parts; k++) s += p[k].s * expf(p[k].m - m);
        index[r] = at;
        log_norm[r] = isfinite(m) ? m + logf(s) : NAN;
    }
    free(out);
}
