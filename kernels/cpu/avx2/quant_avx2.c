/* Weight-only quantized products for CPUs with AVX2 + FMA + F16C but no AVX-512 (AMD Zen 1-3, Intel
 * Haswell to Alder Lake): the library xllm.kernels.native builds from this directory where the AVX-512
 * one (kernels/cpu) cannot run. Formats, layouts and XQ_* tags as kernels/cpu/gemm_quant.h (mirrored by
 * xllm.kernels.quant_native.QUANT_TAGS); the entry points have the AVX-512 library's signatures.
 *
 * Product (every M): each row of x is rounded to 16-bit integers per block of 32 values exactly as the
 * AVX-512 GEMV rounds it (dx = amax / 32512, q = round-to-nearest-even(x / dx)), stored as int16. A weight
 * block is widened to int16 (nibbles zero-extended, int8 sign-extended) and VPMADDWD gives exact int32
 * pair sums (|sum| <= 32 * 128 * 32512 < 2^31), converted to fp32 and scaled by dx * d; the 4-bit formats'
 * w = d q + m adds m * dx * sum(q) apart (sx). The integer block sums are the AVX-512 kernel's, bit for
 * bit; only the order of the fp32 sums differs. Accuracy: within ~5e-5 (RMS, relative) of the fp32
 * product of the dequantized weight (the 16-bit activations).
 *
 * Schedule: chunks of 16 output rows are split over the OpenMP team; inside a chunk the rows of x go in
 * groups of up to XA_GROUP (accumulators stay in registers) and each group streams the chunk's weight rows
 * one after the other (the first group from DRAM, with software prefetch ahead of the stream; later groups
 * from L1/L2). Every output element is computed by the same instructions whatever the chunking, so the
 * greedy head (argmax over the same products) agrees with xllm_quant_linear bit for bit.
 *
 * Contract: K % 32 == 0 (K % 128 for int4_g128); data/scales/zeros contiguous; x rows contiguous; y rows at
 * stride N; bias optional, in x's dtype. XQ_W8A8 weights run weight-only, as XQ_INT8 (the caller keeps the
 * W8A8 product, which rounds x to int8, on its reference path).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../quant_formats.h" /* XQ_* tags, XllmQWeight, xq_row_bytes, xq_h2f */
#include "avx2_common.h"      /* xa_bf2f, xa_f2bf, xa_f2bf8, xa_load8, xa_hsum */

#define XQ_QMAX 32512.0f
#define XA_GROUP 4          /* rows of x per pass over a chunk's weight rows */
#define XA_CHUNK 16         /* output rows per chunk */
#define XA_PF_BYTES 4096    /* software prefetch distance in a weight row's stream */

/* ---- activations: int16 per block of 32, scale dx and dx * sum(q) per block ----------------- */

typedef struct {
    int16_t *q; /* [M][K] */
    float *dx;  /* [M][K / 32] */
    float *sx;  /* [M][K / 32] */
} XaAct;

static XaAct xa_quantize(const void *x, int bf16, int64_t M, int64_t K, void **heap) {
    const int64_t nb = K / 32;
    const size_t qbytes = ((size_t)(M * K) * 2 + 63) / 64 * 64;
    uint8_t *buf = (uint8_t *)aligned_alloc(64, qbytes + (size_t)(2 * M * nb) * 4 + 64);
    *heap = buf;
    XaAct a = {(int16_t *)buf, (float *)(buf + qbytes), (float *)(buf + qbytes) + M * nb};
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * K + b * 32;
            __m256 v[4], amax = _mm256_setzero_ps();
            const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (int j = 0; j < 4; j++) {
                v[j] = xa_load8(x, bf16, i + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], absmask));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / XQ_QMAX;
            const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
            __m256i s = _mm256_setzero_si256(), q[4];
            for (int j = 0; j < 4; j++) {
                q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
                s = _mm256_add_epi32(s, q[j]);
            }
            /* packs interleaves 128-bit lanes: fix the order back to 0..15 / 16..31 */
            const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
            const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(a.q + i), p01);
            _mm256_storeu_si256((__m256i *)(a.q + i + 16), p23);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            a.dx[r * nb + b] = d;
            a.sx[r * nb + b] = d * (float)_mm_cvtsi128_si32(s4);
        }
    return a;
}

/* ---- weight blocks ------------------------------------------------------------------------- */

/* block blk of a weight row as int16 (w0: values 0..15, w1: 16..31), its scale d and offset m
 * (w = d q + m; m = 0 for the signed formats, whose q is the value itself) */
ALWAYS_INLINE void xa_block(const int FMT, const uint8_t *row, const uint8_t *sc, const uint8_t *zp, int64_t blk,
                            __m256i *w0, __m256i *w1, float *d, float *m) {
    const uint8_t *qs;
    switch (FMT) {
    case XQ_Q8_0: case XQ_INT8: {
        const uint8_t *b = FMT == XQ_Q8_0 ? row + blk * 34 + 2 : row + blk * 32;
        *d = FMT == XQ_Q8_0 ? xq_h2f(b - 2) : 1.0f;
        *m = 0.0f;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16)));
        return;
    }
    case XQ_Q4_0:
        qs = row + blk * 18 + 2;
        *d = xq_h2f(qs - 2);
        *m = -8.0f * *d;
        break;
    case XQ_Q4_1:
        qs = row + blk * 20 + 4;
        *d = xq_h2f(qs - 4);
        *m = xq_h2f(qs - 2);
        break;
    default: { /* int4: groups of 32 or 128 */
        const int64_t g = FMT == XQ_INT4_G32 ? blk : blk >> 2;
        qs = row + blk * 16;
        *d = xq_h2f(sc + 2 * g);
        *m = -*d * (float)zp[g];
        break;
    }
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), nib = _mm_set1_epi8(0x0F);
    *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(v, nib));
    *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
}

/* out[r] = x_r . dequant(W[n]) for the G rows of x from r0 (fp32, no bias) */
ALWAYS_INLINE void xa_row(const int FMT, const int G, const XaAct a, int64_t r0, int64_t K, const XllmQWeight *W,
                          int64_t n, float *out) {
    const int64_t nb = K / 32;
    const XqRowView v = xq_row_view(FMT, W, K, n);
    const uint8_t *row = v.row, *sc = v.sc, *zp = v.zp;
    const int64_t bb = xq_row_bytes(FMT, 32); /* bytes of a block */
    __m256 acc[XA_GROUP];
    float off[XA_GROUP];
    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {
        acc[g] = _mm256_setzero_ps();
        off[g] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        if ((b & 1) == 0) _mm_prefetch((const char *)row + b * bb + XA_PF_BYTES, _MM_HINT_T0);
        __m256i w0, w1;
        float d, m;
        xa_block(FMT, row, sc, zp, b, &w0, &w1, &d, &m);
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {
            const int64_t r = r0 + g;
            const int16_t *xq = a.q + r * K + b * 32;
            const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16))));
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a.dx[r * nb + b] * d), acc[g]);
            if (m != 0.0f) off[g] += m * a.sx[r * nb + b];
        }
    }
    const float s = FMT == XQ_INT8 ? ((const float *)W->scales)[n] : 1.0f;
    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {
        const float v = xa_hsum(acc[g]) + off[g];
        out[g] = FMT == XQ_INT8 ? v * s : v;
    }
}

/* rows [n0, n0 + cnt) of the product for every row of x, fp32 with bias, into out[M][XA_CHUNK] */
ALWAYS_INLINE void xa_chunk(const int FMT, const XaAct a, int64_t M, int64_t K, const XllmQWeight *W, int64_t n0,
                            int64_t cnt, const void *bias, int bias_bf16, float *out) {
    for (int64_t r0 = 0; r0 < M; r0 += XA_GROUP) {
        const int64_t G = M - r0 < XA_GROUP ? M - r0 : XA_GROUP;
        for (int64_t j = 0; j < cnt; j++) {
            float v[XA_GROUP];
            switch (G) {
            case 1: xa_row(FMT, 1, a, r0, K, W, n0 + j, v); break;
            case 2: xa_row(FMT, 2, a, r0, K, W, n0 + j, v); break;
            case 3: xa_row(FMT, 3, a, r0, K, W, n0 + j, v); break;
            default: xa_row(FMT, 4, a, r0, K, W, n0 + j, v); break;
            }
            const float bj = !bias ? 0.0f : bias_bf16 ? xa_bf2f(((const uint16_t *)bias)[n0 + j])
                                                     : ((const float *)bias)[n0 + j];
            for (int64_t g = 0; g < G; g++) out[(r0 + g) * XA_CHUNK + j] = v[g] + bj;
        }
    }
}

static void xa_chunk_any(const XaAct a, int64_t M, int64_t K, const XllmQWeight *W, int64_t n0, int64_t cnt,
                         const void *bias, int bias_bf16, float *out) {
    switch (W->fmt) {
#define XA_F(F) \
    case F: xa_chunk(F, a, M, K, W, n0, cnt, bias, bias_bf16, out); break;
        XA_F(XQ_Q8_0) XA_F(XQ_Q4_0) XA_F(XQ_Q4_1) case XQ_W8A8: XA_F(XQ_INT8) XA_F(XQ_INT4_G32) XA_F(XQ_INT4_G128)
#undef XA_F
    default: memset(out, 0, sizeof(float) * (size_t)(M * XA_CHUNK));
    }
}

/* y[M, N] = x[M, K] . dequant(W)^T (+ bias): x bf16 (x_bf16) or fp32; y bf16 when out_bf16 (bf16 x only),
 * else fp32. `path` (the AVX-512 library's choice of algorithm) is accepted and ignored: one algorithm. */
void xllm_quant_linear(const XllmQWeight *W, const void *x, int x_bf16, int64_t M, int64_t K, int64_t N,
                       const void *bias, void *y, int out_bf16, int path) {
    (void)path;
    out_bf16 = out_bf16 && x_bf16;
    void *heap;
    const XaAct a = xa_quantize(x, x_bf16, M, K, &heap);
    const int64_t chunks = (N + XA_CHUNK - 1) / XA_CHUNK;
#pragma omp parallel
    {
        float *out = (float *)aligned_alloc(64, sizeof(float) * (size_t)(M * XA_CHUNK));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * XA_CHUNK, cnt = N - n0 < XA_CHUNK ? N - n0 : XA_CHUNK;
            xa_chunk_any(a, M, K, W, n0, cnt, bias, x_bf16, out);
            for (int64_t r = 0; r < M; r++)
                for (int64_t j = 0; j < cnt; j++) {
                    const float v = out[r * XA_CHUNK + j];
                    if (out_bf16)
                        ((uint16_t *)y)[r * N + n0 + j] = xa_f2bf(v);
                    else
                        ((float *)y)[r * N + n0 + j] = v;
                }
        }
        free(out);
    }
    free(heap);
}

/* out[m] = argmax (first index on ties) of row m of xllm_quant_linear's product (bf16 x: its bf16 output,
 * compared as fp32; fp32 x: fp32), without writing the product. NaN-free input. */
void xllm_head_argmax_quant(const XllmQWeight *W, const void *x, int x_bf16, int64_t M, int64_t K, int64_t N,
                            const void *bias, int64_t *out) {
    if (M <= 0) return;
    void *heap;
    const XaAct a = xa_quantize(x, x_bf16, M, K, &heap);
    const int64_t chunks = (N + XA_CHUNK - 1) / XA_CHUNK;
    const int nt = omp_get_max_threads();
    float *bv = (float *)malloc(sizeof(float) * (size_t)(M * nt));
    int64_t *bi = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * nt));
#pragma omp parallel
    {
        const int t = omp_get_thread_num();
        float *buf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(M * XA_CHUNK));
        for (int64_t r = 0; r < M; r++) {
            bv[t * M + r] = -INFINITY;
            bi[t * M + r] = -1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) { /* static: each thread's chunks ascend, ties keep the first */
            const int64_t n0 = c * XA_CHUNK, cnt = N - n0 < XA_CHUNK ? N - n0 : XA_CHUNK;
            xa_chunk_any(a, M, K, W, n0, cnt, bias, x_bf16, buf);
            for (int64_t r = 0; r < M; r++)
                for (int64_t j = 0; j < cnt; j++) {
                    float v = buf[r * XA_CHUNK + j];
                    if (x_bf16) v = xa_bf2f(xa_f2bf(v));
                    if (v > bv[t * M + r] || bi[t * M + r] < 0) {
                        bv[t * M + r] = v;
                        bi[t * M + r] = n0 + j;
                    }
                }
        }
        free(buf);
    }
    for (int64_t r = 0; r < M; r++) { /* threads hold ascending ranges: a later one wins only if greater */
        float best = -INFINITY;
        int64_t idx = -1;
        for (int t = 0; t < nt; t++)
            if (bi[t * M + r] >= 0 && (idx < 0 || bv[t * M + r] > best)) {
                best = bv[t * M + r];
                idx = bi[t * M + r];
            }
        out[r] = idx < 0 ? 0 : idx;
    }
    free(bv);
    free(bi);
    free(heap);
}

/* ---- dequantization: bit-equal to xllm.kernels.quant.dequantize ------------------------------ */

/* elements 0..31 of block blk of row n in fp32: (q - offset) * d (Q4_0, int4), q * d (Q8_0, int8: one
 * exact product or one rounding), d q + m (Q4_1: one FMA; d q is exact for a 4-bit q and an fp16 d) */
ALWAYS_INLINE void xa_dequant_block(const int FMT, const XllmQWeight *W, int64_t K, int64_t n, int64_t blk,
                                    float *dst) {
    const XqRowView v = xq_row_view(FMT, W, K, n);
    __m256i w0, w1;
    float d, m;
    xa_block(FMT, v.row, v.sc, v.zp, blk, &w0, &w1, &d, &m);
    const __m256i off = _mm256_set1_epi32(xq_block_offset(FMT, v, blk));
    if (FMT == XQ_INT8) d = ((const float *)W->scales)[n];
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m256i halves[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w0)),
                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w0, 1)),
                               _mm256_cvtepi16_epi32(_mm256_castsi256_si128(w1)),
                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w1, 1))};
    for (int j = 0; j < 4; j++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(halves[j], off));
        _mm256_storeu_ps(dst + 8 * j, FMT == XQ_Q4_1 ? _mm256_fmadd_ps(q, dv, mv) : _mm256_mul_ps(q, dv));
    }
}

static void xa_dequant_block_any(const XllmQWeight *W, int64_t K, int64_t n, int64_t blk, float *dst) {
    switch (W->fmt) {
#define XA_D(F) \
    case F: xa_dequant_block(F, W, K, n, blk, dst); break;
        XA_D(XQ_Q8_0) XA_D(XQ_Q4_0) XA_D(XQ_Q4_1) case XQ_W8A8: XA_D(XQ_INT8) XA_D(XQ_INT4_G32) XA_D(XQ_INT4_G128)
#undef XA_D
    default: memset(dst, 0, 32 * sizeof(float));
    }
}

/* W -> fp32 [N, K], row-major */
void xllm_quant_dequantize_f32(const XllmQWeight *W, int64_t K, int64_t N, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t blk = 0; blk < K / 32; blk++) xa_dequant_block_any(W, K, n, blk, out + n * K + blk * 32);
}

/* out[i, :] = dequant(W)[ids[i], :] for i < n, bf16 (nearest even) when out_bf16, else fp32; ids in [0, N).
 * One thread: a step looks up a few rows. */
void xllm_quant_gather_rows(const XllmQWeight *W, int64_t K, const int64_t *ids, int64_t n, void *out, int out_bf16) {
    float blk32[32] __attribute__((aligned(32)));
    for (int64_t i = 0; i < n; i++)
        for (int64_t blk = 0; blk < K / 32; blk++) {
            if (!out_bf16) {
                xa_dequant_block_any(W, K, ids[i], blk, (float *)out + i * K + blk * 32);
                continue;
            }
            xa_dequant_block_any(W, K, ids[i], blk, blk32);
            uint16_t *o = (uint16_t *)out + i * K + blk * 32;
            for (int j = 0; j < 4; j++) _mm_storeu_si128((__m128i *)(o + 8 * j), xa_f2bf8(_mm256_load_ps(blk32 + 8 * j)));
        }
}

/* no AMX on these CPUs */
int xllm_amx_int8_ready(void) { return 0; }
