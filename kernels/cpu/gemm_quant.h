/* Weight-only quantized products y[M,N] = x[M,K] . dequant(W)[N,K]^T (+ bias), W in a packed format
 * of xllm.kernels.quant (formats and layouts in its docstring; the XQ_* tags mirror QUANT_TAGS).
 *
 * Skinny path (M <= 8, decode): integer dot products at 16-bit activation precision. Each row of x is
 * rounded to 16-bit integers per block of 32 (scale dx = amax / 32512, nearest even) and stored as two
 * byte planes, q = 256 h + l (llama.cpp rounds to int8 instead, ~100x coarser: that flipped SmolLM2's
 * near-tie greedy tokens; see the activation section). A weight row is streamed once for all M rows, a
 * quad of 4 blocks at a time: the quad's values are unpacked into two zmm (lane i = block i; `lo` its
 * first 16 values, `hi` its last 16: exactly what the GGUF nibble order gives, int8 blocks shuffled
 * to match), each activation plane is stored in the same split order, and AVX512-VNNI VPDPBUSD (u8 x
 * s8, exact int32 sums; two per plane) gives per-lane block sums 256 * sum(w h) + sum(w l), converted to
 * fp32 and scaled by dx (per block of x) and d (per block of W). 4-bit formats are w = d * q + m (Q4_0: m = -8 d; Q4_1: stored m;
 * int4: m = -scale * zero), so the product adds m * dx * sum(xq), accumulated apart. Signed weights
 * (Q8_0, int8) run VPDPBUSD with the activation planes as the u8 operand (the high plane offset by 128,
 * its accumulator started at -128 * sum(w)), which keeps the sums exact. A row's last quad may be partial (K = 576: 18 blocks),
 * read with masked loads. The 16 partial sums of each (weight row, x row) are parked in L1 for a chunk
 * of 16 weight rows and reduced 4 rows at a time (streaming 4 rows side by side instead defeats the
 * DRAM prefetchers: Q8_0 ran at a third of the speed). Chunks of 16 output rows are split over the team.
 *
 * AMX path (bf16 x, 2+ rows, where the CPU and kernel allow AMX): gemm_quant_amx.h; it replaces the paths
 * below for those products.
 *
 * Large path (M > 16; 9..16 rows run the skinny GEMV over chunks of 8 rows): a team member dequantizes
 * a panel of 48 weight rows (fp32 math, FMA) straight into the packed GEMM's layout (gemm_packed.h:
 * bf16 VNNI pairs or fp32) in an L2-resident buffer, transposing 16x16 dword tiles, and runs the
 * blocked micro-kernel over all M rows against it.
 *
 * W8A8 path (XQ_W8A8 weights: int8's layout plus VNNI panels; every M, on AMX CPUs too): the
 * activations are rounded to int8 per row too and gemm_w8a8.h's int8 GEMM runs (xq_w8a8_applies).
 *
 * Contract: K % 32 == 0 (K % 128 for int4_g128); data/scales/zeros contiguous as documented;
 * x rows contiguous (stride K); y rows at stride ldy; bias optional, in x's dtype.
 * Accuracy against the fp32 product of the dequantized weight: the skinny path's 16-bit activations cost
 * < 1e-4 of the output's max (fp32 out; random data with 30x outlier channels; benchmarks/gemm_quant.py
 * measures it per shape), int8 ones cost ~1 %; the large path is exact in fp32 and rounds the
 * dequantized weight to bf16 for bf16 x (~0.3 %).
 */
#ifndef XLLM_CPU_GEMM_QUANT_H
#define XLLM_CPU_GEMM_QUANT_H

#include <stdlib.h>

#include "common.h"
#include "gemm_packed.h"

#include "quant_formats.h"

#define XQ_MAX_M 8

/* 16 packed bytes -> 32 u8 values (element j low nibble of byte j, j + 16 high nibble) */
ALWAYS_INLINE __m256i xq_nib32(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* block `blk` of a weight row: the 32 values (u8 for 4-bit formats, s8 for signed ones) and w = d*q + m */
ALWAYS_INLINE __m256i xq_block(const int FMT, const uint8_t *row, const uint8_t *sc, const uint8_t *zp,
                               int64_t blk, float *d, float *m) {
    switch (FMT) {
    case XQ_Q8_0: {
        const uint8_t *b = row + blk * 34;
        *d = xq_h2f(b);
        *m = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    case XQ_Q4_0: {
        const uint8_t *b = row + blk * 18;
        *d = xq_h2f(b);
        *m = -8.0f * *d;
        return xq_nib32(b + 2);
    }
    case XQ_Q4_1: {
        const uint8_t *b = row + blk * 20;
        *d = xq_h2f(b);
        *m = xq_h2f(b + 2);
        return xq_nib32(b + 4);
    }
    case XQ_INT8:
        *d = 1.0f;
        *m = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(row + blk * 32));
    default: { /* int4: groups of 32 or 128 */
        const int64_t g = FMT == XQ_INT4_G32 ? blk : blk >> 2;
        *d = xq_h2f(sc + 2 * g);
        *m = -*d * (float)zp[g];
        return xq_nib32(row + blk * 16);
    }
    }
}

/* ---- activation quantization ---------------------------------------------------------------- */

/* x rows quantized per 32-block to 16-bit integers (q = round(x / dx), dx = amax / XQ_QMAX: |q| <=
 * 32512), each stored as two byte planes so that VPDPBUSD (u8 x s8) keeps the products exact:
 * q = 256 * h + l. For the unsigned-weight (4-bit) formats the activation is the s8 operand: l in
 * [-128, 127] (`ql`), h in [-127, 127] (`qh`). For the signed-weight formats (Q8_0, int8) it is the u8
 * operand: l = q & 255 in [0, 255], and h + 128 in [1, 255] (the kernel subtracts 128 * sum(w) from the
 * high plane's sums). Layout: quads of 4 blocks (the last one zero-padded: nqt = ceil(K / 128) quads,
 * row stride 128 * nqt bytes per plane); inside a quad the first 16 values of its 4 blocks come first,
 * then their last 16 (the order in which the kernel unpacks a quad of weight blocks). dxv [M][nqt][16]:
 * a quad's 4 scales dx, each repeated 4 times (one per int32 lane of the block's 128-bit lane);
 * sx [M][4 nqt] = dx * sum(q); padding blocks have dx = sx = 0.
 * Accuracy: the step dx is amax / 32512 per 32 values (llama.cpp's Q8 activations: amax / 127), so the
 * product is within ~5e-5 (RMS, relative) of the fp32 product of the dequantized weight: well below
 * the rounding of bf16 activations (2^-9 per value). */
#define XQ_QMAX 32512.0f
typedef struct {
    uint8_t *qh, *ql;
    float *dxv, *sx;
    int64_t nqt;
} XqAct;

ALWAYS_INLINE int64_t xq_quads(int64_t K) { return (K / 32 + 3) / 4; }

ALWAYS_INLINE size_t xq_act_bytes(int64_t M, int64_t K) {
    const int64_t nqt = xq_quads(K);
    return (size_t)(M * nqt * (2 * 128 + 64 + 16));
}

ALWAYS_INLINE XqAct xq_act_view(void *buf, int64_t M, int64_t K) {
    XqAct a;
    a.nqt = xq_quads(K);
    a.dxv = (float *)buf; /* 64-byte aligned first */
    a.qh = (uint8_t *)(a.dxv + M * a.nqt * 16);
    a.ql = a.qh + M * a.nqt * 128;
    a.sx = (float *)(a.ql + M * a.nqt * 128);
    return a;
}

/* block b of row r from its 32 values v0 (0..15), v1 (16..31) */
ALWAYS_INLINE void xq_act_block(const XqAct a, int64_t r, int64_t b, __m512 v0, __m512 v1, int offset) {
    const __m512 amax = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float d = _mm512_reduce_max_ps(amax) / XQ_QMAX;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    __m512i l0, l1, h0, h1;
    if (offset) { /* l = q & 255 (u8), h + 128 (u8) */
        const __m512i m255 = _mm512_set1_epi32(255), o128 = _mm512_set1_epi32(128);
        l0 = _mm512_and_si512(q0, m255);
        l1 = _mm512_and_si512(q1, m255);
        h0 = _mm512_add_epi32(_mm512_srai_epi32(q0, 8), o128);
        h1 = _mm512_add_epi32(_mm512_srai_epi32(q1, 8), o128);
    } else { /* l = the sign-extended low byte, h = (q - l) / 256 */
        l0 = _mm512_srai_epi32(_mm512_slli_epi32(q0, 24), 24);
        l1 = _mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24);
        h0 = _mm512_srai_epi32(_mm512_sub_epi32(q0, l0), 8);
        h1 = _mm512_srai_epi32(_mm512_sub_epi32(q1, l1), 8);
    }
    const int64_t at = (r * a.nqt + b / 4) * 128 + (b % 4) * 16;
    _mm_storeu_si128((__m128i *)(a.ql + at), _mm512_cvtepi32_epi8(l0));
    _mm_storeu_si128((__m128i *)(a.ql + at + 64), _mm512_cvtepi32_epi8(l1));
    _mm_storeu_si128((__m128i *)(a.qh + at), _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128((__m128i *)(a.qh + at + 64), _mm512_cvtepi32_epi8(h1));
    a.sx[r * a.nqt * 4 + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    _mm_storeu_ps(a.dxv + (r * a.nqt + b / 4) * 16 + (b % 4) * 4, _mm_set1_ps(d));
}

ALWAYS_INLINE void xq_act_pad(const XqAct a, int64_t M, int64_t K, int offset) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = K / 32; b < 4 * a.nqt; b++) {
            const int64_t at = (r * a.nqt + b / 4) * 128 + (b % 4) * 16;
            memset(a.ql + at, 0, 16);
            memset(a.ql + at + 64, 0, 16);
            memset(a.qh + at, offset ? 0x80 : 0, 16);
            memset(a.qh + at + 64, offset ? 0x80 : 0, 16);
            a.sx[r * a.nqt * 4 + b] = 0.0f;
            _mm_storeu_ps(a.dxv + (r * a.nqt + b / 4) * 16 + (b % 4) * 4, _mm_setzero_ps());
        }
}

static void xq_quantize_bf16(const uint16_t *x, int64_t M, int64_t K, int offset, XqAct a) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / 32; b++) {
            const uint16_t *p = x + r * K + b * 32;
            xq_act_block(a, r, b, load_bf16x16(p), load_bf16x16(p + 16), offset);
        }
    xq_act_pad(a, M, K, offset);
}

static void xq_quantize_f32(const float *x, int64_t M, int64_t K, int offset, XqAct a) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / 32; b++) {
            const float *p = x + r * K + b * 32;
            xq_act_block(a, r, b, _mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), offset);
        }
    xq_act_pad(a, M, K, offset);
}

/* ---- skinny GEMV ---------------------------------------------------------------------------- */

/* The quad loaders read blocks i < `left` only (left = 4 except in a row's last, partial quad; the
 * missing blocks read as zeros, d = m = 0, so they add nothing). */

ALWAYS_INLINE __m128i xq_gather16(const uint8_t *p, int64_t stride, int left) { /* uint16 at p + i * stride */
    uint16_t v[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++)
        if (i < left) memcpy(&v[i], p + i * stride, 2);
    return _mm_setr_epi16((short)v[0], (short)v[1], (short)v[2], (short)v[3], 0, 0, 0, 0);
}

ALWAYS_INLINE __m128i xq_gather32(const uint8_t *p, int64_t stride, int left) { /* uint32 at p + i * stride */
    int32_t v[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++)
        if (i < left) memcpy(&v[i], p + i * stride, 4);
    return _mm_setr_epi32(v[0], v[1], v[2], v[3]);
}

ALWAYS_INLINE __m128i xq_load16(const uint8_t *p, int ok) {
    return ok ? _mm_loadu_si128((const __m128i *)p) : _mm_setzero_si128();
}

ALWAYS_INLINE __m256i xq_load32(const uint8_t *p, int ok) {
    return ok ? _mm256_loadu_si256((const __m256i *)p) : _mm256_setzero_si256();
}

ALWAYS_INLINE __m512i xq_load4x16(const uint8_t *p, int64_t stride, int left) { /* 16 bytes at p + i * stride */
    __m512i v = _mm512_castsi128_si512(xq_load16(p, 1));
    v = _mm512_inserti32x4(v, xq_load16(p + stride, left > 1), 1);
    v = _mm512_inserti32x4(v, xq_load16(p + 2 * stride, left > 2), 2);
    return _mm512_inserti32x4(v, xq_load16(p + 3 * stride, left > 3), 3);
}

ALWAYS_INLINE __m512i xq_load64(const uint8_t *p, int64_t valid) { /* 64 bytes, those past `valid` zero */
    if (valid >= 64) return _mm512_loadu_si512((const void *)p);
    if (valid <= 0) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi8((__mmask64)((1ull << valid) - 1), (const void *)p);
}

/* quad q (blocks 4q .. 4q+left-1) of a weight row: lo = the first 16 values of each block (128-bit
 * lane i = block i), hi = the last 16; dv = the blocks' d, each repeated 4 times; mv = the blocks' m */
ALWAYS_INLINE void xq_quad(const int FMT, const uint8_t *row, const uint8_t *sc, const uint8_t *zp, int64_t q,
                           int left, __m512i *lo, __m512i *hi, __m512 *dv, __m128 *mv) {
    const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512i v;
    switch (FMT) {
    case XQ_Q8_0: case XQ_INT8: {
        __m512i A, B;
        if (FMT == XQ_Q8_0) {
            const uint8_t *b = row + q * 4 * 34;
            A = _mm512_inserti64x4(_mm512_castsi256_si512(xq_load32(b + 2, 1)), xq_load32(b + 36, left > 1), 1);
            B = _mm512_inserti64x4(_mm512_castsi256_si512(xq_load32(b + 70, left > 2)), xq_load32(b + 104, left > 3),
                                   1);
            *dv = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_cvtph_ps(xq_gather16(b, 34, left))));
        } else {
            A = xq_load64(row + q * 128, 32 * left);
            B = xq_load64(row + q * 128 + 64, 32 * left - 64);
            *dv = _mm512_set1_ps(1.0f);
        }
        *lo = _mm512_shuffle_i64x2(A, B, 0x88);
        *hi = _mm512_shuffle_i64x2(A, B, 0xDD);
        *mv = _mm_setzero_ps();
        return;
    }
    case XQ_Q4_0: {
        const uint8_t *b = row + q * 4 * 18;
        v = xq_load4x16(b + 2, 18, left);
        const __m128 d4 = _mm_cvtph_ps(xq_gather16(b, 18, left));
        *mv = _mm_mul_ps(d4, _mm_set1_ps(-8.0f));
        *dv = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(d4));
        break;
    }
    case XQ_Q4_1: {
        const uint8_t *b = row + q * 4 * 20;
        v = xq_load4x16(b + 4, 20, left);
        const __m256 dm = _mm256_cvtph_ps(xq_gather32(b, 20, left)); /* d0 m0 d1 m1 d2 m2 d3 m3 */
        *dv = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6),
                                    _mm512_castps256_ps512(dm));
        *mv = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)));
        break;
    }
    case XQ_INT4_G32: {
        v = xq_load64(row + q * 64, 16 * left);
        __m128i sc4, z4;
        if (left == 4) {
            int32_t z;
            memcpy(&z, zp + 4 * q, 4);
            sc4 = _mm_loadl_epi64((const __m128i *)(sc + 8 * q));
            z4 = _mm_cvtsi32_si128(z);
        } else {
            sc4 = _mm_maskz_loadu_epi16((__mmask8)((1u << left) - 1), sc + 8 * q);
            z4 = _mm_maskz_loadu_epi8((__mmask16)((1u << left) - 1), zp + 4 * q);
        }
        const __m128 d4 = _mm_cvtph_ps(sc4);
        *mv = _mm_mul_ps(_mm_sub_ps(_mm_setzero_ps(), d4), _mm_cvtepi32_ps(_mm_cvtepu8_epi32(z4)));
        *dv = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(d4));
        break;
    }
    default: { /* XQ_INT4_G128: one group per quad (K % 128 == 0: never partial) */
        v = _mm512_loadu_si512((const void *)(row + q * 64));
        const float d = xq_h2f(sc + 2 * q);
        *dv = _mm512_set1_ps(d);
        *mv = _mm_set1_ps(-d * (float)zp[q]);
        break;
    }
    }
    *lo = _mm512_and_si512(v, nib);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
}

/* acc[r] += the quad's products with row r of x (off[r]: the 4-bit formats' m * sx terms). Per plane
 * two VPDPBUSD give exact int32 block sums; the 16-bit sums are 256 * high + low. */
ALWAYS_INLINE void xq_quad_rows(const int FMT, const int M, const XqAct a, int64_t q, __m512i lo, __m512i hi,
                                __m512 dv, __m128 mv, __m512 *acc, __m128 *off) {
    __m512i base = _mm512_setzero_si512();
    if (xq_signed(FMT)) { /* -128 * sum(w) per lane: cancels the +128 offset of the high plane */
        const __m512i u128 = _mm512_set1_epi8((char)0x80);
        base = _mm512_sub_epi32(base, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(base, u128, lo), u128, hi));
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        const uint8_t *xh = a.qh + (r * a.nqt + q) * 128, *xl = a.ql + (r * a.nqt + q) * 128;
        const __m512i hl = _mm512_loadu_si512((const void *)xh), hh = _mm512_loadu_si512((const void *)(xh + 64));
        const __m512i ll = _mm512_loadu_si512((const void *)xl), lh = _mm512_loadu_si512((const void *)(xl + 64));
        __m512i H, L;
        if (xq_signed(FMT)) {
            H = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(base, hl, lo), hh, hi);
            L = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ll, lo), lh, hi);
        } else {
            H = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, hl), hi, hh);
            L = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ll), hi, lh);
        }
        const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(H, 8), L);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_loadu_ps(a.dxv + (r * a.nqt + q) * 16));
        acc[r] = FMT == XQ_INT8 ? _mm512_add_ps(acc[r], f) : _mm512_fmadd_ps(f, dv, acc[r]);
        if (!xq_signed(FMT)) off[r] = _mm_fmadd_ps(mv, _mm_loadu_ps(a.sx + (r * a.nqt + q) * 4), off[r]);
    }
}

/* the 16-lane sums of a0..a3 as one vector */
ALWAYS_INLINE __m128 xq_reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
    const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

/* How far ahead of the quad it reads xq_row prefetches the weight stream (into L1; prefetches never
 * fault, past the end they only cost bandwidth). The hardware prefetchers alone left DRAM's latency
 * exposed: a Q4_1 GEMV at one row streamed ~10 GB/s on 2 threads of this Xeon against ~14 GB/s in
 * L2-sized loops. 4-16 KB ahead (T0) measured best: 1536x576 at 1 row, Q4_1 9.7 -> 13.6 GB/s, Q8_0
 * 12.4 -> 18.6 GB/s; at 4 rows 6.1 -> 7.8 and 7.5 -> 12.0 GB/s (the machine reads ~18.4 GB/s). */
#define XQ_PF_BYTES 8192

/* part[r] = 16 partial sums of x_r . dequant(W[n]) for r < M (one weight row streamed once for all M
 * rows; the horizontal sums are left to the caller, which does them 4 weight rows at a time) */
ALWAYS_INLINE void xq_row(const int FMT, const int M, const XqAct a, int64_t K, const XllmQWeight *W, int64_t n,
                          __m512 *part) {
    const int64_t nb = K / 32, nq = nb / 4;
    const XqRowView v = xq_row_view(FMT, W, K, n);
    const uint8_t *row = v.row, *sc = v.sc, *zp = v.zp;
    __m512 acc[XQ_MAX_M];
    __m128 off[XQ_MAX_M];
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        acc[r] = _mm512_setzero_ps();
        off[r] = _mm_setzero_ps();
    }
    __m512i lo, hi;
    __m512 dv;
    __m128 mv;
    const int64_t qb = xq_row_bytes(FMT, 128); /* bytes of a quad */
    for (int64_t q = 0; q < nq; q++) {
        const char *pf = (const char *)row + q * qb + XQ_PF_BYTES; /* every line of the quad XQ_PF_BYTES on */
        _mm_prefetch(pf, _MM_HINT_T0);
        if (qb > 64) _mm_prefetch(pf + 64, _MM_HINT_T0);
        if (qb > 128) _mm_prefetch(pf + 128, _MM_HINT_T0);
        xq_quad(FMT, row, sc, zp, q, 4, &lo, &hi, &dv, &mv);
        xq_quad_rows(FMT, M, a, q, lo, hi, dv, mv, acc, off);
    }
    if (nb > 4 * nq) { /* a partial last quad (never for int4_g128) */
        xq_quad(FMT, row, sc, zp, nq, (int)(nb - 4 * nq), &lo, &hi, &dv, &mv);
        xq_quad_rows(FMT, M, a, nq, lo, hi, dv, mv, acc, off);
    }
    const __m512 s = _mm512_set1_ps(FMT == XQ_INT8 ? ((const float *)W->scales)[n] : 1.0f);
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        const __m512 t = xq_signed(FMT) ? acc[r] : _mm512_add_ps(acc[r], _mm512_zextps128_ps512(off[r]));
        part[r] = FMT == XQ_INT8 ? _mm512_mul_ps(t, s) : t;
    }
}

/* rows [n0, n0 + 16) of the output as fp32: out[r * 16 + j] = x_r . dequant(W[n0 + j]) (0 past N). Weight
 * rows are streamed one after the other (side-by-side streams defeat the DRAM prefetchers), their partial
 * sums parked in L1 and reduced 4 rows at a time into one 16-lane vector per row of x. */
ALWAYS_INLINE void xq_gemv_chunk_f32(const int FMT, const int M, const XqAct a, int64_t K, const XllmQWeight *W,
                                     int64_t N, int64_t n0, float *out) {
    __m512 part[16][XQ_MAX_M];
    const int64_t cnt = N - n0 < 16 ? N - n0 : 16;
    for (int64_t j = 0; j < cnt; j++) xq_row(FMT, M, a, K, W, n0 + j, part[j]);
    for (int64_t j = cnt; j < 16; j++)
        _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) part[j][r] = _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        __m512 v = _mm512_castps128_ps512(xq_reduce4(part[0][r], part[1][r], part[2][r], part[3][r]));
        v = _mm512_insertf32x4(v, xq_reduce4(part[4][r], part[5][r], part[6][r], part[7][r]), 1);
        v = _mm512_insertf32x4(v, xq_reduce4(part[8][r], part[9][r], part[10][r], part[11][r]), 2);
        v = _mm512_insertf32x4(v, xq_reduce4(part[12][r], part[13][r], part[14][r], part[15][r]), 3);
        _mm512_storeu_ps(out + r * 16, v);
    }
}

/* rows [n0, n0 + 16) of the output (masked past N), bias added, stored as bf16 or fp32 */
ALWAYS_INLINE void xq_gemv_chunk(const int FMT, const int M, const XqAct a, int64_t K, const XllmQWeight *W,
                                 int64_t N, int64_t n0, const void *bias, int bias_bf16, void *y, int64_t ldy,
                                 int out_bf16) {
    float out[XQ_MAX_M * 16] __attribute__((aligned(64)));
    xq_gemv_chunk_f32(FMT, M, a, K, W, N, n0, out);
    const int64_t cnt = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)(cnt >= 16 ? 0xffff : (1u << cnt) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias)
        bv = bias_bf16 ? load_bf16x16_mask((const uint16_t *)bias + n0, mask)
                       : _mm512_maskz_loadu_ps(mask, (const float *)bias + n0);
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(out + r * 16), bv);
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + r * ldy + n0, mask, v);
    }
}

ALWAYS_INLINE void xq_gemv_rows(const int FMT, const int M, const XqAct a, int64_t K, const XllmQWeight *W,
                                int64_t N, const void *bias, int bias_bf16, void *y, int64_t ldy, int out_bf16) {
    const int64_t chunks = (N + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) xq_gemv_chunk(FMT, M, a, K, W, N, c * 16, bias, bias_bf16, y, ldy, out_bf16);
}

static void xq_gemv_dispatch(const XqAct a, int64_t M, int64_t K, const XllmQWeight *W, int64_t N, const void *bias,
                             int bias_bf16, void *y, int64_t ldy, int out_bf16) {
#define XQ_M(F, m) \
    case m: xq_gemv_rows(F, m, a, K, W, N, bias, bias_bf16, y, ldy, out_bf16); break;
#define XQ_F(F)                                                                                          \
    case F:                                                                                              \
        switch (M) { XQ_M(F, 1) XQ_M(F, 2) XQ_M(F, 3) XQ_M(F, 4) XQ_M(F, 5) XQ_M(F, 6) XQ_M(F, 7) default: \
                         XQ_M(F, 8) }                                                                    \
        break;
    switch (W->fmt) {
        XQ_F(XQ_Q8_0) XQ_F(XQ_Q4_0) XQ_F(XQ_Q4_1) case XQ_W8A8: XQ_F(XQ_INT8) XQ_F(XQ_INT4_G32) XQ_F(XQ_INT4_G128)
    default: break;
    }
#undef XQ_F
#undef XQ_M
}

/* one chunk of 16 output rows as fp32 (xq_gemv_chunk_f32) for any format and M <= 8 */
static void xq_chunk_f32_dispatch(const XqAct a, int64_t M, int64_t K, const XllmQWeight *W, int64_t N, int64_t n0,
                                  float *out) {
#define XQ_M(F, m) \
    case m: xq_gemv_chunk_f32(F, m, a, K, W, N, n0, out); break;
#define XQ_F(F)                                                                                          \
    case F:                                                                                              \
        switch (M) { XQ_M(F, 1) XQ_M(F, 2) XQ_M(F, 3) XQ_M(F, 4) XQ_M(F, 5) XQ_M(F, 6) XQ_M(F, 7) default: \
                         XQ_M(F, 8) }                                                                    \
        break;
    switch (W->fmt) {
        XQ_F(XQ_Q8_0) XQ_F(XQ_Q4_0) XQ_F(XQ_Q4_1) case XQ_W8A8: XQ_F(XQ_INT8) XQ_F(XQ_INT4_G32) XQ_F(XQ_INT4_G128)
    default: break;
    }
#undef XQ_F
#undef XQ_M
}

/* W's rows from n on (a view: the same format, pointers advanced) */
ALWAYS_INLINE XllmQWeight xq_rows_from(const XllmQWeight *W, int64_t K, int64_t n) {
    XllmQWeight v = *W;
    const XqRowView r = xq_row_view((int)W->fmt, W, K, n);
    v.data = r.row;
    v.packed = NULL; /* (panels of the whole weight) */
    if (W->fmt == XQ_INT8 || W->fmt == XQ_W8A8) v.scales = (const float *)W->scales + n;
    if (xq_is_int4((int)W->fmt)) {
        v.scales = r.sc;
        v.zeros = r.zp;
    }
    return v;
}

/* Per-thread quantized activations of M <= 8 rows of x (bf16 when x_bf16, else fp32) for a weight of
 * format fmt: in `local` (XQ_LOCAL_BYTES, 64-byte aligned) when they fit, else in *heap (free it). */
#define XQ_LOCAL_BYTES 49152 /* K <= 2304 at 8 rows, 18688 at 1: no allocation */
ALWAYS_INLINE XqAct xq_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t fmt, uint8_t *local,
                                     void **heap) {
    const size_t bytes = (xq_act_bytes(M, K) + 63) / 64 * 64;
    void *buf = local;
    *heap = NULL;
    if (bytes > XQ_LOCAL_BYTES) buf = *heap = aligned_alloc(64, bytes);
    const XqAct a = xq_act_view(buf, M, K);
    if (x_bf16)
        xq_quantize_bf16((const uint16_t *)x, M, K, xq_signed((int)fmt), a);
    else
        xq_quantize_f32((const float *)x, M, K, xq_signed((int)fmt), a);
    return a;
}

/* TEAM (call from every thread of a parallel region, or outside one): y = x . W^T (+ bias) for
 * M <= 8 rows of x (bf16 when x_bf16, else fp32). Each thread quantizes x privately (M x K values:
 * cheaper than a barrier), then chunks of 16 output rows are split over the team (ends with a barrier). */
static void xq_gemv_team(const void *x, int x_bf16, int64_t M, int64_t K, const XllmQWeight *W, int64_t N,
                         const void *bias, void *y, int64_t ldy, int out_bf16) {
    uint8_t local[XQ_LOCAL_BYTES] __attribute__((aligned(64)));
    void *heap;
    const XqAct a = xq_quantize_rows(x, x_bf16, M, K, W->fmt, local, &heap);
    xq_gemv_dispatch(a, M, K, W, N, bias, x_bf16, y, ldy, out_bf16);
    free(heap);
}

#include "gemm_quant_panel.h"

#include "gemm_quant_amx.h"

#include "gemm_w8a8.h"

/* rows past which the panel GEMM beats the skinny GEMV run over chunks of 8 rows (measured on the Zen 4
 * EPYC, Q4_1 1536x576, one thread: M = 16 chunks 193 us vs panels 226 us; M = 32 383 vs 352 us) */
#define XQ_CHUNKED_MAX_M 16

/* TEAM: the product for any M: the W8A8 GEMM for XQ_W8A8 weights (gemm_w8a8.h), else bf16 x over
 * XQ_AMX_MIN_M+ rows on AMX where the CPU has it (gemm_quant_amx.h), else the skinny GEMV up to 8 rows,
 * over chunks of 8 rows up to XQ_CHUNKED_MAX_M, else the panel-dequantizing GEMM */
static void xq_linear_team(const void *x, int x_bf16, int64_t M, int64_t K, const XllmQWeight *W, int64_t N,
                           const void *bias, void *y, int64_t ldy, int out_bf16) {
    if (xq_w8a8_applies(W, M)) {
        xw_gemm_team(x, x_bf16, M, K, W, N, bias, y, ldy, out_bf16 && x_bf16, 1);
        return;
    }
    if (xq_amx_applies(x_bf16, M)) {
        xq_amx_team((const uint16_t *)x, M, K, W, N, (const uint16_t *)bias, y, ldy, out_bf16);
        return;
    }
    if (M > XQ_CHUNKED_MAX_M) {
        xq_gemm_team(x, x_bf16, M, K, W, N, bias, y, ldy, out_bf16);
        return;
    }
    const int64_t xes = x_bf16 ? 2 : 4, yes = (x_bf16 && out_bf16) ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += XQ_MAX_M)
        xq_gemv_team((const char *)x + m0 * K * xes, x_bf16, M - m0 < XQ_MAX_M ? M - m0 : XQ_MAX_M, K, W, N, bias,
                     (char *)y + m0 * ldy * yes, ldy, out_bf16);
}

#endif
