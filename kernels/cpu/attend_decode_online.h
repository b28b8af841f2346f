/* The online-softmax pieces of the decode attentions that read a row's KV heads in one pass (attend_decode_amx.h:
 * scores on AMX tiles; attend_decode_avx.h: scores on VDPBF16PS): a block's scores laid out as key t's query j at
 * t * GP + j (GP = G rounded up to a power of two, the AMX C tile's columns), the online softmax step over a
 * block (ar_softmax_block), P.V in fp32 with the values split into even / odd channels (ar_values_block) and
 * the final division and bf16 rounding (ar_store_rows). AR_*: the blocks and the limits of one call's stack buffers.
 */
#ifndef XLLM_CPU_ATTEND_DECODE_ONLINE_H
#define XLLM_CPU_ATTEND_DECODE_ONLINE_H

#include "common.h"

#define AR_KB 32        /* positions per block */
#define AR_PF 16        /* positions of prefetch distance */
#define AR_MAX_G 16     /* queries per KV head (C tile columns) */
#define AR_MAX_D 128    /* D / 32 A tiles of keys per 16-key step (B tiles 4..7) */
#define AR_MAX_HD 8192  /* KVH * GP * D / 2 and KVH * G * Dv (stack buffers of one call) */
#define AR_MAX_KVH 64   /* KV heads per call */

/* G rounded up to a power of two (the C tile's columns) */
static inline int64_t ar_gp(int64_t G) {
    int64_t gp = 1;
    while (gp < G) gp *= 2;
    return gp;
}

/* whether one call's stack buffers hold KVH heads */
static inline int ar_fits(int64_t KVH, int64_t G, int64_t D, int64_t Dv) {
    return KVH <= AR_MAX_KVH && KVH * ar_gp(G) * D / 2 <= AR_MAX_HD && KVH * G * Dv <= AR_MAX_HD;
}

/* lane l of x combined (OP) with lanes l + GP, l + 2 GP, ..: every lane then holds its query's total */
#define AR_ROT(x, n) _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(x), _mm512_castps_si512(x), n))
#define AR_FOLD(OP, x, GP)                         \
    do {                                           \
        if ((GP) <= 8) x = OP(x, AR_ROT(x, 8));    \
        if ((GP) <= 4) x = OP(x, AR_ROT(x, 4));    \
        if ((GP) <= 2) x = OP(x, AR_ROT(x, 2));    \
        if ((GP) <= 1) x = OP(x, AR_ROT(x, 1));    \
    } while (0)

/* online softmax step over one block's scores s[nk * GP] (unscaled, the C tiles' lane pattern):
 * s = exp(s * scale - m_new) in place; *m, *l (running max and sum, lane patterns) updated; returns
 * alpha = exp(m_old - m_new) (0 while m_old = -inf) as a lane pattern */
static inline __m512 ar_softmax_block(float *s, int64_t GP, int64_t nk, float scale, __m512 *m, __m512 *l) {
    const int64_t nv = nk * GP / 16, rem = nk * GP - 16 * nv;
    const __m512 sc = _mm512_set1_ps(scale);
    const __mmask16 mk = (__mmask16)((1u << rem) - 1);
    __m512 mx = _mm512_set1_ps(-INFINITY), sm = _mm512_setzero_ps();
    for (int64_t i = 0; i < nv; i++) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * i), sc);
        _mm512_storeu_ps(s + 16 * i, x);
        mx = _mm512_max_ps(mx, x);
    }
    if (rem) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, s + 16 * nv), sc);
        _mm512_mask_storeu_ps(s + 16 * nv, mk, x);
        mx = _mm512_mask_max_ps(mx, mk, mx, x);
    }
    AR_FOLD(_mm512_max_ps, mx, GP);
    const __m512 mo = *m, mn = _mm512_max_ps(mo, mx);
    for (int64_t i = 0; i < nv; i++) {
        const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * i), mn));
        _mm512_storeu_ps(s + 16 * i, p);
        sm = _mm512_add_ps(sm, p);
    }
    if (rem) {
        const __m512 p = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + 16 * nv), mn)));
        _mm512_mask_storeu_ps(s + 16 * nv, mk, p);
        sm = _mm512_add_ps(sm, p);
    }
    AR_FOLD(_mm512_add_ps, sm, GP);
    const __mmask16 seen = _mm512_cmp_ps_mask(mo, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(mo, mn)));
    *l = _mm512_fmadd_ps(*l, alpha, sm);
    *m = mn;
    return alpha;
}

/* acc rows j0 .. j0 + J - 1 (Dv apart), channels [c0, c0 + 32 NZ) in the split order ([even 16][odd 16] per
 * 32 channels) += sum over t < nk of p[t * GP + j] * v[t * v_stride + ..]; J, NZ compile-time per instance */
ALWAYS_INLINE void ar_values(const float *p, int64_t GP, int64_t j0, const int J, const uint16_t *v, int64_t v_stride,
                             int64_t c0, const int NZ, int64_t nk, float *acc, int64_t Dv) {
    __m512 a[8][4];
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int j = 0; j < J; j++)
        for (int c = 0; c < 2 * NZ; c++) a[j][c] = _mm512_loadu_ps(acc + (j0 + j) * Dv + c0 + 16 * c);
    for (int64_t t = 0; t < nk; t++) {
        const uint16_t *vt = v + t * v_stride + c0;
        __m512 x[4];
        for (int z = 0; z < NZ; z++) {
            const __m512i w = _mm512_loadu_si512((const void *)(vt + 32 * z));
            x[2 * z] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            x[2 * z + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
        }
        const float *pt = p + t * GP + j0;
        for (int j = 0; j < J; j++) {
            const __m512 pj = _mm512_set1_ps(pt[j]);
            for (int c = 0; c < 2 * NZ; c++) a[j][c] = _mm512_fmadd_ps(pj, x[c], a[j][c]);
        }
    }
    for (int j = 0; j < J; j++)
        for (int c = 0; c < 2 * NZ; c++) _mm512_storeu_ps(acc + (j0 + j) * Dv + c0 + 16 * c, a[j][c]);
}

/* P.V of one head's block: pieces of 64 channels (groups of up to 6 queries) and a last 32 (up to 8) */
static inline void ar_values_block(const float *p, int64_t G, int64_t GP, const uint16_t *v, int64_t v_stride,
                                   int64_t nk, float *acc, int64_t Dv) {
#define AR_V(JJ, ZZ) ar_values(p, GP, j0, JJ, v, v_stride, c0, ZZ, nk, acc, Dv)
    for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
        const int two = Dv - c0 >= 64;
        const int64_t jg = two ? 6 : 8;
        for (int64_t j0 = 0; j0 < G; j0 += jg) {
            const int64_t J = G - j0 < jg ? G - j0 : jg;
            if (two) {
                switch (J) {
                case 1: AR_V(1, 2); break;
                case 2: AR_V(2, 2); break;
                case 3: AR_V(3, 2); break;
                case 4: AR_V(4, 2); break;
                case 5: AR_V(5, 2); break;
                default: AR_V(6, 2); break;
                }
            } else {
                switch (J) {
                case 1: AR_V(1, 1); break;
                case 2: AR_V(2, 1); break;
                case 3: AR_V(3, 1); break;
                case 4: AR_V(4, 1); break;
                case 5: AR_V(5, 1); break;
                case 6: AR_V(6, 1); break;
                case 7: AR_V(7, 1); break;
                default: AR_V(8, 1); break;
                }
            }
        }
    }
#undef AR_V
}

/* Prefetch a row's first AR_PF positions of K and V (KVH heads of D / Dv bf16 channels): the kernels
 * prefetch every other position AR_PF ahead of its use. into_l2: _MM_HINT_T1, else _MM_HINT_T0. */
ALWAYS_INLINE void ar_prefetch_first(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                     int64_t KVH, int64_t D, int64_t Dv, int64_t len, const int into_l2) {
    for (int64_t t = 0; t < AR_PF && t < len; t++) {
        for (int64_t off = 0; off < KVH * D * 2; off += 64) {
            const char *p = (const char *)(k + t * k_stride) + off;
            if (into_l2) _mm_prefetch(p, _MM_HINT_T1); else _mm_prefetch(p, _MM_HINT_T0);
        }
        for (int64_t off = 0; off < KVH * Dv * 2; off += 64) {
            const char *p = (const char *)(v + t * v_stride) + off;
            if (into_l2) _mm_prefetch(p, _MM_HINT_T1); else _mm_prefetch(p, _MM_HINT_T0);
        }
    }
}

/* A row's online state before its first block: m[g] = -inf, l[g] = 0 for g < KVH, acc (KVH * G rows of Dv) 0 */
static inline void ar_state_init(int64_t KVH, int64_t G, int64_t Dv, __m512 *m, __m512 *l, float *acc) {
    for (int64_t g = 0; g < KVH; g++) {
        m[g] = _mm512_set1_ps(-INFINITY);
        l[g] = _mm512_setzero_ps();
    }
    memset(acc, 0, sizeof(float) * (size_t)(KVH * G * Dv));
}

/* One head's block after its scores s (unscaled, the C tile's lane order): the online softmax step
 * (ar_softmax_block), the head's accumulators ag (G rows of Dv) rescaled where its max moved (never on the
 * row's first block, b0 == 0), then P.V of the block's values vg (ar_values_block) */
static inline void ar_block_step(float *s, int64_t G, int64_t GP, int64_t nk, float scale, int64_t b0, __m512 *m,
                                 __m512 *l, const uint16_t *vg, int64_t v_stride, float *ag, int64_t Dv) {
    const __m512 alpha = ar_softmax_block(s, GP, nk, scale, m, l);
    if (b0 > 0 && (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) & ((1u << G) - 1))) {
        float al[16];
        _mm512_storeu_ps(al, alpha);
        for (int64_t j = 0; j < G; j++) {
            const __m512 a = _mm512_set1_ps(al[j]);
            for (int64_t c = 0; c < Dv; c += 16)
                _mm512_storeu_ps(ag + j * Dv + c, _mm512_mul_ps(_mm512_loadu_ps(ag + j * Dv + c), a));
        }
    }
    ar_values_block(s, G, GP, vg, v_stride, nk, ag, Dv);
}

/* out + h * Dv = acc row h (the split order of ar_values) / its query's sum, in channel order, rounded to bf16 */
static inline void ar_store_rows(const float *acc, const __m512 *l, int64_t KVH, int64_t G, int64_t Dv, uint16_t *out) {
    float al[16];
    /* back to channel order (lane i of a piece's even / odd vector is channel 2i / 2i + 1), / sum, bf16 */
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t g = 0; g < KVH; g++) {
        _mm512_storeu_ps(al, l[g]);
        for (int64_t j = 0; j < G; j++) {
            const int64_t h = g * G + j;
            const __m512 iv = _mm512_set1_ps(1.0f / al[j]);
            for (int64_t c = 0; c < Dv; c += 32) {
                const float *a = acc + h * Dv + c;
                const __m512 ev = _mm512_loadu_ps(a), od = _mm512_loadu_ps(a + 16);
                store_bf16_ps(out + h * Dv + c, _mm512_mul_ps(_mm512_permutex2var_ps(ev, lo_idx, od), iv));
                store_bf16_ps(out + h * Dv + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(ev, hi_idx, od), iv));
            }
        }
    }
}

#endif
