/* Llama-family fused decode (template body; included by llama_decode.c once per dtype).
 *
 * Macros: T (storage type), SFX (name suffix), TOF(x) (T -> float), RND(f) (float -> float
 * rounded to T's precision), STORE(f) (float -> T), DOT (T dot product), GEMV_ROW (one output
 * row of x[B,K] . w[K] for all B rows into float acc[B]), ATTEND_ROW (attend.h's attend_row_*).
 */

/* y[b, n] = x[b, :] . W[n, :] (+ bias[n]), rounded to T, rows split across the team.
 * B is a compile-time constant in each instance (see the dispatch) so accumulators stay in registers. */
ALWAYS_INLINE void CAT(gemv_team_b_, SFX)(const T *x, const int64_t B, int64_t K, const T *W, int64_t N,
                                          const T *bias, T *y) {
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float acc[MAX_B];
        GEMV_ROW(x, B, K, W + n * K, acc);
        const float b = bias ? TOF(bias[n]) : 0.0f;
        for (int64_t i = 0; i < B; i++) y[i * N + n] = STORE(acc[i] + b);
    }
}

/* act[b, i] = silu(gate) * up with gate/up rows i and I + i of the fused weight. A thread takes
 * blocks of 16 rows and streams the block's gate rows, then its up rows (one sequential stream at
 * a time), then applies SiLU-and-mul to 16 lanes at once. */
ALWAYS_INLINE void CAT(gate_up_silu_team_b_, SFX)(const T *x, const int64_t B, int64_t K, const T *W, int64_t I,
                                                  T *act) {
    const int64_t blocks = (I + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t i0 = blk * 16, n = I - i0 < 16 ? I - i0 : 16;
        float g[MAX_B][16], u[MAX_B][16], acc[MAX_B];
        for (int64_t r = 0; r < n; r++) {
            GEMV_ROW(x, B, K, W + (i0 + r) * K, acc);
            for (int64_t b = 0; b < B; b++) g[b][r] = acc[b];
        }
        for (int64_t r = 0; r < n; r++) {
            GEMV_ROW(x, B, K, W + (I + i0 + r) * K, acc);
            for (int64_t b = 0; b < B; b++) u[b][r] = acc[b];
        }
        for (int64_t b = 0; b < B; b++) {
            if (n == 16) {
                const __m512 gv = VRND(_mm512_loadu_ps(g[b])), uv = VRND(_mm512_loadu_ps(u[b]));
                const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                   exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                VSTORE(act + b * I + i0, _mm512_mul_ps(VRND(sig), uv));
            } else {
                for (int64_t r = 0; r < n; r++) {
                    const float gr = RND(g[b][r]), ur = RND(u[b][r]);
                    act[b * I + i0 + r] = STORE(RND(gr / (1.0f + expf(-gr))) * ur);
                }
            }
        }
    }
}

#define DISPATCH_B(B, CALL)                   \
    switch (B) {                              \
    case 1: CALL(1); break;                   \
    case 2: CALL(2); break;                   \
    case 3: CALL(3); break;                   \
    case 4: CALL(4); break;                   \
    case 5: CALL(5); break;                   \
    case 6: CALL(6); break;                   \
    case 7: CALL(7); break;                   \
    default: CALL(8); break;                  \
    }

static void CAT(gemv_team_, SFX)(const T *x, int64_t B, int64_t K, const T *W, int64_t N, const T *bias, T *y) {
#define GEMV_CALL(b) CAT(gemv_team_b_, SFX)(x, b, K, W, N, bias, y)
    DISPATCH_B(B, GEMV_CALL)
#undef GEMV_CALL
}

static void CAT(gate_up_silu_team_, SFX)(const T *x, int64_t B, int64_t K, const T *W, int64_t I, T *act) {
#define GU_CALL(b) CAT(gate_up_silu_team_b_, SFX)(x, b, K, W, I, act)
    DISPATCH_B(B, GU_CALL)
#undef GU_CALL
}
#undef DISPATCH_B

/* y[B, N] = x[B, K] . W[N, K]^T (+ bias) inside the team (ends with a barrier). One row streams W
 * with the row-streaming GEMV; two or more take the blocked GEMM over the packed copy when the layer
 * has one: both stream the weights once, but the GEMV's per-row dot products (a horizontal reduction
 * per output and row, 1 + 1/B loads per FMA) turn compute-bound from ~4 rows on this hardware while
 * the blocked GEMM (broadcast x, no reductions) stays at the memory bandwidth to 8 rows. */
static void CAT(project_team_, SFX)(const T *x, int64_t B, int64_t K, const T *W, const T *Wp,
                                    const XllmQWeight *Q, int64_t N, const T *bias, T *y) {
    if (Q->fmt != XQ_NONE) { /* quantized weight: the VNNI GEMV streams it once for all B rows */
        xq_linear_team(x, IS_BF16, B, K, Q, N, bias, y, N, IS_BF16);
        return;
    }
    if (Wp != NULL && B >= 2) {
        GEMM_PACKED_TEAM(x, B, K, Wp, N, bias, y);
        return;
    }
    CAT(gemv_team_, SFX)(x, B, K, W, N, bias, y);
}

/* act[b, i] = silu(gu[b, i]) * gu[b, I + i], rounded like the eager op; (row, 16-lane block) items over the team */
static void CAT(silu_mul_team_, SFX)(const T *gu, int64_t B, int64_t I, T *act) {
    const int64_t blocks = (I + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * blocks; item++) {
        const int64_t b = item / blocks, i0 = (item % blocks) * 16;
        const T *g = gu + b * 2 * I, *u = g + I;
        T *a = act + b * I;
        if (i0 + 16 <= I) {
            const __m512 gv = VLOAD(g + i0), uv = VLOAD(u + i0);
            const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                               exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            VSTORE(a + i0, _mm512_mul_ps(VRND(sig), uv));
        } else {
            for (int64_t i = i0; i < I; i++) {
                const float gr = TOF(g[i]), ur = TOF(u[i]);
                a[i] = STORE(RND(gr / (1.0f + expf(-gr))) * ur);
            }
        }
    }
}

/* act[b, i] = silu(x_b . Wq[i]) * (x_b . Wq[I + i]) for B <= 8 rows over a quantized gate/up weight, in one
 * pass: each chunk of 16 gate rows and the matching 16 up rows through the quantized GEMV, then SiLU-and-mul
 * with the rounding points of the unfused path (the products rounded to T, then silu_mul) (ends with a
 * barrier). One barrier and no [B, 2I] round trip instead of the GEMV, a barrier and silu_mul_team. */
static void CAT(quant_gate_up_silu_team_, SFX)(const T *x, int64_t B, int64_t K, const XllmQWeight *Q, int64_t I,
                                              T *act) {
    uint8_t local[XQ_LOCAL_BYTES] __attribute__((aligned(64)));
    void *heap;
    const XqAct a = xq_quantize_rows(x, IS_BF16, B, K, Q->fmt, local, &heap);
    const XllmQWeight up = xq_rows_from(Q, K, I);
    const int64_t chunks = (I + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t i0 = ch * 16, n = I - i0 < 16 ? I - i0 : 16;
        float g[MAX_B * 16] __attribute__((aligned(64))), u[MAX_B * 16] __attribute__((aligned(64)));
        xq_chunk_f32_dispatch(a, B, K, Q, I, i0, g);
        xq_chunk_f32_dispatch(a, B, K, &up, I, i0, u);
        for (int64_t b = 0; b < B; b++) {
            if (n == 16) {
                const __m512 gv = VRND(_mm512_load_ps(g + b * 16)), uv = VRND(_mm512_load_ps(u + b * 16));
                const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                   exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                VSTORE(act + b * I + i0, _mm512_mul_ps(VRND(sig), uv));
            } else {
                for (int64_t r = 0; r < n; r++) {
                    const float gr = RND(g[b * 16 + r]), ur = RND(u[b * 16 + r]);
                    act[b * I + i0 + r] = STORE(RND(gr / (1.0f + expf(-gr))) * ur);
                }
            }
        }
    }
    free(heap);
}

/* out = rmsnorm(in) * w (HF numerics: fp32 statistics, cast, then weight multiply) */
static void CAT(rmsnorm_row_, SFX)(const T *in, const T *w, int64_t n, float eps, T *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float v = TOF(in[i]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = STORE(TOF(w[i]) * RND(TOF(in[i]) * r));
}

/* rotate-half RoPE of one head in place, cos/sin rows of the fp32 table */
static void CAT(rope_head_, SFX)(T *x, const float *cos, const float *sin, int64_t rd) {
    const int64_t half = rd / 2;
    float tmp[512];
    for (int64_t i = 0; i < rd; i++) tmp[i] = TOF(x[i]);
    for (int64_t i = 0; i < rd; i++) {
        const float rot = i < half ? -tmp[i + half] : tmp[i - half];
        x[i] = STORE(RND(tmp[i] * RND(cos[i])) + RND(rot * RND(sin[i])));
    }
}

/* r_out = (first ? h : h + r_in) (rounded to T); x = rmsnorm(r_out) * w — for B rows, privately.
 * Every thread computes x itself (a few thousand flops) instead of waiting on a barrier; only
 * thread 0 stores r_out (a buffer nobody reads in this phase). */
static void CAT(residual_norm_, SFX)(const T *h, const T *r_in, T *r_out, int store, const T *w, int64_t B,
                                     int64_t n, float eps, int first, T *x, float *tmp) {
    for (int64_t b = 0; b < B; b++) {
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float v = first ? TOF(h[b * n + i]) : RND(TOF(h[b * n + i]) + TOF(r_in[b * n + i]));
            tmp[i] = v;
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) {
            if (store) r_out[b * n + i] = STORE(tmp[i]);
            x[b * n + i] = STORE(TOF(w[i]) * RND(tmp[i] * inv));
        }
    }
}

/* lora: NULL, or the step's adapter rows (lora_step.h), added after each adapted projection.
 * phase_s: NULL, or FORWARD_PHASES doubles to which the call adds the wall time of each phase over all
 * layers, as the general step does (llama_forward.h); here q/k norm, RoPE and the KV store are inside the
 * attention phase (index 3) and index 2 stays 0. */
int CAT(xllm_llama_decode_, SFX)(const XllmLlamaCfg *c, const XllmLlamaLayer *layers, int64_t B,
                                 const int64_t *slots, const int64_t *positions, const float *cos_table,
                                 const float *sin_table, T *hidden, T *residual, T *work, double *phase_s,
                                 const XllmLoraStep *lora) {
    const int64_t Hd = c->hidden, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, I = c->inter;
    const int64_t qkv_dim = (nh + 2 * nkv) * hd, rd = c->rotary_dim, G = nh / nkv;
    int status = XSHM_OK;
    T *r_alt = work, *qkv = r_alt + B * Hd, *attn = qkv + B * qkv_dim, *act = attn + B * nh * hd;
    T *gu = act + B * I; /* [B, 2I]: the gate/up projection when it goes through the blocked GEMM */
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = positions[b] + 1 > max_len ? positions[b] + 1 : max_len;
    /* runs of rows: a row continues its predecessor's run when it is the same slot's next position */
    int64_t run_start[MAX_B + 1], n_runs = 0;
    for (int64_t b = 0; b < B; b++)
        if (b == 0 || slots[b] != slots[b - 1] || positions[b] != positions[b - 1] + 1) run_start[n_runs++] = b;
    run_start[n_runs] = B;
    /* The residual stream ping-pongs between `residual` and `r_alt`: a phase reads one and thread 0
     * writes the other, so no thread ever reads a half-written residual. Five barriers per layer
     * (after the QKV projection, attention, O projection, gate/up projection and down projection;
     * six with two or more rows and packed float weights: the gate/up GEMM, then SiLU-and-mul; a
     * quantized gate/up fuses SiLU-and-mul into its GEMV). */
#pragma omp parallel
    {
        T *x = (T *)malloc(sizeof(T) * (size_t)(B * Hd));
        float *tmp = (float *)malloc(sizeof(float) * (size_t)Hd);
        /* attention scratch: scores + accumulators; quantized KV: kvq_attend_group's scratch, fp32 queries and
         * accumulators (kvq_group_floats) */
        const int64_t nsc = c->kv_quant ? kvq_group_floats(G, max_len, hd, hd) : G * max_len + G * hd;
        float *scores = (float *)malloc(sizeof(float) * (size_t)nsc);
        const int store = omp_get_thread_num() == 0;
        const int timed = phase_s != NULL && store;
        double last = timed ? omp_get_wtime() : 0.0;
        T *r_cur = residual, *r_next = r_alt;
        for (int64_t l = 0; l < c->n_layers; l++) {
            const XllmLlamaLayer *L = layers + l;
            /* residual add + input norm (r_cur -> r_next) */
            CAT(residual_norm_, SFX)(hidden, r_cur, r_next, store, (const T *)L->ln1, B, Hd, c->eps, l == 0, x, tmp);
            MARK(0);
            CAT(project_team_, SFX)(x, B, Hd, (const T *)L->qkv_w, (const T *)L->qkv_wp, &L->qkv_q, qkv_dim,
                                    (const T *)L->qkv_b, qkv);
            LORA_ADD(LORA_OF(lora, l, qkv), lora, x, B, Hd, qkv, qkv_dim);
            MARK(1);
            /* per (run, kv head): q/k norm + RoPE of the group's heads, KV write, attention. A run is
             * a row and the rows after it in the same slot at the next positions (a speculative verify
             * chunk: its last known token and its drafts); one thread does a run's rows in order, so a
             * row attends over the K/V its predecessors just wrote. Plain decode: one row per run. bf16 rows
             * attend on AMX where it applies (attend.h's attend_row_*; the tiles configured per layer, as the
             * GEMMs configure theirs). */
            const int amx_dec = !c->kv_quant && attend_decode_begin(IS_BF16, G, hd, hd);
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < n_runs * nkv; item++) {
                const int64_t r = item / nkv, g = item % nkv;
                for (int64_t b = run_start[r]; b < run_start[r + 1]; b++) {
                    const int64_t pos = positions[b], len = pos + 1;
                    T *row = qkv + b * qkv_dim;
                    T *kh = row + (nh + g) * hd, *vh = row + (nh + nkv + g) * hd;
                    const float *cs = cos_table + pos * rd, *sn = sin_table + pos * rd;
                    for (int64_t j = 0; j < G; j++) {
                        T *qh = row + (g * G + j) * hd;
                        if (c->qk_norm) CAT(rmsnorm_row_, SFX)(qh, (const T *)L->q_norm, hd, c->eps, qh);
                        CAT(rope_head_, SFX)(qh, cs, sn, rd);
                    }
                    if (c->qk_norm) CAT(rmsnorm_row_, SFX)(kh, (const T *)L->k_norm, hd, c->eps, kh);
                    CAT(rope_head_, SFX)(kh, cs, sn, rd);
                    if (c->kv_quant) { /* quantized rows: encode this head's K/V, attend over the codes */
                        const int fp8 = c->kv_quant == 2;
                        const int64_t piece = g * (hd + KVQ_SCALE_BYTES);
                        uint8_t *kq = (uint8_t *)L->k_cache + slots[b] * c->k_slot_stride + piece;
                        uint8_t *vq = (uint8_t *)L->v_cache + slots[b] * c->v_slot_stride + piece;
                        KVQ_ENCODE_ROW(kh, 1, hd, fp8, kq + pos * c->k_tok_stride);
                        KVQ_ENCODE_ROW(vh, 1, hd, fp8, vq + pos * c->v_tok_stride);
                        float *qf = scores, *acc = qf + G * hd, *gs = acc + G * hd;
                        const T *qg = row + g * G * hd;
                        const int qbf = IS_BF16 && hd % 32 == 0; /* bf16 queries as they are (the eager kernel's) */
                        if (!qbf)
                            for (int64_t j = 0; j < G * hd; j++) qf[j] = TOF(qg[j]);
                        kvq_attend_group(qbf ? (const void *)qg : (const void *)qf, qbf, G, hd, kq, c->k_tok_stride,
                                         vq, c->v_tok_stride, hd, len, c->scale, fp8, gs, acc);
                        for (int64_t j = 0; j < G * hd; j++) attn[b * nh * hd + g * G * hd + j] = STORE(acc[j]);
                        continue;
                    }
                    T *kc = (T *)L->k_cache + slots[b] * c->k_slot_stride + g * hd;
                    T *vc = (T *)L->v_cache + slots[b] * c->v_slot_stride + g * hd;
                    memcpy(kc + pos * c->k_tok_stride, kh, hd * sizeof(T));
                    memcpy(vc + pos * c->v_tok_stride, vh, hd * sizeof(T));
                    ATTEND_ROW(amx_dec, row + g * G * hd, 0, 1, G, hd, kc, c->k_tok_stride, vc, c->v_tok_stride, hd,
                               len, c->scale, scores, attn + b * nh * hd + g * G * hd);
                }
            }
            attend_decode_end(amx_dec);
            MARK(3);
            CAT(project_team_, SFX)(attn, B, nh * hd, (const T *)L->o_w, (const T *)L->o_wp, &L->o_q, Hd,
                                    (const T *)L->o_b, hidden);
            LORA_ADD(LORA_OF(lora, l, o), lora, attn, B, nh * hd, hidden, Hd);
            TP_ALL_REDUCE(hidden, B * Hd)
            MARK(4);
            /* residual add + post-attention norm (r_next -> r_cur) */
            CAT(residual_norm_, SFX)(hidden, r_next, r_cur, store, (const T *)L->ln2, B, Hd, c->eps, 0, x, tmp);
            MARK(5);
            const XllmLoraProj *gu_lora = LORA_OF(lora, l, gate_up);
            if (gu_lora != NULL) { /* the adapter adds to gate/up before SiLU-and-mul: unfused */
                CAT(project_team_, SFX)(x, B, Hd, (const T *)L->gate_up_w, (const T *)L->gate_up_wp, &L->gate_up_q,
                                        2 * I, NULL, gu);
                LORA_ADD(gu_lora, lora, x, B, Hd, gu, 2 * I);
                CAT(silu_mul_team_, SFX)(gu, B, I, act);
            } else if (L->gate_up_q.fmt != XQ_NONE && !xq_amx_applies(IS_BF16, B) &&
                       !xq_w8a8_applies(&L->gate_up_q, B)) {
                CAT(quant_gate_up_silu_team_, SFX)(x, B, Hd, &L->gate_up_q, I, act);
            } else if (L->gate_up_q.fmt != XQ_NONE) { /* AMX or W8A8: the GEMM, then SiLU-and-mul */
                xq_linear_team(x, IS_BF16, B, Hd, &L->gate_up_q, 2 * I, NULL, gu, 2 * I, IS_BF16);
                CAT(silu_mul_team_, SFX)(gu, B, I, act);
            } else if (L->gate_up_wp != NULL && B >= 2) {
                GEMM_PACKED_TEAM(x, B, Hd, (const T *)L->gate_up_wp, 2 * I, NULL, gu);
                CAT(silu_mul_team_, SFX)(gu, B, I, act);
            } else {
                CAT(gate_up_silu_team_, SFX)(x, B, Hd, (const T *)L->gate_up_w, I, act);
            }
            MARK(6);
            CAT(project_team_, SFX)(act, B, I, (const T *)L->down_w, (const T *)L->down_wp, &L->down_q, Hd, NULL,
                                    hidden);
            LORA_ADD(LORA_OF(lora, l, down), lora, act, B, I, hidden, Hd);
            TP_ALL_REDUCE(hidden, B * Hd)
            MARK(7);
        }
        free(x);
        free(tmp);
        free(scores);
    }
    return status;
}
