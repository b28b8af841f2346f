/* Entries over quantized, slot-addressed KV (kv_quant.h for the row layout and codes). Strides of
 * the caches are in bytes (a row is KVH pieces of D codes + fp32 scale, then padding); query,
 * output and new-row strides are in elements of T (bf16 or fp32 by the suffix).
 *
 * xllm_kvq_write_rows_*: quantize T_rows token rows' K/V and store them at (slots[t], positions[t])
 *   (v_cache or v_rows NULL: keys only).
 * xllm_kvq_decode_attention_*: decode_attention over quantized KV (attention.c's contract), the
 *   step's new rows (k_new / v_new, may be NULL) quantized and stored first by the item that reads
 *   them; dequantization fused into the score and value loops (kvq_attend_group).
 * xllm_kvq_varlen_attention_*: the varlen contract of attend_varlen.h over quantized KV: a chunk's
 *   work item dequantizes its KV head's keys and values [0, last position] into per-thread buffers
 *   of T and runs varlen_block over them; decode rows take kvq_attend_group.
 */
#include <stdlib.h>

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

#define DEFINE_KVQ_ENTRIES(SFX, T, TOF, FROM_F32, BF16)                                                            \
    void xllm_kvq_write_rows_##SFX(uint8_t *k_cache, uint8_t *v_cache, int64_t k_slot_stride, int64_t k_tok_stride, \
                                   int64_t v_slot_stride, int64_t v_tok_stride, const int64_t *slots,               \
                                   const int64_t *positions, int64_t T_rows, const T *k_rows, const T *v_rows,      \
                                   int64_t k_row_stride, int64_t v_row_stride, int64_t KVH, int64_t D, int64_t Dv,  \
                                   int fp8) {                                                                       \
        _Pragma("omp parallel for schedule(static) if (T_rows * KVH * (D + Dv) > (1 << 17))")                       \
        for (int64_t t = 0; t < T_rows; t++) {                                                                      \
            kvq_encode_row_##SFX(k_rows + t * k_row_stride, KVH, D, fp8,                                            \
                                 k_cache + slots[t] * k_slot_stride + positions[t] * k_tok_stride);                 \
            if (v_cache && v_rows)                                                                                  \
                kvq_encode_row_##SFX(v_rows + t * v_row_stride, KVH, Dv, fp8,                                       \
                                     v_cache + slots[t] * v_slot_stride + positions[t] * v_tok_stride);             \
        }                                                                                                           \
    }                                                                                                               \
    void xllm_kvq_decode_attention_##SFX(const T *q, uint8_t *k_cache, uint8_t *v_cache, int64_t k_slot_stride,     \
                                         int64_t k_tok_stride, int64_t v_slot_stride, int64_t v_tok_stride,         \
                                         const int64_t *slots, const int64_t *lens, int64_t B, int64_t H,           \
                                         int64_t KVH, int64_t D, int64_t Dv, float scale, const T *k_new,           \
                                         const T *v_new, int fp8, T *out) {                                         \
        const int64_t G = H / KVH;                                                                                  \
        int64_t max_len = 1;                                                                                        \
        for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;                            \
        const int64_t nf = kvq_group_floats(G, max_len, D, Dv);                                                     \
        _Pragma("omp parallel") {                                                                                   \
            float *buf = (float *)malloc(sizeof(float) * (size_t)nf);                                               \
            float *qf = buf, *acc = qf + G * D, *scratch = acc + G * Dv;                                            \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < B * KVH; item++) {                \
                const int64_t b = item / KVH, g = item % KVH, pos = lens[b] - 1;                                    \
                uint8_t *kb = k_cache + slots[b] * k_slot_stride + g * (D + KVQ_SCALE_BYTES);                       \
                uint8_t *vb = v_cache + slots[b] * v_slot_stride + g * (Dv + KVQ_SCALE_BYTES);                      \
                if (k_new) { /* this step's token, quantized into (slot, len - 1) by the item that reads it */     \
                    for (int64_t d = 0; d < D; d++) qf[d] = TOF(k_new[(b * KVH + g) * D + d]);                     \
                    kvq_encode_head(qf, D, fp8, kb + pos * k_tok_stride);                                           \
                    if (v_new) {                                                                                    \
                        for (int64_t d = 0; d < Dv; d++) qf[d] = TOF(v_new[(b * KVH + g) * Dv + d]);                \
                        kvq_encode_head(qf, Dv, fp8, vb + pos * v_tok_stride);                                      \
                    }                                                                                               \
                }                                                                                                   \
                const T *qb = q + (b * H + g * G) * D;                                                              \
                const int qbf = BF16 && D % 32 == 0; /* bf16 queries as they are: vdpbf16ps scores */              \
                if (!qbf)                                                                                           \
                    for (int64_t i = 0; i < G * D; i++) qf[i] = TOF(qb[i]);                                         \
                kvq_attend_group(qbf ? (const void *)qb : (const void *)qf, qbf, G, D, kb, k_tok_stride, vb,        \
                                 v_tok_stride, Dv, lens[b], scale, fp8, scratch, acc);                              \
                T *o = out + (b * H + g * G) * Dv;                                                                  \
                for (int64_t j = 0; j < G * Dv; j++) o[j] = FROM_F32(acc[j]);                                      \
            }                                                                                                       \
            free(buf);                                                                                              \
        }                                                                                                           \
    }                                                                                                               \
    void xllm_kvq_varlen_attention_##SFX(const T *q, int64_t q_row_stride, const uint8_t *k_cache,                 \
                                         const uint8_t *v_cache, int64_t k_slot_stride, int64_t k_tok_stride,       \
                                         int64_t v_slot_stride, int64_t v_tok_stride, const int64_t *slots,         \
                                         const int64_t *qstart, const int64_t *ctx, int64_t S, int64_t H,           \
                                         int64_t KVH, int64_t D, int64_t Dv, float scale, int fp8, T *out,          \
                                         int64_t out_row_stride) {                                                  \
        int64_t max_ctx = 1;                                                                                        \
        for (int64_t i = 0; i < S; i++) max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;                             \
        const VarlenDims dims = varlen_dims(H, KVH, D, Dv);                                                         \
        const int64_t G = dims.G, BR = dims.BR;                                                                     \
        int64_t nf = varlen_scratch_floats_qk(max_ctx, H, KVH, D, Dv);                                              \
        const int64_t ng = kvq_group_floats(G, max_ctx, D, Dv);                                                     \
        nf = ((nf > ng ? nf : ng) + 15) / 16 * 16;                                                                    \
        const int64_t kv_floats = (max_ctx * (D + Dv) * (int64_t)sizeof(T) + 3) / 4;                                \
        int64_t n_items = 0;                                                                                        \
        for (int64_t i = 0; i < S; i++) {                                                                           \
            const int64_t n = qstart[i + 1] - qstart[i];                                                            \
            if (n > 1) n_items += KVH * ((n + BR - 1) / BR);                                                        \
        }                                                                                                           \
        _Pragma("omp parallel") {                                                                                   \
            float *scratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)((nf + kv_floats + 15) / 16 * 16)); \
            T *kd = (T *)(scratch + nf), *vd = kd + max_ctx * D;                                                    \
            int64_t cur_i = 0, cur_base = 0;                                                                        \
            _Pragma("omp for schedule(dynamic, 1) nowait") for (int64_t item = 0; item < n_items; item++) {         \
                if (item < cur_base) cur_i = cur_base = 0;                                                          \
                int64_t n, cnt;                                                                                     \
                for (;;) {                                                                                          \
                    n = qstart[cur_i + 1] - qstart[cur_i];                                                          \
                    cnt = n > 1 ? KVH * ((n + BR - 1) / BR) : 0;                                                    \
                    if (item < cur_base + cnt) break;                                                               \
                    cur_base += cnt;                                                                                \
                    cur_i++;                                                                                        \
                }                                                                                                   \
                const int64_t local = item - cur_base, nb = (n + BR - 1) / BR;                                      \
                const int64_t blk = nb - 1 - local / KVH, g = local % KVH;                                          \
                const int64_t r0 = blk * BR, nr = n - r0 < BR ? n - r0 : BR, pos0 = ctx[cur_i] - n + r0;            \
                const int64_t kend = pos0 + nr;                                                                     \
                kvq_dequant_rows_##SFX(k_cache + slots[cur_i] * k_slot_stride + g * (D + KVQ_SCALE_BYTES),          \
                                       k_tok_stride, kend, D, fp8, kd);                                             \
                kvq_dequant_rows_##SFX(v_cache + slots[cur_i] * v_slot_stride + g * (Dv + KVQ_SCALE_BYTES),         \
                                       v_tok_stride, kend, Dv, fp8, vd);                                            \
                varlen_block(BF16, q, q_row_stride, kd, D, vd, Dv, qstart[cur_i] + r0, nr, pos0, g * G, D, Dv,      \
                             scale, out, out_row_stride, &dims, scratch);                                           \
            }                                                                                                       \
            float *qf = scratch, *acc = qf + G * D, *gs = acc + G * Dv;                                             \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < S * KVH; item++) {                \
                const int64_t i = item / KVH, g = item % KVH, t = qstart[i];                                        \
                if (qstart[i + 1] - t != 1) continue;                                                               \
                const T *qb = q + t * q_row_stride + g * G * D;                                                     \
                const int qbf = BF16 && D % 32 == 0;                                                                \
                if (!qbf)                                                                                           \
                    for (int64_t e = 0; e < G * D; e++) qf[e] = TOF(qb[e]);                                         \
                kvq_attend_group(qbf ? (const void *)qb : (const void *)qf, qbf, G, D,                              \
                                 k_cache + slots[i] * k_slot_stride + g * (D + KVQ_SCALE_BYTES),                    \
                                 k_tok_stride, v_cache + slots[i] * v_slot_stride + g * (Dv + KVQ_SCALE_BYTES),     \
                                 v_tok_stride, Dv, ctx[i], scale, fp8, gs, acc);                                    \
                T *o = out + t * out_row_stride + g * G * Dv;                                                       \
                for (int64_t j = 0; j < G * Dv; j++) o[j] = FROM_F32(acc[j]);                                      \
            }                                                                                                       \
            free(scratch);                                                                                          \
        }                                                                                                           \
    }

DEFINE_KVQ_ENTRIES(bf16, uint16_t, bf16_to_f32, f32_to_bf16, 1)
DEFINE_KVQ_ENTRIES(f32, float, KVQ_F32_ID, KVQ_F32_ID, 0)
