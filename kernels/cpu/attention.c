/* Decode attention over per-sequence contiguous KV (xTensor / contiguous layout).
 *
 * q [B, H, D]; sequence b's keys are k_cache[slots[b] * k_slot_stride + t * k_tok_stride + g * D]
 * for t < lens[b] and KV head g (GQA: query head h reads KV head h / (H / KVH)); values likewise
 * with their own strides and width Dv (a latent cache passes v = k with Dv < D). Output
 * [B, H, Dv]. No block table: (slot, length) addresses the whole context, and nothing past
 * lens[b] is read. Work is split over (b, g) pairs; each pair handles its G query heads
 * together so a key row is loaded once for all of them. Softmax in fp32.
 */
#include <stdlib.h>

#include "common.h"

#define DEFINE_DECODE_ATTENTION(SUFFIX, T, DOT, TO_F32, FROM_F32)                                             \
    void xllm_decode_attention_##SUFFIX(const T *q, const T *k_cache, const T *v_cache, int64_t k_slot_stride, \
                                         int64_t k_tok_stride, int64_t v_slot_stride, int64_t v_tok_stride,   \
                                         const int64_t *slots, const int64_t *lens, int64_t B, int64_t H,     \
                                         int64_t KVH, int64_t D, int64_t Dv, float scale, T *out) {           \
        const int64_t G = H / KVH;                                                                             \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t item = 0; item < B * KVH; item++) {      \
            const int64_t b = item / KVH, g = item % KVH, L = lens[b];                                         \
            const T *kb = k_cache + slots[b] * k_slot_stride + g * D;                                          \
            const T *vb = v_cache + slots[b] * v_slot_stride + g * Dv;                                         \
            float *s = (float *)malloc(sizeof(float) * (size_t)(G * L + G * Dv));                              \
            float *acc = s + G * L;                                                                            \
            for (int64_t t = 0; t < L; t++) {                                                                  \
                const T *kt = kb + t * k_tok_stride;                                                           \
                for (int64_t j = 0; j < G; j++) s[j * L + t] = DOT(q + ((b * H) + g * G + j) * D, kt, D) * scale; \
            }                                                                                                  \
            for (int64_t j = 0; j < G; j++) {                                                                  \
                float *sj = s + j * L, mx = -INFINITY, sum = 0.0f;                                             \
                for (int64_t t = 0; t < L; t++) mx = sj[t] > mx ? sj[t] : mx;                                  \
                for (int64_t t = 0; t < L; t++) {                                                              \
                    sj[t] = expf(sj[t] - mx);                                                                  \
                    sum += sj[t];                                                                              \
                }                                                                                              \
                float inv = 1.0f / sum;                                                                        \
                for (int64_t t = 0; t < L; t++) sj[t] *= inv;                                                  \
                for (int64_t d = 0; d < Dv; d++) acc[j * Dv + d] = 0.0f;                                      \
            }                                                                                                  \
            for (int64_t t = 0; t < L; t++) {                                                                  \
                const T *vt = vb + t * v_tok_stride;                                                           \
                for (int64_t j = 0; j < G; j++) {                                                              \
                    const float p = s[j * L + t];                                                              \
                    float *aj = acc + j * Dv;                                                                  \
                    for (int64_t d = 0; d < Dv; d++) aj[d] += p * TO_F32(vt[d]);                               \
                }                                                                                              \
            }                                                                                                  \
            for (int64_t j = 0; j < G; j++)                                                                    \
                for (int64_t d = 0; d < Dv; d++) out[((b * H) + g * G + j) * Dv + d] = FROM_F32(acc[j * Dv + d]); \
            free(s);                                                                                           \
        }                                                                                                      \
    }

#define F32_ID(x) (x)
DEFINE_DECODE_ATTENTION(bf16, uint16_t, dot_bf16, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE_ATTENTION(f32, float, dot_f32, F32_ID, F32_ID)
