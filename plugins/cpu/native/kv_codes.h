/* DeepSeek-V4.1's cache precision formats as C row codecs, bit for bit those of
 * core/models/deepseek_v41/kv_quant.py (which documents them):
 *   KV_FP8   (window keys)        block 32: e4m3fn codes, ue8m0 scale 2^ceil(log2(max(amax, 1e-4) / 448))
 *   KV_NVFP4 (compressed entries) block 16: e2m1 codes, e4m3fn scale e4m3(max(amax, 6 * 2^-9) / 6)
 *   KV_MXFP4 (indexer q and keys) block 32: e2m1 codes, ue8m0 scale 2^ceil(log2(max(amax, 6 * 2^-126) / 6))
 * A packed row is its codes (one byte a channel for fp8, two codes a byte for fp4, the LOW nibble the
 * even channel), then one scale byte per block. The arithmetic is kv_quant.py's in fp32: the scale's
 * product `amax * (1 / 448)` (`* (1 / 6)` for mxfp4) or quotient `amax / 6` (nvfp4), values `x / scale`
 * clamped to the format's range and rounded to nearest-even on its grid (e2m1 ties to the even code
 * index), dequantised as `code * scale` (exact in fp32). A final partial block is read as zero-padded,
 * as there (every real configuration has whole blocks). Non-finite inputs: unspecified, as there. */
#ifndef DEEPINFER_CPU_NATIVE_KV_CODES_H
#define DEEPINFER_CPU_NATIVE_KV_CODES_H

#include "common.h"

enum { KV_FP8 = 0, KV_NVFP4 = 1, KV_MXFP4 = 2 };

static inline long kv_block(int fmt) { return fmt == KV_NVFP4 ? 16 : 32; }

/* code bytes of a row of C channels, then its scale bytes (a final partial block has one too) */
static inline long kv_code_bytes(int fmt, long C) { return fmt == KV_FP8 ? C : (C + 1) / 2; }

static inline long kv_row_bytes(int fmt, long C) {
    return kv_code_bytes(fmt, C) + (C + kv_block(fmt) - 1) / kv_block(fmt);
}

static inline uint32_t kv_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float kv_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> e4m3fn, round to nearest even (c10's fp8e4m3fn_from_fp32_value: values >= 464 become NaN) */
static inline uint8_t kv_to_e4m3(float f) {
    uint32_t bits = kv_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= (1087u << 20)) {
        result = 0x7F;
    } else if (bits < (121u << 23)) { /* below 2^-6, the smallest normal: a subnormal code */
        const uint32_t denorm_mask = 141u << 23;
        result = (uint8_t)(kv_bits(kv_float(bits) + kv_float(denorm_mask)) - denorm_mask);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu;
        bits += odd;
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

/* e4m3fn -> fp32, exact: the exponent and mantissa bits placed in fp32's, times 2^(127 - 7) (a subnormal
 * code lands on an fp32 subnormal, which the product scales back exactly); the NaN codes are never made
 * by kv_to_e4m3 from the clamped values here */
static inline float kv_from_e4m3(uint8_t b) {
    return kv_float(((uint32_t)(b & 0x7F) << 20) | ((uint32_t)(b & 0x80) << 24)) * 0x1p120f;
}

/* the e2m1 grid: codes 0..7 the non-negative levels, 8..15 their negations (8 is -0.0) */
static const float KV_E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* the e2m1 code of v in [-6, 6]: its magnitude index counts the boundaries below it, `>` where a tie
 * rounds down to the even index, `>=` where it rounds up; the sign bit kept (-0.0 -> 8) */
static inline uint8_t kv_e2m1_code(float v) {
    const float m = fabsf(v);
    const uint8_t index = (uint8_t)((m > 0.25f) + (m > 1.25f) + (m > 2.5f) + (m > 5.0f) + (m >= 0.75f)
                                    + (m >= 1.75f) + (m >= 3.5f));
    return index | (signbit(v) ? 8 : 0);
}

/* the power of two 2^(e - 127) from a biased exponent byte (0 gives +0.0, as the bits do) */
static inline float kv_pow2(uint32_t e) { return kv_float(e << 23); }

/* the biased exponent of the smallest power of two >= v (v > 0, fp32): its exponent field, plus one when
 * the mantissa field is not zero */
static inline uint32_t kv_pow2_ceil(float v) {
    const uint32_t bits = kv_bits(v);
    return ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0);
}

/* one block's scale (fp32) and scale byte from its amax */
static inline float kv_block_scale(int fmt, float amax, uint8_t *scale_byte) {
    if (fmt == KV_NVFP4) {
        const float floor = (float)(6.0 / 512.0);
        const uint8_t s = kv_to_e4m3((amax < floor ? floor : amax) / 6.0f);
        *scale_byte = s;
        return kv_from_e4m3(s);
    }
    const float floor = fmt == KV_FP8 ? (float)1e-4 : (float)(6.0 * 0x1p-126);
    const float factor = fmt == KV_FP8 ? (float)(1.0 / 448.0) : (float)(1.0 / 6.0);
    const uint32_t e = kv_pow2_ceil((amax < floor ? floor : amax) * factor);
    *scale_byte = (uint8_t)e;
    return kv_pow2(e);
}

/* x [C] fp32 -> its packed row `out` [kv_row_bytes(fmt, C)] */
static inline void kv_encode_row(int fmt, const float *restrict x, long C, uint8_t *restrict out) {
    const long block = kv_block(fmt);
    uint8_t *scales = out + kv_code_bytes(fmt, C);
    for (long b0 = 0; b0 < C; b0 += block) {
        const long end = b0 + block < C ? b0 + block : C;
        float amax = 0.0f;
        for (long i = b0; i < end; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float scale = kv_block_scale(fmt, amax, scales + b0 / block);
        if (fmt == KV_FP8) {
            for (long i = b0; i < end; i++) {
                const float v = x[i] / scale;
                out[i] = kv_to_e4m3(v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v));
            }
            continue;
        }
        for (long i = b0; i < end; i += 2) { /* the zero past an odd C is code 0 */
            const float v0 = x[i] / scale, v1 = i + 1 < C ? x[i + 1] / scale : 0.0f;
            const uint8_t c0 = kv_e2m1_code(v0 < -6.0f ? -6.0f : (v0 > 6.0f ? 6.0f : v0));
            const uint8_t c1 = kv_e2m1_code(v1 < -6.0f ? -6.0f : (v1 > 6.0f ? 6.0f : v1));
            out[i / 2] = (uint8_t)(c0 | (c1 << 4));
        }
    }
}

/* a packed row -> its C fp32 values (exact) */
static inline void kv_decode_row(int fmt, const uint8_t *restrict row, long C, float *restrict out) {
    const long block = kv_block(fmt);
    const uint8_t *scales = row + kv_code_bytes(fmt, C);
    for (long b0 = 0; b0 < C; b0 += block) {
        const long end = b0 + block < C ? b0 + block : C;
        const float scale = fmt == KV_NVFP4 ? kv_from_e4m3(scales[b0 / block]) : kv_pow2(scales[b0 / block]);
        if (fmt == KV_FP8) {
            for (long i = b0; i < end; i++) out[i] = kv_from_e4m3(row[i]) * scale;
            continue;
        }
        for (long i = b0; i < end; i += 2) {
            const uint8_t pair = row[i / 2];
            out[i] = KV_E2M1[pair & 0x0F] * scale;
            if (i + 1 < C) out[i + 1] = KV_E2M1[pair >> 4] * scale;
        }
    }
}

/* a packed row -> its values as a tensor of `dtype` holds them, in fp32 (kv_quant.decode's cast) */
static inline void kv_decode_row_as(int fmt, const uint8_t *restrict row, long C, int dtype, float *restrict out) {
    kv_decode_row(fmt, row, C, out);
    if (dtype == DT_BF16)
        for (long i = 0; i < C; i++) out[i] = bf16_to_float(float_to_bf16(out[i]));
}

#endif
