/* Quantized KV rows (int8 / fp8 e4m3, one fp32 scale per token and KV head) and decode attention
 * over them. Layout and codes: xllm/kernels/kv_quant.py (the torch reference these match).
 *
 * A token's row holds KVH pieces of D codes followed by the piece's fp32 scale (D + 4 bytes each),
 * then padding; rows are `tok_stride` bytes apart. fp8 = 1 selects e4m3fn codes, 0 int8.
 *
 * Encoding is bit-identical to the torch reference: amax over the head in fp32, scale = amax / QMAX,
 * x / scale (divisor 1 when amax == 0) rounded to nearest even (int8: clamped to +-127; e4m3:
 * clamped to +-448, then rounded to 3 mantissa bits, subnormals in steps of 2^-9).
 * Decoding: int8 via cvtepi8; e4m3 via fp16 (the code's 7 magnitude bits shifted into an fp16's
 * exponent and mantissa: 2^-8 of the value, exact for normals and subnormals; the 2^8 is folded into
 * the row's scale), then times the scale.
 */
#ifndef XLLM_CPU_KV_QUANT_H
#define XLLM_CPU_KV_QUANT_H

#include "attend.h"

#define KVQ_SCALE_BYTES 4

ALWAYS_INLINE float kvq_qmax(int fp8) { return fp8 ? 448.0f : 127.0f; }

static inline uint8_t kvq_f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(f);
    if (a != a) return sign | 0x7F;
    if (a < 0x1p-6f) return sign | (uint8_t)lrintf(a * 512.0f); /* subnormal steps; 8 -> 0x08 = 2^-6 */
    uint32_t au;
    memcpy(&au, &a, 4);
    const uint32_t r = au + 0x7FFFFu + ((au >> 20) & 1u); /* nearest even at 3 mantissa bits */
    const int e = (int)(r >> 23) - 127 + 7;
    const uint32_t m = (r >> 20) & 7u;
    if (e > 15 || (e == 15 && m == 7)) return sign | 0x7E; /* saturate at 448 */
    return sign | (uint8_t)(e << 3) | (uint8_t)m;
}

/* quantize one head's D values (fp32) into codes + scale at dst */
static inline void kvq_encode_head(const float *x, int64_t D, int fp8, uint8_t *dst) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float scale = amax / kvq_qmax(fp8), div = scale > 0.0f ? scale : 1.0f;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / div;
        if (fp8) {
            y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
            dst[d] = kvq_f32_to_e4m3(y);
        } else {
            float r = nearbyintf(y);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            dst[d] = (uint8_t)(int8_t)r;
        }
    }
    memcpy(dst + D, &scale, 4);
}

#define DEFINE_KVQ_ENCODE_ROW(SFX, T, TOF)                                                                        \
    /* one token's KVH heads of D values (packed) -> a quantized row at dst */                                   \
    static inline void kvq_encode_row_##SFX(const T *x, int64_t KVH, int64_t D, int fp8, uint8_t *dst) {         \
        float buf[512];                                                                                           \
        for (int64_t g = 0; g < KVH; g++) {                                                                       \
            for (int64_t d = 0; d < D; d++) buf[d] = TOF(x[g * D + d]);                                          \
            kvq_encode_head(buf, D, fp8, dst + g * (D + KVQ_SCALE_BYTES));                                       \
        }                                                                                                         \
    }

#define KVQ_F32_ID(x) (x)
DEFINE_KVQ_ENCODE_ROW(bf16, uint16_t, bf16_to_f32)
DEFINE_KVQ_ENCODE_ROW(f32, float, KVQ_F32_ID)

/* 16 codes -> 16 fp32, unscaled and divided by kvq_unit(fp8) (e4m3: the fp16 the code becomes is 2^-8 of
 * its value; callers fold the 256 into the row's scale) */
ALWAYS_INLINE __m512 kvq_load16(const uint8_t *p, int fp8) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (!fp8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(h);
}

ALWAYS_INLINE float kvq_unit(int fp8) { return fp8 ? 256.0f : 1.0f; }

/* The codes of rows [0, n) of a 16-row tile as kvq_load16 gives them into tile[t * D ..] (fp32; with
 * bf16 != 0 bf16, exact: every int8 and e4m3 value is a bf16 number; needs D % 32 == 0), and each row's
 * scale times kvq_unit into scales[t]; rows n..15 zero. Row t's head piece starts at src + t * tok_stride (D % 16 == 0). */
static inline void kvq_codes_tile(const uint8_t *src, int64_t tok_stride, int64_t n, int64_t D, int fp8, int bf16,
                                  void *tile, float *scales) {
    for (int64_t t = 0; t < 16; t++) {
        if (t >= n) {
            scales[t] = 0.0f;
            memset((char *)tile + t * D * (bf16 ? 2 : 4), 0, (size_t)(D * (bf16 ? 2 : 4)));
            continue;
        }
        const uint8_t *row = src + t * tok_stride;
        memcpy(scales + t, row + D, 4);
        scales[t] *= kvq_unit(fp8);
        if (bf16) {
            uint16_t *dst = (uint16_t *)tile + t * D;
            for (int64_t d = 0; d < D; d += 32)
                _mm512_storeu_si512((void *)(dst + d),
                                    (__m512i)_mm512_cvtne2ps_pbh(kvq_load16(row + d + 16, fp8), kvq_load16(row + d, fp8)));
        } else {
            float *dst = (float *)tile + t * D;
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, kvq_load16(row + d, fp8));
        }
    }
}

/* acc[j * Dv + c*16 ..] = sum_t s[j * len + t] * scale_t * codes_t[c*16 ..] with every accumulator in registers
 * (G and NC = Dv / 16 compile-time constants in each instance); v rows v_stride bytes apart. */
ALWAYS_INLINE void kvq_values_reg(const float *s, int64_t len, const uint8_t *v, int64_t v_stride, int fp8,
                                  float *acc, const int G, const int NC) {
    __m512 a[6][8];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < NC; c++) a[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const uint8_t *vt = v + t * v_stride;
        if (t + 8 < len) _mm_prefetch((const char *)(vt + 8 * v_stride), _MM_HINT_T1);
        float scale;
        memcpy(&scale, vt + NC * 16, 4);
        scale *= kvq_unit(fp8);
        __m512 vv[8];
        for (int c = 0; c < NC; c++) vv[c] = kvq_load16(vt + c * 16, fp8);
        for (int j = 0; j < G; j++) {
            const __m512 p = _mm512_set1_ps(s[j * len + t] * scale);
            for (int c = 0; c < NC; c++) a[j][c] = _mm512_fmadd_ps(p, vv[c], a[j][c]);
        }
    }
    for (int j = 0; j < G; j++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + (j * NC + c) * 16, a[j][c]);
}

#define KVQ_VALUES_CASE(GG, NN)                                                                                 \
    case GG:                                                                                                     \
        if (fp8) kvq_values_reg(s, len, v, v_stride, 1, acc, GG, NN);                                           \
        else kvq_values_reg(s, len, v, v_stride, 0, acc, GG, NN);                                               \
        return 1;

/* returns 0 when (G, Dv) has no register-resident instance */
static inline int kvq_values_fast(const float *s, int64_t len, const uint8_t *v, int64_t v_stride, int fp8, float *acc,
                                  int64_t G, int64_t Dv) {
    if (Dv == 64) {
        switch (G) {
            KVQ_VALUES_CASE(1, 4)
            KVQ_VALUES_CASE(2, 4)
            KVQ_VALUES_CASE(3, 4)
            KVQ_VALUES_CASE(4, 4)
            KVQ_VALUES_CASE(5, 4)
            KVQ_VALUES_CASE(6, 4)
        default: return 0;
        }
    }
    if (Dv == 128) {
        switch (G) {
            KVQ_VALUES_CASE(1, 8)
            KVQ_VALUES_CASE(2, 8)
            KVQ_VALUES_CASE(3, 8)
        default: return 0;
        }
    }
    return 0;
}

/* Attention of G query heads (q: G rows of D, bf16 when bf16 != 0 (then D % 32 == 0), else fp32) over one
 * KV head's quantized context of len tokens (k / v: the head's piece in token 0's row; rows k_stride /
 * v_stride bytes apart). Scores: q . codes (bf16: vdpbf16ps, exact products) times the key's scale;
 * values: probabilities times the value's scale, times its codes. D % 16 == 0 and Dv % 16 == 0.
 * scratch: G * len + 16 * (D + Dv) + 32 floats. acc: G * Dv floats out. */
static inline void kvq_attend_group(const void *q, int bf16, int64_t G, int64_t D, const uint8_t *k, int64_t k_stride,
                                    const uint8_t *v, int64_t v_stride, int64_t Dv, int64_t len, float scale,
                                    int fp8, float *scratch, float *acc) {
    float *s = scratch, *ktile = s + G * len, *vtile = ktile + 16 * D, *scales = vtile + 16 * Dv;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const uint8_t *kt = k + t0 * k_stride;
        if (t0 + 16 < len)
            for (int64_t t = 16; t < 32 && t0 + t < len; t++) _mm_prefetch((const char *)(kt + t * k_stride), _MM_HINT_T1);
        kvq_codes_tile(kt, k_stride, n, D, fp8, bf16, ktile, scales);
        const __m512 ks = _mm512_mul_ps(_mm512_loadu_ps(scales), sc);
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        for (int64_t j = 0; j < G; j++) {
            const __m512 raw = bf16 ? scores16_bf16((const uint16_t *)q + j * D, (const uint16_t *)ktile, D, D)
                                    : scores16_f32((const float *)q + j * D, ktile, D, D);
            _mm512_mask_storeu_ps(s + j * len + t0, m, _mm512_mul_ps(raw, ks));
        }
    }
    softmax_rows(s, G, len);
    if (kvq_values_fast(s, len, v, v_stride, fp8, acc, G, Dv)) return;
    for (int64_t i = 0; i < G * Dv; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        kvq_codes_tile(v + t0 * v_stride, v_stride, n, Dv, fp8, 0, vtile, scales);
        const __m512 vs = _mm512_loadu_ps(scales);
        for (int64_t j = 0; j < G; j++) {
            float p[16];
            _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), s + j * len + t0), vs));
            for (int64_t c = 0; c < Dv; c += 16) {
                __m512 a = _mm512_loadu_ps(acc + j * Dv + c);
                for (int64_t t = 0; t < n; t++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vtile + t * Dv + c), a);
                _mm512_storeu_ps(acc + j * Dv + c, a);
            }
        }
    }
}

#endif
