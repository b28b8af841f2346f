/* Decode attention on AMX (bf16): one decode row's query heads over its contiguous context, all the row's KV
 * heads in one pass (included by attend.h; attend_row_bf16 takes it where ar_applies()).
 *
 * attend_rows_bf16_amx(q, KVH, G, D, k, k_stride, v, v_stride, Dv, len, scale, out): query head h = g * G + j
 * (g < KVH, j < G) at q + h * D attends over the keys k + t * k_stride + g * D and values v + t * v_stride +
 * g * Dv for t < len (nothing past len is read); out + h * Dv gets softmax(q_h . K^T * scale) . V, rounded
 * to bf16 once.
 *
 * The positions go in blocks of AR_KB; per block, each KV head in turn:
 *   - scores S^T = K . Q^T on AMX: per 16 keys one C tile of 16 keys x GP fp32 (GP = G rounded up to a power
 *     of two, so lane l of a 16-lane score vector is query l % GP and per-query reductions are lane
 *     rotations), A = the 16 key rows as they lie in the cache (D / 32 tiles of 32 channels), B = the
 *     head's queries as channel pairs (arranged once per call, zero columns past G);
 *   - the online softmax step in fp32: scale, the block's max per query, the running max, exp(s - m) with
 *     the vectorized exp, the running sum, and the rescale of the accumulators by exp(m_old - m_new) where
 *     the max moved (the running max is subtracted exactly at every block, as varlen_block does);
 *   - P.V with fp32 FMAs: a 32-channel piece of a value row is one 64-byte load split into its even channels
 *     (the low halves shifted up) and odd channels (the high halves masked): two fp32 vectors without the
 *     widening shuffle. The accumulators stay in that split order and are put back in channel order at the
 *     end, divided by the sum.
 * So a row's K and V position rows stream through once, in order, and every row is fetched AR_PF positions
 * ahead. Work per key and query: two TDPBF16PS rows (D = 64), 1/4 of a vector exp, Dv/16 FMAs.
 *
 * Arithmetic: exact bf16 products summed in fp32 (TDPBF16PS, denormals flushed; a different summation order
 * from VDPBF16PS), fp32 softmax and fp32 P.V (the probabilities are not rounded), one rounding of the output.
 *
 * Contract: ar_applies(KVH, G, D, Dv) (G <= 16, D % 32 == 0, D <= 128, Dv % 32 == 0, amx_ready(), the
 * per-call stack buffers) and this thread's tiles configured by ar_configure(G, D); amx_tile_release() gives them
 * back (other AMX kernels load their own configuration).
 */
#ifndef XLLM_CPU_ATTEND_DECODE_AMX_H
#define XLLM_CPU_ATTEND_DECODE_AMX_H

#include "amx.h"
#include "attend_decode_online.h"
#include "common.h"

static inline int ar_applies(int64_t KVH, int64_t G, int64_t D, int64_t Dv) {
    return G >= 1 && G <= AR_MAX_G && D % 32 == 0 && D <= AR_MAX_D && Dv % 32 == 0 && ar_fits(KVH, G, D, Dv) &&
           amx_ready();
}

/* tiles 0, 1: C (16 keys x GP fp32); 2, 3: A (16 keys x 32 bf16); 4 .. 3 + D/32: B (16 channel pairs x GP) */
AMX_TARGET static inline void ar_configure(int64_t G, int64_t D) {
    AmxTileCfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 4 + D / 32; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)(t == 2 || t == 3 ? 64 : 4 * ar_gp(G));
    }
    amx_load_config(&cfg);
}

/* C tile CT = 16 key rows (kstride elements apart) . the head's queries (B tiles 4..), NB 32-channel steps */
#define AR_SCORES16(CT, kp, kstride, NB)                 \
    do {                                                 \
        _tile_zero(CT);                                  \
        _tile_loadd(2, (kp), (kstride) * 2);             \
        _tile_dpbf16ps(CT, 2, 4);                        \
        if (NB > 1) {                                    \
            _tile_loadd(3, (kp) + 32, (kstride) * 2);    \
            _tile_dpbf16ps(CT, 3, 5);                    \
        }                                                \
        if (NB > 2) {                                    \
            _tile_loadd(2, (kp) + 64, (kstride) * 2);    \
            _tile_dpbf16ps(CT, 2, 6);                    \
        }                                                \
        if (NB > 3) {                                    \
            _tile_loadd(3, (kp) + 96, (kstride) * 2);    \
            _tile_dpbf16ps(CT, 3, 7);                    \
        }                                                \
    } while (0)

#define AR_SCORES16_NB(CT, kp, kstride, nb)                  \
    switch (nb) {                                            \
    case 1: AR_SCORES16(CT, kp, kstride, 1); break;          \
    case 2: AR_SCORES16(CT, kp, kstride, 2); break;          \
    case 3: AR_SCORES16(CT, kp, kstride, 3); break;          \
    default: AR_SCORES16(CT, kp, kstride, 4); break;         \
    }

/* the B tiles of one head's queries (qt: [D/2 pairs][GP] dwords) */
AMX_TARGET static inline void ar_load_queries(const uint32_t *qt, int64_t GP, int64_t D) {
    const int64_t nb = D / 32;
    _tile_loadd(4, qt, 4 * GP);
    if (nb > 1) _tile_loadd(5, qt + 16 * GP, 4 * GP);
    if (nb > 2) _tile_loadd(6, qt + 32 * GP, 4 * GP);
    if (nb > 3) _tile_loadd(7, qt + 48 * GP, 4 * GP);
}

/* s[t * GP + j] = q_j . k_t for t < nk (unscaled), key rows k_stride apart; a last partial 16 through a
 * zero-padded copy. Prefetches the K / V bytes [0, pkb) / [0, pvb) of rows t < npf at pk / pv (rows
 * k_stride / v_stride apart), one 16-key step at a time. */
AMX_TARGET static inline void ar_scores_block(const uint16_t *k, int64_t k_stride, int64_t nk, int64_t GP, int64_t D,
                                              float *s, const char *pk, int64_t pkb, const char *pv, int64_t pvb,
                                              int64_t v_stride, int64_t npf) {
    const int64_t nb = D / 32;
    for (int64_t t0 = 0; t0 < nk; t0 += 16) {
        for (int64_t t = t0; t < t0 + 16 && t < npf; t++) {
            for (int64_t off = 0; off < pkb; off += 64) _mm_prefetch(pk + t * k_stride * 2 + off, _MM_HINT_T0);
            for (int64_t off = 0; off < pvb; off += 64) _mm_prefetch(pv + t * v_stride * 2 + off, _MM_HINT_T0);
        }
        if (t0 + 16 > nk) {
            uint16_t kt[16 * AR_MAX_D] __attribute__((aligned(64)));
            memset(kt, 0, sizeof(uint16_t) * (size_t)(16 * D));
            for (int64_t t = t0; t < nk; t++) memcpy(kt + (t - t0) * D, k + t * k_stride, (size_t)(D * 2));
            AR_SCORES16_NB(0, kt, D, nb);
            _tile_stored(0, s + t0 * GP, 4 * GP);
        } else if ((t0 / 16) & 1) { /* alternate C tiles: a step's products need not wait for the last store */
            AR_SCORES16_NB(1, k + t0 * k_stride, k_stride, nb);
            _tile_stored(1, s + t0 * GP, 4 * GP);
        } else {
            AR_SCORES16_NB(0, k + t0 * k_stride, k_stride, nb);
            _tile_stored(0, s + t0 * GP, 4 * GP);
        }
    }
}

static inline void attend_rows_bf16_amx(const uint16_t *q, int64_t KVH, int64_t G, int64_t D, const uint16_t *k,
                                        int64_t k_stride, const uint16_t *v, int64_t v_stride, int64_t Dv,
                                        int64_t len, float scale, uint16_t *out) {
    const int64_t GP = ar_gp(G);
    uint32_t qt[AR_MAX_HD] __attribute__((aligned(64)));
    float acc[AR_MAX_HD] __attribute__((aligned(64))), s[AR_KB * AR_MAX_G] __attribute__((aligned(64)));
    __m512 m[AR_MAX_KVH], l[AR_MAX_KVH];
    memset(qt, 0, sizeof(uint32_t) * (size_t)(KVH * D / 2 * GP));
    for (int64_t g = 0; g < KVH; g++)
        for (int64_t p = 0; p < D / 2; p++)
            for (int64_t j = 0; j < G; j++) memcpy(qt + (g * D / 2 + p) * GP + j, q + (g * G + j) * D + 2 * p, 4);
    ar_state_init(KVH, G, Dv, m, l, acc);
    ar_prefetch_first(k, k_stride, v, v_stride, KVH, D, Dv, len, 0);
    for (int64_t b0 = 0; b0 < len; b0 += AR_KB) {
        const int64_t nk = len - b0 < AR_KB ? len - b0 : AR_KB;
        for (int64_t g = 0; g < KVH; g++) {
            const uint16_t *kg = k + b0 * k_stride + g * D, *vg = v + b0 * v_stride + g * Dv;
            float *ag = acc + g * G * Dv;
            ar_load_queries(qt + g * D / 2 * GP, GP, D);
            ar_scores_block(kg, k_stride, nk, GP, D, s, (const char *)(kg + AR_PF * k_stride), D * 2,
                            (const char *)(vg + AR_PF * v_stride), Dv * 2, v_stride, len - b0 - AR_PF);
            ar_block_step(s, G, GP, nk, scale, b0, m + g, l + g, vg, v_stride, ag, Dv);
        }
    }
    ar_store_rows(acc, l, KVH, G, Dv, out);
}

#endif
