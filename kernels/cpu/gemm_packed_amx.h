/* The packed bf16 GEMM on AMX: y[M, N] = x[M, K] . W[N, K]^T (+ bias) over the packed layout of
 * gemm_packed.h, included by it; gemm_packed_team_bf16 takes this path where gpa_applies(M, K).
 *
 * The packed bf16 panel ([K/2][48][2]) is already the VNNI layout TDPBF16PS wants for its B operand:
 * the 16 k-pairs x 16 columns x 2 of a B tile are 16 rows of 64 bytes at a stride of 192 bytes. x is
 * row-major, the A operand as it stands (16 rows x 32 k at x's row stride). So there is no repacking:
 * per (M-block, panel) item a thread runs, for each block of 16 rows, C[0..2] += A . B[0..2] over K in
 * steps of 32 (tiles: C 0-2, A 3, B 4-6), stores the three C tiles (16 x 48 fp32), adds the bias and
 * writes the row's valid columns (rounded to bf16 once, or fp32). A last partial block of rows is
 * shifted back to end at row M (its overlap recomputed, the same values stored again); M < 16 goes
 * through a zero-padded copy of x.
 *
 * Arithmetic: exact bf16 products summed in fp32 (TDPBF16PS; denormals flushed), in a different order
 * from VDPBF16PS's (rounding differences of the sums only). Contract: gemm_packed.h's, plus K % 32 == 0
 * and amx_ready() (amx.h); TEAM function (ends with a barrier).
 */
#ifndef XLLM_CPU_GEMM_PACKED_AMX_H
#define XLLM_CPU_GEMM_PACKED_AMX_H

#include "amx.h"

/* rows from which gemm_packed_team_bf16 takes the AMX path: SmolLM2's shapes, 2 threads, this AMX Xeon
 * (packed AVX-512 vs AMX, ms): see xllm.kernels.gemm's benchmark in docs/performance.md */
#ifndef GPA_MIN_M
#define GPA_MIN_M 2
#endif
#define GPA_XBLOCK_MIN (256 * 1024) /* x bytes of one M-block where the L2 size is unknown */

static inline int gpa_applies(int64_t M, int64_t K) { return M >= GPA_MIN_M && K % 32 == 0 && amx_ready(); }

/* x bytes of one M-block: half of this core's L2 (the rest holds the panel streaming through and the
 * next one prefetched), at least GPA_XBLOCK_MIN. Every M-block streams all of W once more, so the larger
 * the block the fewer the passes: 1x512 prefill's gate/up (3.5 MB of W) took three passes at 256 KB. */
static pthread_once_t gpa_once = PTHREAD_ONCE_INIT;
static int64_t gpa_xblock = GPA_XBLOCK_MIN; /* written once, under gpa_once */

static void gpa_probe(void) {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 / 2 > GPA_XBLOCK_MIN) gpa_xblock = l2 / 2;
}

static inline int64_t gpa_xblock_bytes(void) {
    pthread_once(&gpa_once, gpa_probe);
    return gpa_xblock;
}

/* rows per M-block: a multiple of 16 whose x fits gpa_xblock_bytes() (at least 16), all of M when it fits */
static inline int64_t gpa_mblock(int64_t M, int64_t row_bytes) {
    int64_t mc = gpa_xblock_bytes() / (row_bytes > 0 ? row_bytes : 1) / 16 * 16;
    if (mc < 16) mc = 16;
    return M <= mc + mc / 2 ? M : mc;
}

/* one block of 16 rows of x (row stride ldx) against one panel: c[16][48] fp32. Per step of 32 k it
 * prefetches pf_step bytes at *pf (into L2) and advances *pf: the next panel, spread over this one's work
 * (pf_step 0: none). The tile loads alone leave DRAM's latency exposed (a 64-row decode's gate/up ran at
 * ~11 GB/s); with the next panel in L2 they run ~25 % faster at 16-64 rows (2 threads, this Xeon). */
AMX_TARGET static inline void gpa_block(const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *wp, float *c,
                                        const char **pf, int64_t pf_step) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const uint16_t *w = wp + (k0 / 2) * 2 * GP_NR;
        for (int64_t b = 0; b < pf_step; b += 64) _mm_prefetch(*pf + b, _MM_HINT_T1);
        *pf += pf_step;
        _tile_loadd(3, x + k0, ldx * 2);
        _tile_loadd(4, w, 4 * GP_NR);
        _tile_loadd(5, w + 32, 4 * GP_NR);
        _tile_loadd(6, w + 64, 4 * GP_NR);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, c, 4 * GP_NR);
    _tile_stored(1, c + 16, 4 * GP_NR);
    _tile_stored(2, c + 32, 4 * GP_NR);
}

/* rows [first, first + n) of a block's c (block row 0 = y row y0) + bias -> y */
static inline void gpa_store(const float *c, int64_t first, int64_t n, const __m512 *bias, void *y, int64_t ldy,
                             int64_t y0, int out_bf16, int64_t ncols) {
    for (int64_t i = first; i < first + n; i++) {
        for (int v = 0; v < GP_NV; v++) {
            const __mmask16 m = gp_mask(ncols, v);
            const __m512 a = _mm512_add_ps(_mm512_load_ps(c + i * GP_NR + 16 * v), bias[v]);
            if (out_bf16 == GP_OUT_BF16)
                _mm256_mask_storeu_epi16((uint16_t *)y + (y0 + i) * ldy + 16 * v, m, (__m256i)_mm512_cvtneps_pbh(a));
            else
                _mm512_mask_storeu_ps((float *)y + (y0 + i) * ldy + 16 * v, m,
                                      out_bf16 == GP_OUT_WIDENED ? gp_bf16_round(a) : a);
        }
    }
}

AMX_TARGET static void gemm_packed_amx_team_bf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                                 const uint16_t *Wp, int64_t N, const uint16_t *bias, void *y,
                                                 int64_t ldy, int out_bf16) {
    const int64_t np = gp_panels(N), mc = gpa_mblock(M, K * 2), nmb = (M + mc - 1) / mc;
    float c[16 * GP_NR] __attribute__((aligned(64)));
    uint16_t *pad = NULL; /* M < 16: x zero-padded to 16 rows */
    if (M < 16) {
        pad = (uint16_t *)aligned_alloc(64, (size_t)(16 * K * 2));
        memset(pad, 0, (size_t)(16 * K * 2));
        for (int64_t i = 0; i < M; i++) memcpy(pad + i * K, x + i * ldx, (size_t)(K * 2));
    }
    amx_configure_16x64(7);
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < nmb * np; it++) {
        const int64_t mb = it / np, p = it % np, m0 = mb * mc, n0 = p * GP_NR;
        const int64_t rows = M - m0 < mc ? M - m0 : mc, ncols = N - n0 < GP_NR ? N - n0 : GP_NR;
        const uint16_t *wp = Wp + p * GP_NR * K;
        /* the panel of the next item (this thread's next one under the static schedule), in equal slices
         * over this item's k-steps; none after the last panel */
        const int64_t ksteps = K / 32, nblk = pad != NULL ? 1 : (rows + 15) / 16;
        const char *pf = (const char *)(it + 1 < nmb * np ? Wp + ((it + 1) % np) * GP_NR * K : Wp);
        const int64_t pf_step = it + 1 < nmb * np ? (GP_NR * K * 2 / (nblk * ksteps) + 127) / 64 * 64 : 0;
        __m512 bv[GP_NV];
        for (int v = 0; v < GP_NV; v++)
            bv[v] = bias ? load_bf16x16_mask(bias + n0 + 16 * v, gp_mask(ncols, v)) : _mm512_setzero_ps();
        char *yp = (char *)y + n0 * (out_bf16 == GP_OUT_BF16 ? 2 : 4);
        if (pad != NULL) {
            gpa_block(pad, K, K, wp, c, &pf, pf_step);
            gpa_store(c, 0, M, bv, yp, ldy, 0, out_bf16, ncols);
            continue;
        }
        for (int64_t r = 0; r < rows; r += 16) {
            const int64_t s = m0 + r + 16 <= M ? m0 + r : M - 16; /* the last block shifted back to end at M */
            gpa_block(x + s * ldx, ldx, K, wp, c, &pf, pf_step);
            gpa_store(c, m0 + r - s, rows - r < 16 ? rows - r : 16, bv, yp, ldy, s, out_bf16, ncols);
        }
    }
    amx_tile_release();
#pragma omp barrier
    free(pad);
}

#endif
