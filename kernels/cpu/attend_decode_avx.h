/* Decode attention without AMX (bf16, AVX-512 BF16): one decode row's query heads over its contiguous
 * context, all the row's KV heads in one pass (included by attend.h; attend_row_bf16 takes it where
 * av_applies()). The AMX kernel's structure (attend_decode_amx.h) with its scores on VDPBF16PS:
 *
 * attend_rows_bf16_avx(q, KVH, G, D, k, k_stride, v, v_stride, Dv, len, scale, out): query head h = g * G + j
 * at q + h * D attends over keys k + t * k_stride + g * D and values v + t * v_stride + g * Dv, t < len;
 * out + h * Dv gets softmax(q_h . K^T * scale) . V, rounded to bf16 once.
 *
 * Positions go in blocks of AR_KB; per block, each KV head in turn: scores of its G queries against 16 keys
 * at a time (VDPBF16PS over the key rows as they lie, 16 horizontal sums at once), laid out as the AMX C
 * tile lays them (key t's query j at t * GP + j), then the same online softmax step and P.V as the AMX
 * kernel (ar_softmax_block, ar_values_block; attend_decode_online.h). So a row's K and V position rows stream
 * through once, in order, every row prefetched into the L2 AR_PF positions ahead (T1: see attend.h), and the
 * scratch is on the stack, whatever the length. Against attend_group per KV head (a row's heads one after
 * the other, scores over the whole length, then the values) it read KV 1.5-1.7x faster on the AMD build
 * machine (docs/performance.md, "Decode attention: prefetching into the L2").
 *
 * Included by attend.h after scores16_bf16, which it uses.
 *
 * Arithmetic: exact bf16 products summed in fp32 (VDPBF16PS, the same sums as attend_group's scores), fp32
 * online softmax and fp32 P.V, one rounding of the output.
 */
#ifndef XLLM_CPU_ATTEND_DECODE_AVX_H
#define XLLM_CPU_ATTEND_DECODE_AVX_H

#include "attend_decode_online.h"
#include "common.h"

static inline int av_applies(int64_t KVH, int64_t G, int64_t D, int64_t Dv) {
    return G >= 1 && G <= AR_MAX_G && D % 32 == 0 && D <= AR_MAX_D && Dv % 32 == 0 && ar_fits(KVH, G, D, Dv);
}

/* s[t * GP + j] = q_j . k_t for t < nk (unscaled; queries j in [G, GP) score 0), keys k_stride apart;
 * prefetches rows t < npf at pk / pv ([0, pkb) / [0, pvb) bytes each), one 16-key step at a time */
static inline void av_scores_block(const uint16_t *q, int64_t G, int64_t GP, int64_t D, const uint16_t *k,
                                   int64_t k_stride, int64_t nk, float *s, const char *pk, int64_t pkb,
                                   const char *pv, int64_t pvb, int64_t v_stride, int64_t npf) {
    for (int64_t t0 = 0; t0 < nk; t0 += 16) {
        for (int64_t t = t0; t < t0 + 16 && t < npf; t++) {
            for (int64_t off = 0; off < pkb; off += 64) _mm_prefetch(pk + t * k_stride * 2 + off, _MM_HINT_T1);
            for (int64_t off = 0; off < pvb; off += 64) _mm_prefetch(pv + t * v_stride * 2 + off, _MM_HINT_T1);
        }
        const uint16_t *kb = k + t0 * k_stride;
        int64_t kbs = k_stride;
        uint16_t kt[16 * AR_MAX_D] __attribute__((aligned(64)));
        if (t0 + 16 > nk) { /* a last partial 16 through a zero-padded copy */
            memset(kt, 0, sizeof(uint16_t) * (size_t)(16 * D));
            for (int64_t t = t0; t < nk; t++) memcpy(kt + (t - t0) * D, k + t * k_stride, (size_t)(D * 2));
            kb = kt;
            kbs = D;
        }
        __m512 sv[AR_MAX_G];
        for (int64_t j = 0; j < GP; j++) sv[j] = j < G ? scores16_bf16(q + j * D, kb, kbs, D) : _mm512_setzero_ps();
        float *st = s + t0 * GP;
        if (GP == 4) { /* 4 x 16 -> 16 x 4: lane transposes */
            const __m512 u0 = _mm512_unpacklo_ps(sv[0], sv[1]), u1 = _mm512_unpackhi_ps(sv[0], sv[1]);
            const __m512 u2 = _mm512_unpacklo_ps(sv[2], sv[3]), u3 = _mm512_unpackhi_ps(sv[2], sv[3]);
            const __m512 w0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u2)));
            const __m512 w1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u2)));
            const __m512 w2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u1), _mm512_castps_pd(u3)));
            const __m512 w3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u1), _mm512_castps_pd(u3)));
            const __m512 x0 = _mm512_shuffle_f32x4(w0, w1, 0x44), x1 = _mm512_shuffle_f32x4(w0, w1, 0xEE);
            const __m512 x2 = _mm512_shuffle_f32x4(w2, w3, 0x44), x3 = _mm512_shuffle_f32x4(w2, w3, 0xEE);
            _mm512_storeu_ps(st, _mm512_shuffle_f32x4(x0, x2, 0x88));
            _mm512_storeu_ps(st + 16, _mm512_shuffle_f32x4(x0, x2, 0xDD));
            _mm512_storeu_ps(st + 32, _mm512_shuffle_f32x4(x1, x3, 0x88));
            _mm512_storeu_ps(st + 48, _mm512_shuffle_f32x4(x1, x3, 0xDD));
        } else {
            float tmp[AR_MAX_G * 16] __attribute__((aligned(64)));
            for (int64_t j = 0; j < GP; j++) _mm512_store_ps(tmp + j * 16, sv[j]);
            for (int64_t t = 0; t < 16; t++)
                for (int64_t j = 0; j < GP; j++) st[t * GP + j] = tmp[j * 16 + t];
        }
    }
}

static inline void attend_rows_bf16_avx(const uint16_t *q, int64_t KVH, int64_t G, int64_t D, const uint16_t *k,
                                        int64_t k_stride, const uint16_t *v, int64_t v_stride, int64_t Dv,
                                        int64_t len, float scale, uint16_t *out) {
    const int64_t GP = ar_gp(G);
    float acc[AR_MAX_HD] __attribute__((aligned(64))), s[AR_KB * AR_MAX_G] __attribute__((aligned(64)));
    __m512 m[AR_MAX_KVH], l[AR_MAX_KVH];
    ar_state_init(KVH, G, Dv, m, l, acc);
    ar_prefetch_first(k, k_stride, v, v_stride, KVH, D, Dv, len, 1);
    for (int64_t b0 = 0; b0 < len; b0 += AR_KB) {
        const int64_t nk = len - b0 < AR_KB ? len - b0 : AR_KB;
        for (int64_t g = 0; g < KVH; g++) {
            const uint16_t *kg = k + b0 * k_stride + g * D, *vg = v + b0 * v_stride + g * Dv;
            float *ag = acc + g * G * Dv;
            av_scores_block(q + g * G * D, G, GP, D, kg, k_stride, nk, s, (const char *)(kg + AR_PF * k_stride), D * 2,
                            (const char *)(vg + AR_PF * v_stride), Dv * 2, v_stride, len - b0 - AR_PF);
            ar_block_step(s, G, GP, nk, scale, b0, m + g, l + g, vg, v_stride, ag, Dv);
        }
    }
    ar_store_rows(acc, l, KVH, G, Dv, out);
}

#endif
