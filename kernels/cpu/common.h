/* Shared inline helpers of the xLLM CPU kernels (AVX-512F/BW/BF16, OpenMP). */
#ifndef XLLM_CPU_COMMON_H
#define XLLM_CPU_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

ALWAYS_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* 16 bf16 -> 16 fp32 */
ALWAYS_INLINE __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

ALWAYS_INLINE __m512 load_bf16x16_mask(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const void *)p)), 16));
}

/* dot of n bf16 pairs, fp32 accumulation (exact products) */
ALWAYS_INLINE float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(a + i)),
                               (__m512bh)_mm512_loadu_si512((const void *)(b + i)));
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(load_bf16x16(a + i), load_bf16x16(b + i), acc);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(load_bf16x16_mask(a + i, m), load_bf16x16_mask(b + i, m), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

ALWAYS_INLINE float dot_f32(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc2);
    }
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
}

/* exp(x) for 16 lanes: x = n*ln2 + r, |r| <= ln2/2, degree-6 polynomial, scaled by 2^n
 * (max error ~2 ulp; inputs below -87 flush to 0, above 88 saturate to inf). */
ALWAYS_INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* fp32 -> nearest-even bf16 -> fp32 for 16 lanes */
ALWAYS_INLINE __m512 round_bf16_ps(__m512 v) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE void store_bf16_ps(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* in-register transpose of a 16x16 matrix of dwords (r[i] = row i on entry, column i on return) */
ALWAYS_INLINE void transpose16_epi32(__m512i *r) {
    __m512i t[16], s[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        s[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        s[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        s[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        s[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* s[4b + c] lane L = column 4L + c of rows 4b..4b+3 */
    for (int c = 0; c < 4; c++) {
        const __m512i a = _mm512_shuffle_i32x4(s[c], s[4 + c], 0x44), b = _mm512_shuffle_i32x4(s[c], s[4 + c], 0xEE);
        const __m512i e = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0x44);
        const __m512i f = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
    }
}

#endif
