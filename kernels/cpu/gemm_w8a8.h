/* W8A8: int8 weights x int8 activations with AVX512-VNNI VPDPBUSD, for the "w8a8" format of
 * xllm.kernels.quant (included by gemm_quant.h; XQ_W8A8 there).
 *
 * The weight is stored as the "int8" format is (row-major [N, K] int8, symmetric per output channel,
 * fp32 scales sw[N]; the int8 paths of gemm_quant.h read it so, e.g. bf16 x on AMX), plus the panels
 * below. For M >= XW_MIN_M:
 *
 *   y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k]  (+ bias[n]),  in fp32, then y's dtype
 *
 * qx: each row of x rounded to int8 with its own scale sx[m] = amax(|x[m, :]|) / 127 (nearest even;
 * a row of zeros has sx = 1), so a row's result does not depend on the other rows of the step. The
 * products are exact int32 sums: VPDPBUSD multiplies u8 by s8, so qx is stored as qx + 128 and the
 * offset is taken back through comp[n] = 128 * sum_k qw[n, k]. The fp32 epilogue is
 * ((float)(acc - comp) * sw) * sx (+ bias), in that order (the torch reference in xllm.kernels.quant
 * follows it, so the two agree to the last bit).
 *
 * Each team member quantizes x privately (M x K bytes: cheaper than a barrier) and takes whole panels
 * of 48 output rows in VPDPBUSD's layout ([K/4][48][4]: the quad k..k+3 of 48 columns in three zmm),
 * then runs 8x48 register tiles (24 int32 accumulators) over all M rows against each. The panels come
 * from W->packed when the weight carries them (xllm.kernels.quant packs every "w8a8" weight once:
 * ceil(N/48) panels, each 48 * K int8 (rows past N zero) followed by its comp as int32 [48]: xw_panel_at;
 * the panels from any multiple of 48 rows on are a weight of their own), a contiguous stream the DRAM
 * prefetchers follow; else each panel is transposed from the row-major
 * int8 into a private buffer per call (xw_panel). Twice the multiply rate of the bf16 kernel's
 * VDPBF16PS on Zen 4 (64 products per instruction against 32, at the same instruction rate).
 * Where the CPU has AMX-INT8 and the weight its panels (K % 64 == 0), the tiles run on TDPBUSD instead
 * (gemm_w8a8_amx.h: the same rounded x, the same panels, the same exact sums and epilogue).
 *
 * Contract: K % 32 == 0; x rows contiguous (stride K); y rows at stride ldy; bias optional, in x's dtype.
 */
#ifndef XLLM_CPU_GEMM_W8A8_H
#define XLLM_CPU_GEMM_W8A8_H

#define XW_NV 3
#define XW_NR (16 * XW_NV) /* output columns per panel */
#define XW_MR 8            /* rows per register tile */
#define XW_MIN_M 1         /* rows from which the W8A8 GEMM runs: every product (one row too: over the packed
                              panels it outruns the int8 GEMV, and a row's result never depends on the batch) */

/* panel p of W->packed (48 * K int8) and its offset sums (int32 [48], right after it) */
ALWAYS_INLINE const int8_t *xw_panel_at(const XllmQWeight *W, int64_t K, int64_t p) {
    return (const int8_t *)W->packed + p * (XW_NR * K + 4 * XW_NR);
}

ALWAYS_INLINE __mmask16 xw_mask(int64_t ncols, int v) {
    const int64_t left = ncols - 16 * v;
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* x [M, K] (bf16 or fp32) -> xu [M, K] u8 = qx + 128, sx [M] */
static void xw_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, uint8_t *xu, float *sx) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *rb = (const uint16_t *)x + m * K;
        const float *rf = (const float *)x + m * K;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(x_bf16 ? load_bf16x16(rb + k) : _mm512_loadu_ps(rf + k)));
        const float a = _mm512_reduce_max_ps(amax), s = a > 0.0f ? a / 127.0f : 1.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / s);
        sx[m] = s;
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = x_bf16 ? load_bf16x16(rb + k) : _mm512_loadu_ps(rf + k);
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv)); /* nearest even */
            q = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127)),
                                 _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(xu + m * K + k), _mm512_cvtepi32_epi8(q));
        }
    }
}

/* int8 rows n0 .. n0+47 of W (zeros past N) -> panel [K/4][48][4], comp[48] = 128 * row sums */
static void xw_panel(const int8_t *W, int64_t K, int64_t N, int64_t n0, int8_t *panel, int32_t *comp) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int g = 0; g < XW_NV; g++) {
        __m512i sum = _mm512_setzero_si512(); /* lane i: row n0 + 16 g + i */
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            const int64_t bytes = K - k0 < 64 ? K - k0 : 64; /* 64, or 32 at the end (K % 32 == 0) */
            const __mmask64 lm = bytes == 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t n = n0 + 16 * g + i;
                r[i] = n < N ? _mm512_maskz_loadu_epi8(lm, W + n * K + k0) : _mm512_setzero_si512();
            }
            transpose16_epi32(r); /* r[j] lane i: quad j of row i */
            for (int64_t j = 0; j < bytes / 4; j++) {
                _mm512_storeu_si512((void *)(panel + ((k0 / 4 + j) * XW_NR + 16 * g) * 4), r[j]);
                sum = _mm512_dpbusd_epi32(sum, ones, r[j]);
            }
        }
        _mm512_storeu_si512((void *)(comp + 16 * g), _mm512_slli_epi32(sum, 7));
    }
}

/* the epilogue of 16 output columns (16 v .. 16 v + 15 of a panel): offsets, scales, bias and the store mask */
typedef struct {
    __m512i c;
    __m512 s, b;
    __mmask16 m;
    int has_bias;
} XwOut;

ALWAYS_INLINE XwOut xw_out_setup(const int32_t *comp, const float *sw, const void *bias, int bias_bf16, int64_t ncols,
                                 int v) {
    XwOut o;
    o.m = xw_mask(ncols, v);
    o.c = _mm512_maskz_loadu_epi32(o.m, comp + 16 * v);
    o.s = _mm512_maskz_loadu_ps(o.m, sw + 16 * v);
    o.has_bias = bias != NULL;
    o.b = bias == NULL ? _mm512_setzero_ps()
          : bias_bf16  ? load_bf16x16_mask((const uint16_t *)bias + 16 * v, o.m)
                       : _mm512_maskz_loadu_ps(o.m, (const float *)bias + 16 * v);
    return o;
}

/* y[at .. at + 16) (elements; bf16 when out_bf16, else fp32) = ((acc - comp) * sw) * sx (+ bias) */
ALWAYS_INLINE void xw_out16(const XwOut o, __m512i acc, float sx, void *y, int64_t at, int out_bf16) {
    /* (an explicitly rounded product: GCC would contract it and the bias add into an FMA) */
    __m512 f = _mm512_mul_round_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, o.c)), o.s), _mm512_set1_ps(sx),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (o.has_bias) f = _mm512_add_ps(f, o.b);
    if (out_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)y + at, o.m, (__m256i)_mm512_cvtneps_pbh(f));
    else
        _mm512_mask_storeu_ps((float *)y + at, o.m, f);
}

/* MR rows of xu against one panel: y[r, 0..ncols) (bf16 when out_bf16, else fp32) */
ALWAYS_INLINE void xw_tile(const uint8_t *xu, const float *sx, int64_t K, const int8_t *wp, const int32_t *comp,
                           const float *sw, const void *bias, int bias_bf16, void *y, int64_t ldy, int out_bf16,
                           int64_t ncols, const int MR) {
    __v16si acc[XW_MR][XW_NV]; /* (int32 lanes: GCC keeps __m512i tiles in memory, not in registers) */
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < XW_NV; v++) acc[r][v] = (__v16si)_mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
        const int8_t *w = wp + k * XW_NR;
        __m512i wv[XW_NV];
        for (int v = 0; v < XW_NV; v++) wv[v] = _mm512_loadu_si512((const void *)(w + 64 * v));
        for (int r = 0; r < MR; r++) {
            int32_t quad;
            memcpy(&quad, xu + r * K + k, 4);
            const __m512i xv = _mm512_set1_epi32(quad);
            for (int v = 0; v < XW_NV; v++) acc[r][v] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][v], xv, wv[v]);
        }
    }
    __asm__ volatile("" ::: "memory"); /* keeps the epilogue's loads out of the k loop's registers */
    for (int v = 0; v < XW_NV; v++) {
        const XwOut o = xw_out_setup(comp, sw, bias, bias_bf16, ncols, v);
        for (int r = 0; r < MR; r++) xw_out16(o, (__m512i)acc[r][v], sx[r], y, r * ldy + 16 * v, out_bf16);
    }
}

#include "gemm_w8a8_amx.h"

/* whether xq_linear_team runs W's product over M rows here (on AMX CPUs too: the same rounding everywhere) */
ALWAYS_INLINE int xq_w8a8_applies(const XllmQWeight *W, int64_t M) { return W->fmt == XQ_W8A8 && M >= XW_MIN_M; }

/* TEAM (call from every thread of a parallel region, or outside one): y = W8A8(x, W) (+ bias), any M;
 * W->fmt is XQ_W8A8 (or XQ_INT8: the same layout). The tiles run on AMX-INT8 where xwa_applies and
 * allow_amx, else on VNNI (the same result). Ends with a barrier. */
static void xw_gemm_team(const void *x, int x_bf16, int64_t M, int64_t K, const XllmQWeight *W, int64_t N,
                         const void *bias, void *y, int64_t ldy, int out_bf16, int allow_amx) {
    const int64_t np = (N + XW_NR - 1) / XW_NR, oes = out_bf16 ? 2 : 4;
    const int amx = allow_amx && xwa_applies(W, M, K);
    const int64_t rows = amx && M < 16 ? 16 : M; /* AMX: at least one whole tile of rows */
    uint8_t *xu = aligned_alloc(64, (size_t)((rows * K + 63) / 64 * 64));
    float *sx = aligned_alloc(64, (size_t)((M * 4 + 63) / 64 * 64));
    xw_quantize_rows(x, x_bf16, M, K, xu, sx);
    if (amx) {
        memset(xu + M * K, 128, (size_t)((rows - M) * K)); /* the padding rows: qx = 0 (never stored) */
        xwa_gemm_team(xu, sx, M, K, W, N, bias, x_bf16, y, ldy, out_bf16);
        free(sx);
        free(xu);
        return;
    }
    int8_t *own = W->packed == NULL ? aligned_alloc(64, (size_t)(XW_NR * K)) : NULL;
    int32_t own_comp[XW_NR] __attribute__((aligned(64)));
    const int8_t *data = (const int8_t *)W->data;
    const float *scales = (const float *)W->scales;
    const int64_t nt = (M + XW_MR - 1) / XW_MR;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        const int64_t n0 = p * XW_NR, ncols = N - n0 < XW_NR ? N - n0 : XW_NR;
        const int8_t *panel = own;
        const int32_t *comp = own_comp;
        if (own != NULL)
            xw_panel(data, K, N, n0, own, own_comp);
        else {
            panel = xw_panel_at(W, K, p);
            comp = (const int32_t *)(panel + XW_NR * K);
        }
        const void *bp = bias == NULL ? NULL : (const char *)bias + n0 * (x_bf16 ? 2 : 4);
        int64_t r0 = 0;
        for (int64_t t = 0; t < nt; t++) {
            const int64_t mr = M / nt + (t < M % nt);
            const uint8_t *xt = xu + r0 * K;
            void *yt = (char *)y + (r0 * ldy + n0) * oes;
            switch (mr) {
#define XW_CASE(n) \
    case n: xw_tile(xt, sx + r0, K, panel, comp, scales + n0, bp, x_bf16, yt, ldy, out_bf16, ncols, n); break;
                XW_CASE(1) XW_CASE(2) XW_CASE(3) XW_CASE(4) XW_CASE(5) XW_CASE(6) XW_CASE(7) default: XW_CASE(8)
#undef XW_CASE
            }
            r0 += mr;
        }
    }
    free(own);
    free(sx);
    free(xu);
}

#endif
