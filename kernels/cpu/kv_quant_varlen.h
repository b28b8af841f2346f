/* Varlen attention over quantized, slot-addressed KV as a TEAM function (kv_quant.h for the row layout
 * and codes, attend_varlen.h for the varlen contract), shared by the standalone entry
 * (xllm_kvq_varlen_attention_*, kv_quant.c) and the fused general step (llama_forward.h).
 *
 * kvq_varlen_attention_team_{bf16,f32}: every thread of the current team calls it (orphaned `omp for`
 * loops; outside a parallel region it runs single-threaded); it ends with the team's barrier. A chunk's
 * work item dequantizes its KV head's keys and values [0, last position of the block] into this thread's
 * part of `scratch` (rows of T) and runs varlen_block over them; decode rows (one-row chunks) take
 * kvq_attend_group over the codes. `scratch`: kvq_varlen_scratch_floats(max_ctx, H, KVH, D, Dv, sizeof(T))
 * floats per thread, 64-byte aligned. Strides of the caches are in bytes.
 */
#ifndef XLLM_CPU_KV_QUANT_VARLEN_H
#define XLLM_CPU_KV_QUANT_VARLEN_H

#include "attend_varlen.h"
#include "kv_quant.h"

/* dequantize rows [0, n) of one head (pieces tok_stride bytes apart) into dst (D-wide rows of T) */
static inline void kvq_dequant_rows_bf16(const uint8_t *src, int64_t tok_stride, int64_t n, int64_t D, int fp8,
                                         uint16_t *dst) {
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *row = src + t * tok_stride;
        float scale;
        memcpy(&scale, row + D, 4);
        const __m512 sc = _mm512_set1_ps(scale * kvq_unit(fp8));
        for (int64_t d = 0; d < D; d += 16) store_bf16_ps(dst + t * D + d, _mm512_mul_ps(kvq_load16(row + d, fp8), sc));
    }
}

static inline void kvq_dequant_rows_f32(const uint8_t *src, int64_t tok_stride, int64_t n, int64_t D, int fp8,
                                        float *dst) {
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *row = src + t * tok_stride;
        float scale;
        memcpy(&scale, row + D, 4);
        const __m512 sc = _mm512_set1_ps(scale * kvq_unit(fp8));
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + t * D + d, _mm512_mul_ps(kvq_load16(row + d, fp8), sc));
    }
}

/* floats of kvq_attend_group's scratch + its fp32 queries and accumulators */
static inline int64_t kvq_group_floats(int64_t G, int64_t max_len, int64_t D, int64_t Dv) {
    return G * max_len + 16 * (D + Dv) + G * D + G * Dv + 48;
}

/* varlen/decode scratch (a multiple of 16 floats) followed by the dequantized K/V rows of one chunk */
static inline int64_t kvq_varlen_head_floats(int64_t max_ctx, int64_t H, int64_t KVH, int64_t D, int64_t Dv) {
    const int64_t nf = varlen_scratch_floats_qk(max_ctx, H, KVH, D, Dv);
    const int64_t ng = kvq_group_floats(H / KVH, max_ctx, D, Dv);
    return ((nf > ng ? nf : ng) + 15) / 16 * 16;
}

static inline int64_t kvq_varlen_scratch_floats(int64_t max_ctx, int64_t H, int64_t KVH, int64_t D, int64_t Dv,
                                                int64_t elem_bytes) {
    const int64_t kv_floats = (max_ctx * (D + Dv) * elem_bytes + 3) / 4;
    return (kvq_varlen_head_floats(max_ctx, H, KVH, D, Dv) + kv_floats + 15) / 16 * 16;
}

#define DEFINE_KVQ_VARLEN_TEAM(SFX, T, TOF, FROM_F32, BF16)                                                        \
    static inline void kvq_varlen_attention_team_##SFX(                                                            \
        const T *q, int64_t q_row_stride, const uint8_t *k_cache, const uint8_t *v_cache, int64_t k_slot_stride,    \
        int64_t k_tok_stride, int64_t v_slot_stride, int64_t v_tok_stride, const int64_t *slots,                    \
        const int64_t *qstart, const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t Dv,        \
        float scale, int fp8, T *out, int64_t out_row_stride, float *scratch) {                                     \
        int64_t max_ctx = 1;                                                                                        \
        for (int64_t i = 0; i < S; i++) max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;                             \
        const VarlenDims dims = varlen_dims(H, KVH, D, Dv);                                                         \
        const int64_t G = dims.G, BR = dims.BR;                                                                     \
        T *kd = (T *)(scratch + kvq_varlen_head_floats(max_ctx, H, KVH, D, Dv)), *vd = kd + max_ctx * D;            \
        int64_t n_items = 0;                                                                                        \
        for (int64_t i = 0; i < S; i++) {                                                                           \
            const int64_t n = qstart[i + 1] - qstart[i];                                                            \
            if (n > 1) n_items += KVH * ((n + BR - 1) / BR);                                                        \
        }                                                                                                           \
        int64_t cur_i = 0, cur_base = 0;                                                                            \
        _Pragma("omp for schedule(dynamic, 1) nowait") for (int64_t item = 0; item < n_items; item++) {             \
            if (item < cur_base) cur_i = cur_base = 0;                                                              \
            int64_t n, cnt;                                                                                         \
            for (;;) {                                                                                              \
                n = qstart[cur_i + 1] - qstart[cur_i];                                                              \
                cnt = n > 1 ? KVH * ((n + BR - 1) / BR) : 0;                                                        \
                if (item < cur_base + cnt) break;                                                                   \
                cur_base += cnt;                                                                                    \
                cur_i++;                                                                                            \
            }                                                                                                       \
            const int64_t local = item - cur_base, nb = (n + BR - 1) / BR;                                          \
            const int64_t blk = nb - 1 - local / KVH, g = local % KVH;                                              \
            const int64_t r0 = blk * BR, nr = n - r0 < BR ? n - r0 : BR, pos0 = ctx[cur_i] - n + r0;                \
            const int64_t kend = pos0 + nr;                                                                         \
            kvq_dequant_rows_##SFX(k_cache + slots[cur_i] * k_slot_stride + g * (D + KVQ_SCALE_BYTES), k_tok_stride, \
                                   kend, D, fp8, kd);                                                               \
            kvq_dequant_rows_##SFX(v_cache + slots[cur_i] * v_slot_stride + g * (Dv + KVQ_SCALE_BYTES),             \
                                   v_tok_stride, kend, Dv, fp8, vd);                                                \
            varlen_block(BF16, q, q_row_stride, kd, D, vd, Dv, qstart[cur_i] + r0, nr, pos0, g * G, D, Dv, scale,    \
                         out, out_row_stride, &dims, scratch);                                                      \
        }                                                                                                           \
        float *qf = scratch, *acc = qf + G * D, *gs = acc + G * Dv;                                                 \
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < S * KVH; item++) {                    \
            const int64_t i = item / KVH, g = item % KVH, t = qstart[i];                                            \
            if (qstart[i + 1] - t != 1) continue;                                                                   \
            const T *qb = q + t * q_row_stride + g * G * D;                                                         \
            const int qbf = BF16 && D % 32 == 0; /* bf16 queries as they are: vdpbf16ps scores */                  \
            if (!qbf)                                                                                               \
                for (int64_t e = 0; e < G * D; e++) qf[e] = TOF(qb[e]);                                             \
            kvq_attend_group(qbf ? (const void *)qb : (const void *)qf, qbf, G, D,                                  \
                             k_cache + slots[i] * k_slot_stride + g * (D + KVQ_SCALE_BYTES), k_tok_stride,          \
                             v_cache + slots[i] * v_slot_stride + g * (Dv + KVQ_SCALE_BYTES), v_tok_stride, Dv,     \
                             ctx[i], scale, fp8, gs, acc);                                                          \
            T *o = out + t * out_row_stride + g * G * Dv;                                                           \
            for (int64_t j = 0; j < G * Dv; j++) o[j] = FROM_F32(acc[j]);                                          \
        }                                                                                                           \
    }

DEFINE_KVQ_VARLEN_TEAM(bf16, uint16_t, bf16_to_f32, f32_to_bf16, 1)
DEFINE_KVQ_VARLEN_TEAM(f32, float, KVQ_F32_ID, KVQ_F32_ID, 0)

#endif
