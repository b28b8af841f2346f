/* Llama-family fused general step (template body; included by llama_step.c once per dtype, after
 * llama_decode.h whose row helpers it reuses).
 *
 * One call runs every layer for a packed step of T tokens from S sequences: decode rows (a chunk
 * of one token) and prefill chunks alike. Token t has (slot, position) = (token_slots[t],
 * positions[t]); sequence s owns rows [seq_starts[s], seq_starts[s+1]) and attends over its
 * context [0, ctx_lens[s]) in slot seq_slots[s], of which its chunk is the last rows (causal within
 * the chunk). Per layer, each phase a worksharing loop of the one OpenMP team: residual + RMSNorm
 * per row, the QKV GEMM, q/k norm + RoPE + KV store per row, varlen attention over all sequences,
 * the O GEMM, residual + RMSNorm, the gate/up GEMM (+ SiLU-and-mul), the down GEMM. GEMMs with two
 * or more rows use the blocked kernel over the layer's packed weights (gemm_packed.h) when the
 * layer has them, else the row-streaming GEMV in chunks of MAX_B rows (as does a one-row step). Rounding points are the
 * eager path's, as in the decode step. On return `hidden` holds the last layer's MLP output and
 * `residual` the residual stream ([T, hidden] each): the caller applies the final norm to the rows
 * that sample.
 *
 * work: T * (qkv_dim + n_heads * head_dim + 3 * inter + hidden) elements of T.
 * lora: NULL, or the step's adapter rows (lora_step.h), added after each adapted projection.
 * phase_s: NULL, or FORWARD_PHASES doubles to which the call adds the wall time of each phase over
 * all layers (taken by thread 0 after each phase's closing barrier): the step's profile by part.
 * A tensor-parallel shard (c->comm) all-reduces the O and down GEMMs' outputs (counted in their phases).
 * Returns 0, or a failed collective's XSHM_* code.
 */


/* y[M, N] = x[M, K] . W[N, K]^T (+ bias): inside the team, ends with a barrier */
static void CAT(linear_team_, SFX)(const T *x, int64_t M, int64_t K, const T *W, const T *Wp,
                                   const XllmQWeight *Q, int64_t N, const T *bias, T *y) {
    if (Q->fmt != XQ_NONE) { /* quantized: the VNNI GEMV (over 8-row chunks to 16 rows), else the panel GEMM */
        xq_linear_team(x, IS_BF16, M, K, Q, N, bias, y, N, IS_BF16);
        return;
    }
    if (Wp != NULL && M >= 2) { /* the GEMV turns compute-bound from ~4 rows; one row streams fastest with it */
        GEMM_PACKED_TEAM(x, M, K, Wp, N, bias, y);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MAX_B)
        CAT(gemv_team_, SFX)(x + m0 * K, M - m0 < MAX_B ? M - m0 : MAX_B, K, W, N, bias, y + m0 * N);
}

/* r = (first ? h : h + r) rounded; x = rmsnorm(r) * w, one row per iteration (rows split over the team);
 * 16 lanes at a time, the rounding points of the eager op (the sum of squares in 16 partial sums) */
static void CAT(residual_norm_rows_, SFX)(const T *h, T *r, const T *w, int64_t M, int64_t n, float eps, int first,
                                          T *x) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const T *hm = h + m * n;
        T *rm = r + m * n, *xm = x + m * n;
        __m512 ssv = _mm512_setzero_ps();
        float ss = 0.0f;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 v = VLOAD(hm + i);
            if (!first) v = VRND(_mm512_add_ps(v, VLOAD(rm + i)));
            VSTORE(rm + i, v);
            ssv = _mm512_fmadd_ps(v, v, ssv);
        }
        for (; i < n; i++) {
            const float v = first ? TOF(hm[i]) : RND(TOF(hm[i]) + TOF(rm[i]));
            rm[i] = STORE(v);
            ss += v * v;
        }
        ss += _mm512_reduce_add_ps(ssv);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        const __m512 iv = _mm512_set1_ps(inv);
        for (i = 0; i + 16 <= n; i += 16)
            VSTORE(xm + i, _mm512_mul_ps(VLOAD(w + i), VRND(_mm512_mul_ps(VLOAD(rm + i), iv))));
        for (; i < n; i++) xm[i] = STORE(TOF(w[i]) * RND(TOF(rm[i]) * inv));
    }
}

/* rotate-half RoPE of one head in place, 16 lanes at a time (the scalar rope_head_ where the half
 * rotary width is not a multiple of 16); the same rounding points */
static void CAT(rope_head_vec_, SFX)(T *x, const float *cos, const float *sin, int64_t rd) {
    const int64_t half = rd / 2;
    if (half % 16) {
        CAT(rope_head_, SFX)(x, cos, sin, rd);
        return;
    }
    for (int64_t j = 0; j < half; j += 16) {
        const __m512 a = VLOAD(x + j), b = VLOAD(x + half + j);
        const __m512 c1 = VRND(_mm512_loadu_ps(cos + j)), s1 = VRND(_mm512_loadu_ps(sin + j));
        const __m512 c2 = VRND(_mm512_loadu_ps(cos + half + j)), s2 = VRND(_mm512_loadu_ps(sin + half + j));
        const __m512 lo = _mm512_sub_ps(VRND(_mm512_mul_ps(a, c1)), VRND(_mm512_mul_ps(b, s1)));
        const __m512 hi = _mm512_add_ps(VRND(_mm512_mul_ps(b, c2)), VRND(_mm512_mul_ps(a, s2)));
        VSTORE(x + j, lo);
        VSTORE(x + half + j, hi);
    }
}

/* act[m, i] = silu(gu[m, i]) * gu[m, I + i] (each rounded like the eager op) */
static void CAT(silu_mul_rows_, SFX)(const T *gu, int64_t M, int64_t I, T *act) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const T *g = gu + m * 2 * I, *u = g + I;
        T *a = act + m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = VLOAD(g + i), uv = VLOAD(u + i);
            const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                               exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            VSTORE(a + i, _mm512_mul_ps(VRND(sig), uv));
        }
        for (; i < I; i++) {
            const float gr = TOF(g[i]), ur = TOF(u[i]);
            a[i] = STORE(RND(gr / (1.0f + expf(-gr))) * ur);
        }
    }
}

/* q/k RMSNorm (Qwen3) and RoPE of every head of each token, then its K/V row stored at (slot, pos) */
static void CAT(rope_store_rows_, SFX)(const XllmLlamaCfg *c, const XllmLlamaLayer *L, T *qkv, int64_t M,
                                       const int64_t *token_slots, const int64_t *positions, const float *cos_table,
                                       const float *sin_table) {
    const int64_t nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, rd = c->rotary_dim;
    const int64_t qkv_dim = (nh + 2 * nkv) * hd;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        T *row = qkv + m * qkv_dim;
        const int64_t pos = positions[m];
        const float *cs = cos_table + pos * rd, *sn = sin_table + pos * rd;
        for (int64_t h = 0; h < nh + nkv; h++) {
            T *x = row + h * hd;
            if (c->qk_norm) CAT(rmsnorm_row_, SFX)(x, (const T *)(h < nh ? L->q_norm : L->k_norm), hd, c->eps, x);
            CAT(rope_head_vec_, SFX)(x, cs, sn, rd);
        }
        if (c->kv_quant) { /* quantized rows (kv_quant.h), as the eager path's store encodes them */
            KVQ_ENCODE_ROW(row + nh * hd, nkv, hd, c->kv_quant == 2,
                           (uint8_t *)L->k_cache + token_slots[m] * c->k_slot_stride + pos * c->k_tok_stride);
            KVQ_ENCODE_ROW(row + (nh + nkv) * hd, nkv, hd, c->kv_quant == 2,
                           (uint8_t *)L->v_cache + token_slots[m] * c->v_slot_stride + pos * c->v_tok_stride);
            continue;
        }
        T *kc = (T *)L->k_cache + token_slots[m] * c->k_slot_stride + pos * c->k_tok_stride;
        T *vc = (T *)L->v_cache + token_slots[m] * c->v_slot_stride + pos * c->v_tok_stride;
        memcpy(kc, row + nh * hd, nkv * hd * sizeof(T));
        memcpy(vc, row + (nh + nkv) * hd, nkv * hd * sizeof(T));
    }
}

int CAT(xllm_llama_forward_, SFX)(const XllmLlamaCfg *c, const XllmLlamaLayer *layers, int64_t M,
                                  const int64_t *token_slots, const int64_t *positions, int64_t S,
                                  const int64_t *seq_starts, const int64_t *ctx_lens, const int64_t *seq_slots,
                                  const float *cos_table, const float *sin_table, T *hidden, T *residual,
                                  T *work, double *phase_s, const XllmLoraStep *lora) {
    const int64_t Hd = c->hidden, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, I = c->inter;
    const int64_t qkv_dim = (nh + 2 * nkv) * hd;
    int status = XSHM_OK;
    T *qkv = work, *attn = qkv + M * qkv_dim, *gu = attn + M * nh * hd, *act = gu + M * 2 * I, *x = act + M * I;
    int64_t max_ctx = 1;
    for (int64_t s = 0; s < S; s++) max_ctx = ctx_lens[s] > max_ctx ? ctx_lens[s] : max_ctx;
    const size_t scratch_floats = (size_t)(c->kv_quant ? kvq_varlen_scratch_floats(max_ctx, nh, nkv, hd, hd, sizeof(T))
                                                       : ATTN_SCRATCH(max_ctx, nh, nkv, hd));
#pragma omp parallel
    {
        float *scratch = (float *)aligned_alloc(64, (sizeof(float) * scratch_floats + 63) / 64 * 64);
        const int timed = phase_s != NULL && omp_get_thread_num() == 0;
        double last = timed ? omp_get_wtime() : 0.0;
        for (int64_t l = 0; l < c->n_layers; l++) {
            const XllmLlamaLayer *L = layers + l;
            CAT(residual_norm_rows_, SFX)(hidden, residual, (const T *)L->ln1, M, Hd, c->eps, l == 0, x);
            MARK(0);
            CAT(linear_team_, SFX)(x, M, Hd, (const T *)L->qkv_w, (const T *)L->qkv_wp, &L->qkv_q, qkv_dim,
                                   (const T *)L->qkv_b, qkv);
            LORA_ADD(LORA_OF(lora, l, qkv), lora, x, M, Hd, qkv, qkv_dim);
            MARK(1);
            CAT(rope_store_rows_, SFX)(c, L, qkv, M, token_slots, positions, cos_table, sin_table);
            MARK(2);
            if (c->kv_quant)
                KVQ_ATTN_TEAM(qkv, qkv_dim, (const uint8_t *)L->k_cache, (const uint8_t *)L->v_cache, c->k_slot_stride,
                              c->k_tok_stride, c->v_slot_stride, c->v_tok_stride, seq_slots, seq_starts, ctx_lens, S,
                              nh, nkv, hd, hd, c->scale, c->kv_quant == 2, attn, nh * hd, scratch);
            else
                ATTN_TEAM(qkv, qkv_dim, (const T *)L->k_cache, (const T *)L->v_cache, c->k_slot_stride,
                          c->k_tok_stride, c->v_slot_stride, c->v_tok_stride, seq_slots, seq_starts, ctx_lens, S, nh,
                          nkv, hd, hd, c->scale, attn, nh * hd, scratch);
            MARK(3);
            CAT(linear_team_, SFX)(attn, M, nh * hd, (const T *)L->o_w, (const T *)L->o_wp, &L->o_q, Hd,
                                   (const T *)L->o_b, hidden);
            LORA_ADD(LORA_OF(lora, l, o), lora, attn, M, nh * hd, hidden, Hd);
            TP_ALL_REDUCE(hidden, M * Hd)
            MARK(4);
            CAT(residual_norm_rows_, SFX)(hidden, residual, (const T *)L->ln2, M, Hd, c->eps, 0, x);
            MARK(5);
            const XllmLoraProj *gu_lora = LORA_OF(lora, l, gate_up);
            if (gu_lora != NULL) { /* the adapter adds to gate/up before SiLU-and-mul: unfused */
                CAT(linear_team_, SFX)(x, M, Hd, (const T *)L->gate_up_w, (const T *)L->gate_up_wp, &L->gate_up_q,
                                       2 * I, NULL, gu);
                LORA_ADD(gu_lora, lora, x, M, Hd, gu, 2 * I);
                CAT(silu_mul_rows_, SFX)(gu, M, I, act);
            } else if (L->gate_up_q.fmt != XQ_NONE && M <= XQ_CHUNKED_MAX_M && !xq_amx_applies(IS_BF16, M) &&
                !xq_w8a8_applies(&L->gate_up_q, M)) {
                /* the GEMV with SiLU-and-mul fused */
                for (int64_t m0 = 0; m0 < M; m0 += MAX_B)
                    CAT(quant_gate_up_silu_team_, SFX)(x + m0 * Hd, M - m0 < MAX_B ? M - m0 : MAX_B, Hd,
                                                       &L->gate_up_q, I, act + m0 * I);
            } else if (L->gate_up_q.fmt != XQ_NONE || (L->gate_up_wp != NULL && M >= 2)) {
                CAT(linear_team_, SFX)(x, M, Hd, (const T *)L->gate_up_w, (const T *)L->gate_up_wp, &L->gate_up_q,
                                       2 * I, NULL, gu);
                CAT(silu_mul_rows_, SFX)(gu, M, I, act);
            } else {
                for (int64_t m0 = 0; m0 < M; m0 += MAX_B)
                    CAT(gate_up_silu_team_, SFX)(x + m0 * Hd, M - m0 < MAX_B ? M - m0 : MAX_B, Hd,
                                                 (const T *)L->gate_up_w, I, act + m0 * I);
            }
            MARK(6);
            CAT(linear_team_, SFX)(act, M, I, (const T *)L->down_w, (const T *)L->down_wp, &L->down_q, Hd, NULL,
                                   hidden);
            LORA_ADD(LORA_OF(lora, l, down), lora, act, M, I, hidden, Hd);
            TP_ALL_REDUCE(hidden, M * Hd)
            MARK(7);
        }
        free(scratch);
    }
    return status;
}
