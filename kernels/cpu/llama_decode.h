/* Llama-family fused decode (template body; included by llama_decode.c once per dtype).
 *
 * Macros: T (storage type), SFX (name suffix), TOF(x) (T -> float), RND(f) (float -> float
 * rounded to T's precision), STORE(f) (float -> T), DOT (T dot product), GEMV_ROW (one output
 * row of x[B,K] . w[K] for all B rows into float acc[B]).
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

/* act[b, i] = silu(gate) * up with gate/up rows i and I + i of the fused weight. */
ALWAYS_INLINE void CAT(gate_up_silu_team_b_, SFX)(const T *x, const int64_t B, int64_t K, const T *W, int64_t I,
                                                  T *act) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < I; i++) {
        float g[MAX_B], u[MAX_B];
        GEMV_ROW(x, B, K, W + i * K, g);
        GEMV_ROW(x, B, K, W + (I + i) * K, u);
        for (int64_t b = 0; b < B; b++) {
            const float gr = RND(g[b]), ur = RND(u[b]);
            const float s = RND(gr / (1.0f + expf(-gr)));
            act[b * I + i] = STORE(s * ur);
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

void CAT(xllm_llama_decode_, SFX)(const XllmLlamaCfg *c, const XllmLlamaLayer *layers, int64_t B,
                                  const int64_t *slots, const int64_t *positions, const float *cos_table,
                                  const float *sin_table, T *hidden, T *residual, T *work) {
    const int64_t Hd = c->hidden, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, I = c->inter;
    const int64_t qkv_dim = (nh + 2 * nkv) * hd, rd = c->rotary_dim, G = nh / nkv;
    T *x = work, *qkv = x + B * Hd, *attn = qkv + B * qkv_dim, *act = attn + B * nh * hd;
#pragma omp parallel
    for (int64_t l = 0; l < c->n_layers; l++) {
        const XllmLlamaLayer *L = layers + l;
        /* residual add + input norm */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            T *h = hidden + b * Hd, *r = residual + b * Hd;
            if (l == 0) {
                for (int64_t i = 0; i < Hd; i++) r[i] = h[i];
            } else {
                for (int64_t i = 0; i < Hd; i++) r[i] = STORE(TOF(h[i]) + TOF(r[i]));
            }
            CAT(rmsnorm_row_, SFX)(r, (const T *)L->ln1, Hd, c->eps, x + b * Hd);
        }
        CAT(gemv_team_, SFX)(x, B, Hd, (const T *)L->qkv_w, qkv_dim, (const T *)L->qkv_b, qkv);
        /* q/k norm, RoPE, KV write: one (b, head) per item over q and k heads */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * (nh + nkv); item++) {
            const int64_t b = item / (nh + nkv), h = item % (nh + nkv);
            T *v = qkv + b * qkv_dim + h * hd;
            if (c->qk_norm) CAT(rmsnorm_row_, SFX)(v, (const T *)(h < nh ? L->q_norm : L->k_norm), hd, c->eps, v);
            const int64_t pos = positions[b];
            CAT(rope_head_, SFX)(v, cos_table + pos * rd, sin_table + pos * rd, rd);
            if (h >= nh) {
                const int64_t g = h - nh;
                T *kdst = (T *)L->k_cache + slots[b] * c->k_slot_stride + pos * c->k_tok_stride + g * hd;
                T *vdst = (T *)L->v_cache + slots[b] * c->v_slot_stride + pos * c->v_tok_stride + g * hd;
                memcpy(kdst, v, hd * sizeof(T));
                memcpy(vdst, v + nkv * hd, hd * sizeof(T));
            }
        }
        /* attention: one (b, kv head) per item, its G query heads together */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * nkv; item++) {
            const int64_t b = item / nkv, g = item % nkv, len = positions[b] + 1;
            const T *kb = (const T *)L->k_cache + slots[b] * c->k_slot_stride + g * hd;
            const T *vb = (const T *)L->v_cache + slots[b] * c->v_slot_stride + g * hd;
            float *s = (float *)malloc(sizeof(float) * (size_t)(G * len + G * hd));
            float *acc = s + G * len;
            const T *q0 = qkv + b * qkv_dim + g * G * hd;
            for (int64_t t = 0; t < len; t++) {
                const T *kt = kb + t * c->k_tok_stride;
                for (int64_t j = 0; j < G; j++) s[j * len + t] = DOT(q0 + j * hd, kt, hd) * c->scale;
            }
            for (int64_t j = 0; j < G; j++) {
                float *sj = s + j * len, mx = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) mx = sj[t] > mx ? sj[t] : mx;
                for (int64_t t = 0; t < len; t++) {
                    sj[t] = expf(sj[t] - mx);
                    sum += sj[t];
                }
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; t++) sj[t] *= inv;
                for (int64_t d = 0; d < hd; d++) acc[j * hd + d] = 0.0f;
            }
            for (int64_t t = 0; t < len; t++) {
                const T *vt = vb + t * c->v_tok_stride;
                for (int64_t j = 0; j < G; j++) {
                    const float p = s[j * len + t];
                    float *aj = acc + j * hd;
                    for (int64_t d = 0; d < hd; d++) aj[d] += p * TOF(vt[d]);
                }
            }
            for (int64_t j = 0; j < G * hd; j++) attn[b * nh * hd + g * G * hd + j] = STORE(acc[j]);
            free(s);
        }
        CAT(gemv_team_, SFX)(attn, B, nh * hd, (const T *)L->o_w, Hd, (const T *)L->o_b, hidden);
        /* residual add + post-attention norm */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            T *h = hidden + b * Hd, *r = residual + b * Hd;
            for (int64_t i = 0; i < Hd; i++) r[i] = STORE(TOF(h[i]) + TOF(r[i]));
            CAT(rmsnorm_row_, SFX)(r, (const T *)L->ln2, Hd, c->eps, x + b * Hd);
        }
        CAT(gate_up_silu_team_, SFX)(x, B, Hd, (const T *)L->gate_up_w, I, act);
        CAT(gemv_team_, SFX)(act, B, I, (const T *)L->down_w, Hd, NULL, hidden);
    }
}
