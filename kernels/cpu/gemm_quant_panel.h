/* Dequantization of quantized weights into the packed GEMM's panels (gemm_packed.h) and the panel
 * GEMM over them for any M; included by gemm_quant.h (formats and XQ_* tags there). */
#ifndef XLLM_CPU_GEMM_QUANT_PANEL_H
#define XLLM_CPU_GEMM_QUANT_PANEL_H

/* ---- dequantization into the packed GEMM's panels ------------------------------------------- */

/* elements 0..15 and 16..31 of block `blk` of weight row n, dequantized in fp32 bit for bit as quant.dequantize
 * does it: the integer offset taken first (Q4_0 q - 8, int4 q - zero), then times d, plus m for Q4_1 (one FMA,
 * one rounding, as the reference's: a 4-bit q times an fp16 d is exact) */
ALWAYS_INLINE void xq_dequant_block(const int FMT, const XllmQWeight *W, int64_t K, int64_t n, int64_t blk,
                                    __m512 *lo, __m512 *hi) {
    const XqRowView v = xq_row_view(FMT, W, K, n);
    float d, m;
    const __m256i w = xq_block(FMT, v.row, v.sc, v.zp, blk, &d, &m);
    __m512i q0, q1;
    if (xq_signed(FMT)) {
        q0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(w));
        q1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(w, 1));
    } else {
        q0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(w));
        q1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(w, 1));
    }
    if (FMT == XQ_Q4_0 || xq_is_int4(FMT)) { /* (q - offset) * d: a zero weight keeps d's sign, as in the reference */
        const __m512i off = _mm512_set1_epi32(xq_block_offset(FMT, v, blk));
        q0 = _mm512_sub_epi32(q0, off);
        q1 = _mm512_sub_epi32(q1, off);
        m = 0.0f;
    }
    if (FMT == XQ_INT8) d = ((const float *)W->scales)[n]; /* (XQ_W8A8 weights come as XQ_INT8) */
    const __m512 dv = _mm512_set1_ps(d);
    if (FMT == XQ_Q4_1) {
        const __m512 mv = _mm512_set1_ps(m);
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), dv, mv);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), dv, mv);
    } else {
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), dv);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), dv);
    }
}

/* weight rows n0 .. n0+47 (zeros past N) -> one packed panel (bf16 pairs or fp32, gemm_packed.h) */
ALWAYS_INLINE void xq_panel(const int FMT, const XllmQWeight *W, int64_t K, int64_t N, int64_t n0, void *panel,
                            int bf16) {
    const int64_t nb = K / 32;
    for (int64_t g = 0; g < GP_NV; g++) {
        for (int64_t blk = 0; blk < nb; blk++) {
            __m512i rl[16], rh[16];
            for (int i = 0; i < 16; i++) {
                const int64_t n = n0 + g * 16 + i;
                __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
                if (n < N) xq_dequant_block(FMT, W, K, n, blk, &lo, &hi);
                if (bf16) {
                    rl[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                } else {
                    rl[i] = _mm512_castps_si512(lo);
                    rh[i] = _mm512_castps_si512(hi);
                }
            }
            transpose16_epi32(rl);
            if (bf16) { /* rl[j] = pair j (k = blk*32 + 2j, +1) of the 16 rows */
                uint16_t *p = (uint16_t *)panel + (blk * 16) * 2 * GP_NR + g * 32;
                for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(p + j * 2 * GP_NR), rl[j]);
            } else {
                transpose16_epi32(rh);
                float *p = (float *)panel + (blk * 32) * GP_NR + g * 16;
                for (int j = 0; j < 16; j++) {
                    _mm512_storeu_si512((void *)(p + j * GP_NR), rl[j]);
                    _mm512_storeu_si512((void *)(p + (16 + j) * GP_NR), rh[j]);
                }
            }
        }
    }
}

static void xq_panel_dispatch(const XllmQWeight *W, int64_t K, int64_t N, int64_t n0, void *panel, int bf16) {
    switch (W->fmt) {
    case XQ_Q8_0: xq_panel(XQ_Q8_0, W, K, N, n0, panel, bf16); break;
    case XQ_Q4_0: xq_panel(XQ_Q4_0, W, K, N, n0, panel, bf16); break;
    case XQ_Q4_1: xq_panel(XQ_Q4_1, W, K, N, n0, panel, bf16); break;
    case XQ_W8A8:
    case XQ_INT8: xq_panel(XQ_INT8, W, K, N, n0, panel, bf16); break;
    case XQ_INT4_G32: xq_panel(XQ_INT4_G32, W, K, N, n0, panel, bf16); break;
    case XQ_INT4_G128: xq_panel(XQ_INT4_G128, W, K, N, n0, panel, bf16); break;
    default: break;
    }
}

/* TEAM: y = x . W^T (+ bias) for any M through per-panel dequantization and the blocked micro-kernel
 * (each thread dequantizes the panels of its share into a private buffer; ends with a barrier). */
static void xq_gemm_team(const void *x, int x_bf16, int64_t M, int64_t K, const XllmQWeight *W, int64_t N,
                         const void *bias, void *y, int64_t ldy, int out_bf16) {
    const int64_t np = gp_panels(N), es = x_bf16 ? 2 : 4, oes = (x_bf16 && out_bf16) ? 2 : 4;
    void *panel = aligned_alloc(64, (size_t)(GP_NR * K * es));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        const int64_t n0 = p * GP_NR, ncols = N - n0 < GP_NR ? N - n0 : GP_NR;
        xq_panel_dispatch(W, K, N, n0, panel, x_bf16);
        if (x_bf16)
            gp_panel_bf16((const uint16_t *)x, K, M, K, (const uint16_t *)panel,
                          bias ? (const uint16_t *)bias + n0 : NULL, (char *)y + n0 * oes, ldy, out_bf16, ncols);
        else
            gp_panel_f32((const float *)x, K, M, K, (const float *)panel, bias ? (const float *)bias + n0 : NULL,
                         (float *)y + n0, ldy, ncols);
    }
    free(panel);
}

#endif
