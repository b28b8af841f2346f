/* The W8A8 GEMM on AMX-INT8 (included by gemm_w8a8.h): the same product as its VNNI tiles, on TDPBUSD.
 *
 * The w8a8 panels ([K/4][48][4] int8, packed once at load) are already TDPBUSD's B layout: the 16 k-quads x
 * 16 columns x 4 bytes of a B tile are 16 rows of 64 bytes at a stride of 192 bytes, so three B tiles cover
 * a panel's 48 columns for 64 k. The A operand is x rounded to int8 as gemm_w8a8.h rounds it (qx + 128 as
 * u8, row-major: 16 rows x 64 k at x's row stride). Per (M-block, panel) item a thread runs, for each block
 * of 16 rows, C[0..2] += A . B[0..2] over K in steps of 64 (tiles: C 0-2, A 3, B 4-6), stores the three
 * int32 C tiles and writes the rows through gemm_w8a8.h's epilogue, ((acc - comp) * sw) * sx (+ bias).
 * The int32 sums are exact, so the result is the VNNI kernel's and quant.w8a8_reference's to the last bit.
 * A last partial block of rows is shifted back to end at row M (its overlap recomputed, the same values
 * stored again); M < 16 runs on x padded to 16 rows. Each item prefetches the next item's panel into L2,
 * spread over its k-steps, and M-blocks hold half the core's L2 of x (gemm_packed_amx.h's sizing).
 *
 * Contract: gemm_w8a8.h's, plus K % 64 == 0, the weight's packed panels, and amx_int8_ready() (amx.h).
 */
#ifndef XLLM_CPU_GEMM_W8A8_AMX_H
#define XLLM_CPU_GEMM_W8A8_AMX_H

#include "amx.h"

/* rows from which the W8A8 GEMM runs on AMX-INT8 where it can (see xwa_applies). SmolLM2's shapes, 2 threads,
 * weights from DRAM, this session's AMX Xeon (AMX / VNNI speed): 0.83-0.86 at 1 row, 0.98-1.09 at 2, 1.15-1.26
 * at 4, 1.35-1.63 at 8, 1.7-2.35 at 64, 2.0-3.6 at 512 (docs/performance.md) */
#ifndef XWA_MIN_M
#define XWA_MIN_M 3
#endif

/* whether xw_gemm_team runs W's product over M rows on AMX-INT8 */
static inline int xwa_applies(const XllmQWeight *W, int64_t M, int64_t K) {
    return W->packed != NULL && M >= XWA_MIN_M && K % 64 == 0 && amx_int8_ready();
}

/* one block of 16 rows of xu (row stride K) against one panel: c[16][48] int32 (prefetching as gpa_block) */
AMX_INT8_TARGET static inline void xwa_block(const uint8_t *xu, int64_t K, const int8_t *wp, int32_t *c,
                                             const char **pf, int64_t pf_step) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
        const int8_t *w = wp + k0 * XW_NR; /* quad k0 / 4: 4 * XW_NR bytes per quad */
        for (int64_t b = 0; b < pf_step; b += 64) _mm_prefetch(*pf + b, _MM_HINT_T1);
        *pf += pf_step;
        _tile_loadd(3, xu + k0, K);
        _tile_loadd(4, w, 4 * XW_NR);
        _tile_loadd(5, w + 64, 4 * XW_NR);
        _tile_loadd(6, w + 128, 4 * XW_NR);
        _tile_dpbusd(0, 3, 4);
        _tile_dpbusd(1, 3, 5);
        _tile_dpbusd(2, 3, 6);
    }
    _tile_stored(0, c, 4 * XW_NR);
    _tile_stored(1, c + 16, 4 * XW_NR);
    _tile_stored(2, c + 32, 4 * XW_NR);
}

/* TEAM: y = W8A8 product of the rounded rows xu [max(M, 16), K] (u8, rows past M any value) with scales
 * sx [M] against W's packed panels (+ bias in bias_bf16 ? bf16 : fp32); ends with a barrier */
AMX_INT8_TARGET static void xwa_gemm_team(const uint8_t *xu, const float *sx, int64_t M, int64_t K,
                                          const XllmQWeight *W, int64_t N, const void *bias, int bias_bf16, void *y,
                                          int64_t ldy, int out_bf16) {
    const int64_t np = (N + XW_NR - 1) / XW_NR, mc = gpa_mblock(M, K), nmb = (M + mc - 1) / mc;
    const float *scales = (const float *)W->scales;
    int32_t c[16 * XW_NR] __attribute__((aligned(64)));
    amx_configure_16x64(7);
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < nmb * np; it++) {
        const int64_t mb = it / np, p = it % np, m0 = mb * mc, n0 = p * XW_NR;
        const int64_t rows = M - m0 < mc ? M - m0 : mc, ncols = N - n0 < XW_NR ? N - n0 : XW_NR;
        const int8_t *wp = xw_panel_at(W, K, p);
        const int64_t ksteps = K / 64, nblk = (rows + 15) / 16;
        const char *pf = (const char *)xw_panel_at(W, K, it + 1 < nmb * np ? (it + 1) % np : 0);
        const int64_t pf_step = it + 1 < nmb * np ? ((XW_NR * K + 4 * XW_NR) / (nblk * ksteps) + 127) / 64 * 64 : 0;
        const void *bp = bias == NULL ? NULL : (const char *)bias + n0 * (bias_bf16 ? 2 : 4);
        XwOut o[XW_NV];
        for (int v = 0; v < XW_NV; v++)
            o[v] = xw_out_setup((const int32_t *)(wp + XW_NR * K), scales + n0, bp, bias_bf16, ncols, v);
        for (int64_t r = 0; r < rows; r += 16) {
            /* the last block shifted back to end at M (M >= 16), else the padded rows */
            const int64_t s = m0 + r + 16 <= M || M < 16 ? m0 + r : M - 16;
            xwa_block(xu + s * K, K, wp, c, &pf, pf_step);
            const int64_t first = m0 + r - s, last = m0 + r + (rows - r < 16 ? rows - r : 16) - s;
            for (int64_t i = first; i < last; i++)
                for (int v = 0; v < XW_NV; v++)
                    xw_out16(o[v], _mm512_load_si512((const void *)(c + i * XW_NR + 16 * v)), sx[s + i], y,
                             (s + i) * ldy + n0 + 16 * v, out_bf16);
        }
    }
    amx_tile_release();
#pragma omp barrier
}

#endif
