/* Fused steps of Llama-family decoders (Llama, Mistral, Qwen2 qkv bias, Qwen3 q/k norm) over
 * per-sequence contiguous KV (the xTensor layout): the decode step (llama_decode.h) and the general
 * step of decode rows and prefill chunks (llama_forward.h).
 *
 * The decode step: one call runs every layer for B <= 8 decoding sequences inside a single OpenMP parallel region
 * (phases separated by the implicit barriers of `omp for`, five per layer): residual add +
 * RMSNorm (computed by every thread for itself), fused QKV GEMV (+bias), then per (sequence, KV
 * head) q/k RMSNorm, RoPE, KV write at (slot, position) and attention over [slot, :pos+1] (rows of
 * one slot at consecutive positions, a speculative verify chunk, are one item done in row order), O
 * GEMV, residual + RMSNorm, gate/up GEMV fused with SiLU-and-mul, down GEMV. Weight rows are
 * streamed once per step for all B sequences; with B >= 2 rows the projections take the blocked
 * GEMM over the layer's packed weights when it has them (the GEMV turns compute-bound from ~4 rows;
 * the blocked GEMM streams at the memory bandwidth to 8 rows, so a verify chunk's extra rows stay
 * nearly free). The bf16 variant rounds to bf16 where the torch
 * eager path does (each op's output), so the two follow each other closely; fp32 matches to
 * rounding. On return `hidden` holds the last layer's MLP output and `residual` the residual
 * stream: the caller applies the final norm (hidden + residual) and the LM head.
 *
 * KV rows: the model dtype, or quantized (cfg->kv_quant: int8 / fp8_e4m3 rows of kv_quant.h, strides in
 * bytes). Then both steps encode each new K/V head with kvq_encode_row (bit-identical to the eager
 * store) and attend over the codes with the eager path's kernels: kvq_attend_group for decode rows,
 * kvq_varlen_attention_team (kv_quant_varlen.h) for the general step.
 *
 * Tensor parallelism (cfg->comm non-NULL): the weights are a rank's shard (its heads, its slice of the
 * intermediate), so the O and down GEMMs give partial sums; both steps all-reduce them through the
 * shared-memory group inside the OpenMP team (xllm_shm_all_reduce_team: bit-identical sums on every rank)
 * before the residual add. Both return 0, or the failed collective's XSHM_* code (the step is then void).
 */
#include <omp.h>
#include <stdlib.h>

#include "attend.h"
#include "gemm_quant.h"
#include "lora_team.h"
#include "shm_allreduce.h"

#define MAX_B 8
/* per-phase timers of both steps (phase_s): thread 0 adds the time since the last mark after each phase */
#define FORWARD_PHASES 8 /* norm, qkv GEMM, rope + KV store, attention, o GEMM, norm, gate/up (+ SiLU), down */
#define MARK(i)                                                                  \
    do {                                                                         \
        if (timed) {                                                             \
            const double now_ = omp_get_wtime();                                 \
            phase_s[i] += now_ - last;                                           \
            last = now_;                                                         \
        }                                                                        \
    } while (0)
/* all-reduce hidden[rows, Hd] over the shard's group (no-op in one process), inside the team; on a failure
 * every thread leaves the layer loop (the code is the same on all threads) */
#define TP_ALL_REDUCE(hidden, n)                                                                      \
    if (c->comm != NULL) {                                                                            \
        const int rc_ = xllm_shm_all_reduce_team(c->comm, hidden, n, IS_BF16 ? XSHM_BF16 : XSHM_F32); \
        if (rc_ != XSHM_OK) {                                                                         \
            _Pragma("omp single nowait") status = rc_;                                                \
            break;                                                                                    \
        }                                                                                             \
    }
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

typedef struct {
    int64_t hidden, n_heads, n_kv_heads, head_dim, inter, n_layers;
    int64_t k_slot_stride, k_tok_stride, v_slot_stride, v_tok_stride;
    float eps, scale;
    int32_t qk_norm, rotary_dim;
    /* 0: K/V rows in the model dtype (strides in elements of T); 1 / 2: quantized int8 / fp8_e4m3 rows
     * (kv_quant.h: per head head_dim codes + an fp32 scale; strides in bytes) */
    int32_t kv_quant;
    /* a tensor-parallel shard's shared-memory group (shm_allreduce.h), or NULL (one process): the O and down
     * projections then produce this rank's partial sums (its heads / its intermediate slice), all-reduced
     * inside the team before each residual add; the counts above are the rank's local ones */
    XllmShm *comm;
} XllmLlamaCfg;

typedef struct {
    const void *ln1, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *o_b, *ln2, *gate_up_w, *down_w;
    void *k_cache, *v_cache;
    /* the blocked GEMM's packed copies of the four weights (gemm_packed.h), or NULL: the general step
     * then streams the [N, K] weights in chunks of MAX_B rows */
    const void *qkv_wp, *o_wp, *gate_up_wp, *down_wp;
    /* quantized projections (gemm_quant.h; fmt XQ_NONE where the weight is the plain matrix above): a
     * quantized one runs the quantized GEMV (<= 8 rows) or the panel-dequantizing GEMM */
    XllmQWeight qkv_q, o_q, gate_up_q, down_q;
} XllmLlamaLayer;

/* one LoRA-adapted projection of a layer in the fused steps (lora_step.h): the stacked adapters A [slots, n, K]
 * and B [slots, N, rank] in the model dtype (xllm.models.lora.LoraProjection), n = n_parts * rank; part p owns
 * A's rows [p * rank, (p + 1) * rank) and the output rows part_start[p] .. part_start[p] + part_size[p] - 1 (a
 * fused qkv has 3 parts, gate/up 2), whose B rows hold its rank columns; a == NULL: no adapter on it */
typedef struct {
    const void *a, *b;
    int64_t n, rank, n_parts;
    int64_t part_start[3], part_size[3];
} XllmLoraProj;

typedef struct {
    XllmLoraProj qkv, o, gate_up, down;
} XllmLoraLayer;

/* a step's adapter rows (NULL for a step of the base model alone): the layers' adapted projections, the rows
 * grouped by slot (lora_team.h; rows of the base model in no group), the scale of each slot, and an fp32
 * scratch of rows x max(n) shared by the team */
typedef struct {
    const XllmLoraLayer *layers;
    XllmLoraGroups groups;
    const float *scale;
    float *tmp;
} XllmLoraStep;

#include "attend_varlen.h"
#include "gemm_packed.h"
#include "kv_quant_varlen.h"

/* acc[b] = x[b, :K] . w[:K] for b < B; w streamed once (sequentially) for all rows */
ALWAYS_INLINE void gemv_row_bf16(const uint16_t *x, const int64_t B, int64_t K, const uint16_t *w, float *acc) {
    __m512 a[MAX_B], a2 = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) a[b] = _mm512_setzero_ps();
    int64_t k = 0;
    if (B == 1) { /* two chains hide the dot-product latency */
        for (; k + 64 <= K; k += 64) {
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)_mm512_loadu_si512((const void *)(x + k)),
                                    (__m512bh)_mm512_loadu_si512((const void *)(w + k)));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)));
        }
        a[0] = _mm512_add_ps(a[0], a2);
    }
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
        for (int64_t b = 0; b < B; b++)
            a[b] = _mm512_dpbf16_ps(a[b], (__m512bh)_mm512_loadu_si512((const void *)(x + b * K + k)), wv);
    }
    for (int64_t b = 0; b < B; b++) {
        float s = _mm512_reduce_add_ps(a[b]);
        for (int64_t kk = k; kk < K; kk++) s += bf16_to_f32(x[b * K + kk]) * bf16_to_f32(w[kk]);
        acc[b] = s;
    }
}

ALWAYS_INLINE void gemv_row_f32(const float *x, const int64_t B, int64_t K, const float *w, float *acc) {
    __m512 a[MAX_B], a2 = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) a[b] = _mm512_setzero_ps();
    int64_t k = 0;
    if (B == 1) {
        for (; k + 32 <= K; k += 32) {
            a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a[0]);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a2);
        }
        a[0] = _mm512_add_ps(a[0], a2);
    }
    for (; k + 16 <= K; k += 16) {
        __m512 wv = _mm512_loadu_ps(w + k);
        for (int64_t b = 0; b < B; b++) a[b] = _mm512_fmadd_ps(_mm512_loadu_ps(x + b * K + k), wv, a[b]);
    }
    for (int64_t b = 0; b < B; b++) {
        float s = _mm512_reduce_add_ps(a[b]);
        for (int64_t kk = k; kk < K; kk++) s += x[b * K + kk] * w[kk];
        acc[b] = s;
    }
}


#define T uint16_t
#define SFX bf16
#define IS_BF16 1
#define TOF(v) bf16_to_f32(v)
#define RND(f) round_bf16(f)
#define STORE(f) f32_to_bf16(f)
#define DOT dot_bf16
#define GEMV_ROW gemv_row_bf16
#define VRND(v) round_bf16_ps(v)
#define VSTORE(p, v) store_bf16_ps(p, v)
#define ATTEND_ROW attend_row_bf16
#define VLOAD(p) load_bf16x16(p)
#define GEMM_PACKED_TEAM(x, M, K, Wp, N, bias, y) gemm_packed_team_bf16(x, K, M, K, Wp, N, bias, y, N, 1)
#define ATTN_TEAM varlen_attention_team_bf16
#define KVQ_ATTN_TEAM kvq_varlen_attention_team_bf16
#define KVQ_ENCODE_ROW kvq_encode_row_bf16
#define ATTN_SCRATCH varlen_scratch_floats
#include "lora_step.h"
#include "llama_decode.h"
#include "llama_forward.h"
#undef T
#undef SFX
#undef IS_BF16
#undef TOF
#undef RND
#undef STORE
#undef DOT
#undef GEMV_ROW
#undef VRND
#undef VSTORE
#undef ATTEND_ROW
#undef VLOAD
#undef GEMM_PACKED_TEAM
#undef ATTN_TEAM
#undef KVQ_ATTN_TEAM
#undef KVQ_ENCODE_ROW
#undef ATTN_SCRATCH
#undef LORA_OF
#undef LORA_ADD

#define T float
#define SFX f32
#define IS_BF16 0
#define TOF(v) (v)
#define RND(f) (f)
#define STORE(f) (f)
#define DOT dot_f32
#define GEMV_ROW gemv_row_f32
#define VRND(v) (v)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define ATTEND_ROW attend_row_f32
#define VLOAD(p) _mm512_loadu_ps(p)
#define GEMM_PACKED_TEAM(x, M, K, Wp, N, bias, y) gemm_packed_team_f32(x, K, M, K, Wp, N, bias, y, N)
#define ATTN_TEAM varlen_attention_team_f32
#define KVQ_ATTN_TEAM kvq_varlen_attention_team_f32
#define KVQ_ENCODE_ROW kvq_encode_row_f32
#define ATTN_SCRATCH varlen_scratch_floats
#include "lora_step.h"
#include "llama_decode.h"
#include "llama_forward.h"
