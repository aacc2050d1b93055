/* kv_store: rows encoded in one of DeepSeek-V4.1's cache formats (kv_codes.h) and written into cache
 * rows (a decode step's window keys, a compressor's published entries and index keys). */
#include "common.h"
#include "kv_codes.h"

/* ----- kv_store: cache[dest[t]] = encode(x[t]) for t < N -----
 * x [N, C] in `dtype`, rows `x_stride` elements apart; cache [n, kv_row_bytes(fmt, C)] uint8; dest [N]
 * int64. Each row is encoded from its fp32 values, as kv_quant.encode reads a tensor of that dtype.
 * Returns -1 (nothing written) at a dest row outside [0, n), else 0. */
int kv_store(const void *x, long x_stride, int dtype, long N, long C, int fmt, uint8_t *cache, long n,
             const int64_t *dest) {
    for (long t = 0; t < N; t++)
        if (dest[t] < 0 || dest[t] >= n) return -1;
    const long bytes = kv_row_bytes(fmt, C);
    float *row = malloc((size_t)C * sizeof(float));
    for (long t = 0; t < N; t++) {
        load_row((const char *)x + (size_t)t * x_stride * elem_size(dtype), dtype, row, C);
        kv_encode_row(fmt, row, C, cache + (size_t)dest[t] * bytes);
    }
    free(row);
    return 0;
}
