/* Standalone entries of the varlen (prefill + decode rows) attention and the KV row write that
 * precedes it; the team functions they wrap live in attend_varlen.h (see its contract).
 *
 * xllm_varlen_attention_{bf16,f32}: causal attention of S packed chunks over slot-addressed KV,
 * in its own parallel region with per-thread scratch.
 * xllm_write_kv_rows_{bf16,f32}: store T token rows' K/V at (slots_per_row[t], positions_per_row[t])
 * (v_cache or v_rows NULL: keys only, e.g. a latent cache) — the native replacement of
 * `k_cache[slots, positions] = k`.
 */
#include <stdlib.h>

#include "attend_varlen.h"

#define DEFINE_VARLEN_ENTRIES(SFX, T)                                                                              \
    void xllm_varlen_attention_##SFX(const T *q, int64_t q_row_stride, const T *k_cache, const T *v_cache,         \
                                     int64_t k_slot_stride, int64_t k_tok_stride, int64_t v_slot_stride,           \
                                     int64_t v_tok_stride, const int64_t *slots, const int64_t *qstart,            \
                                     const int64_t *ctx, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t Dv, \
                                     float scale, T *out, int64_t out_row_stride) {                                \
        int64_t max_ctx = 1;                                                                                       \
        for (int64_t i = 0; i < S; i++) max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;                            \
        const int64_t n = varlen_scratch_floats_qk(max_ctx, H, KVH, D, Dv);                                           \
        _Pragma("omp parallel") {                                                                                  \
            float *scratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)((n + 15) / 16 * 16));             \
            varlen_attention_team_##SFX(q, q_row_stride, k_cache, v_cache, k_slot_stride, k_tok_stride,            \
                                        v_slot_stride, v_tok_stride, slots, qstart, ctx, S, H, KVH, D, Dv, scale,  \
                                        out, out_row_stride, scratch);                                             \
            free(scratch);                                                                                         \
        }                                                                                                          \
    }                                                                                                              \
    void xllm_write_kv_rows_##SFX(T *k_cache, T *v_cache, int64_t k_slot_stride, int64_t k_tok_stride,             \
                                  int64_t v_slot_stride, int64_t v_tok_stride, const int64_t *slots_per_row,       \
                                  const int64_t *positions_per_row, int64_t T_rows, const T *k_rows,               \
                                  const T *v_rows, int64_t k_row_stride, int64_t v_row_stride, int64_t KVH,        \
                                  int64_t D, int64_t Dv) {                                                         \
        /* a thread team only pays off for large writes (a few hundred KB) */                                      \
        const int64_t bytes = T_rows * KVH * (D + Dv) * (int64_t)sizeof(T);                                        \
        _Pragma("omp parallel if (bytes > (1 << 19))")                                                             \
        write_kv_rows_team(k_cache, v_cache, (int64_t)sizeof(T), k_slot_stride, k_tok_stride, v_slot_stride,       \
                           v_tok_stride, slots_per_row, positions_per_row, T_rows, k_rows, v_rows, k_row_stride,   \
                           v_row_stride, KVH, D, Dv);                                                              \
    }

DEFINE_VARLEN_ENTRIES(bf16, uint16_t)
DEFINE_VARLEN_ENTRIES(f32, float)
