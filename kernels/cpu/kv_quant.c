/* Entries over quantized, slot-addressed KV (kv_quant.h for the row layout and codes). Strides of
 * the caches are in bytes (a row is KVH pieces of D codes + fp32 scale, then padding); query,
 * output and new-row strides are in elements of T (bf16 or fp32 by the suffix).
 *
 * xllm_kvq_write_rows_*: quantize T_rows token rows' K/V and store them at (slots[t], positions[t])
 *   (v_cache or v_rows NULL: keys only).
 * xllm_kvq_decode_attention_*: decode_attention over quantized KV (attention.c's contract), the
 *   step's new rows (k_new / v_new, may be NULL) quantized and stored first by the item that reads
 *   them; dequantization fused into the score and value loops (kvq_attend_group).
 * xllm_kvq_varlen_attention_*: the varlen contract of attend_varlen.h over quantized KV, one parallel
 *   region around kvq_varlen_attention_team_* (kv_quant_varlen.h; the fused general step calls that
 *   team function inside its own region).
 */
#include <stdlib.h>

#include "kv_quant_varlen.h"

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
        const int64_t nf = kvq_varlen_scratch_floats(max_ctx, H, KVH, D, Dv, (int64_t)sizeof(T));                   \
        _Pragma("omp parallel") {                                                                                   \
            float *scratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)nf);                                \
            kvq_varlen_attention_team_##SFX(q, q_row_stride, k_cache, v_cache, k_slot_stride, k_tok_stride,         \
                                            v_slot_stride, v_tok_stride, slots, qstart, ctx, S, H, KVH, D, Dv,      \
                                            scale, fp8, out, out_row_stride, scratch);                              \
            free(scratch);                                                                                          \
        }                                                                                                           \
    }

DEFINE_KVQ_ENTRIES(bf16, uint16_t, bf16_to_f32, f32_to_bf16, 1)
DEFINE_KVQ_ENTRIES(f32, float, KVQ_F32_ID, KVQ_F32_ID, 0)
