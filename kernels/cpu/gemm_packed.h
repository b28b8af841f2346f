/* Blocked GEMM over a packed weight layout: y[M,N] = x[M,K] . W[N,K]^T (+ bias), any M >= 1.
 *
 * Packed layout (made once by xllm_gemm_pack_bf16 / xllm_gemm_pack_f32 in gemm_packed.c):
 * W is cut into panels of GP_NR = 48 output columns (the last one zero-padded), stored one after
 * the other, each contiguous:
 *   bf16: panel p = [K/2][48][2]  element (k, c) at Wp[p*48*K + (k/2)*96 + c*2 + (k%2)]
 *         (the VNNI pair layout VDPBF16PS consumes: one 64-byte load = 16 columns x one k pair)
 *   fp32: panel p = [K][48]       element (k, c) at Wp[p*48*K + k*48 + c]
 * so both dtypes take xllm_gemm_packed_numel(N, K) = ceil(N/48) * 48 * K elements.
 *
 * Micro-kernel: a tile of MR <= 8 rows x 48 columns kept in 24 zmm fp32 accumulators; per k pair
 * (bf16) or k (fp32) it loads the panel's three vectors and broadcasts each row's x pair (as one
 * 32-bit lane), so there are no horizontal reductions. Rows are cut into balanced tiles of <= 8.
 * Blocking: the rows are split into M-blocks whose x fits in L2 (~192 KB; one block for decode
 * sizes), the work is the (M-block, panel) pairs split over the team in contiguous chunks: a
 * thread streams each panel of its share from DRAM once per M-block (the first row tile prefetches
 * ahead in the panel), the other row tiles reuse it from L1/L2, and the x block stays in its L2.
 *
 * Contract: K even (bf16) / K >= 1 (fp32); x rows at stride ldx, y rows at stride ldy (elements);
 * N arbitrary (the stores of the last panel are masked); bias optional (NULL), in x's dtype.
 * Output: fp32 accumulation (the bias, widened to fp32, is the accumulators' initial value), then
 * (bf16, out_bf16 == GP_OUT_BF16) one rounding to nearest-even, like gemm.c and torch; GP_OUT_F32 stores
 * the fp32 value, GP_OUT_WIDENED the bf16-rounded value as fp32. bf16 products go through VDPBF16PS
 * (denormal inputs/outputs flushed to zero).
 *
 * TEAM functions: gemm_packed_team_bf16 / gemm_packed_team_f32 must be called by every thread of
 * an enclosing `#pragma omp parallel` region (an orphaned `omp for`, ending with its implicit
 * barrier); called outside a parallel region they run on the calling thread alone.
 */
#ifndef XLLM_CPU_GEMM_PACKED_H
#define XLLM_CPU_GEMM_PACKED_H

#include "common.h"

/* Tuned on the Zen4 EPYC (2 threads): 2x12, 3x8 and 4x6 tiles and prefetch distances 1-8 KB
 * were within the run-to-run noise (~5%) of each other, 3x8 slightly ahead at M = 16..128. */
#define GP_NV 3            /* zmm vectors per panel row */
#define GP_NR (16 * GP_NV) /* output columns per panel (the packed layout depends on it) */
#define GP_MR 8            /* max rows per register tile (GP_MR * GP_NV accumulators) */
#define GP_PF_BYTES 4096   /* software prefetch distance inside a panel (first row tile only) */
#define GP_XBLOCK_BYTES (192 * 1024) /* target size of an M-block of x (L2 is 1 MB per core) */

/* output modes (the out_bf16 argument): fp32 sums, bf16 (rounded once), or the bf16 value widened back to
 * fp32 (what torch's `.float()` of the bf16 output holds, written once: an LM head's logits) */
#define GP_OUT_F32 0
#define GP_OUT_BF16 1
#define GP_OUT_WIDENED 2

/* v rounded to bf16 (nearest even, as VCVTNEPS2BF16) and widened back to fp32 */
ALWAYS_INLINE __m512 gp_bf16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

ALWAYS_INLINE int64_t gp_panels(int64_t N) { return (N + GP_NR - 1) / GP_NR; }

/* rows per M-block: one block while x fits in GP_XBLOCK_BYTES (with 50% slack), else balanced
 * blocks of about that size (a multiple of GP_MR) */
ALWAYS_INLINE int64_t gp_mblock(int64_t M, int64_t row_bytes) {
    int64_t mc = GP_XBLOCK_BYTES / (row_bytes > 0 ? row_bytes : 1);
    mc = mc < GP_MR ? GP_MR : mc / GP_MR * GP_MR;
    if (M <= mc + mc / 2) return M;
    const int64_t nb = (M + mc - 1) / mc;
    return (M + nb - 1) / nb;
}

ALWAYS_INLINE __mmask16 gp_mask(int64_t ncols, int v) {
    const int64_t left = ncols - 16 * v;
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* ---- bf16 ------------------------------------------------------------------------------------ */

ALWAYS_INLINE void gp_tile_bf16(const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *wp,
                                const __m512 *bias, void *y, int64_t ldy, int out_bf16, int64_t ncols,
                                int prefetch, const int MR) {
    __m512 acc[GP_MR][GP_NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < GP_NV; v++) acc[r][v] = bias[v];
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t *w = wp + k * GP_NR;
        if (prefetch)
            for (int v = 0; v < GP_NV; v++) _mm_prefetch((const char *)(w + 32 * v) + GP_PF_BYTES, _MM_HINT_T0);
        __m512bh wv[GP_NV];
        for (int v = 0; v < GP_NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512((const void *)(w + 32 * v));
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + k, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < GP_NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
        }
    }
    for (int r = 0; r < MR; r++) {
        for (int v = 0; v < GP_NV; v++) {
            const __mmask16 m = gp_mask(ncols, v);
            if (out_bf16 == GP_OUT_BF16)
                _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + 16 * v, m, (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
            else
                _mm512_mask_storeu_ps((float *)y + r * ldy + 16 * v, m,
                                      out_bf16 == GP_OUT_WIDENED ? gp_bf16_round(acc[r][v]) : acc[r][v]);
        }
    }
}

/* all rows of one M-block against one panel (ncols valid columns of it) */
static void gp_panel_bf16(const uint16_t *x, int64_t ldx, int64_t rows, int64_t K, const uint16_t *wp,
                          const uint16_t *bias, void *y, int64_t ldy, int out_bf16, int64_t ncols) {
    __m512 bv[GP_NV];
    for (int v = 0; v < GP_NV; v++)
        bv[v] = bias ? load_bf16x16_mask(bias + 16 * v, gp_mask(ncols, v)) : _mm512_setzero_ps();
    const int64_t es = out_bf16 == GP_OUT_BF16 ? 2 : 4;
    const int64_t nt = (rows + GP_MR - 1) / GP_MR;
    int64_t r0 = 0;
    for (int64_t t = 0; t < nt; t++) {
        const int64_t mr = rows / nt + (t < rows % nt);
        const uint16_t *xt = x + r0 * ldx;
        void *yt = (char *)y + r0 * ldy * es;
        const int pf = t == 0; /* the first tile streams the panel from DRAM */
        switch (mr) {
#define GP_CASE(n) \
    case n: gp_tile_bf16(xt, ldx, K, wp, bv, yt, ldy, out_bf16, ncols, pf, n); break;
            GP_CASE(1) GP_CASE(2) GP_CASE(3) GP_CASE(4) GP_CASE(5) GP_CASE(6) GP_CASE(7) default: GP_CASE(8)
#undef GP_CASE
        }
        r0 += mr;
    }
}

/* the AVX-512 kernel alone (gemm_packed_team_bf16 chooses between it and AMX) */
static void gemm_packed_avx_team_bf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *Wp,
                                      int64_t N, const uint16_t *bias, void *y, int64_t ldy, int out_bf16) {
    const int64_t np = gp_panels(N), mc = gp_mblock(M, K * 2), nmb = (M + mc - 1) / mc;
    const int64_t es = out_bf16 == GP_OUT_BF16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nmb * np; it++) {
        const int64_t mb = it / np, p = it % np, m0 = mb * mc;
        const int64_t rows = M - m0 < mc ? M - m0 : mc, n0 = p * GP_NR;
        const int64_t ncols = N - n0 < GP_NR ? N - n0 : GP_NR;
        gp_panel_bf16(x + m0 * ldx, ldx, rows, K, Wp + p * GP_NR * K, bias ? bias + n0 : NULL,
                      (char *)y + (m0 * ldy + n0) * es, ldy, out_bf16, ncols);
    }
}

#include "gemm_packed_amx.h"

/* bf16 entry: the AMX kernel where gpa_applies(M, K), else the AVX-512 one */
static void gemm_packed_team_bf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *Wp,
                                  int64_t N, const uint16_t *bias, void *y, int64_t ldy, int out_bf16) {
    if (gpa_applies(M, K))
        gemm_packed_amx_team_bf16(x, ldx, M, K, Wp, N, bias, y, ldy, out_bf16);
    else
        gemm_packed_avx_team_bf16(x, ldx, M, K, Wp, N, bias, y, ldy, out_bf16);
}

/* ---- fp32 ------------------------------------------------------------------------------------ */

ALWAYS_INLINE void gp_tile_f32(const float *x, int64_t ldx, int64_t K, const float *wp, const __m512 *bias,
                               float *y, int64_t ldy, int64_t ncols, int prefetch, const int MR) {
    __m512 acc[GP_MR][GP_NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < GP_NV; v++) acc[r][v] = bias[v];
    for (int64_t k = 0; k < K; k++) {
        const float *w = wp + k * GP_NR;
        if (prefetch)
            for (int v = 0; v < GP_NV; v++) _mm_prefetch((const char *)(w + 16 * v) + GP_PF_BYTES, _MM_HINT_T0);
        __m512 wv[GP_NV];
        for (int v = 0; v < GP_NV; v++) wv[v] = _mm512_loadu_ps(w + 16 * v);
        for (int r = 0; r < MR; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            for (int v = 0; v < GP_NV; v++) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < GP_NV; v++) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, gp_mask(ncols, v), acc[r][v]);
}

static void gp_panel_f32(const float *x, int64_t ldx, int64_t rows, int64_t K, const float *wp, const float *bias,
                         float *y, int64_t ldy, int64_t ncols) {
    __m512 bv[GP_NV];
    for (int v = 0; v < GP_NV; v++)
        bv[v] = bias ? _mm512_maskz_loadu_ps(gp_mask(ncols, v), bias + 16 * v) : _mm512_setzero_ps();
    const int64_t nt = (rows + GP_MR - 1) / GP_MR;
    int64_t r0 = 0;
    for (int64_t t = 0; t < nt; t++) {
        const int64_t mr = rows / nt + (t < rows % nt);
        const float *xt = x + r0 * ldx;
        float *yt = y + r0 * ldy;
        const int pf = t == 0; /* the first tile streams the panel from DRAM */
        switch (mr) {
#define GP_CASE(n) \
    case n: gp_tile_f32(xt, ldx, K, wp, bv, yt, ldy, ncols, pf, n); break;
            GP_CASE(1) GP_CASE(2) GP_CASE(3) GP_CASE(4) GP_CASE(5) GP_CASE(6) GP_CASE(7) default: GP_CASE(8)
#undef GP_CASE
        }
        r0 += mr;
    }
}

static void gemm_packed_team_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *Wp, int64_t N,
                                 const float *bias, float *y, int64_t ldy) {
    const int64_t np = gp_panels(N), mc = gp_mblock(M, K * 4), nmb = (M + mc - 1) / mc;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nmb * np; it++) {
        const int64_t mb = it / np, p = it % np, m0 = mb * mc;
        const int64_t rows = M - m0 < mc ? M - m0 : mc, n0 = p * GP_NR;
        const int64_t ncols = N - n0 < GP_NR ? N - n0 : GP_NR;
        gp_panel_f32(x + m0 * ldx, ldx, rows, K, Wp + p * GP_NR * K, bias ? bias + n0 : NULL, y + m0 * ldy + n0,
                     ldy, ncols);
    }
}

#endif
