/* The segmented LoRA product's two team phases (shared by lora.c's standalone kernel and the fused steps'
 * lora_step.h): rows already grouped by slot (xllm.kernels.lora.LoraRows), called by every thread of an OpenMP team (or
 * by one thread outside any parallel region); each phase is a worksharing loop ending with a barrier.
 *
 *   shrink: h[t, p*rank + k] = x[t] . A[s][p*rank + k], fp32 accumulation (vdpbf16ps for bf16, FMA for fp32),
 *      rounded to the model dtype as torch's bf16 matmul rounds its output (fp32: no rounding); work items
 *      (group, A row) so each A row is streamed once per call for all the group's rows;
 *   expand: per (group, part, block of 64 output columns) the block's B rows are transposed once into an fp32
 *      tile [rank][64], then each row of the group gets delta = h[t, part] @ tile (fp32 FMA, exact products of
 *      the rounded h) and out = round(out + round(scale) * round(delta)).
 *
 * Layout (xllm.models.lora.LoraStack): per slot A [n_parts * rank, in] and B [out_dim, rank], contiguous,
 * zero padded; part p's A rows are p*rank .. p*rank+rank-1 and feed its output rows part_start[p] ..
 * part_start[p]+part_size[p]-1, whose B rows hold that part's rank columns. At most LORA_MAX_PARTS parts.
 */
#ifndef XLLM_LORA_TEAM_H
#define XLLM_LORA_TEAM_H

#include <stdlib.h>

#include "common.h"

#define LORA_MAX_PARTS 8

/* a step's rows grouped by slot: order[gstart[g] .. gstart[g+1]) are the rows of slot gslot[g] */
typedef struct {
    const int64_t *order, *gslot, *gstart;
    int64_t groups;
} XllmLoraGroups;

#define LORA_BLOCK 64 /* output columns per expand work item (4 vectors of 16) */

/* 16 elements of a B row (n <= 16 of them, zero beyond) as fp32 lanes */
ALWAYS_INLINE __m512 lora_load16_bf16(const uint16_t *p, int64_t n) {
    return n >= 16 ? load_bf16x16(p) : load_bf16x16_mask(p, (__mmask16)((1u << n) - 1));
}

ALWAYS_INLINE __m512 lora_load16_f32(const float *p, int64_t n) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}

/* out = round(out + scale * round(delta)), the rounding points of torch's bf16 matmul and index_add_ */
ALWAYS_INLINE void lora_out_bf16(uint16_t *o, __m512 acc, __m512 scale, __mmask16 m) {
    const __m512 v = _mm512_fmadd_ps(scale, round_bf16_ps(acc), load_bf16x16_mask(o, m));
    _mm256_mask_storeu_epi16((void *)o, m, (__m256i)_mm512_cvtneps_pbh(v));
}

ALWAYS_INLINE void lora_out_f32(float *o, __m512 acc, __m512 scale, __mmask16 m) {
    _mm512_mask_storeu_ps(o, m, _mm512_fmadd_ps(scale, acc, _mm512_maskz_loadu_ps(m, o)));
}

ALWAYS_INLINE __mmask16 lora_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* One team function per dtype: T element type, SFX name suffix, DOT the fp32 dot of two rows, HRND the rounding
 * of h and of the scale to the dtype. h: fp32 scratch of [rows, n_parts * rank] indexed by the original row. */
#define DEFINE_LORA_TEAM(SFX, T, DOT, HRND)                                                                        \
    static void lora_team_##SFX(const T *x, T *out, int64_t in_dim, int64_t out_dim, const T *a, const T *b,      \
                                const XllmLoraGroups *G, const float *scales, int64_t n_parts,                    \
                                const int64_t *part_start, const int64_t *part_size, int64_t rank, float *h) {    \
        const int64_t nh = n_parts * rank, groups = G->groups;                                                    \
        const int64_t *order = G->order, *gslot = G->gslot, *gstart = G->gstart;                                  \
        int64_t ublock[LORA_MAX_PARTS + 1]; /* expand work items: blocks of LORA_BLOCK columns per part */        \
        ublock[0] = 0;                                                                                            \
        for (int64_t p = 0; p < n_parts; p++)                                                                     \
            ublock[p + 1] = ublock[p] + (part_size[p] + LORA_BLOCK - 1) / LORA_BLOCK;                             \
        const int64_t units = ublock[n_parts];                                                                    \
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < groups * nh; item++) {                  \
            const int64_t g = item / nh, k = item % nh;                                                           \
            const T *arow = a + (gslot[g] * nh + k) * in_dim;                                                     \
            for (int64_t i = gstart[g]; i < gstart[g + 1]; i++) {                                                 \
                const int64_t t = order[i];                                                                       \
                h[t * nh + k] = HRND(DOT(x + t * in_dim, arow, in_dim));                                          \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < groups * units; item++) {               \
            const int64_t g = item / units, u = item % units;                                                     \
            int64_t p = 0;                                                                                        \
            while (ublock[p + 1] <= u) p++;                                                                       \
            const int64_t c0 = part_start[p] + (u - ublock[p]) * LORA_BLOCK;                                     \
            const int64_t cols = part_start[p] + part_size[p] - c0 < LORA_BLOCK ? part_start[p] + part_size[p] - c0 \
                                                                                : LORA_BLOCK;                     \
            const T *bs = b + gslot[g] * out_dim * rank;                                                          \
            float tile[rank * LORA_BLOCK]; /* tile[k * 64 + c] = B[c0 + c][p*rank + k] */                        \
            for (int64_t sb = 0; sb < LORA_BLOCK; sb += 16)                                                       \
                for (int64_t kb = 0; kb < rank; kb += 16) {                                                       \
                    __m512i r[16];                                                                                \
                    for (int64_t c = 0; c < 16; c++)                                                              \
                        r[c] = sb + c < cols ? _mm512_castps_si512(                                               \
                                                   lora_load16_##SFX(bs + (c0 + sb + c) * rank + kb, rank - kb))    \
                                             : _mm512_setzero_si512();                                            \
                    transpose16_epi32(r);                                                                         \
                    for (int64_t k = 0; k < 16 && kb + k < rank; k++)                                             \
                        _mm512_storeu_ps(tile + (kb + k) * LORA_BLOCK + sb, _mm512_castsi512_ps(r[k]));           \
                }                                                                                                 \
            const __m512 scale = _mm512_set1_ps(HRND(scales[gslot[g]]));                                          \
            const __mmask16 m0 = lora_mask(cols), m1 = lora_mask(cols - 16), m2 = lora_mask(cols - 32),           \
                            m3 = lora_mask(cols - 48);                                                            \
            for (int64_t i = gstart[g]; i < gstart[g + 1]; i++) {                                                 \
                const int64_t t = order[i];                                                                       \
                const float *ht = h + t * nh + p * rank;                                                          \
                __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;                          \
                for (int64_t k = 0; k < rank; k++) {                                                              \
                    const __m512 hk = _mm512_set1_ps(ht[k]);                                                      \
                    const float *tk = tile + k * LORA_BLOCK;                                                      \
                    acc0 = _mm512_fmadd_ps(hk, _mm512_loadu_ps(tk), acc0);                                        \
                    acc1 = _mm512_fmadd_ps(hk, _mm512_loadu_ps(tk + 16), acc1);                                   \
                    acc2 = _mm512_fmadd_ps(hk, _mm512_loadu_ps(tk + 32), acc2);                                   \
                    acc3 = _mm512_fmadd_ps(hk, _mm512_loadu_ps(tk + 48), acc3);                                   \
                }                                                                                                 \
                T *o = out + t * out_dim + c0;                                                                    \
                lora_out_##SFX(o, acc0, scale, m0);                                                               \
                if (m1) lora_out_##SFX(o + 16, acc1, scale, m1);                                                  \
                if (m2) lora_out_##SFX(o + 32, acc2, scale, m2);                                                  \
                if (m3) lora_out_##SFX(o + 48, acc3, scale, m3);                                                  \
            }                                                                                                     \
        }                                                                                                         \
    }

ALWAYS_INLINE float lora_no_round(float v) { return v; }

DEFINE_LORA_TEAM(bf16, uint16_t, dot_bf16, round_bf16)
DEFINE_LORA_TEAM(f32, float, dot_f32, lora_no_round)

#endif
