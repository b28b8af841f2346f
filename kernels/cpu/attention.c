/* Decode attention over per-sequence contiguous KV (xTensor / contiguous layout).
 *
 * q [B, H, D]; sequence b's keys are k_cache[slots[b] * k_slot_stride + t * k_tok_stride + g * D]
 * for t < lens[b] and KV head g (GQA: query head h reads KV head h / (H / KVH)); values likewise
 * with their own strides and width Dv (a latent cache passes v = k with Dv < D). Output
 * [B, H, Dv]. No block table: (slot, length) addresses the whole context, and nothing past
 * lens[b] is read. With k_new/v_new ([B, KVH, D] / [B, KVH, Dv]) the step's new rows are first
 * stored at position lens[b] - 1 (v_new NULL: a latent cache whose values live in the keys).
 * Work is split over (b, g) pairs, or over rows b with all their KV heads when there are at least 4 rows
 * per thread; each handles a KV head's G query heads together so a key row is loaded once for all of them
 * (attend.h's attend_row_*, on AMX for bf16 where it applies). Softmax in fp32.
 */
#include <stdlib.h>

#include "attend.h"

#define DEFINE_DECODE_ATTENTION(SFX, T, BF16)                                                                  \
    void xllm_decode_attention_##SFX(const T *q, const T *k_cache, const T *v_cache, int64_t k_slot_stride,       \
                                      int64_t k_tok_stride, int64_t v_slot_stride, int64_t v_tok_stride,          \
                                      const int64_t *slots, const int64_t *lens, int64_t B, int64_t H,            \
                                      int64_t KVH, int64_t D, int64_t Dv, float scale, const T *k_new,            \
                                      const T *v_new, T *out) {                                                   \
        const int64_t G = H / KVH;                                                                                 \
        int64_t max_len = 1;                                                                                       \
        for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;                           \
        _Pragma("omp parallel") {                                                                                  \
            float *s = (float *)malloc(sizeof(float) * (size_t)(G * max_len + G * Dv));                            \
            const int64_t hpi = attend_heads_per_item(B, KVH, G, D, Dv), per = KVH / hpi;                          \
            const int amx = attend_decode_begin(BF16, G, D, Dv);                                                   \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < B * per; item++) {               \
                const int64_t b = item / per, g0 = item % per * hpi;                                               \
                /* this step's token: written here, at (slot, len - 1), by the item that reads it */               \
                for (int64_t g = g0; k_new && g < g0 + hpi; g++) {                                                 \
                    T *kd = (T *)k_cache + slots[b] * k_slot_stride + (lens[b] - 1) * k_tok_stride + g * D;        \
                    memcpy(kd, k_new + (b * KVH + g) * D, D * sizeof(T));                                          \
                    if (v_new) {                                                                                   \
                        T *vd = (T *)v_cache + slots[b] * v_slot_stride + (lens[b] - 1) * v_tok_stride + g * Dv;   \
                        memcpy(vd, v_new + (b * KVH + g) * Dv, Dv * sizeof(T));                                    \
                    }                                                                                              \
                }                                                                                                  \
                attend_row_##SFX(amx, q + b * H * D, g0, g0 + hpi, G, D, k_cache + slots[b] * k_slot_stride,       \
                                 k_tok_stride, v_cache + slots[b] * v_slot_stride, v_tok_stride, Dv, lens[b], scale,  \
                                 s, out + b * H * Dv);                                                             \
            }                                                                                                      \
            attend_decode_end(amx);                                                                                \
            free(s);                                                                                               \
        }                                                                                                          \
    }

DEFINE_DECODE_ATTENTION(bf16, uint16_t, 1)
DEFINE_DECODE_ATTENTION(f32, float, 0)
