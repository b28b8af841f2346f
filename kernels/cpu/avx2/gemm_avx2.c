/* The bf16 and fp32 products for CPUs with AVX2 + FMA but no AVX-512: y = x @ W^T (+ bias), the entry points
 * and contracts of the AVX-512 library's xllm_gemm_bf16 and xllm_gemm_f32 (kernels/cpu/gemm.c), for any number
 * of rows. Without them a bf16 linear on such a CPU is torch's reference GEMM (about 1 GFLOP/s on a 2-core
 * Zen 3: a bf16 model ran 92 % of its time in aten::mm; this kernel: 40-50 GFLOP/s from 8 rows). The fp32 one
 * is a decode-sized kernel: linear calls it for up to 8 rows (equal to torch at 1 row, 1.2-2.9x at 5-8).
 *
 * Product: x's rows are widened to fp32 once; each output is one fp32 accumulator of 8 lanes over K in steps of
 * 8 (weights widened by a shift, FMA), its lanes summed, then the K % 8 tail in order, then the bias; bf16
 * outputs are rounded to nearest even. Every output element is computed by the same instructions whatever
 * the batch, the tile or the thread that computes it: a row's result does not depend on the other rows.
 *
 * Schedule: chunks of XB_CHUNK weight rows are split over the OpenMP team (a chunk stays in L2 while every
 * row of x passes over it); inside a chunk, tiles of up to 4 rows of x by 2 weight rows (1 by 4 for one row:
 * decode) keep their accumulators in registers.
 *
 * Contract (xllm_gemm_f32: the same in fp32, fp32 outputs): x [M][K] and W [N][K] contiguous bf16; bias NULL
 * or [N] bf16; y [M][N]: bf16 when out_bf16 is 1,
 * fp32 when 0, and when 2 (here only) fp32 holding the bf16-rounded values (logits). Any M >= 0, K >= 1, N >= 0.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_common.h" /* xa_bf2f, xa_f2bf, xa_load8, xa_hsum */

#define XB_CHUNK 32            /* weight rows per chunk of work */
#define XB_PARALLEL_MACS 262144 /* smaller products run on the calling thread (waking the team costs more) */

/* out[m][c] = x_m . w_c for MR rows of xf (fp32, stride K) and NR weight rows from w (stride K; bf16 when
 * WB, else fp32) */
ALWAYS_INLINE void xb_tile(const float *xf, int64_t K, const void *w, const int WB, const int MR, const int NR,
                           float out[4][4]) {
    __m256 acc[4][4];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NR; c++) acc[m][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int c = 0; c < NR; c++) wv[c] = xa_load8(w, WB, c * K + k);
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_loadu_ps(xf + m * K + k);
            for (int c = 0; c < NR; c++) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NR; c++) {
            float s = xa_hsum(acc[m][c]);
            for (int64_t t = k; t < K; t++)
                s += xf[m * K + t] * (WB ? xa_bf2f(((const uint16_t *)w)[c * K + t]) : ((const float *)w)[c * K + t]);
            out[m][c] = s;
        }
}

/* one tile at rows m0.. (mr of them) and weight rows n.. (nr), stored with the bias (bf16 weights, bias and
 * outputs modes 1/2 when WB; all fp32 else) */
static void xb_run_tile(const float *xf, int64_t K, const void *W, const int WB, int64_t N, const void *bias,
                        void *y, int out_mode, int64_t m0, int mr, int64_t n, int nr) {
    float out[4][4];
    const float *xs = xf + m0 * K;
    const void *ws = WB ? (const void *)((const uint16_t *)W + n * K) : (const void *)((const float *)W + n * K);
    switch (mr * 8 + nr) {
    case 1 * 8 + 4: xb_tile(xs, K, ws, WB, 1, 4, out); break;
    case 1 * 8 + 2: xb_tile(xs, K, ws, WB, 1, 2, out); break;
    case 1 * 8 + 1: xb_tile(xs, K, ws, WB, 1, 1, out); break;
    case 2 * 8 + 2: xb_tile(xs, K, ws, WB, 2, 2, out); break;
    case 2 * 8 + 1: xb_tile(xs, K, ws, WB, 2, 1, out); break;
    case 3 * 8 + 2: xb_tile(xs, K, ws, WB, 3, 2, out); break;
    case 3 * 8 + 1: xb_tile(xs, K, ws, WB, 3, 1, out); break;
    case 4 * 8 + 2: xb_tile(xs, K, ws, WB, 4, 2, out); break;
    default: xb_tile(xs, K, ws, WB, 4, 1, out); break;
    }
    for (int m = 0; m < mr; m++)
        for (int c = 0; c < nr; c++) {
            const float b = !bias ? 0.0f : WB ? xa_bf2f(((const uint16_t *)bias)[n + c]) : ((const float *)bias)[n + c];
            const float v = out[m][c] + b;
            if (out_mode == 1)
                ((uint16_t *)y)[(m0 + m) * N + n + c] = xa_f2bf(v);
            else if (out_mode == 2)
                ((float *)y)[(m0 + m) * N + n + c] = xa_bf2f(xa_f2bf(v));
            else
                ((float *)y)[(m0 + m) * N + n + c] = v;
        }
}

/* every tile of y over the team: chunks of XB_CHUNK weight rows, rows of x in fours (call inside a parallel
 * region) */
static void xb_gemm(const float *xf, int64_t M, int64_t K, const void *W, const int WB, int64_t N, const void *bias,
                    void *y, int out_mode) {
    const int64_t chunks = (N + XB_CHUNK - 1) / XB_CHUNK;
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t n0 = ch * XB_CHUNK, n1 = n0 + XB_CHUNK < N ? n0 + XB_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
            const int wide = mr == 1 ? 4 : 2;
            for (int64_t n = n0; n < n1;) {
                const int nr = n1 - n >= wide ? wide : 1;
                if (WB)
                    xb_run_tile(xf, K, W, 1, N, bias, y, out_mode, m0, mr, n, nr);
                else
                    xb_run_tile(xf, K, W, 0, N, bias, y, 0, m0, mr, n, nr);
                n += nr;
            }
        }
    }
}

void xllm_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, const uint16_t *bias,
                    void *y, int out_bf16) {
    if (M <= 0 || N <= 0) return;
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (!xf) abort();
#pragma omp parallel if (M * N * K >= XB_PARALLEL_MACS)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * K; i++) xf[i] = xa_bf2f(x[i]);
        xb_gemm(xf, M, K, W, 1, N, bias, y, out_bf16);
    }
    free(xf);
}

void xllm_gemm_f32(const float *x, int64_t M, int64_t K, const float *W, int64_t N, const float *bias, float *y) {
    if (M <= 0 || N <= 0) return;
#pragma omp parallel if (M * N * K >= XB_PARALLEL_MACS)
    xb_gemm(x, M, K, W, 0, N, bias, y, 0);
}
