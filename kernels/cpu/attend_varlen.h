/* Causal varlen attention over slot-addressed KV: every chunk of a step (prefill chunks and
 * decode rows) in one call, usable by a whole OpenMP team inside an existing parallel region.
 *
 * Contract (T = uint16_t bf16 or float, by the _bf16 / _f32 suffix):
 *   Sequence i (0 <= i < S) has query rows t in [qstart[i], qstart[i+1]) (n_i = qstart[i+1] - qstart[i]
 *   >= 1 rows; qstart need not start at 0), context length ctx[i] >= n_i and KV slot slots[i]. Its
 *   K/V rows [0, ctx[i]) are already written: key of position p, KV head g at
 *   k_cache + slots[i]*k_slot_stride + p*k_tok_stride + g*D (values likewise with v_* strides and
 *   width Dv; a latent cache passes v_cache = k_cache and Dv <= D). Rows at positions >= ctx[i]
 *   are never read (they may be unmapped or hold garbage/NaN).
 *   Chunk row r (t = qstart[i] + r) sits at position ctx[i] - n_i + r and attends to positions
 *   [0, ctx[i] - n_i + r]. Query head h (H = KVH * G) reads KV head h / G; its query is
 *   q + t*q_row_stride + h*D (heads packed within a row; rows may be strided, e.g. a fused qkv
 *   buffer), its output out + t*out_row_stride + h*Dv. Scores are scaled by `scale`, the softmax
 *   is fp32 with exact max subtraction (online over key tiles), the outputs are rounded to T
 *   (bf16: nearest-even).
 *
 *   varlen_attention_team_{bf16,f32} must be called by every thread of the current team (it holds
 *   orphaned `omp for` loops; it also works outside a parallel region, single-threaded) and ends
 *   with the team's barrier. `scratch` is this thread's private buffer of
 *   varlen_scratch_floats_qk(max_ctx, H, KVH, D, Dv) floats (= varlen_scratch_floats(max_ctx, H,
 *   KVH, Dv) when D <= Dv), max_ctx >= every ctx[i].
 *
 * Work: one item per (chunk, KV head, block of query rows) for chunks of n_i > 1 rows, handed out
 * dynamically (most expensive blocks first), then one item per (decode row, KV head), or per decode row
 * with all its KV heads when there are at least 4 rows per thread (attend.h's attend_row_*: on AMX, one
 * pass over the row's K/V positions). A block holds BR rows x G heads = M query vectors (about VARLEN_M_TARGET),
 * laid out 16 to a vector lane group; over key tiles of VARLEN_KT keys it computes S^T (keys x
 * 16 queries) with _mm512_dpbf16_ps (bf16: a broadcast key pair times the transposed, pair-packed
 * queries) or FMA (fp32), skips tiles past the causal diagonal, updates the running max/sum per
 * lane, and accumulates P.V into fp32 rows (register blocks of 2-4 rows x up to 8 vectors of 16
 * value channels, values converted to fp32 once per tile). bf16 chunk items run on AMX instead where
 * varlen_amx_applies() (attend_amx.h: tile products for S and P.V, probabilities rounded to bf16).
 */
#ifndef XLLM_CPU_ATTEND_VARLEN_H
#define XLLM_CPU_ATTEND_VARLEN_H

#include "attend.h"
#include "attend_amx.h"

#define VARLEN_KT 32       /* keys per tile */
#define VARLEN_M_TARGET 96 /* query vectors (rows x heads of a group) per work item */

typedef struct {
    int64_t G, BR, Mpad, Dp, Dvp;
} VarlenDims;

static inline VarlenDims varlen_dims(int64_t H, int64_t KVH, int64_t D, int64_t Dv) {
    VarlenDims d;
    d.G = H / KVH;
    d.BR = VARLEN_M_TARGET / d.G > 0 ? VARLEN_M_TARGET / d.G : 1;
    d.Mpad = (d.BR * d.G + 15) / 16 * 16;
    d.Dp = (D + 1) / 2 * 2;
    d.Dvp = (Dv + 15) / 16 * 16;
    return d;
}

/* Floats of per-thread scratch the team functions need for contexts up to max_ctx, query/key
 * width D and value width Dv (any D; see varlen_scratch_floats for the common D <= Dv). */
static inline int64_t varlen_scratch_floats_qk(int64_t max_ctx, int64_t H, int64_t KVH, int64_t D, int64_t Dv) {
    const VarlenDims d = varlen_dims(H, KVH, D, Dv);
    const int64_t tiled = d.Mpad * d.Dp              /* packed queries (fp32 needs Mpad * D floats) */
                          + VARLEN_KT * d.Mpad       /* scores / probabilities of one tile */
                          + VARLEN_KT * d.Dvp        /* the tile's values in fp32 */
                          + d.Mpad * d.Dvp           /* output accumulators */
                          + 4 * d.Mpad + 16;         /* running max, sum, rescale, positions */
    const int64_t decode = d.G * (max_ctx > 1 ? max_ctx : 1) + d.G * Dv + 16; /* attend_group */
    const int64_t amx = varlen_amx_scratch_floats(d.Mpad, D, Dv);           /* attend_amx.h's blocks */
    const int64_t most = tiled > decode ? tiled : decode;
    return most > amx ? most : amx;
}

/* The same for query/key width D <= Dv (e.g. D == Dv, the usual attention); a latent cache whose
 * keys are wider than its values (MLA) needs varlen_scratch_floats_qk. */
static inline int64_t varlen_scratch_floats(int64_t max_ctx, int64_t H, int64_t KVH, int64_t Dv) {
    return varlen_scratch_floats_qk(max_ctx, H, KVH, Dv, Dv);
}

/* S^T of keys [k, k + NB) (rows k_stride apart) for QB groups of 16 packed queries. */
ALWAYS_INLINE void varlen_scores(const int bf16, const void *qp, int64_t Mpad, const int QB, const void *k,
                                 int64_t k_stride, const int NB, int64_t D, __m512 acc[2][8]) {
    for (int b = 0; b < QB; b++)
        for (int c = 0; c < NB; c++) acc[b][c] = _mm512_setzero_ps();
    if (bf16) {
        const uint32_t *qp32 = (const uint32_t *)qp;
        const uint16_t *kk = (const uint16_t *)k;
        const int64_t P = D / 2;
        for (int64_t p = 0; p < P; p++) {
            __m512i qv[2];
            for (int b = 0; b < QB; b++) qv[b] = _mm512_loadu_si512((const void *)(qp32 + p * Mpad + b * 16));
            for (int c = 0; c < NB; c++) {
                uint32_t w;
                memcpy(&w, kk + c * k_stride + 2 * p, 4);
                const __m512i kb = _mm512_set1_epi32((int)w);
                for (int b = 0; b < QB; b++) acc[b][c] = _mm512_dpbf16_ps(acc[b][c], (__m512bh)qv[b], (__m512bh)kb);
            }
        }
        if (D & 1) { /* last channel paired with a zero (never read past the head) */
            __m512i qv[2];
            for (int b = 0; b < QB; b++) qv[b] = _mm512_loadu_si512((const void *)(qp32 + P * Mpad + b * 16));
            for (int c = 0; c < NB; c++) {
                const __m512i kb = _mm512_set1_epi32((int)kk[c * k_stride + D - 1]);
                for (int b = 0; b < QB; b++) acc[b][c] = _mm512_dpbf16_ps(acc[b][c], (__m512bh)qv[b], (__m512bh)kb);
            }
        }
    } else {
        const float *qf = (const float *)qp, *kf = (const float *)k;
        for (int64_t e = 0; e < D; e++) {
            __m512 qv[2];
            for (int b = 0; b < QB; b++) qv[b] = _mm512_loadu_ps(qf + e * Mpad + b * 16);
            for (int c = 0; c < NB; c++) {
                const __m512 kb = _mm512_set1_ps(kf[c * k_stride + e]);
                for (int b = 0; b < QB; b++) acc[b][c] = _mm512_fmadd_ps(qv[b], kb, acc[b][c]);
            }
        }
    }
}

/* o[r][c*16..] = o * alpha[r] + sum_{n < nk} p[n][r] * vt[n][c*16..] for R rows and NC vectors of
 * value channels (all accumulators in registers); p rows are Mpad apart, vt / o rows Dvp apart. */
ALWAYS_INLINE void varlen_pv(const float *p, int64_t Mpad, const float *vt, int64_t Dvp, int64_t nk, float *o,
                             const float *alpha, const int R, const int NC) {
    __m512 a[4][8];
    for (int r = 0; r < R; r++) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < NC; c++) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * Dvp + c * 16), al);
    }
    for (int64_t n = 0; n < nk; n++) {
        __m512 vv[8];
        for (int c = 0; c < NC; c++) {
            vv[c] = _mm512_loadu_ps(vt + n * Dvp + c * 16);
            __asm__("" : "+v"(vv[c])); /* keep the row in a register: one load per R FMAs, not per FMA */
        }
        for (int r = 0; r < R; r++) {
            const __m512 pr = _mm512_set1_ps(p[n * Mpad + r]);
            for (int c = 0; c < NC; c++) a[r][c] = _mm512_fmadd_ps(pr, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + r * Dvp + c * 16, a[r][c]);
}

/* P.V for the 16 rows of one lane group: row blocks of 4 (<= 4 vectors) or 2 rows (<= 8 vectors) */
static inline void varlen_pv_group(const float *p, int64_t Mpad, const float *vt, int64_t Dvp, const int32_t *qpos,
                                   int64_t n0, int64_t n1, float *o, const float *alpha, int64_t rows) {
    const int64_t nct = Dvp / 16;
    for (int64_t c0 = 0; c0 < nct; c0 += 8) {
        const int64_t nc = nct - c0 < 8 ? nct - c0 : 8;
        const int64_t R = nc <= 4 ? 4 : 2;
        for (int64_t r = 0; r < rows; r += R) {
            const int64_t last = qpos[r + R - 1] + 1, nk = (last < n1 ? last : n1) - n0;
            if (nk <= 0) continue; /* every key of the tile is masked for these rows (alpha == 1) */
            const float *pr = p + r;
            float *orow = o + r * Dvp + c0 * 16;
            const float *vc = vt + c0 * 16;
            switch (nc) {
            case 1: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 4, 1); break;
            case 2: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 4, 2); break;
            case 3: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 4, 3); break;
            case 4: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 4, 4); break;
            case 5: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 2, 5); break;
            case 6: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 2, 6); break;
            case 7: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 2, 7); break;
            default: varlen_pv(pr, Mpad, vc, Dvp, nk, orow, alpha + r, 2, 8); break;
            }
        }
    }
}

/* One work item: rows t0 .. t0 + nr - 1 (positions pos0 ..) of one sequence, the G query heads
 * hq0 .. hq0 + G - 1 of one KV head whose keys / values start at kb / vb. */
ALWAYS_INLINE void varlen_block(const int bf16, const void *q, int64_t q_row_stride, const void *kb, int64_t kts,
                                const void *vb, int64_t vts, int64_t t0, int64_t nr, int64_t pos0, int64_t hq0,
                                int64_t D, int64_t Dv, float scale, void *out, int64_t out_row_stride,
                                const VarlenDims *d, float *scratch) {
    const int64_t G = d->G, M = nr * G, Mpad = d->Mpad, Dvp = d->Dvp, QG = (M + 15) / 16, esz = bf16 ? 2 : 4;
    float *qp = scratch, *s = qp + Mpad * d->Dp, *vt = s + VARLEN_KT * Mpad, *o = vt + VARLEN_KT * Dvp;
    float *mrun = o + Mpad * Dvp, *lrun = mrun + Mpad, *alpha = lrun + Mpad;
    int32_t *qpos = (int32_t *)(alpha + Mpad);

    /* pack the queries transposed: lane m = row m / G, head m % G (padding lanes: zero queries at
     * the last row's position, so they never widen the causal range) */
    for (int64_t m = 0; m < Mpad; m++) {
        const int64_t mm = m < M ? m : M - 1;
        qpos[m] = (int32_t)(pos0 + mm / G);
        mrun[m] = -INFINITY;
        lrun[m] = 0.0f;
    }
    if (bf16) {
        uint32_t *qp32 = (uint32_t *)qp;
        const int64_t P = d->Dp / 2;
        for (int64_t m = 0; m < Mpad; m++) {
            if (m >= M) {
                for (int64_t e = 0; e < P; e++) qp32[e * Mpad + m] = 0;
                continue;
            }
            const uint16_t *qm = (const uint16_t *)q + (t0 + m / G) * q_row_stride + (hq0 + m % G) * D;
            for (int64_t e = 0; e < D / 2; e++) memcpy(qp32 + e * Mpad + m, qm + 2 * e, 4);
            if (D & 1) qp32[(P - 1) * Mpad + m] = qm[D - 1];
        }
    } else {
        for (int64_t m = 0; m < Mpad; m++) {
            if (m >= M) {
                for (int64_t e = 0; e < D; e++) qp[e * Mpad + m] = 0.0f;
                continue;
            }
            const float *qm = (const float *)q + (t0 + m / G) * q_row_stride + (hq0 + m % G) * D;
            for (int64_t e = 0; e < D; e++) qp[e * Mpad + m] = qm[e];
        }
    }
    memset(o, 0, sizeof(float) * (size_t)(Mpad * Dvp));

    const int64_t kend = pos0 + nr; /* keys [0, kend) */
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t n0 = 0; n0 < kend; n0 += VARLEN_KT) {
        const int64_t n1 = n0 + VARLEN_KT < kend ? n0 + VARLEN_KT : kend;
        /* the tile's values in fp32 (zero-padded to Dvp) */
        for (int64_t n = n0; n < n1; n++) {
            float *vr = vt + (n - n0) * Dvp;
            if (bf16) {
                const uint16_t *src = (const uint16_t *)vb + n * vts;
                int64_t c = 0;
                for (; c + 16 <= Dv; c += 16) _mm512_storeu_ps(vr + c, load_bf16x16(src + c));
                if (c < Dv) _mm512_storeu_ps(vr + c, load_bf16x16_mask(src + c, (__mmask16)((1u << (Dv - c)) - 1)));
            } else {
                const float *src = (const float *)vb + n * vts;
                int64_t c = 0;
                for (; c + 16 <= Dv; c += 16) _mm512_storeu_ps(vr + c, _mm512_loadu_ps(src + c));
                if (c < Dv) _mm512_storeu_ps(vr + c, _mm512_maskz_loadu_ps((__mmask16)((1u << (Dv - c)) - 1), src + c));
            }
        }
        for (int64_t g0 = 0; g0 < QG;) {
            const int64_t gmax0 = qpos[g0 * 16 + 15];
            if (gmax0 < n0) { /* causal: every key of this tile is past the group's rows */
                g0++;
                continue;
            }
            /* two lane groups at once when both exist; keys up to the later group's last position */
            const int QB = g0 + 1 < QG ? 2 : 1;
            const int64_t last = qpos[(g0 + QB - 1) * 16 + 15] + 1, ne = last < n1 ? last : n1;
            const float *qg = qp + g0 * 16; /* bf16 pairs and fp32 values are both 4 bytes */
            __m512 acc[2][8];
            int64_t n = n0;
            for (; n + 8 <= ne; n += 8) {
                const void *kn = (const char *)kb + n * kts * esz;
                if (QB == 2) varlen_scores(bf16, qg, Mpad, 2, kn, kts, 8, D, acc);
                else varlen_scores(bf16, qg, Mpad, 1, kn, kts, 8, D, acc);
                for (int b = 0; b < QB; b++)
                    for (int c = 0; c < 8; c++)
                        _mm512_storeu_ps(s + (n + c - n0) * Mpad + (g0 + b) * 16, _mm512_mul_ps(acc[b][c], sc));
            }
            for (; n < ne; n++) {
                const void *kn = (const char *)kb + n * kts * esz;
                if (QB == 2) varlen_scores(bf16, qg, Mpad, 2, kn, kts, 1, D, acc);
                else varlen_scores(bf16, qg, Mpad, 1, kn, kts, 1, D, acc);
                for (int b = 0; b < QB; b++) _mm512_storeu_ps(s + (n - n0) * Mpad + (g0 + b) * 16, _mm512_mul_ps(acc[b][0], sc));
            }
            /* online softmax per lane group over its unmasked keys of the tile */
            for (int b = 0; b < QB; b++) {
                const int64_t g = g0 + b, gl = qpos[g * 16 + 15] + 1, gne = gl < n1 ? gl : n1;
                if (gne <= n0) { /* no key of this tile for the group: nothing changes */
                    _mm512_storeu_ps(alpha + g * 16, _mm512_set1_ps(1.0f));
                    continue;
                }
                const __m512i qv = _mm512_loadu_si512((const void *)(qpos + g * 16));
                const __m512 mold = _mm512_loadu_ps(mrun + g * 16);
                __m512 mx = mold;
                for (int64_t k = n0; k < gne; k++) {
                    const __mmask16 valid = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)k), qv);
                    mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_loadu_ps(s + (k - n0) * Mpad + g * 16));
                }
                const __m512 al = exp512(_mm512_sub_ps(mold, mx));
                __m512 sum = _mm512_setzero_ps();
                for (int64_t k = n0; k < gne; k++) {
                    const __mmask16 valid = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)k), qv);
                    float *sk = s + (k - n0) * Mpad + g * 16;
                    const __m512 pk = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(sk), mx)));
                    _mm512_storeu_ps(sk, pk);
                    sum = _mm512_add_ps(sum, pk);
                }
                _mm512_storeu_ps(lrun + g * 16, _mm512_fmadd_ps(_mm512_loadu_ps(lrun + g * 16), al, sum));
                _mm512_storeu_ps(mrun + g * 16, mx);
                _mm512_storeu_ps(alpha + g * 16, al);
                const int64_t rows = M - g * 16 < 16 ? M - g * 16 : 16;
                varlen_pv_group(s + g * 16, Mpad, vt, Dvp, qpos + g * 16, n0, gne, o + g * 16 * Dvp, alpha + g * 16,
                                (rows + 3) / 4 * 4);
            }
            g0 += QB;
        }
    }
    /* normalise and store */
    for (int64_t m = 0; m < M; m++) {
        const __m512 inv = _mm512_set1_ps(1.0f / lrun[m]);
        const int64_t t = t0 + m / G, h = hq0 + m % G;
        const float *om = o + m * Dvp;
        int64_t c = 0;
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + t * out_row_stride + h * Dv;
            for (; c + 16 <= Dv; c += 16) store_bf16_ps(dst + c, _mm512_mul_ps(_mm512_loadu_ps(om + c), inv));
            if (c < Dv) {
                const __m256i hv = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(om + c), inv));
                _mm256_mask_storeu_epi16(dst + c, (__mmask16)((1u << (Dv - c)) - 1), hv);
            }
        } else {
            float *dst = (float *)out + t * out_row_stride + h * Dv;
            for (; c + 16 <= Dv; c += 16) _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_loadu_ps(om + c), inv));
            if (c < Dv)
                _mm512_mask_storeu_ps(dst + c, (__mmask16)((1u << (Dv - c)) - 1),
                                      _mm512_mul_ps(_mm512_loadu_ps(om + c), inv));
        }
    }
}

/* Items of chunks with more than one row: (sequence, row block from the last, KV head). The
 * cursor (cur_i, cur_base) walks the sequences forward as a thread's item numbers grow. */
ALWAYS_INLINE void varlen_team(const int bf16, const void *q, int64_t q_row_stride, const void *k_cache,
                               const void *v_cache, int64_t k_slot_stride, int64_t k_tok_stride, int64_t v_slot_stride,
                               int64_t v_tok_stride, const int64_t *slots, const int64_t *qstart, const int64_t *ctx,
                               int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t Dv, float scale, void *out,
                               int64_t out_row_stride, float *scratch) {
    const VarlenDims d = varlen_dims(H, KVH, D, Dv);
    const int64_t G = d.G, BR = d.BR, esz = bf16 ? 2 : 4;
    int64_t n_items = 0;
    for (int64_t i = 0; i < S; i++) {
        const int64_t n = qstart[i + 1] - qstart[i];
        if (n > 1) n_items += KVH * ((n + BR - 1) / BR);
    }
    int64_t cur_i = 0, cur_base = 0;
    const int amx = n_items > 0 && varlen_amx_applies(bf16, D, Dv);
    if (amx) amx_configure_16x64(6);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < n_items; item++) {
        if (item < cur_base) cur_i = cur_base = 0;
        int64_t n, cnt;
        for (;;) {
            n = qstart[cur_i + 1] - qstart[cur_i];
            cnt = n > 1 ? KVH * ((n + BR - 1) / BR) : 0;
            if (item < cur_base + cnt) break;
            cur_base += cnt;
            cur_i++;
        }
        const int64_t local = item - cur_base, nb = (n + BR - 1) / BR;
        const int64_t blk = nb - 1 - local / KVH, g = local % KVH;
        const int64_t r0 = blk * BR, nr = n - r0 < BR ? n - r0 : BR;
        const char *kb = (const char *)k_cache + (slots[cur_i] * k_slot_stride + g * D) * esz;
        const char *vb = (const char *)v_cache + (slots[cur_i] * v_slot_stride + g * Dv) * esz;
        if (amx)
            varlen_block_amx((const uint16_t *)q, q_row_stride, (const uint16_t *)kb, k_tok_stride,
                             (const uint16_t *)vb, v_tok_stride, qstart[cur_i] + r0, nr, ctx[cur_i] - n + r0, g * G, G,
                             D, Dv, scale, (uint16_t *)out, out_row_stride, scratch);
        else
            varlen_block(bf16, q, q_row_stride, kb, k_tok_stride, vb, v_tok_stride, qstart[cur_i] + r0, nr,
                         ctx[cur_i] - n + r0, g * G, D, Dv, scale, out, out_row_stride, &d, scratch);
    }
    if (amx) amx_tile_release();
    /* decode rows: one item per (sequence, KV head) */
    /* ... or per sequence with all its KV heads when there are enough rows (attend.h's attend_row_*) */
    int64_t n_dec = 0;
    for (int64_t i = 0; i < S; i++) n_dec += qstart[i + 1] - qstart[i] == 1;
    const int64_t hpi = attend_heads_per_item(n_dec, KVH, G, D, Dv), per = KVH / hpi;
    const int amx_dec = n_dec > 0 && attend_decode_begin(bf16, G, D, Dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < S * per; item++) {
        const int64_t i = item / per, g0 = item % per * hpi, t = qstart[i];
        if (qstart[i + 1] - t != 1) continue;
        if (bf16)
            attend_row_bf16(amx_dec, (const uint16_t *)q + t * q_row_stride, g0, g0 + hpi, G, D,
                            (const uint16_t *)k_cache + slots[i] * k_slot_stride, k_tok_stride,
                            (const uint16_t *)v_cache + slots[i] * v_slot_stride, v_tok_stride, Dv, ctx[i], scale,
                            scratch, (uint16_t *)out + t * out_row_stride);
        else
            attend_row_f32(0, (const float *)q + t * q_row_stride, g0, g0 + hpi, G, D,
                           (const float *)k_cache + slots[i] * k_slot_stride, k_tok_stride,
                           (const float *)v_cache + slots[i] * v_slot_stride, v_tok_stride, Dv, ctx[i], scale, scratch,
                           (float *)out + t * out_row_stride);
    }
    attend_decode_end(amx_dec);
}

static inline void varlen_attention_team_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                                              const uint16_t *v_cache, int64_t k_slot_stride, int64_t k_tok_stride,
                                              int64_t v_slot_stride, int64_t v_tok_stride, const int64_t *slots,
                                              const int64_t *qstart, const int64_t *ctx, int64_t S, int64_t H,
                                              int64_t KVH, int64_t D, int64_t Dv, float scale, uint16_t *out,
                                              int64_t out_row_stride, float *scratch) {
    varlen_team(1, q, q_row_stride, k_cache, v_cache, k_slot_stride, k_tok_stride, v_slot_stride, v_tok_stride, slots,
                qstart, ctx, S, H, KVH, D, Dv, scale, out, out_row_stride, scratch);
}

static inline void varlen_attention_team_f32(const float *q, int64_t q_row_stride, const float *k_cache,
                                             const float *v_cache, int64_t k_slot_stride, int64_t k_tok_stride,
                                             int64_t v_slot_stride, int64_t v_tok_stride, const int64_t *slots,
                                             const int64_t *qstart, const int64_t *ctx, int64_t S, int64_t H,
                                             int64_t KVH, int64_t D, int64_t Dv, float scale, float *out,
                                             int64_t out_row_stride, float *scratch) {
    varlen_team(0, q, q_row_stride, k_cache, v_cache, k_slot_stride, k_tok_stride, v_slot_stride, v_tok_stride, slots,
                qstart, ctx, S, H, KVH, D, Dv, scale, out, out_row_stride, scratch);
}

/* Store T token rows' K (and V unless v_cache or v_rows is NULL) at (slots[t], positions[t]);
 * row t's KV head g is k_rows + t*k_row_stride + g*D (heads packed), its cache row
 * k_cache + slots[t]*k_slot_stride + positions[t]*k_tok_stride + g*D. Team version: rows split
 * over the current team (orphaned `omp for`, barrier at the end). esz: bytes per element. */
static inline void write_kv_rows_team(void *k_cache, void *v_cache, int64_t esz, int64_t k_slot_stride,
                                      int64_t k_tok_stride, int64_t v_slot_stride, int64_t v_tok_stride,
                                      const int64_t *slots, const int64_t *positions, int64_t T, const void *k_rows,
                                      const void *v_rows, int64_t k_row_stride, int64_t v_row_stride, int64_t KVH,
                                      int64_t D, int64_t Dv) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)k_cache + (slots[t] * k_slot_stride + positions[t] * k_tok_stride) * esz,
               (const char *)k_rows + t * k_row_stride * esz, (size_t)(KVH * D * esz));
        if (v_cache && v_rows)
            memcpy((char *)v_cache + (slots[t] * v_slot_stride + positions[t] * v_tok_stride) * esz,
                   (const char *)v_rows + t * v_row_stride * esz, (size_t)(KVH * Dv * esz));
    }
}

#endif
