/* sink_attention_decode: decode attention with a per-head sink; sink_attention_invariant: the same
 * with each sequence's keys in a canonical order (the batch_invariant feature). */
#include "common.h"

/* ----- sink_attention_decode: MQA with a per-head sink, for queries that see few keys (decode) -----
 * q [B, S, H, d], kv [B, L, d] (K = V), mask [B, S, L] (1 = attend), sinks [H] fp32; out [B, S, H, d]
 * in q's dtype. Per query, 16 heads at a time are the lanes of every vector: a key's scores for the
 * 16 heads are d multiply-adds with the key's elements broadcast, the softmax (the sink's logit
 * included) runs lane-wise over the keys, and the output accumulates p * v the same way, so there
 * are no horizontal sums. fp32 throughout; a query that sees no key gets 0 (the sink takes all). */

#define ATTN_LANES 16
typedef float lanes16 __attribute__((vector_size(ATTN_LANES * sizeof(float))));

static inline size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* The keys of batch item b are visited in the order order[b * L ..] (NULL: 0 .. L-1). */
static void sink_attention(const void *q, const void *kv, const uint8_t *mask, const float *sinks, float scale,
                           void *out, long B, long S, long H, long L, long d, int dtype, const long *order,
                           int num_threads) {
    const size_t es = elem_size(dtype);
    const long head_blocks = (H + ATTN_LANES - 1) / ATTN_LANES;
#define KEY(p) (ord ? ord[p] : (p))
    PARALLEL_IF(B * S * H * L * d > PARALLEL_MIN_WORK, {
        lanes16 *qt = aligned_alloc(64, round64((size_t)d * sizeof(lanes16)));         /* [d], scaled */
        lanes16 *acc = aligned_alloc(64, round64((size_t)d * sizeof(lanes16)));        /* [d] */
        lanes16 *probs = aligned_alloc(64, round64((size_t)(L + 1) * sizeof(lanes16))); /* [L] */
        float *row = malloc((size_t)d * sizeof(float));
        float *keys_f = malloc((size_t)4 * d * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (long item = 0; item < B * S * head_blocks; item++) {
            const long bs = item / head_blocks, b = bs / S, h0 = (item % head_blocks) * ATTN_LANES;
            const long nh = H - h0 < ATTN_LANES ? H - h0 : ATTN_LANES;
            for (long h = 0; h < ATTN_LANES; h++) {
                if (h < nh) load_row((const char *)q + (size_t)(bs * H + h0 + h) * d * es, dtype, row, d);
                for (long i = 0; i < d; i++) qt[i][h] = h < nh ? row[i] * scale : 0.0f;
            }
            const long *ord = order ? order + b * L : NULL;
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
                    if (visible[KEY(l)]) idx[n++] = KEY(l);
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
            for (long jj = 0; jj < L; jj++) {
                const long j = KEY(jj);
                if (!visible[j]) continue;
                lanes16 p;
                _Pragma("omp simd")
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
                    if (visible[KEY(l)]) idx[n++] = KEY(l);
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
    });
#undef KEY
}

void sink_attention_decode(const void *q, const void *kv, const uint8_t *mask, const float *sinks, float scale,
                           void *out, long B, long S, long H, long L, long d, int dtype, int num_threads) {
    sink_attention(q, kv, mask, sinks, scale, out, B, S, H, L, d, dtype, NULL, num_threads);
}

/* ----- canonical key order: indices 0..L-1 sorted by the bytes of their rows (merge sort, stable) ----- */

static void sort_rows(const char *rows, size_t row_bytes, long *idx, long *tmp, long L) {
    for (long width = 1; width < L; width *= 2) {
        for (long lo = 0; lo < L; lo += 2 * width) {
            const long mid = lo + width < L ? lo + width : L, hi = lo + 2 * width < L ? lo + 2 * width : L;
            long i = lo, j = mid, o = lo;
            while (i < mid && j < hi)
                tmp[o++] = memcmp(rows + idx[j] * row_bytes, rows + idx[i] * row_bytes, row_bytes) < 0 ? idx[j++]
                                                                                                       : idx[i++];
            while (i < mid) tmp[o++] = idx[i++];
            while (j < hi) tmp[o++] = idx[j++];
        }
        memcpy(idx, tmp, (size_t)L * sizeof(long));
    }
}

/* ----- sink_attention_invariant: the batch-invariant attention (the batch_invariant feature) -----
 * The same contract and arithmetic, for any number of queries, with each sequence's keys visited in
 * a canonical order: sorted by their bytes. A query's softmax sum and weighted value sum then do not
 * depend on where its keys sit in kv (window ring order at decode, positional order in a prefill
 * block, the indexer's pick order, padding to the longest sequence). Identical keys contribute
 * identically, so their relative order cannot matter. */
void sink_attention_invariant(const void *q, const void *kv, const uint8_t *mask, const float *sinks, float scale,
                              void *out, long B, long S, long H, long L, long d, int dtype, int num_threads) {
    const size_t row_bytes = (size_t)d * elem_size(dtype);
    long *order = malloc((size_t)(B * L + 1) * sizeof(long));
    PARALLEL_IF(B * L * d > PARALLEL_MIN_WORK && B > 1, {
        long *tmp = malloc((size_t)(L + 1) * sizeof(long));
        _Pragma("omp for schedule(static)")
        for (long b = 0; b < B; b++) {
            long *idx = order + b * L;
            for (long l = 0; l < L; l++) idx[l] = l;
            sort_rows((const char *)kv + (size_t)b * L * row_bytes, row_bytes, idx, tmp, L);
        }
        free(tmp);
    });
    sink_attention(q, kv, mask, sinks, scale, out, B, S, H, L, d, dtype, order, num_threads);
    free(order);
}
