/* Skinny matrix products for decode: y[M,N] = x[M,K] . W[N,K]^T (+ bias), M small.
 *
 * Memory-bound when M is small: every weight element is read once from DRAM and
 * used for all M rows of x (which stay in L1). bf16 uses AVX512-BF16 VDPBF16PS
 * (pairs of bf16 products accumulated in fp32); fp32 uses AVX-512 FMA. Each
 * weight row is streamed sequentially (what the hardware prefetcher follows
 * best: ~40 GB/s here against ~15 GB/s for interleaved rows) with M (x2 when
 * M = 1) accumulators in registers; M is a compile-time constant through the
 * dispatch below. Rows of W are split across OpenMP threads (the libgomp
 * runtime torch uses).
 * Contract: K % 32 == 0 (bf16) or K % 16 == 0 (fp32); contiguous rows; M <= 8.
 * bf16 output (with the bias added in fp32) is rounded once to nearest-even, like torch.
 */
#include "common.h"

ALWAYS_INLINE void store_bf16(const uint16_t *bias, void *y, int out_bf16, int64_t N, int64_t m, int64_t n,
                              float s) {
    if (out_bf16) {
        ((uint16_t *)y)[m * N + n] = f32_to_bf16(s + (bias ? bf16_to_f32(bias[n]) : 0.0f));
    } else {
        ((float *)y)[m * N + n] = s + (bias ? bf16_to_f32(bias[n]) : 0.0f);
    }
}

ALWAYS_INLINE void row_bf16(const uint16_t *x, int64_t K, const uint16_t *W, int64_t N, int64_t n,
                            const uint16_t *bias, void *y, int out_bf16, const int M) {
    const uint16_t *w = W + n * K;
    __m512 acc[8], acc2 = _mm512_setzero_ps();
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    if (M == 1) { /* two chains hide the dot-product latency */
        for (; k + 64 <= K; k += 64) {
            acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512((const void *)(x + k)),
                                      (__m512bh)_mm512_loadu_si512((const void *)(w + k)));
            acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)),
                                    (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)));
        }
    }
    for (; k < K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k)), wv);
    }
    if (M == 1) acc[0] = _mm512_add_ps(acc[0], acc2);
    for (int m = 0; m < M; m++) store_bf16(bias, y, out_bf16, N, m, n, _mm512_reduce_add_ps(acc[m]));
}

ALWAYS_INLINE void run_bf16(const uint16_t *x, int64_t K, const uint16_t *W, int64_t N, const uint16_t *bias,
                            void *y, int out_bf16, const int M) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) row_bf16(x, K, W, N, n, bias, y, out_bf16, M);
}

void xllm_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, int64_t N,
                    const uint16_t *bias, void *y, int out_bf16) {
    switch (M) {
    case 1: run_bf16(x, K, W, N, bias, y, out_bf16, 1); break;
    case 2: run_bf16(x, K, W, N, bias, y, out_bf16, 2); break;
    case 3: run_bf16(x, K, W, N, bias, y, out_bf16, 3); break;
    case 4: run_bf16(x, K, W, N, bias, y, out_bf16, 4); break;
    case 5: run_bf16(x, K, W, N, bias, y, out_bf16, 5); break;
    case 6: run_bf16(x, K, W, N, bias, y, out_bf16, 6); break;
    case 7: run_bf16(x, K, W, N, bias, y, out_bf16, 7); break;
    default: run_bf16(x, K, W, N, bias, y, out_bf16, 8); break;
    }
}

ALWAYS_INLINE void row_f32(const float *x, int64_t K, const float *W, int64_t N, int64_t n, const float *bias,
                           float *y, const int M) {
    const float *w = W + n * K;
    __m512 acc[8], acc2 = _mm512_setzero_ps();
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    if (M == 1) {
        for (; k + 32 <= K; k += 32) {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), acc[0]);
            acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), acc2);
        }
    }
    for (; k < K; k += 16) {
        __m512 wv = _mm512_loadu_ps(w + k);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, acc[m]);
    }
    if (M == 1) acc[0] = _mm512_add_ps(acc[0], acc2);
    for (int m = 0; m < M; m++) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + (bias ? bias[n] : 0.0f);
}

ALWAYS_INLINE void run_f32(const float *x, int64_t K, const float *W, int64_t N, const float *bias, float *y,
                           const int M) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) row_f32(x, K, W, N, n, bias, y, M);
}

void xllm_gemm_f32(const float *x, int64_t M, int64_t K, const float *W, int64_t N, const float *bias, float *y) {
    switch (M) {
    case 1: run_f32(x, K, W, N, bias, y, 1); break;
    case 2: run_f32(x, K, W, N, bias, y, 2); break;
    case 3: run_f32(x, K, W, N, bias, y, 3); break;
    case 4: run_f32(x, K, W, N, bias, y, 4); break;
    case 5: run_f32(x, K, W, N, bias, y, 5); break;
    case 6: run_f32(x, K, W, N, bias, y, 6); break;
    case 7: run_f32(x, K, W, N, bias, y, 7); break;
    default: run_f32(x, K, W, N, bias, y, 8); break;
    }
}
