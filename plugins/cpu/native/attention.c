/* sink_attention_decode: decode attention with a per-head sink; sink_attention_coded_rows: the same
 * over keys read by index from cache tensors (a decode step's window ring and compressed entries),
 * plain or packed in DeepSeek-V4.1's cache formats (kv_codes.h); sink_attention_invariant: the same with each sequence's keys in a canonical
 * order (the batch_invariant feature). */
#include "common.h"
#include "kv_codes.h"

/* How a call's keys are stored: as rows of the queries' dtype (KEYS_PLAIN), or packed in a V4.1 cache
 * format (kv_codes.h: KV_FP8, KV_NVFP4), decoded to the values a tensor of that dtype holds; the keys
 * at positions below `split` (of the L a query sees) in form code0, the others in form code1. */
#define KEYS_PLAIN (-1)
typedef struct {
    int code0, code1;
    long split;
} key_forms;
static const key_forms PLAIN_KEYS = {KEYS_PLAIN, KEYS_PLAIN, 0};

static inline void load_key(const char *row, const key_forms *forms, long position, int dtype, float *dst, long d) {
    const int code = position < forms->split ? forms->code0 : forms->code1;
    if (code == KEYS_PLAIN)
        load_row(row, dtype, dst, d);
    else
        kv_decode_row_as(code, (const uint8_t *)row, d, dtype, dst);
}

/* the bytes of one key row of d features in form `code` */
static inline size_t key_row_bytes(int code, long d, int dtype) {
    return code == KEYS_PLAIN ? (size_t)d * elem_size(dtype) : (size_t)kv_row_bytes(code, d);
}

/* ----- sink_attention_decode: MQA with a per-head sink, for queries that see few keys (decode) -----
 * q [B, S, H, d], kv [B, L, d] (K = V), mask [B, S, L] (1 = attend), sinks [H] fp32; out [B, S, H, d]
 * in q's dtype. Per query, ATTN_LANES heads at a time are the lanes of every vector: a key's scores
 * for those heads are d multiply-adds with the key's elements broadcast, the softmax (the sink's logit
 * included) runs lane-wise over the keys, and the output accumulates p * v the same way, so there
 * are no horizontal sums. fp32 throughout; a query that sees no key gets 0 (the sink takes all). */

static inline size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* Key l of batch item b is the row at key_rows[b * L + l]; the keys are visited in the order
 * order[b * L ..] (NULL: 0 .. L-1). With AVX2 (and no AVX-512) a vector of 16 lanes is two 256-bit
 * registers, so a call of up to 8 heads (the small checkpoints' 4) runs on 8 lanes, one register: half
 * the instructions of 16 lanes of which 12 are padding (scripts/bench_attention_output.py, 4 heads, one
 * thread: the sink attention 2.37x the AVX-512 build's time before, 1.00x after). More heads keep 16
 * lanes: each key is widened once per 16 heads. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define ATTN_LANES 16
#define ATTN_VEC lanes16
#define ATTN_FN sink_attention16
#include "sink_attention.h"
#define ATTN_LANES 8
#define ATTN_VEC lanes8
#define ATTN_FN sink_attention8
#include "sink_attention.h"

static void sink_attention(const void *q, const char *const *key_rows, const key_forms *forms, const uint8_t *mask,
                           const float *sinks, float scale, void *out, long B, long S, long H, long L, long d,
                           int dtype, const long *order, int num_threads) {
    (H <= 8 ? sink_attention8 : sink_attention16)(q, key_rows, forms, mask, sinks, scale, out, B, S, H, L, d, dtype,
                                                  order, num_threads);
}
#else
#define ATTN_LANES 16
#define ATTN_VEC lanes16
#define ATTN_FN sink_attention
#include "sink_attention.h"
#endif

/* kv [B, L, d] contiguous -> its B * L row addresses (caller frees) */
static const char **contiguous_rows(const void *kv, long B, long L, size_t row_bytes) {
    const char **rows = malloc((size_t)(B * L + 1) * sizeof(*rows));
    for (long i = 0; i < B * L; i++) rows[i] = (const char *)kv + (size_t)i * row_bytes;
    return rows;
}

void sink_attention_decode(const void *q, const void *kv, const uint8_t *mask, const float *sinks, float scale,
                           void *out, long B, long S, long H, long L, long d, int dtype, int num_threads) {
    const char **rows = contiguous_rows(kv, B, L, (size_t)d * elem_size(dtype));
    sink_attention(q, rows, &PLAIN_KEYS, mask, sinks, scale, out, B, S, H, L, d, dtype, NULL, num_threads);
    free(rows);
}

/* ----- sink_attention_coded_rows: sink_attention_decode over keys read by index from cache tensors -----
 * The key set of item b is part 0's rows rows0[b, 0..L0) of cache0, then part 1's rows rows1[b, 0..L1)
 * of cache1 (L1 = 0: no part 1), with masks mask0 [B, S, L0] and mask1 [B, S, L1]: the same keys, order
 * and arithmetic as sink_attention_decode over the concatenation of the gathered rows and of the masks,
 * without materialising either. A part's rows are in form code0 / code1: KEYS_PLAIN (cache [n, d] of
 * `dtype`) or packed in a V4.1 format (cache [n, kv_row_bytes(code, d)] uint8), each such key decoded to
 * the values a `dtype` tensor of kv_quant.decode holds (the bits of the decoded, gathered keys). Returns 0,
 * or -1 (nothing written) when a row index is outside its cache. */
int sink_attention_coded_rows(const void *q, const void *cache0, const long *rows0, const uint8_t *mask0, long n0,
                              long L0, int code0, const void *cache1, const long *rows1, const uint8_t *mask1,
                              long n1, long L1, int code1, const float *sinks, float scale, void *out, long B, long S,
                              long H, long d, int dtype, int num_threads) {
    const key_forms forms = {code0, code1, L0};
    const size_t bytes0 = key_row_bytes(code0, d, dtype), bytes1 = key_row_bytes(code1, d, dtype);
    const long L = L0 + L1;
    const char **key_rows = malloc((size_t)(B * L + 1) * sizeof(*key_rows));
    uint8_t *mask = malloc((size_t)(B * S * L + 1));
    int status = 0;
    for (long b = 0; b < B && status == 0; b++) {
        for (long l = 0; l < L0; l++) {
            const long r = rows0[b * L0 + l];
            if (r < 0 || r >= n0) status = -1;
            key_rows[b * L + l] = (const char *)cache0 + (size_t)(status ? 0 : r) * bytes0;
        }
        for (long l = 0; l < L1; l++) {
            const long r = rows1[b * L1 + l];
            if (r < 0 || r >= n1) status = -1;
            key_rows[b * L + L0 + l] = (const char *)cache1 + (size_t)(status ? 0 : r) * bytes1;
        }
        for (long s = 0; s < S; s++) {
            memcpy(mask + (b * S + s) * L, mask0 + (b * S + s) * L0, (size_t)L0);
            if (L1) memcpy(mask + (b * S + s) * L + L0, mask1 + (b * S + s) * L1, (size_t)L1);
        }
    }
    if (status == 0)
        sink_attention(q, key_rows, &forms, mask, sinks, scale, out, B, S, H, L, d, dtype, NULL, num_threads);
    free(mask);
    free(key_rows);
    return status;
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
    const char **rows = contiguous_rows(kv, B, L, row_bytes);
    sink_attention(q, rows, &PLAIN_KEYS, mask, sinks, scale, out, B, S, H, L, d, dtype, order, num_threads);
    free(rows);
    free(order);
}
