/* Row-wise fused elementwise ops for any number of tokens (prefill and large decode
 * batches), with the rounding points of the torch eager ops they replace:
 *   - residual add + RMSNorm (HF numerics: fp32 statistics, cast to T, then * weight),
 *   - SiLU(gate) * up over a fused [T, 2I] gate_up tensor,
 *   - rotate-half RoPE of [T, heads, head_dim] rows with per-token cos/sin table rows.
 * Rows are split across OpenMP threads.
 */
#include "common.h"

#define DEFINE_ELEMENTWISE(SFX, T, TOF, RND, STORE)                                                          \
    /* out = rmsnorm(x [+ residual_in]) * w; residual_out (if given) receives x [+ residual_in] */        \
    void xllm_add_rmsnorm_##SFX(const T *x, const T *residual_in, T *residual_out, const T *w, int64_t rows,  \
                                int64_t n, float eps, T *out) {                                              \
        _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < rows; r++) {                   \
            const T *xr = x + r * n;                                                                         \
            const T *ri = residual_in ? residual_in + r * n : NULL;                                          \
            T *ro = residual_out ? residual_out + r * n : NULL;                                              \
            T *o = out + r * n;                                                                              \
            float ss = 0.0f;                                                                                 \
            for (int64_t i = 0; i < n; i++) {                                                                \
                float v = TOF(xr[i]);                                                                        \
                if (ri) v = RND(v + TOF(ri[i]));                                                             \
                if (ro) ro[i] = STORE(v);                                                                    \
                ss += v * v;                                                                                 \
            }                                                                                                \
            const float inv = 1.0f / sqrtf(ss / (float)n + eps);                                            \
            const T *src = ro ? ro : xr;                                                                     \
            for (int64_t i = 0; i < n; i++) o[i] = STORE(TOF(w[i]) * RND(TOF(src[i]) * inv));                \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    void xllm_silu_mul_##SFX(const T *gate_up, int64_t rows, int64_t inter, T *out) {                       \
        _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < rows; r++) {                   \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                                            \
            T *o = out + r * inter;                                                                          \
            int64_t i = 0;                                                                                   \
            for (; i + 16 <= inter; i += 16) {                                                               \
                const __m512 gv = VLOAD(g + i);                                                              \
                const __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),                     \
                                                 exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));           \
                VSTORE(o + i, _mm512_mul_ps(VRND(sg), VLOAD(u + i)));                                        \
            }                                                                                                \
            for (; i < inter; i++) {                                                                         \
                const float gv = TOF(g[i]);                                                                  \
                o[i] = STORE(RND(gv / (1.0f + expf(-gv))) * TOF(u[i]));                                      \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    void xllm_rope_##SFX(T *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,            \
                         const float *cos_table, const float *sin_table, const int64_t *positions, int64_t rd) { \
        const int64_t half = rd / 2;                                                                         \
        _Pragma("omp parallel for schedule(static)") for (int64_t item = 0; item < rows * heads; item++) {   \
            const int64_t r = item / heads, h = item % heads;                                                \
            T *v = x + r * row_stride + h * head_dim;                                                        \
            const float *c = cos_table + positions[r] * rd, *s = sin_table + positions[r] * rd;              \
            float tmp[1024];                                                                                 \
            for (int64_t i = 0; i < rd; i++) tmp[i] = TOF(v[i]);                                             \
            for (int64_t i = 0; i < rd; i++) {                                                               \
                const float rot = i < half ? -tmp[i + half] : tmp[i - half];                                 \
                v[i] = STORE(RND(tmp[i] * RND(c[i])) + RND(rot * RND(s[i])));                                \
            }                                                                                                \
        }                                                                                                    \
    }

#define F32_ID(x) (x)
#define VLOAD load_bf16x16
#define VRND round_bf16_ps
#define VSTORE store_bf16_ps
DEFINE_ELEMENTWISE(bf16, uint16_t, bf16_to_f32, round_bf16, f32_to_bf16)
#undef VLOAD
#undef VRND
#undef VSTORE
#define VLOAD _mm512_loadu_ps
#define VRND F32_ID
#define VSTORE _mm512_storeu_ps
DEFINE_ELEMENTWISE(f32, float, F32_ID, F32_ID, F32_ID)

/* out[r] = index of the largest of row r (first one on ties, like torch.argmax); NaN-free input */
void xllm_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        __m512 best = _mm512_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(row + c));
        float mx = _mm512_reduce_max_ps(best);
        for (; c < cols; c++) mx = row[c] > mx ? row[c] : mx;
        int64_t idx = 0;
        for (c = 0; c < cols; c++)
            if (row[c] == mx) {
                idx = c;
                break;
            }
        out[r] = idx;
    }
}
