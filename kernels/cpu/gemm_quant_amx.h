/* Quantized products with bf16 activations over 2+ rows on AMX (AMX-TILE + AMX-BF16): y[M, N] = x[M, K] .
 * bf16(dequant(W))[N, K]^T (+ bias), included by gemm_quant.h.
 *
 * Algorithm: per group of 16 weight rows (split over the team), a thread dequantizes the group's rows
 * for all K into a 16 x K bf16 buffer (d * q + m in fp32 with FMA, rounded to bf16 nearest-even: the
 * values the dequantized bf16 model holds), then for each block of 16 rows of x runs TDPBF16PS over K in
 * steps of 32 with A = the buffer's 16 x 32 slice (row-major, no transpose) and B = x's 16 rows as
 * VNNI pairs (x packed once per call into [K/2][16][2] per block of 16 rows: 16x16 dword transposes),
 * so C[n][m] accumulates in fp32; C is stored, transposed and written to y[m][n] (+ bias, rounded).
 * Unlike the skinny VNNI GEMV (16-bit activations, exact weights) the weights are rounded to bf16 here:
 * the arithmetic of the dequantized bf16 model (bf16 x: exact products, fp32 sums). Dequantization is
 * ~10 instructions per weight row and block of 32 whatever M, the tile products cost ~16 cycles per
 * 16 x 16 x 32, so 2..16 rows cost about what one row costs the GEMV, and larger M much less than the
 * panel GEMM.
 *
 * Runs where amx_ready() (amx.h: CPUID, the kernel's permission for tile data, XLLM_AMX not 0).
 */
#ifndef XLLM_CPU_GEMM_QUANT_AMX_H
#define XLLM_CPU_GEMM_QUANT_AMX_H

#include "amx.h"

/* rows from which the AMX path replaces the GEMV (xq_linear_team): one thread, CPU time, SmolLM2's Q4_1
 * gate/up (3072 x 576) and down (576 x 1536), a busy machine: GEMV / AMX at M = 4 256 / 675 us and 106 / 195 us,
 * M = 8 630 / 363 and 202 / 220, M = 16 1006 / 364 and 374 / 182 (AMX costs the same to 16 rows: its
 * dequantization dominates) */
#define XQ_AMX_MIN_M 6

/* whether xq_linear_team takes the AMX path for this product */
static inline int xq_amx_applies(int x_bf16, int64_t M) { return x_bf16 && M >= XQ_AMX_MIN_M && amx_ready(); }

/* x rows [m0, m0 + 16) (rows >= M zero) as VNNI pairs: dst[kp * 16 + i] = the bf16 pair (2kp, 2kp+1) of row m0 + i */
static inline void xq_amx_pack_x(const uint16_t *x, int64_t M, int64_t K, int64_t m0, uint32_t *dst) {
    const int64_t kps = K / 2;
    for (int64_t kp0 = 0; kp0 < kps; kp0 += 16) {
        const int64_t n = kps - kp0 < 16 ? kps - kp0 : 16;
        const __mmask16 mask = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = m0 + i < M ? _mm512_maskz_loadu_epi32(mask, (const uint32_t *)(x + (m0 + i) * K) + kp0)
                              : _mm512_setzero_si512();
        transpose16_epi32(r); /* r[j] = pair kp0 + j of the 16 rows */
        for (int64_t j = 0; j < n; j++) _mm512_storeu_si512((void *)(dst + (kp0 + j) * 16), r[j]);
    }
}

/* weight rows [n0, n0 + 16) (rows >= N zero) dequantized to bf16 into buf[16][K] */
static inline void xq_amx_dequant_group(const XllmQWeight *W, int64_t K, int64_t N, int64_t n0, uint16_t *buf) {
    for (int64_t r = 0; r < 16; r++) {
        uint16_t *row = buf + r * K;
        if (n0 + r >= N) {
            memset(row, 0, (size_t)K * 2);
            continue;
        }
        for (int64_t blk = 0; blk < K / 32; blk++) {
            __m512 lo, hi;
            switch (W->fmt) {
#define XQ_D(F) \
    case F: xq_dequant_block(F, W, K, n0 + r, blk, &lo, &hi); break;
                XQ_D(XQ_Q8_0) XQ_D(XQ_Q4_0) XQ_D(XQ_Q4_1) case XQ_W8A8: XQ_D(XQ_INT8) XQ_D(XQ_INT4_G32) XQ_D(XQ_INT4_G128)
#undef XQ_D
            default: lo = hi = _mm512_setzero_ps();
            }
            _mm512_storeu_si512((void *)(row + blk * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* TEAM: y[M, N] = x . bf16(dequant(W))^T (+ bias, bf16) for bf16 x, M >= 1 rows, out bf16 or fp32 (ends with a
 * barrier). Rows of x go in chunks of XQ_AMX_MCHUNK (their packed pairs stay in L2; each chunk dequantizes the
 * weight groups again). Call only where amx_ready(). */
#define XQ_AMX_MCHUNK 256
AMX_TARGET static void xq_amx_team(const uint16_t *x, int64_t M, int64_t K, const XllmQWeight *W, int64_t N,
                                      const uint16_t *bias, void *y, int64_t ldy, int out_bf16) {
    const int64_t groups = (N + 15) / 16, mch = M < XQ_AMX_MCHUNK ? M : XQ_AMX_MCHUNK;
    uint32_t *xp = (uint32_t *)aligned_alloc(64, (size_t)(((mch + 15) / 16) * (K / 2) * 16 * 4));
    uint16_t *wbuf = (uint16_t *)aligned_alloc(64, (size_t)(16 * K * 2));
    amx_configure_16x64(3); /* tmm0 C (16 x 16 fp32), tmm1 A (16 x 32 bf16), tmm2 B (16 k-pairs x 16 x 2) */
    for (int64_t mc0 = 0; mc0 < M; mc0 += XQ_AMX_MCHUNK) {
        const int64_t mrows = M - mc0 < XQ_AMX_MCHUNK ? M - mc0 : XQ_AMX_MCHUNK, mblocks = (mrows + 15) / 16;
        const uint16_t *xc = x + mc0 * K;
        for (int64_t mb = 0; mb < mblocks; mb++) xq_amx_pack_x(xc, mrows, K, mb * 16, xp + mb * (K / 2) * 16);
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * 16, ncols = N - n0 < 16 ? N - n0 : 16;
            const __mmask16 nmask = (__mmask16)(ncols >= 16 ? 0xffff : (1u << ncols) - 1);
            xq_amx_dequant_group(W, K, N, n0, wbuf);
            __m512 bv = _mm512_setzero_ps();
            if (bias) bv = load_bf16x16_mask(bias + n0, nmask);
            for (int64_t mb = 0; mb < mblocks; mb++) {
                const uint32_t *xb = xp + mb * (K / 2) * 16;
                _tile_zero(0);
                for (int64_t k0 = 0; k0 < K; k0 += 32) {
                    _tile_loadd(1, wbuf + k0, K * 2);       /* A: 16 weight rows x 32 k */
                    _tile_loadd(2, xb + (k0 / 2) * 16, 64); /* B: 16 k-pairs x 16 x rows */
                    _tile_dpbf16ps(0, 1, 2);
                }
                float c[256] __attribute__((aligned(64)));
                _tile_stored(0, c, 64); /* c[n * 16 + m] */
                __m512i r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void *)(c + i * 16));
                transpose16_epi32(r); /* r[m] = outputs n0 .. n0+15 of row m */
                const int64_t rows = mrows - mb * 16 < 16 ? mrows - mb * 16 : 16;
                for (int64_t i = 0; i < rows; i++) {
                    const int64_t m = mc0 + mb * 16 + i;
                    const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[i]), bv);
                    if (out_bf16)
                        _mm256_mask_storeu_epi16((uint16_t *)y + m * ldy + n0, nmask, (__m256i)_mm512_cvtneps_pbh(v));
                    else
                        _mm512_mask_storeu_ps((float *)y + m * ldy + n0, nmask, v);
                }
            }
        }
    }
    amx_tile_release();
#pragma omp barrier
    free(wbuf);
    free(xp);
}

#endif
