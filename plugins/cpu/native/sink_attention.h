/* The body of attention.c's sink attention for one lane count: attention.c includes this file once per
 * instance, with ATTN_LANES (heads per vector), ATTN_VEC (the vector type's name) and ATTN_FN (the
 * function's name) defined; they are undefined at the end. A head's arithmetic does not depend on the
 * lane count (every operation is lane-wise), so every instance gives a head the same bits. */
typedef float ATTN_VEC __attribute__((vector_size(ATTN_LANES * sizeof(float))));

static void ATTN_FN(const void *q, const char *const *key_rows, const key_forms *forms, const uint8_t *mask,
                    const float *sinks, float scale, void *out, long B, long S, long H, long L, long d, int dtype,
                    const long *order, int num_threads) {
    const size_t es = elem_size(dtype);
    const long head_blocks = (H + ATTN_LANES - 1) / ATTN_LANES;
#define KEY(p) (ord ? ord[p] : (p))
    PARALLEL_IF(B * S * H * L * d > PARALLEL_MIN_WORK, {
        ATTN_VEC *qt = aligned_alloc(64, round64((size_t)d * sizeof(ATTN_VEC)));         /* [d], scaled */
        ATTN_VEC *acc = aligned_alloc(64, round64((size_t)d * sizeof(ATTN_VEC)));        /* [d] */
        ATTN_VEC *probs = aligned_alloc(64, round64((size_t)(L + 1) * sizeof(ATTN_VEC))); /* [L] */
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
            const char *const *keys = key_rows + b * L;
            ATTN_VEC sink, top, sum;
            for (long h = 0; h < ATTN_LANES; h++) sink[h] = h < nh ? sinks[h0 + h] : 0.0f;
            top = sink;
            /* scores: four visible keys at a time share each load of qt */
            long l = 0;
            while (l < L) {
                long idx[4], n = 0;
                for (; l < L && n < 4; l++)
                    if (visible[KEY(l)]) idx[n++] = KEY(l);
                for (long j = 0; j < n; j++) load_key(keys[idx[j]], forms, idx[j], dtype, keys_f + j * d, d);
                for (long j = n; j < 4; j++) memset(keys_f + j * d, 0, (size_t)d * sizeof(float));
                ATTN_VEC s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
                const float *k0 = keys_f, *k1 = keys_f + d, *k2 = keys_f + 2 * d, *k3 = keys_f + 3 * d;
                for (long i = 0; i < d; i++) {
                    const ATTN_VEC qi = qt[i];
                    s0 += qi * k0[i];
                    s1 += qi * k1[i];
                    s2 += qi * k2[i];
                    s3 += qi * k3[i];
                }
                const ATTN_VEC scores[4] = {s0, s1, s2, s3};
                for (long j = 0; j < n; j++) {
                    probs[idx[j]] = scores[j];
                    for (long h = 0; h < ATTN_LANES; h++) top[h] = scores[j][h] > top[h] ? scores[j][h] : top[h];
                }
            }
            for (long h = 0; h < ATTN_LANES; h++) sum[h] = vexpf(sink[h] - top[h]);
            for (long jj = 0; jj < L; jj++) {
                const long j = KEY(jj);
                if (!visible[j]) continue;
                ATTN_VEC p;
                _Pragma("omp simd")
                for (long h = 0; h < ATTN_LANES; h++) p[h] = vexpf(probs[j][h] - top[h]);
                probs[j] = p;
                sum += p;
            }
            /* output: four visible keys per pass over the accumulators */
            for (long i = 0; i < d; i++) acc[i] = (ATTN_VEC){0};
            l = 0;
            while (l < L) {
                long idx[4], n = 0;
                for (; l < L && n < 4; l++)
                    if (visible[KEY(l)]) idx[n++] = KEY(l);
                const ATTN_VEC zero = {0};
                ATTN_VEC p[4] = {zero, zero, zero, zero};
                for (long j = 0; j < n; j++) {
                    load_key(keys[idx[j]], forms, idx[j], dtype, keys_f + j * d, d);
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

#undef ATTN_FN
#undef ATTN_VEC
#undef ATTN_LANES
