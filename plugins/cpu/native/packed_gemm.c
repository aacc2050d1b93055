/* packed_gemm_bf16: Y [M, N] = X [M, K] W [N, K]^T (bf16, fp32 sums rounded once) for decode batches, on a
 * weight packed once (pack_bf16) into the layout the register tiles read:
 *
 *     P [ceil(N / PACK_COLS)][ceil(K / 2)][PACK_COLS][2]
 *
 * column blocks of PACK_COLS outputs, K in pairs, zeros past N and K. One 64-byte (AVX512-BF16, 16
 * columns) or 32-byte (AVX2+FMA, 8 columns) load holds a k pair of every column of a block, so a tile of
 * rows x blocks keeps its outputs in registers over all of K: no horizontal sums,
 * each loaded weight vector used by every row of the tile, and each x pair broadcast once per block.
 * A tile is TILE_ROWS x TILE_BLOCKS at most; tile_shape picks the one for M.
 * A panel of a tile's blocks (64 KB at K = 512 with AVX512-BF16) is read from memory by the first row
 * group and from L2 by the others; the panels are split over the threads, the weight streamed once.
 * - AVX512-BF16: vdpbf16ps multiplies a block's 16 column pairs by the broadcast x pair, 16 fp32 sums;
 * - AVX2 + FMA: a block's 8 column pairs are widened to fp32 by one shift (even k) and one mask (odd k),
 *   x rows are widened to fp32 once, two FMAs per pair; from BLOCKED_MIN_ROWS rows K-blocked 6 x 2 tiles
 *   on a panel's block widened once for a slab of rows (blocked_gemm);
 * - portable: the same tiles as plain loops over a block's 8 columns, which the compiler vectorises. */
#include "common.h"

#include <omp.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define PACK_COLS 16
/* the largest tile (its accumulator array); tile_shape picks 4 x 4 or 8 x 3 */
#define TILE_ROWS 8
#define TILE_BLOCKS 4
#define XROW_PER_PAIR 1  /* xrow_t words per K pair */
#define ONE_GROUP_PREFETCH 0 /* panel_pass: a tile of all the rows prefetches the next panel too */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PACK_COLS 8
#define TILE_ROWS 4
#define TILE_BLOCKS 3
#define XROW_PER_PAIR 2
/* one thread, cold weights, a C harness alternating both: 1.4-2.0x at 1-4 rows on 129,280 x 512, 1.3-1.8x
 * on the 161 M V4's experts (256 x 512, 512 x 128) */
#define ONE_GROUP_PREFETCH 1
#else
#define PACK_COLS 8
#define TILE_ROWS 4
#define TILE_BLOCKS 1
#define XROW_PER_PAIR 2
#define ONE_GROUP_PREFETCH 0 /* the portable tiles prefetch nothing */
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* the packed layout's block width (pack_bf16's PACK_COLS): the Python side sizes P with it */
long packed_cols(void) { return PACK_COLS; }

void pack_bf16(const uint16_t *W, uint16_t *P, long N, long K, int num_threads) {
    const long blocks = (N + PACK_COLS - 1) / PACK_COLS, pairs = (K + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K > PARALLEL_MIN_WORK)
    for (long b = 0; b < blocks; b++) {
        uint16_t *restrict pb = P + (size_t)b * pairs * PACK_COLS * 2;
        for (long c = 0; c < PACK_COLS; c++) {
            const long n = b * PACK_COLS + c;
            for (long k = 0; k < 2 * pairs; k++)
                pb[((k >> 1) * PACK_COLS + c) * 2 + (k & 1)] = n < N && k < K ? W[(size_t)n * K + k] : 0;
        }
    }
}

#if defined(__AVX512BF16__)
/* the x rows as bf16, K padded to an even count: row m's pair p is the 32-bit word xs[m * pairs + p] */
typedef uint32_t xrow_t;

/* rows [m0, m0 + mr) x blocks [b0, b0 + nr) of Y; mr, nr are constants at each call site (tile_dispatch) */
ALWAYS_INLINE void tile(const uint16_t *restrict P, const xrow_t *restrict xs, uint16_t *restrict Y, long N,
                        long pairs, long m0, long b0, const int mr, const int nr, const char *ahead, long ahead_step) {
    __m512 acc[TILE_ROWS][TILE_BLOCKS];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *restrict w = P + (size_t)b0 * pairs * 32;
    const xrow_t *restrict x = xs + m0 * pairs;
    for (long p = 0; p < pairs; p++) {
        for (long line = 0; line < ahead_step; line += 64) _mm_prefetch(ahead + p * ahead_step + line, _MM_HINT_T1);
        __m512bh wv[TILE_BLOCKS];
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + ((size_t)j * pairs + p) * 32));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * pairs + p]);
#pragma GCC unroll 8
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < nr; j++) {
        const long n0 = (b0 + j) * 16, left = N - n0;
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(Y + (m0 + i) * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    }
}

/* one x row in that layout; with an even K (and 4-byte aligned rows) the layout is the bf16 rows
 * themselves (packed_rows_in_place) */
static void prepare_row(const uint16_t *x, xrow_t *xs, long K) {
    memcpy(xs, x, (size_t)K * sizeof(uint16_t));
    if (K & 1) ((uint16_t *)xs)[K] = 0;
}

int packed_rows_in_place(const uint16_t *X, long K) { return K % 2 == 0 && (uintptr_t)X % 4 == 0; }

#elif defined(__AVX2__) && defined(__FMA__)
/* the x rows widened to fp32, K padded to an even count */
typedef float xrow_t;

ALWAYS_INLINE void tile(const uint16_t *restrict P, const xrow_t *restrict xs, uint16_t *restrict Y, long N,
                        long pairs, long m0, long b0, const int mr, const int nr, const char *ahead, long ahead_step) {
    __m256 acc[TILE_ROWS][TILE_BLOCKS];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    const uint16_t *restrict w = P + (size_t)b0 * pairs * 16;
    const float *restrict x = xs + m0 * pairs * 2;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (long p = 0; p < pairs; p++) {
        for (long line = 0; line < ahead_step; line += 64) _mm_prefetch(ahead + p * ahead_step + line, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++) {
            /* 8 columns' (k, k + 1) pairs: k is the low half of each 32-bit lane (little-endian) */
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + ((size_t)j * pairs + p) * 16));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                acc[i][j] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(x + i * pairs * 2 + 2 * p), acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(x + i * pairs * 2 + 2 * p + 1), acc[i][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < nr; j++) {
        const long n0 = (b0 + j) * 8, cols = N - n0 < 8 ? N - n0 : 8;
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            float out[8];
            _mm256_storeu_ps(out, acc[i][j]);
            store_row(out, Y + (m0 + i) * N + n0, DT_BF16, cols);
        }
    }
}

/* From BLOCKED_MIN_ROWS rows (decode batches, prefill, the experts' rows) on AVX2: the tiles above widen
 * every weight pair once per 4 rows, and GCC folds their weight loads into the FMAs. Here a panel's
 * weights are widened to fp32 once per block of KB_PAIRS pairs (8 KB, in L1 with the rows' x) and reused
 * by a slab of SLAB_ROWS rows, whose fp32 sums wait in `c` between the K blocks. A 6 x 2 tile (12 sums,
 * 2 weight vectors, 1 broadcast: 15 of the 16 ymm registers) runs 2 loads and 6 broadcasts per 12 FMAs,
 * enough independent sums to cover the FMA latency on both pipes; a slab's rows are split into groups of
 * at most 6, as even as possible. The first group's pass prefetches the weights widened next (this
 * panel's next K block, or the next panel's first) into L1, a line per two k: without it every widening
 * waited on memory. The same products summed in the same order as the tiles above: the same bits.
 * One thread, cold weights, 129,280 x 512 (a C harness alternating both): the prefetch 1.32x and 6 x 2
 * over 4 x 2 another 1.1x at 16 rows (1.45x together), 1.17x at 64; 4 x 3 (16 registers) 0.85-0.92x
 * of 6 x 2; blocks of 32 or 128 pairs no better; from 7 rows 1.1-1.25x the tiles above, at 4-6 rows
 * 0.7-1.0x. */
#define BLOCKED_MIN_ROWS 7
#define BLOCKED_ROWS 6
#define BLOCKED_BLOCKS 2
#define BLOCKED_COLS (8 * BLOCKED_BLOCKS)
#define KB_PAIRS 64  /* K pairs per block: a panel's block widened to fp32 is 16 x 128 x 4 B = 8 KB */
#define SLAB_ROWS 64 /* rows per work item: a slab and a panel are the unit split over the threads */

/* rows [0, mr) of a slab x 8 * nr columns over 2 * np k of the widened block wf [2 np][BLOCKED_COLS]:
 * sums from c (c [mr][BLOCKED_COLS], fp32) unless first; to c, or (last) rounded to bf16 into y (row
 * stride N, cols columns); with `ahead`, the prefetch of nr blocks ahead_stride bytes apart */
ALWAYS_INLINE void block_tile(const float *restrict wf, const float *restrict x, long xstride, float *restrict c,
                              long np, const int mr, const int nr, int first, int last, uint16_t *restrict y,
                              long N, long cols, const char *ahead, long ahead_stride) {
    __m256 acc[BLOCKED_ROWS][BLOCKED_BLOCKS];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++)
            acc[i][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * BLOCKED_COLS + 8 * j);
    for (long k = 0; k < 2 * np; k++) {
        if (ahead && !(k & 1)) {
            const long line = k >> 1; /* the next K block's lines, dealt to its nr blocks in turn */
            _mm_prefetch(ahead + (line % nr) * ahead_stride + (line / nr) * 64, _MM_HINT_T0);
        }
        __m256 w[BLOCKED_BLOCKS];
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++) {
            w[j] = _mm256_loadu_ps(wf + k * BLOCKED_COLS + 8 * j);
            __asm__("" : "+x"(w[j])); /* kept in a register: GCC would fold the load into every row's FMA */
        }
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_broadcast_ss(x + i * xstride + k);
#pragma GCC unroll 8
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
        }
    }
    if (!last) {
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
            for (int j = 0; j < nr; j++) _mm256_storeu_ps(c + i * BLOCKED_COLS + 8 * j, acc[i][j]);
        return;
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) {
        float out[BLOCKED_COLS];
#pragma GCC unroll 8
        for (int j = 0; j < nr; j++) _mm256_storeu_ps(out + 8 * j, acc[i][j]);
        store_row(out, y + i * N, DT_BF16, cols);
    }
}

#define BLOCK_CASE(MR, NR)                                                                        \
    case (MR) * 16 + (NR):                                                                        \
        block_tile(wf, x, xstride, c, np, MR, NR, first, last, y, N, cols, ahead, ahead_stride); \
        break;
#define BLOCK_ROW_CASES(MR) BLOCK_CASE(MR, 1) BLOCK_CASE(MR, 2)

static void block_dispatch(const float *restrict wf, const float *restrict x, long xstride, float *restrict c,
                           long np, int mr, int nr, int first, int last, uint16_t *restrict y, long N, long cols,
                           const char *ahead, long ahead_stride) {
    switch (mr * 16 + nr) {
        BLOCK_ROW_CASES(1)
        BLOCK_ROW_CASES(2)
        BLOCK_ROW_CASES(3)
        BLOCK_ROW_CASES(4)
        BLOCK_ROW_CASES(5)
        BLOCK_ROW_CASES(6)
        default: abort();
    }
}

/* pairs [p0, p0 + np) of nr column blocks of P (from block b0) widened to fp32: wf [2 np][BLOCKED_COLS] */
static void widen_block(const uint16_t *restrict P, long pairs, long b0, int nr, long p0, long np,
                        float *restrict wf) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int j = 0; j < nr; j++) {
        const uint16_t *restrict w = P + ((size_t)(b0 + j) * pairs + p0) * 16;
        for (long p = 0; p < np; p++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + p * 16));
            float *restrict even = wf + 2 * p * BLOCKED_COLS + 8 * j;
            _mm256_storeu_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)));
            _mm256_storeu_ps(even + BLOCKED_COLS, _mm256_castsi256_ps(_mm256_and_si256(wv, high)));
        }
    }
}

/* per-thread scratch of blocked_panel: a widened K block and a slab's sums between the K blocks */
typedef struct {
    float wf[2 * KB_PAIRS * BLOCKED_COLS] __attribute__((aligned(32)));
    float c[SLAB_ROWS * BLOCKED_COLS] __attribute__((aligned(32)));
} blocked_scratch;

/* rows [m_lo, m_hi) (at most SLAB_ROWS) of Y x one panel (blocks [panel * BLOCKED_BLOCKS, + 2)) */
static void blocked_panel(const uint16_t *P, const float *xs, uint16_t *Y, long m_lo, long m_hi, long N, long pairs,
                          long blocks, long panel, blocked_scratch *s) {
    const long b0 = panel * BLOCKED_BLOCKS, xstride = 2 * pairs;
    const int nr = blocks - b0 < BLOCKED_BLOCKS ? (int)(blocks - b0) : BLOCKED_BLOCKS;
    const long n0 = b0 * 8, cols = N - n0 < 8L * nr ? N - n0 : 8L * nr;
    const long groups = (m_hi - m_lo + BLOCKED_ROWS - 1) / BLOCKED_ROWS; /* of <= 6 rows, even */
    for (long p0 = 0; p0 < pairs; p0 += KB_PAIRS) {
        const long np = pairs - p0 < KB_PAIRS ? pairs - p0 : KB_PAIRS;
        widen_block(P, pairs, b0, nr, p0, np, s->wf);
        const int first = p0 == 0, last = p0 + np == pairs;
        /* widened next: this panel's next K block, or the next panel's first */
        const char *ahead = (const char *)(P + (last ? (size_t)(b0 + nr) * pairs : (size_t)b0 * pairs + p0 + np) * 16);
        for (long g = 0, m0 = m_lo; g < groups; g++) {
            const int mr = (int)((m_hi - m_lo) * (g + 1) / groups - (m0 - m_lo));
            block_dispatch(s->wf, xs + m0 * xstride + 2 * p0, xstride, s->c + (m0 - m_lo) * BLOCKED_COLS, np, mr, nr,
                           first, last, Y + m0 * N + n0, N, cols, g == 0 ? ahead : NULL, pairs * 32);
            m0 += mr;
        }
    }
}

static void blocked_gemm(const uint16_t *P, const float *xs, uint16_t *Y, long M, long N, long pairs,
                         int num_threads) {
    const long blocks = (N + 7) / 8, panels = (blocks + BLOCKED_BLOCKS - 1) / BLOCKED_BLOCKS;
    const long slabs = (M + SLAB_ROWS - 1) / SLAB_ROWS;
#pragma omp parallel num_threads(num_threads) if (M * N * pairs > PARALLEL_MIN_WORK)
    {
        blocked_scratch scratch;
#pragma omp for schedule(static)
        for (long item = 0; item < panels * slabs; item++) {
            const long panel = item / slabs, m_lo = (item % slabs) * SLAB_ROWS;
            blocked_panel(P, xs, Y, m_lo, M - m_lo < SLAB_ROWS ? M : m_lo + SLAB_ROWS, N, pairs, blocks, panel,
                          &scratch);
        }
    }
}

#else
typedef float xrow_t;

ALWAYS_INLINE void tile(const uint16_t *restrict P, const xrow_t *restrict xs, uint16_t *restrict Y, long N,
                        long pairs, long m0, long b0, const int mr, const int nr, const char *ahead, long ahead_step) {
    (void)nr, (void)ahead, (void)ahead_step; /* one block; no prefetch */
    float acc[TILE_ROWS][PACK_COLS] = {{0}};
    const uint16_t *restrict w = P + (size_t)b0 * pairs * PACK_COLS * 2;
    const float *restrict x = xs + m0 * pairs * 2;
    for (long p = 0; p < pairs; p++) {
        float we[PACK_COLS], wo[PACK_COLS];
        for (int c = 0; c < PACK_COLS; c++) {
            we[c] = bf16_to_float(w[(p * PACK_COLS + c) * 2]);
            wo[c] = bf16_to_float(w[(p * PACK_COLS + c) * 2 + 1]);
        }
        for (int i = 0; i < mr; i++) {
            const float x0 = x[i * pairs * 2 + 2 * p], x1 = x[i * pairs * 2 + 2 * p + 1];
#pragma omp simd
            for (int c = 0; c < PACK_COLS; c++) acc[i][c] += we[c] * x0 + wo[c] * x1;
        }
    }
    const long n0 = b0 * PACK_COLS, cols = N - n0 < PACK_COLS ? N - n0 : PACK_COLS;
    for (int i = 0; i < mr; i++) store_row(acc[i], Y + (m0 + i) * N + n0, DT_BF16, cols);
}
#endif

#if !defined(__AVX512BF16__)
/* one x row widened to fp32, K padded to even */
static void prepare_row(const uint16_t *x, xrow_t *xs, long K) {
    load_row(x, DT_BF16, xs, K);
    if (K & 1) xs[K] = 0.0f;
}

int packed_rows_in_place(const uint16_t *X, long K) {
    (void)X, (void)K;
    return 0;
}
#endif

/* The x rows in the layout the tiles read: packed_rows_bytes for M rows, rows [m0, m1) of X written by
 * packed_rows (unless packed_rows_in_place(X, K): X itself is that layout). */
size_t packed_rows_bytes(long M, long K) { return (size_t)M * ((K + 1) / 2) * XROW_PER_PAIR * sizeof(xrow_t); }

void packed_rows(const uint16_t *X, void *xs, long m0, long m1, long K) {
    const long stride = (K + 1) / 2 * XROW_PER_PAIR;
    for (long m = m0; m < m1; m++) prepare_row(X + (size_t)m * K, (xrow_t *)xs + (size_t)m * stride, K);
}

static const xrow_t *prepare_x(const uint16_t *X, long M, long K, xrow_t **owned) {
    *owned = NULL;
    if (packed_rows_in_place(X, K)) return (const xrow_t *)X;
    *owned = malloc(packed_rows_bytes(M, K));
    packed_rows(X, *owned, 0, M, K);
    return *owned;
}

/* one call per (mr, nr) so that every tile's loops unroll over constants and its sums stay in registers */
#define TILE_CASE(MR, NR)                                                  \
    case (MR) * 16 + (NR):                                                 \
        tile(P, xs, Y, N, pairs, m0, b0, (MR) < TILE_ROWS ? (MR) : TILE_ROWS, \
             (NR) < TILE_BLOCKS ? (NR) : TILE_BLOCKS, ahead, ahead_step);   \
        break;
#define TILE_ROW_CASES(MR) TILE_CASE(MR, 1) TILE_CASE(MR, 2) TILE_CASE(MR, 3) TILE_CASE(MR, 4)

static void tile_dispatch(const uint16_t *restrict P, const xrow_t *restrict xs, uint16_t *restrict Y, long N,
                          long pairs, long m0, long b0, int mr, int nr, const char *ahead, long ahead_step) {
    switch (mr * 16 + nr) {
        TILE_ROW_CASES(1)
        TILE_ROW_CASES(2)
        TILE_ROW_CASES(3)
        TILE_ROW_CASES(4)
        TILE_ROW_CASES(5)
        TILE_ROW_CASES(6)
        TILE_ROW_CASES(7)
        TILE_ROW_CASES(8)
        default: abort(); /* TILE_ROWS <= 8, TILE_BLOCKS <= 4 */
    }
}

/* rows x blocks of the tiles for an M-row product. AVX512-BF16 (32 zmm): 4 x 4 up to 4 rows, else 8 x 3
 * (24 accumulators, fewer broadcasts and panel passes per weight load): one thread, cold weights,
 * 8 x 3 over 4 x 4 was 1.11-1.14x on the LM head at 16 and 64 rows, 1.29x on 4096 x 512 at 64, and
 * 0.93-0.95x at 4 rows. AVX2 (16 ymm): 4 x 3; 4 x 2 measured 0.69-0.81x of it. */
static void tile_shape(long M, int *rows, int *blocks) {
#if defined(__AVX512BF16__)
    *rows = M <= 4 ? 4 : 8;
    *blocks = M <= 4 ? 4 : 3;
#else
    (void)M;
    *rows = TILE_ROWS;
    *blocks = TILE_BLOCKS;
#endif
}

/* one panel (blocks [panel * width, + width)) of an M-row product, all its row groups */
static void panel_pass(const uint16_t *P, const xrow_t *xs, uint16_t *Y, long M, long N, long pairs, long blocks,
                       int rows, int width, long panel) {
    const long b0 = panel * width, groups = (M + rows - 1) / rows;
    const int nr = blocks - b0 < width ? (int)(blocks - b0) : width;
    /* the next panel into L2, a share per row group: each group's pass prefetches its share in step
     * with its pairs, so the next panel's first group does not wait on memory (measured: LM head, 16 rows,
     * one thread, 144 -> 156 GFLOP/s). With AVX512-BF16 one group leaves it to the hardware prefetchers:
     * a whole panel ahead made 1-4 rows 4 % (into L2) to 30 % (into L1) slower, and again 0.8-1.3x
     * (noise) at 1-4 rows; the AVX2 tiles, slower per pair, gain from it (ONE_GROUP_PREFETCH). */
    const char *next = (const char *)(P + (size_t)(b0 + nr) * pairs * PACK_COLS * 2);
    /* bytes per pair and group */
    const long share = groups > 1 || ONE_GROUP_PREFETCH ? (long)nr * PACK_COLS * 4 / groups : 0;
    for (long g = 0; g < groups; g++) {
        const long m0 = g * rows;
        tile_dispatch(P, xs, Y, N, pairs, m0, b0, M - m0 < rows ? (int)(M - m0) : rows, nr, next + g * share * pairs,
                      share);
    }
}

void packed_gemm_bf16(const uint16_t *P, const uint16_t *X, uint16_t *Y, long M, long N, long K, int num_threads) {
    const long pairs = (K + 1) / 2, blocks = (N + PACK_COLS - 1) / PACK_COLS;
    int rows, width;
    tile_shape(M, &rows, &width);
    const long panels = (blocks + width - 1) / width;
    xrow_t *owned;
    const xrow_t *xs = prepare_x(X, M, K, &owned);
#if defined(BLOCKED_MIN_ROWS)
    if (M >= BLOCKED_MIN_ROWS) {
        blocked_gemm(P, xs, Y, M, N, pairs, num_threads);
        free(owned);
        return;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * N * K > PARALLEL_MIN_WORK)
    for (long panel = 0; panel < panels; panel++) panel_pass(P, xs, Y, M, N, pairs, blocks, rows, width, panel);
    free(owned);
}

/* ----- packed_group_products: one product per group of rows, each on its own packed weight -----
 * Group g (listed in `active`) owns rows [offsets[g], offsets[g + 1]) of xs (packed_rows' layout) and of
 * Y [., N]; its weight [N, K] is packed (pack_bf16) at P + g * group_size elements. A group's tile
 * shape follows its row count (tile_shape; on AVX2 the K-blocked tiles from BLOCKED_MIN_ROWS rows: the
 * MoE at 64 tokens, ~16 rows per expert). Work sharing inside the caller's parallel region (or on
 * the calling thread alone), ending with a barrier: each thread takes a contiguous run of the (group,
 * panel) pairs (the weights streamed in order, which the hardware prefetchers follow) of about equal
 * cost, a panel costing its weight's stream plus its rows' products (groups differ in rows). */
#define PANEL_STREAM_COST 8 /* a panel's weight stream, in rows' products (rows or weights dominate) */

void packed_group_products(const uint16_t *P, size_t group_size, const void *xs, uint16_t *Y, const long *offsets,
                           const long *active, long num_active, long N, long K) {
    const long pairs = (K + 1) / 2, blocks = (N + PACK_COLS - 1) / PACK_COLS;
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    long total = 0;
    for (long a = 0; a < num_active; a++) {
        const long g = active[a], M = offsets[g + 1] - offsets[g];
        total += blocks * (PANEL_STREAM_COST + M);
    }
    /* a panel belongs to the thread whose share holds its cost's midpoint */
    const long start = total * me, stop = total * (me + 1); /* the share, scaled by team */
    long before = 0;
#if defined(BLOCKED_MIN_ROWS)
    blocked_scratch scratch; /* for the groups of BLOCKED_MIN_ROWS rows or more */
#endif
    for (long a = 0; a < num_active && before * team < stop; a++) {
        const long g = active[a], t = offsets[g], M = offsets[g + 1] - t;
        int rows, width;
        tile_shape(M, &rows, &width);
#if defined(BLOCKED_MIN_ROWS)
        if (M >= BLOCKED_MIN_ROWS) width = BLOCKED_BLOCKS; /* blocked_panel's panels */
#endif
        const uint16_t *Pg = P + group_size * g;
        const xrow_t *xg = (const xrow_t *)xs + (size_t)t * pairs * XROW_PER_PAIR;
        for (long panel = 0; panel * width < blocks; panel++) {
            const long nb = blocks - panel * width < width ? blocks - panel * width : width;
            const long cost = nb * (PANEL_STREAM_COST + M), middle = (2 * before + cost) * team;
            before += cost;
            if (middle < 2 * start || middle >= 2 * stop) continue;
#if defined(BLOCKED_MIN_ROWS)
            if (M >= BLOCKED_MIN_ROWS) {
                for (long m_lo = 0; m_lo < M; m_lo += SLAB_ROWS)
                    blocked_panel(Pg, xg, Y + (size_t)t * N, m_lo, M - m_lo < SLAB_ROWS ? M : m_lo + SLAB_ROWS, N,
                                  pairs, blocks, panel, &scratch);
                continue;
            }
#endif
            panel_pass(Pg, xg, Y + (size_t)t * N, M, N, pairs, blocks, rows, width, panel);
        }
    }
#pragma omp barrier
}
