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
 * logits. Rows are split over the threads; a single row (batch-1 decode) stays on the calling
 * thread: cut over two threads it took 26 instead of 43 us with the threads hot, but woke a
 * sleeping OpenMP thread after the step's Python, which on a loaded machine cost a whole time slice
 * (24-28 ms a step). Rows with an infinite or NaN maximum give a non-finite log_norm; the caller
 * recomputes those with torch. */

void argmax_logsumexp(const float *logits, long L, long V, long stride, int64_t *index, float *log_norm,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (L > 1 && L * V > PARALLEL_MIN_WORK)
    for (long r = 0; r < L; r++) {
        const lse_part p = lse_scan(logits + (size_t)r * stride, V);
        index[r] = p.at;
        log_norm[r] = isfinite(p.m) ? p.m + logf(p.s) : NAN;
    }
}
