/* Helpers shared by the AVX2 library's kernels (kernels/cpu/avx2): bf16 <-> fp32 conversions as torch
 * rounds them, 8-lane loads of bf16 or fp32 values, the horizontal sum of a vector. */
#ifndef XLLM_AVX2_COMMON_H
#define XLLM_AVX2_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../quant_formats.h" /* ALWAYS_INLINE */

ALWAYS_INLINE float xa_bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

ALWAYS_INLINE uint16_t xa_f2bf(float f) { /* nearest even, NaN kept quiet (torch's cast) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* 8 fp32 -> 8 bf16 (nearest even; NaN quiet) */
ALWAYS_INLINE __m128i xa_f2bf8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                           _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                            _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i h = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16),
                                         _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

ALWAYS_INLINE __m256 xa_load8(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

ALWAYS_INLINE float xa_hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#endif
