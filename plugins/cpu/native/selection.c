/* The top-k selections of a decode step: the lightning indexer's entry scores (indexer_scores) and the
 * MoE router's expert choice (moe_route_rows). */
#include "common.h"

/* ----- indexer_scores: I[b, s, e] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, e]) -----
 * q [B, S, Hi, di] and keys [B, E, di] in `dtype` (fp32 or bf16), w [B, S, Hi] fp32, mask [B, S, E]
 * (1 = visible); out [B, S, E] fp32, -inf where not visible. The query's heads are widened to fp32
 * once, each key once per query; the dot products are fp32 with the compiler's vector reduction. */
void indexer_scores(const void *q, const float *w, const void *keys, const uint8_t *mask, float *out, long B, long S,
                    long Hi, long di, long E, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    PARALLEL_IF(B * S * E * Hi * di > PARALLEL_MIN_WORK, {
        float *qf = malloc((size_t)Hi * di * sizeof(float));
        float *kf = malloc((size_t)di * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (long bs = 0; bs < B * S; bs++) {
            const long b = bs / S;
            load_row((const char *)q + (size_t)bs * Hi * di * es, dtype, qf, Hi * di);
            const float *wh = w + (size_t)bs * Hi;
            const uint8_t *visible = mask + (size_t)bs * E;
            float *o = out + (size_t)bs * E;
            for (long e = 0; e < E; e++) {
                if (!visible[e]) {
                    o[e] = -INFINITY;
                    continue;
                }
                load_row((const char *)keys + (size_t)(b * E + e) * di * es, dtype, kf, di);
                float score = 0.0f;
                for (long h = 0; h < Hi; h++) {
                    const float *qh = qf + (size_t)h * di;
                    float dot = 0.0f;
                    _Pragma("omp simd reduction(+ : dot)")
                    for (long i = 0; i < di; i++) dot += qh[i] * kf[i];
                    score += wh[h] * (dot > 0.0f ? dot : 0.0f);
                }
                o[e] = score;
            }
        }
        free(kf);
        free(qf);
    });
}

/* ----- moe_route_rows: per token, the k experts and their routing weights -----
 * scores [T, E] fp32 (the router's activations); bias [E] fp32 or NULL; hash_ids [T, k] int64 or NULL
 * (hash layers: the experts are given). Without hash ids the experts are the k largest of
 * scores + bias, largest first (the first index on ties). weights = scaling * s_j / (sum_j s_j + 1e-20)
 * over the chosen experts' unbiased scores, summed in choice order. ids [T, k] int64, weights [T, k].
 * Needs k <= E; returns -1 (and stops) at a hash id outside [0, E), else 0. */
int moe_route_rows(const float *scores, const float *bias, const int64_t *hash_ids, int64_t *ids, float *weights,
                   long T, long E, long k, float scaling) {
    for (long t = 0; t < T; t++) {
        const float *s = scores + (size_t)t * E;
        int64_t *id = ids + (size_t)t * k;
        for (long j = 0; j < k; j++) {
            if (hash_ids) {
                id[j] = hash_ids[(size_t)t * k + j];
                if (id[j] < 0 || id[j] >= E) return -1;
                continue;
            }
            long best = -1;
            float top = 0.0f;
            for (long e = 0; e < E; e++) {
                int taken = 0;
                for (long i = 0; i < j; i++) taken |= id[i] == e;
                const float v = bias ? s[e] + bias[e] : s[e];
                if (!taken && (best < 0 || v > top)) {
                    best = e;
                    top = v;
                }
            }
            id[j] = best;
        }
        float sum = 0.0f;
        for (long j = 0; j < k; j++) sum += s[id[j]];
        const float denom = sum + 1e-20f;
        for (long j = 0; j < k; j++) weights[(size_t)t * k + j] = s[id[j]] / denom * scaling;
    }
    return 0;
}
