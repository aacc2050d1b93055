/* moe_dispatch_rows and moe_combine_rows: the MoE's grouping of rows by expert and its weighted sum. */
#include "common.h"

/* ----- moe_dispatch_rows: group the (token, choice) pairs by expert, then gather their rows -----
 * ids [T, k]; a stable counting sort (the order of argsort(ids.flatten(), stable=True)): counts
 * [E], source_token and source_slot [T*k], rows [T*k, D] = x[source_token] (row_bytes each).
 * Returns 1 (and writes nothing) when an id is outside [0, E), else 0. */

int moe_dispatch_rows(const int64_t *ids, long T, long k, long E, const void *x, long row_bytes, int64_t *counts,
                      int64_t *source_token, int64_t *source_slot, void *rows, int num_threads) {
    const long n = T * k;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= E) return 1;
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
    return 0;
}

/* ----- moe_combine_rows: out[t] = sum_j weights[t, j] * rows[row of (t, j)], fp32 -----
 * rows [T*k, D] grouped by expert (every token owns exactly k of them), source_token/source_slot
 * [T*k] from the dispatch, weights [T, k] fp32, out [T, D] fp32. The k terms are added in
 * choice order, as the reference's [1, k] x [k, D] product. Returns 1 (nothing written) when the
 * rows are not exactly one per (token, choice), else 0. */

int moe_combine_rows(const void *rows, int dtype, long D, const int64_t *source_token, const int64_t *source_slot,
                     long T, long k, const float *weights, float *out, int num_threads) {
    const long n = T * k;
    const size_t es = elem_size(dtype);
    int64_t *where = malloc((size_t)n * sizeof(int64_t));
    for (long i = 0; i < n; i++) where[i] = -1;
    int status = 0;
    for (long i = 0; i < n && !status; i++) {
        const int64_t t = source_token[i], j = source_slot[i];
        if (t < 0 || t >= T || j < 0 || j >= k || where[t * k + j] >= 0) status = 1;
        else where[t * k + j] = i;
    }
    if (status) { free(where); return 1; }  /* not one row per (token, choice): the caller's fallback */
    PARALLEL_IF(n * D > PARALLEL_MIN_WORK, {
        float *r = malloc((size_t)D * sizeof(float));
        _Pragma("omp for schedule(static)")
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
    });
    free(where);
    return 0;
}
