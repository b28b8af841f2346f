/* Causal attention of one prefill work item on AMX (bf16): rows t0 .. t0 + nr - 1 of one chunk (positions
 * pos0 ..), the G query heads hq0 .. hq0 + G - 1 of one KV head, over that head's keys [0, pos0 + nr).
 * Included by attend_varlen.h, whose varlen_team takes it for chunk items where varlen_amx_applies().
 *
 * Per item: the M = nr * G query vectors (row m: chunk row m / G, head m % G, as the AVX-512 block orders
 * them) are copied into a 16-row-padded bf16 matrix (the A operand). Then, per block of VA_BN = 64 keys:
 *   - the block's keys are transposed into the VNNI layout TDPBF16PS takes as B ([D/2][64 keys] pairs, 16x16
 *     dword transposes) and its values interleaved by key pairs ([32][Dv] pairs), once for all query tiles;
 *   - per tile of 16 query vectors that sees any key of the block: S = Q . K^T (four C tiles of 16 keys,
 *     D in steps of 32), the online softmax per row in fp32 (scale, causal mask, exact running max, the
 *     rescale of the row's accumulator by exp(m_old - m_new)), P rounded to bf16 (the A operand of P . V),
 *     and O += P . V with O's rows loaded into C tiles from the fp32 accumulator and stored back.
 * At the end O / l is rounded to bf16 once. Against the AVX-512 block (fp32 probabilities times bf16
 * values): the probabilities are rounded to bf16 before P . V (as FlashAttention and oneDNN's bf16 SDPA do),
 * a relative error of up to 2^-9 per weight, averaged over the keys.
 *
 * Contract: bf16, D % 32 == 0, Dv % 16 == 0, D <= VA_MAX_D, Dv <= VA_MAX_D, amx_ready(); the caller holds a
 * tile configuration of at least 6 tiles of 16 rows x 64 bytes (amx_configure_16x64) and scratch of
 * varlen_amx_scratch_floats(Mpad, D, Dv) floats.
 */
#ifndef XLLM_CPU_ATTEND_AMX_H
#define XLLM_CPU_ATTEND_AMX_H

#include "amx.h"
#include "common.h"

#define VA_BN 64     /* keys per block (four 16-key C tiles of S) */
#define VA_MAX_D 256 /* head sizes up to this (D / 32 tile steps) */

static inline int varlen_amx_applies(int bf16, int64_t D, int64_t Dv) {
    return bf16 && D % 32 == 0 && Dv % 16 == 0 && D <= VA_MAX_D && Dv <= VA_MAX_D && amx_ready();
}

/* floats of scratch for Mpad query vectors (a multiple of 16) */
static inline int64_t varlen_amx_scratch_floats(int64_t Mpad, int64_t D, int64_t Dv) {
    return Mpad * D / 2          /* queries, bf16 */
           + D / 2 * VA_BN       /* keys, VNNI pairs */
           + VA_BN / 2 * Dv      /* values, VNNI pairs */
           + 16 * VA_BN          /* S of one query tile, fp32 */
           + 16 * VA_BN / 2      /* P of one query tile, bf16 */
           + Mpad * Dv           /* O accumulators, fp32 */
           + 3 * Mpad + 64;      /* running max, sum, positions; alignment slack */
}

/* keys [n0, n0 + VA_BN) (rows >= n1 zero) -> kt[p * VA_BN + key] = the pair (2p, 2p + 1) of that key */
static inline void va_pack_keys(const uint16_t *kb, int64_t kts, int64_t n0, int64_t n1, int64_t D, uint32_t *kt) {
    for (int64_t k0 = 0; k0 < VA_BN; k0 += 16) {
        for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = n0 + k0 + i < n1 ? _mm512_loadu_si512((const void *)(kb + (n0 + k0 + i) * kts + 2 * p0))
                                        : _mm512_setzero_si512();
            transpose16_epi32(r); /* r[j] = pair p0 + j of the 16 keys */
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(kt + (p0 + j) * VA_BN + k0), r[j]);
        }
    }
}

/* values of keys [n0, n0 + VA_BN) (rows >= n1 zero) -> vv[kp * Dv + c] = (V[2kp][c], V[2kp + 1][c]) */
static inline void va_pack_values(const uint16_t *vb, int64_t vts, int64_t n0, int64_t n1, int64_t Dv, uint32_t *vv) {
    for (int64_t kp = 0; kp < VA_BN / 2; kp++) {
        const int64_t a = n0 + 2 * kp, b = a + 1;
        for (int64_t c = 0; c < Dv; c += 16) {
            const __m512i lo = a < n1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + a * vts + c)))
                                      : _mm512_setzero_si512();
            const __m512i hi = b < n1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + b * vts + c)))
                                      : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(vv + kp * Dv + c), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* S[16][VA_BN] = Q tile . K block^T (tiles: C 0-3, A 4, B 5) */
AMX_TARGET static inline void va_scores(const uint16_t *qa, int64_t D, const uint32_t *kt, float *s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const uint32_t *kd = kt + (d0 / 2) * VA_BN;
        _tile_loadd(4, qa + d0, D * 2);
        _tile_loadd(5, kd, VA_BN * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, kd + 16, VA_BN * 4);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, kd + 32, VA_BN * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, kd + 48, VA_BN * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s, VA_BN * 4);
    _tile_stored(1, s + 16, VA_BN * 4);
    _tile_stored(2, s + 32, VA_BN * 4);
    _tile_stored(3, s + 48, VA_BN * 4);
}

/* O[16][Dv] += P[16][VA_BN] . V block (O fp32 rows Dv apart; tiles: C 0-3, A 4, B 5) */
AMX_TARGET static inline void va_pv(const uint16_t *pa, const uint32_t *vv, int64_t Dv, float *o) {
    for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
        const int nc = (int)((Dv - c0) / 16 < 4 ? (Dv - c0) / 16 : 4);
        _tile_loadd(0, o + c0, Dv * 4);
        if (nc > 1) _tile_loadd(1, o + c0 + 16, Dv * 4);
        if (nc > 2) _tile_loadd(2, o + c0 + 32, Dv * 4);
        if (nc > 3) _tile_loadd(3, o + c0 + 48, Dv * 4);
        for (int64_t k0 = 0; k0 < VA_BN; k0 += 32) {
            const uint32_t *vk = vv + (k0 / 2) * Dv + c0;
            _tile_loadd(4, pa + k0, VA_BN * 2);
            _tile_loadd(5, vk, Dv * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (nc > 1) {
                _tile_loadd(5, vk + 16, Dv * 4);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (nc > 2) {
                _tile_loadd(5, vk + 32, Dv * 4);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (nc > 3) {
                _tile_loadd(5, vk + 48, Dv * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o + c0, Dv * 4);
        if (nc > 1) _tile_stored(1, o + c0 + 16, Dv * 4);
        if (nc > 2) _tile_stored(2, o + c0 + 32, Dv * 4);
        if (nc > 3) _tile_stored(3, o + c0 + 48, Dv * 4);
    }
}

/* online softmax of one query tile's scores over keys [n0, n0 + VA_BN): P (bf16) into pa, the O rows
 * rescaled, the running max / sum updated. Key n is masked for row i where n > qpos[i]. */
static inline void va_softmax(const float *s, const int32_t *qpos, int64_t n0, float scale, float *mrun, float *lrun,
                              uint16_t *pa, float *o, int64_t Dv) {
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < 16; i++) {
        __m512 v[VA_BN / 16];
        __mmask16 valid[VA_BN / 16];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < VA_BN / 16; c++) {
            const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(n0 + 16 * c)));
            valid[c] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(qpos[i]));
            v[c] = _mm512_mul_ps(_mm512_loadu_ps(s + i * VA_BN + 16 * c), sc);
            mx = _mm512_mask_max_ps(mx, valid[c], mx, v[c]);
        }
        const float mold = mrun[i], mb = _mm512_reduce_max_ps(mx);
        if (mb == -INFINITY) { /* no key of the block for this row */
            for (int c = 0; c < VA_BN / 16; c++)
                _mm256_storeu_si256((__m256i *)(pa + i * VA_BN + 16 * c), _mm256_setzero_si256());
            continue;
        }
        const float mnew = mb > mold ? mb : mold;
        const __m512 m = _mm512_set1_ps(mnew);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < VA_BN / 16; c++) {
            const __m512 p = _mm512_maskz_mov_ps(valid[c], exp512(_mm512_sub_ps(v[c], m)));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256((__m256i *)(pa + i * VA_BN + 16 * c), (__m256i)_mm512_cvtneps_pbh(p));
        }
        if (mnew != mold) {
            const float alpha = mold == -INFINITY ? 0.0f : expf(mold - mnew);
            const __m512 al = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < Dv; c += 16)
                _mm512_storeu_ps(o + i * Dv + c, _mm512_mul_ps(_mm512_loadu_ps(o + i * Dv + c), al));
            lrun[i] *= alpha;
            mrun[i] = mnew;
        }
        lrun[i] += _mm512_reduce_add_ps(sum);
    }
}

/* One work item (see the file comment); D, Dv, G as in varlen_block. */
AMX_TARGET static void varlen_block_amx(const uint16_t *q, int64_t q_row_stride, const uint16_t *kb, int64_t kts,
                                        const uint16_t *vb, int64_t vts, int64_t t0, int64_t nr, int64_t pos0,
                                        int64_t hq0, int64_t G, int64_t D, int64_t Dv, float scale, uint16_t *out,
                                        int64_t out_row_stride, float *scratch) {
    const int64_t M = nr * G, Mpad = (M + 15) / 16 * 16, QG = Mpad / 16;
    float *base = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t *qa = (uint16_t *)base;
    uint32_t *kt = (uint32_t *)(base + Mpad * D / 2);
    uint32_t *vv = kt + D / 2 * VA_BN;
    float *s = (float *)(vv + VA_BN / 2 * Dv);
    uint16_t *pa = (uint16_t *)(s + 16 * VA_BN);
    float *o = (float *)(pa + 16 * VA_BN), *mrun = o + Mpad * Dv, *lrun = mrun + Mpad;
    int32_t *qpos = (int32_t *)(lrun + Mpad);

    for (int64_t m = 0; m < Mpad; m++) { /* padding rows: zero queries at the last row's position */
        const int64_t mm = m < M ? m : M - 1;
        qpos[m] = (int32_t)(pos0 + mm / G);
        mrun[m] = -INFINITY;
        lrun[m] = 0.0f;
        if (m < M)
            memcpy(qa + m * D, q + (t0 + m / G) * q_row_stride + (hq0 + m % G) * D, (size_t)(D * 2));
        else
            memset(qa + m * D, 0, (size_t)(D * 2));
    }
    memset(o, 0, sizeof(float) * (size_t)(Mpad * Dv));

    const int64_t kend = pos0 + nr; /* keys [0, kend) */
    for (int64_t n0 = 0; n0 < kend; n0 += VA_BN) {
        va_pack_keys(kb, kts, n0, kend, D, kt);
        va_pack_values(vb, vts, n0, kend, Dv, vv);
        for (int64_t g = 0; g < QG; g++) {
            if (qpos[g * 16 + 15] < n0) continue; /* causal: the block is past every row of the tile */
            va_scores(qa + g * 16 * D, D, kt, s);
            va_softmax(s, qpos + g * 16, n0, scale, mrun + g * 16, lrun + g * 16, pa, o + g * 16 * Dv, Dv);
            va_pv(pa, vv, Dv, o + g * 16 * Dv);
        }
    }
    for (int64_t m = 0; m < M; m++) {
        const __m512 inv = _mm512_set1_ps(1.0f / lrun[m]);
        uint16_t *dst = out + (t0 + m / G) * out_row_stride + (hq0 + m % G) * Dv;
        for (int64_t c = 0; c < Dv; c += 16) store_bf16_ps(dst + c, _mm512_mul_ps(_mm512_loadu_ps(o + m * Dv + c), inv));
    }
}

#endif
