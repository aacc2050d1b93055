/* experts_bf16 (and experts_packed_bf16, on the register tiles): the routed MoE experts of decode-sized batches. */
#include "gemv.h"

/* packed_gemm.c's products over packed weights (register tiles) */
long packed_cols(void);
int packed_rows_in_place(const uint16_t *X, long K);
size_t packed_rows_bytes(long M, long K);
void packed_rows(const uint16_t *X, void *xs, long m0, long m1, long K);
void packed_group_products(const uint16_t *P, size_t group_size, const void *xs, uint16_t *Y, const long *offsets,
                           const long *active, long num_active, long N, long K);

/* token t's hidden row [I] (bf16) = swiglu of its gate_up row [2I] (bf16: gate, then up), with g, u scratch */
static void hidden_row(const uint16_t *gate_up, uint16_t *hidden, long t, long I, float *g, float *u, float hi,
                       float lo) {
    load_row(gate_up + (size_t)t * 2 * I, DT_BF16, g, I);
    load_row(gate_up + (size_t)t * 2 * I + I, DT_BF16, u, I);
    swiglu_row(g, u, I, hi, lo);
    store_row(g, hidden + (size_t)t * I, DT_BF16, I);
}

/* ----- experts_bf16: the routed experts of a decode-sized batch, streaming each weight once -----
 * rows [n, D] grouped by expert (expert e owns counts[e] rows, after those of experts < e), w13 [E, 2I, D]
 * (gate rows then up rows), w2 [E, D, I]; out [n, D]. Each block of 16 weight rows is read from
 * memory once and applied to all of its expert's rows while it sits in L1. Only the experts that
 * have rows are visited, and their blocks are dealt to the threads evenly. Roundings follow the
 * reference: gate/up and the output of w2 to bf16 (as torch's bf16 products), swiglu in fp32 with
 * one rounding (as the swiglu kernel above). gate_up [n, 2I] and hidden [n, I] are scratch. Returns 1
 * (nothing written) when the counts are negative or do not add up to n, else 0. */

static void expert_products(const uint16_t *W, long N, long K, const long *active, long num_active,
                            const long *offsets, const uint16_t *X, const float *Xf, uint16_t *Y, long ldy) {
    const long blocks = (N + 15) / 16;
#pragma omp for schedule(static)
    for (long it = 0; it < num_active * blocks; it++) {
        const long e = active[it / blocks], n0 = (it % blocks) * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        const long t = offsets[e];
        gemv_rows_tokens(W + (size_t)e * N * K, X + (size_t)t * K, Xf + (size_t)t * K, Y + (size_t)t * ldy, ldy,
                         offsets[e + 1] - t, n0, n1, K);
    }
}

int experts_bf16(const uint16_t *rows, long n, long D, const int64_t *counts, long E, const uint16_t *w13,
                 const uint16_t *w2, long I, float limit, uint16_t *gate_up, uint16_t *hidden, uint16_t *out,
                 int num_threads) {
    long *offsets, *active, num_active;
    if (expert_ranges(counts, E, n, &offsets, &active, &num_active)) return 1;
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
    const int amx = amx_usable() && D % 64 == 0 && I % 32 == 0;
    /* AMX: chunks of 16 tokens per expert and their packed copies; else fp32 copies of the inputs
     * for the portable dot product (unused with AVX512-BF16) */
    long *first_chunk = malloc((size_t)(E + 1) * sizeof(long));
    first_chunk[0] = 0;
    for (long e = 0; e < E; e++) first_chunk[e + 1] = first_chunk[e] + (offsets[e + 1] - offsets[e] + 15) / 16;
    const long num_chunks = first_chunk[E];
    const long K_max = D > I ? D : I;
    uint16_t *packed = amx ? aligned_alloc(64, (size_t)num_chunks * K_max * 16 * sizeof(uint16_t) + 64) : NULL;
    float *rows_f = amx ? NULL : malloc((size_t)n * D * sizeof(float));
    float *hidden_f = amx ? NULL : malloc((size_t)n * I * sizeof(float));
#pragma omp parallel num_threads(num_threads) if (n * D * I > PARALLEL_MIN_WORK)
    {
        float *g = malloc((size_t)I * sizeof(float));
        float *u = malloc((size_t)I * sizeof(float));
        if (amx) {
            amx_configure();
            expert_products_amx(w13, 2 * I, D, active, num_active, offsets, first_chunk, num_chunks, rows, packed,
                                gate_up, 2 * I);
        } else {
#pragma omp for schedule(static)
            for (long t = 0; t < n; t++) gemv_widen_x(rows + (size_t)t * D, rows_f + (size_t)t * D, D);
            expert_products(w13, 2 * I, D, active, num_active, offsets, rows, rows_f, gate_up, 2 * I);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            hidden_row(gate_up, hidden, t, I, g, u, hi, lo);
            if (!amx) gemv_widen_x(hidden + (size_t)t * I, hidden_f + (size_t)t * I, I);
        }
        if (amx) {
            expert_products_amx(w2, D, I, active, num_active, offsets, first_chunk, num_chunks, hidden, packed,
                                out, D);
            amx_release();
        } else {
            expert_products(w2, D, I, active, num_active, offsets, hidden, hidden_f, out, D);
        }
        free(u);
        free(g);
    }
    free(packed);
    free(hidden_f);
    free(rows_f);
    free(first_chunk);
    free(active);
    free(offsets);
    return 0;
}

/* ----- experts_packed_bf16: experts_bf16 on the register tiles -----
 * The same rows, counts, scratch and roundings as experts_bf16, the weights' packed copies instead (pw13:
 * E x pack_bf16([2I, D]), pw2: E x pack_bf16([D, I]), one after the other): each expert's rows are one
 * product per weight (packed_gemm.c's packed_group_products, the (expert, column panel) pairs over the
 * threads). For batches of several rows per expert, where the tiles' register sums beat the GEMVs'. */
int experts_packed_bf16(const uint16_t *rows, long n, long D, const int64_t *counts, long E,
                        const uint16_t *pw13, const uint16_t *pw2, long I, float limit, uint16_t *gate_up,
                        uint16_t *hidden, uint16_t *out, int num_threads) {
    long *offsets, *active, num_active;
    if (expert_ranges(counts, E, n, &offsets, &active, &num_active)) return 1;
    const float hi = limit > 0.0f ? limit : INFINITY, lo = limit > 0.0f ? -limit : -INFINITY;
    const long cols = packed_cols();
    const size_t size13 = (size_t)((2 * I + cols - 1) / cols) * ((D + 1) / 2) * cols * 2;
    const size_t size2 = (size_t)((D + cols - 1) / cols) * ((I + 1) / 2) * cols * 2;
    void *rows_x = packed_rows_in_place(rows, D) ? NULL : malloc(packed_rows_bytes(n, D));
    void *hidden_x = packed_rows_in_place(hidden, I) ? NULL : malloc(packed_rows_bytes(n, I));
#pragma omp parallel num_threads(num_threads) if (n * D * I > PARALLEL_MIN_WORK)
    {
        float *g = malloc((size_t)I * sizeof(float)), *u = malloc((size_t)I * sizeof(float));
        if (rows_x) {
#pragma omp for schedule(static)
            for (long t = 0; t < n; t++) packed_rows(rows, rows_x, t, t + 1, D);
        }
        packed_group_products(pw13, size13, rows_x ? rows_x : rows, gate_up, offsets, active, num_active, 2 * I, D);
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            hidden_row(gate_up, hidden, t, I, g, u, hi, lo);
            if (hidden_x) packed_rows(hidden, hidden_x, t, t + 1, I);
        }
        packed_group_products(pw2, size2, hidden_x ? hidden_x : hidden, out, offsets, active, num_active, D, I);
        free(u);
        free(g);
    }
    free(hidden_x);
    free(rows_x);
    free(active);
    free(offsets);
    return 0;
}
