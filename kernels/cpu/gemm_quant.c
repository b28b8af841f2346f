/* Entry points of the weight-only quantized products (formats, algorithms and contract in gemm_quant.h). */
#include "gemm_quant.h"

/* y[M, N] = x[M, K] . dequant(W)^T (+ bias). x bf16 (x_bf16) or fp32; y bf16 when out_bf16 (bf16 x
 * only), else fp32; bias in x's dtype or NULL. path: 0 = automatic (xq_linear_team: the skinny VNNI GEMV
 * up to 8 rows, over chunks of 8 rows up to 16, else the panel-dequantizing blocked GEMM), 1 = the skinny
 * GEMV (M <= 8), 2 = the blocked GEMM, 3 = the skinny GEMV over chunks of 8 rows (any M), 4 = AMX (bf16 x; where
 * amx_ready() (amx.h), else automatic), 5 = the W8A8 GEMM (gemm_w8a8.h; any M, int8-layout weights; on AMX-INT8
 * where it applies), 6 = the W8A8 GEMM on VNNI only. Paths 1-3 run an XQ_W8A8 weight weight-only, as XQ_INT8. */
void xllm_quant_linear(const XllmQWeight *W, const void *x, int x_bf16, int64_t M, int64_t K, int64_t N,
                       const void *bias, void *y, int out_bf16, int path) {
    out_bf16 = out_bf16 && x_bf16;
    const int64_t xes = x_bf16 ? 2 : 4, yes = out_bf16 ? 2 : 4;
#pragma omp parallel
    {
        if (path == 5 || path == 6)
            xw_gemm_team(x, x_bf16, M, K, W, N, bias, y, N, out_bf16, path == 5);
        else if (path == 4 && x_bf16 && amx_ready())
            xq_amx_team((const uint16_t *)x, M, K, W, N, (const uint16_t *)bias, y, N, out_bf16);
        else if (path == 0 || path == 4)
            xq_linear_team(x, x_bf16, M, K, W, N, bias, y, N, out_bf16);
        else if (path == 2 || (path == 1 && M > XQ_MAX_M))
            xq_gemm_team(x, x_bf16, M, K, W, N, bias, y, N, out_bf16);
        else
            for (int64_t m0 = 0; m0 < M; m0 += XQ_MAX_M)
                xq_gemv_team((const char *)x + m0 * K * xes, x_bf16, M - m0 < XQ_MAX_M ? M - m0 : XQ_MAX_M, K, W, N,
                             bias, (char *)y + m0 * N * yes, N, out_bf16);
    }
}

/* block blk of row n dequantized (xq_dequant_block) for W's format; zeros for an unknown one */
ALWAYS_INLINE void xq_dequant_block_any(const XllmQWeight *W, int64_t K, int64_t n, int64_t blk, __m512 *lo,
                                        __m512 *hi) {
    switch (W->fmt) {
#define XQ_D(F) \
    case F: xq_dequant_block(F, W, K, n, blk, lo, hi); break;
        XQ_D(XQ_Q8_0) XQ_D(XQ_Q4_0) XQ_D(XQ_Q4_1) case XQ_W8A8: XQ_D(XQ_INT8) XQ_D(XQ_INT4_G32) XQ_D(XQ_INT4_G128)
#undef XQ_D
    default: *lo = *hi = _mm512_setzero_ps();
    }
}

/* W -> fp32 [N, K] (the panel path's dequantization, row-major; bit-equal to quant.dequantize, see
 * xq_dequant_block) */
void xllm_quant_dequantize_f32(const XllmQWeight *W, int64_t K, int64_t N, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t blk = 0; blk < K / 32; blk++) {
            __m512 lo, hi;
            xq_dequant_block_any(W, K, n, blk, &lo, &hi);
            _mm512_storeu_ps(out + n * K + blk * 32, lo);
            _mm512_storeu_ps(out + n * K + blk * 32 + 16, hi);
        }
    }
}

/* out[i, :] = dequant(W)[ids[i], :] for i < n (a quantized embedding's lookup; bf16, rounded to nearest even
 * as torch casts, when out_bf16, else fp32), bit-equal to quant.dequantize of those rows (xq_dequant_block);
 * ids must be in [0, N). One thread: a step looks up a few rows. */
void xllm_quant_gather_rows(const XllmQWeight *W, int64_t K, const int64_t *ids, int64_t n, void *out, int out_bf16) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t blk = 0; blk < K / 32; blk++) {
            __m512 lo, hi;
            xq_dequant_block_any(W, K, ids[i], blk, &lo, &hi);
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + i * K + blk * 32;
                _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(hi));
            } else {
                _mm512_storeu_ps((float *)out + i * K + blk * 32, lo);
                _mm512_storeu_ps((float *)out + i * K + blk * 32 + 16, hi);
            }
        }
}

/* ---- measurement helpers (benchmarks/gemm_quant.py): `reps` passes over nw weights of one shape in one
 * call, so that the Python/ctypes call overhead stays out of the kernel's time and the weights (more of
 * them than the caches hold) stream from DRAM as a model's layers do ---- */

void xllm_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, const uint16_t *bias,
                    void *y, int out_bf16);

void xllm_quant_linear_many(const XllmQWeight *Ws, int64_t nw, int64_t reps, const void *x, int x_bf16, int64_t M,
                            int64_t K, int64_t N, void *y, int out_bf16, int path) {
    for (int64_t r = 0; r < reps; r++)
        for (int64_t i = 0; i < nw; i++) xllm_quant_linear(Ws + i, x, x_bf16, M, K, N, NULL, y, out_bf16, path);
}

void xllm_gemm_bf16_many(const uint16_t *const *Ws, int64_t nw, int64_t reps, const uint16_t *x, int64_t M, int64_t K,
                         int64_t N, void *y) {
    for (int64_t r = 0; r < reps; r++)
        for (int64_t i = 0; i < nw; i++) xllm_gemm_bf16(x, M, K, Ws[i], N, NULL, y, 1);
}
