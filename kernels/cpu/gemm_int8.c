/* PROTOTYPE (benchmarks only, not used by the model path): W8A8 GEMM with AVX512-VNNI VPDPBUSD.
 *
 * y[m, n] = sx[m] * sw[n] * (sum_k xu[m,k] * wq[n,k] - comp[n]), output bf16 (nearest-even).
 * Weights: per-output-channel symmetric int8 (sw[n] = max|W[n,:]| / 127), packed in panels of 48
 * columns [K/4][48][4] (the u8 x s8 groups of four VPDPBUSD takes), comp[n] = 128 * sum_k wq[n,k].
 * Activations: per-row dynamic symmetric int8 (sx[m] = max|x[m,:]| / 127) stored as u8 = q + 128,
 * the +128 offset removed through comp. Contract: K % 4 == 0, contiguous rows.
 * Tile: <= 8 rows x 48 columns in 24 int32 zmm accumulators, like gemm_packed.h.
 */
#include "common.h"

#define GI8_NV 3
#define GI8_NR (16 * GI8_NV)
#define GI8_MR 8

int64_t xllm_gemm_int8_numel(int64_t N, int64_t K) { return (N + GI8_NR - 1) / GI8_NR * GI8_NR * K; }

/* W [N, K] bf16 -> Wp int8 panels, sw[N] scales, comp[N] offset compensation */
void xllm_gemm_pack_int8(const uint16_t *W, int64_t N, int64_t K, int8_t *Wp, float *sw, int32_t *comp) {
    const int64_t np = (N + GI8_NR - 1) / GI8_NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        int8_t *dst = Wp + p * GI8_NR * K;
        for (int64_t c = 0; c < GI8_NR; c++) {
            const int64_t n = p * GI8_NR + c;
            float amax = 0.0f;
            for (int64_t k = 0; n < N && k < K; k++) amax = fmaxf(amax, fabsf(bf16_to_f32(W[n * K + k])));
            const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
            int32_t sum = 0;
            for (int64_t k = 0; k < K; k++) {
                int q = n < N ? (int)lrintf(bf16_to_f32(W[n * K + k]) * inv) : 0;
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                dst[(k / 4) * 4 * GI8_NR + c * 4 + (k & 3)] = (int8_t)q;
                sum += q;
            }
            if (n < N) {
                sw[n] = s;
                comp[n] = 128 * sum;
            }
        }
    }
}

/* x [M, K] bf16 -> xu [M, K] u8 (q + 128), sx[M] */
void xllm_quant_rows_bf16_u8(const uint16_t *x, int64_t M, int64_t K, uint8_t *xu, float *sx) {
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = x + m * K;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(row + k)));
        const float a = _mm512_reduce_max_ps(amax), s = a > 0.0f ? a / 127.0f : 1.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / s);
        sx[m] = s;
        for (int64_t k = 0; k < K; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(row + k), inv)); /* nearest-even */
            q = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                                  _mm512_set1_epi32(-127)), _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(xu + m * K + k), _mm512_cvtepi32_epi8(q));
        }
    }
}

ALWAYS_INLINE void gi8_tile(const uint8_t *xu, const float *sx, int64_t K, const int8_t *wp, const __m512 *swv,
                            const __m512i *compv, uint16_t *y, int64_t ldy, int64_t ncols, const int MR) {
    __m512i acc[GI8_MR][GI8_NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < GI8_NV; v++) acc[r][v] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
        const int8_t *w = wp + k * GI8_NR;
        __m512i wv[GI8_NV];
        for (int v = 0; v < GI8_NV; v++) wv[v] = _mm512_loadu_si512((const void *)(w + 64 * v));
        for (int r = 0; r < MR; r++) {
            int32_t quad;
            memcpy(&quad, xu + r * K + k, 4);
            const __m512i xv = _mm512_set1_epi32(quad);
            for (int v = 0; v < GI8_NV; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xv, wv[v]);
        }
    }
    for (int r = 0; r < MR; r++) {
        const __m512 s = _mm512_set1_ps(sx[r]);
        for (int v = 0; v < GI8_NV; v++) {
            const int64_t left = ncols - 16 * v;
            const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], compv[v])),
                                                         swv[v]), s);
            _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, m, (__m256i)_mm512_cvtneps_pbh(f));
        }
    }
}

void xllm_gemm_int8_bf16out(const uint8_t *xu, const float *sx, int64_t M, int64_t K, const int8_t *Wp,
                            const float *sw, const int32_t *comp, int64_t N, uint16_t *y) {
    const int64_t np = (N + GI8_NR - 1) / GI8_NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        const int64_t n0 = p * GI8_NR, ncols = N - n0 < GI8_NR ? N - n0 : GI8_NR;
        __m512 swv[GI8_NV];
        __m512i compv[GI8_NV];
        for (int v = 0; v < GI8_NV; v++) {
            const int64_t left = ncols - 16 * v;
            const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            swv[v] = _mm512_maskz_loadu_ps(m, sw + n0 + 16 * v);
            compv[v] = _mm512_maskz_loadu_epi32(m, comp + n0 + 16 * v);
        }
        const int64_t nt = (M + GI8_MR - 1) / GI8_MR;
        int64_t r0 = 0;
        for (int64_t t = 0; t < nt; t++) {
            const int64_t mr = M / nt + (t < M % nt);
            const uint8_t *xt = xu + r0 * K;
            uint16_t *yt = y + r0 * N + n0;
            const int8_t *wp = Wp + p * GI8_NR * K;
            switch (mr) {
#define GI8_CASE(n) \
    case n: gi8_tile(xt, sx + r0, K, wp, swv, compv, yt, N, ncols, n); break;
                GI8_CASE(1) GI8_CASE(2) GI8_CASE(3) GI8_CASE(4) GI8_CASE(5) GI8_CASE(6) GI8_CASE(7) default: GI8_CASE(8)
#undef GI8_CASE
            }
            r0 += mr;
        }
    }
}
