/* argmax_logsumexp: greedy sampling's token and log-normaliser. */
#include "common.h"

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
