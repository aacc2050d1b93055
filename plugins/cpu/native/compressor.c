/* compress_store: the compressor's per-token raw rows written into their rings at decode. */
#include "common.h"

/* ----- compress_store: rows_kv[ring_row[t]] = kv[t], rows_score[ring_row[t]] = score[t] + ape[position_mod[t]] -----
 * kv, score [T, w] in `dtype`, rows `kv_stride` / `score_stride` elements apart (column slices of one
 * projection); ape [m, w] fp32; position_mod, ring_row [T] int64; rows_kv, rows_score [R, w] fp32 (the
 * rings of every slot, flat). The sum in fp32, as torch adds a bf16 row to an fp32 one. Returns 1
 * (nothing written) at a position_mod outside [0, m) or a ring row outside [0, R), else 0. */
int compress_store(const void *kv, long kv_stride, const void *score, long score_stride, int dtype, const float *ape,
                   long m, const int64_t *position_mod, const int64_t *ring_row, long T, long w, float *rows_kv,
                   float *rows_score, long R) {
    const size_t es = elem_size(dtype);
    for (long t = 0; t < T; t++)
        if (position_mod[t] < 0 || position_mod[t] >= m || ring_row[t] < 0 || ring_row[t] >= R) return 1;
    for (long t = 0; t < T; t++) {
        float *dst_kv = rows_kv + (size_t)ring_row[t] * w, *dst_score = rows_score + (size_t)ring_row[t] * w;
        load_row((const char *)kv + (size_t)t * kv_stride * es, dtype, dst_kv, w);
        load_row((const char *)score + (size_t)t * score_stride * es, dtype, dst_score, w);
        const float *restrict a = ape + (size_t)position_mod[t] * w;
        for (long i = 0; i < w; i++) dst_score[i] = a[i] + dst_score[i];
    }
    return 0;
}
