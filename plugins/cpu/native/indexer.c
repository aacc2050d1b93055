/* index_select: DeepSeek-V4.1's lightning indexer for a few queries per sequence (decode), from its
 * MXFP4 index keys as cached to the picked entries, in one call: the scores, the candidate pool (its
 * candidate source) or the restriction to it (the index sources after it), the top-k. The arithmetic
 * and tie rules are core/models/deepseek_v41/attention.py's `_select` and `_candidate_pool`. */
#include "common.h"
#include "kv_codes.h"

/* The products w[h] * relu(q_h . k) rounded on their own before they are summed, as torch multiplies
 * and then sums: no fused multiply-add across them (GCC contracts a*b+c by default). */
#if defined(__clang__)
#define NO_FP_CONTRACT
#define NO_FP_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#define NO_FP_CONTRACT_BODY
#else
#define NO_FP_CONTRACT
#define NO_FP_CONTRACT_BODY
#endif

/* The head sum of a score in ops.py's order (`_pairwise_head_sum`): neighbours added pairwise, an odd
 * count's last head carried to the next round, until one is left. `products` is overwritten. */
static float head_sum(float *products, long n) {
    while (n > 1) {
        const long half = n / 2;
        for (long i = 0; i < half; i++) products[i] = products[2 * i] + products[2 * i + 1];
        if (n & 1) products[half] = products[n - 1];
        n = half + (n & 1);
    }
    return n ? products[0] : 0.0f;
}

/* an entry's score: sum_h w[h] * relu(q_h . key), q [Hi, di] and key [di] fp32 */
NO_FP_CONTRACT static float entry_score(const float *restrict q, const float *restrict w, const float *restrict key,
                                        long Hi, long di, float *restrict products) {
    NO_FP_CONTRACT_BODY
    for (long h = 0; h < Hi; h++) {
        const float *restrict qh = q + h * di;
        float dot = 0.0f;
        for (long i = 0; i < di; i++) dot += qh[i] * key[i]; /* exact: MXFP4 values, few bits */
        products[h] = (dot > 0.0f ? dot : 0.0f) * w[h];
    }
    return head_sum(products, Hi);
}

/* (score, index) ordered best first: the higher score, then the lower index (a stable descending sort) */
typedef struct {
    float score;
    long index;
} ranked;

static int best_first(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* chosen[i] = 1 for the `keep` best of the n finite values v[i] (best_first order), else 0; returns how
 * many were chosen. `order`: scratch of n. */
static long choose_best(const float *v, long n, long keep, ranked *order, uint8_t *chosen) {
    long finite = 0;
    for (long i = 0; i < n; i++) {
        chosen[i] = 0;
        if (isfinite(v[i])) order[finite++] = (ranked){v[i], i};
    }
    if (finite > keep) qsort(order, (size_t)finite, sizeof(ranked), best_first);
    const long taken = finite < keep ? finite : keep;
    for (long j = 0; j < taken; j++) chosen[order[j].index] = 1;
    return taken;
}

static inline long floor_div(long a, long b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

/* ----- index_select -----
 * q [B, S, Hi, di] in q_dtype (the indexer queries before their MXFP4 rounding, which happens here), rows
 * q_stride elements apart per (b, s); w [B, S, Hi] in w_dtype, rows w_stride apart (the weights'
 * projection, times w_scale here in fp32); keys [n, kv_row_bytes(MXFP4, di)] uint8 (the index keys);
 * rows [B, E] int64 (entry e of sequence b is keys[rows[b, e]]); visible [B, S, E] (1 = the query sees
 * the entry). candidates [B, S, E] or NULL: the candidate source's pool, outside which nothing is picked.
 * pool [B, S, E] or NULL: this call is the candidate source's and writes its pool there, blocks of
 * `block` entries ranked by their best score, the block of each query's newest visible entry (the
 * (q_pos[b, s] + 1) / rate - 1 th) always kept, the `top_blocks` best kept, a block kept only with a
 * finite score; visible entries of kept blocks are in the pool. picks [B, S, k] int64: the min(k, E) best
 * visible (and pooled) entries by score (ties: the lower index), sorted by index, -1 after them.
 * Returns -1 (nothing written) at an entry row outside
 * [0, n), else 0. */
int index_select(const void *q, int q_dtype, long q_stride, const void *w, int w_dtype, long w_stride, float w_scale,
                 const uint8_t *keys, long n, const int64_t *rows, const uint8_t *visible, const uint8_t *candidates,
                 uint8_t *pool, const int64_t *q_pos, long rate, long block, long top_blocks, int64_t *picks, long B,
                 long S, long Hi, long di, long E, long k, int num_threads) {
    for (long i = 0; i < B * E; i++)
        if (rows[i] < 0 || rows[i] >= n) return -1;
    const long key_bytes = kv_row_bytes(KV_MXFP4, di), nb = (E + block - 1) / block, kk = k < E ? k : E;
    PARALLEL_IF(B * S * E * Hi * di > PARALLEL_MIN_WORK && B * S > 1, {
        float *qf = malloc((size_t)(Hi * di + Hi + di + Hi) * sizeof(float));
        float *wf = qf + Hi * di, *kf = wf + Hi, *products = kf + di;
        uint8_t *packed = malloc((size_t)key_bytes);
        float *score = malloc((size_t)(E + nb + 1) * sizeof(float)), *block_best = score + E;
        ranked *order = malloc((size_t)(E + 1) * sizeof(ranked));
        uint8_t *chosen = malloc((size_t)(E + nb + 1)), *kept = chosen + E;
        _Pragma("omp for schedule(static)")
        for (long bs = 0; bs < B * S; bs++) {
            const long b = bs / S;
            const uint8_t *sees = visible + (size_t)bs * E;
            /* the query's heads rounded to MXFP4 (kv_quant's encode then decode), the weights scaled */
            load_row((const char *)q + (size_t)bs * q_stride * elem_size(q_dtype), q_dtype, qf, Hi * di);
            for (long h = 0; h < Hi; h++) {
                kv_encode_row(KV_MXFP4, qf + h * di, di, packed);
                kv_decode_row(KV_MXFP4, packed, di, qf + h * di);
            }
            load_row((const char *)w + (size_t)bs * w_stride * elem_size(w_dtype), w_dtype, wf, Hi);
            for (long h = 0; h < Hi; h++) wf[h] = wf[h] * w_scale;
            for (long e = 0; e < E; e++) {
                if (!sees[e]) {
                    score[e] = -INFINITY;
                    continue;
                }
                kv_decode_row(KV_MXFP4, keys + (size_t)rows[b * E + e] * key_bytes, di, kf);
                score[e] = entry_score(qf, wf, kf, Hi, di, products);
            }
            if (pool != NULL) {
                for (long j = 0; j < nb; j++) {
                    float best = -INFINITY;
                    for (long e = j * block; e < E && e < (j + 1) * block; e++) best = score[e] > best ? score[e] : best;
                    block_best[j] = best;
                }
                const long newest = floor_div(floor_div(q_pos[bs] + 1, rate) - 1, block);
                if (newest >= 0 && newest < nb) block_best[newest] = INFINITY;
                for (long j = 0; j < nb; j++) kept[j] = 0;
                /* the best blocks, +inf (the newest) first; a block of only -inf scores is never kept */
                long finite = 0;
                for (long j = 0; j < nb; j++)
                    if (block_best[j] > -INFINITY) order[finite++] = (ranked){block_best[j], j};
                const long keep = top_blocks < nb ? top_blocks : nb;
                if (finite > keep) qsort(order, (size_t)finite, sizeof(ranked), best_first);
                for (long j = 0; j < finite && j < keep; j++) kept[order[j].index] = 1;
                uint8_t *in_pool = pool + (size_t)bs * E;
                for (long e = 0; e < E; e++) in_pool[e] = kept[e / block] && sees[e];
            } else if (candidates != NULL) {
                const uint8_t *in_pool = candidates + (size_t)bs * E;
                for (long e = 0; e < E; e++)
                    if (!in_pool[e]) score[e] = -INFINITY;
            }
            choose_best(score, E, kk, order, chosen);
            int64_t *out = picks + (size_t)bs * k;
            long j = 0;
            for (long e = 0; e < E; e++)
                if (chosen[e]) out[j++] = e;
            for (; j < k; j++) out[j] = -1;
        }
        free(chosen);
        free(order);
        free(score);
        free(packed);
        free(qf);
    });
    return 0;
}
