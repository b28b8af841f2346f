/* Attention of one KV head's group of G query heads over one sequence's contiguous context
 * (shared by the standalone decode attention and the fused decode step).
 *
 * q: G rows of D; keys k[t * k_stride .. + D], values v[t * v_stride .. + Dv] for t < len;
 * out: G rows of Dv (rounded to the storage type). scratch: >= G * len floats.
 * Scores via dot products (fp32 accumulation), softmax with the vectorized exp, then values
 * accumulated 16 lanes at a time. bf16 decode rows take attend_decode_amx.h on a CPU with AMX and
 * attend_decode_avx.h elsewhere (attend_row_bf16 below, the entry of the decode loops), where their
 * shapes apply; attend_group is the rest (fp32 rows, other shapes).
 *
 * Software prefetches of the context go into the L2 (T1), not the L1: a T0 prefetch holds one of the
 * L1's few miss buffers until its line arrives from DRAM, which capped the KV read at ~13 GB/s on the
 * AMD build machine (T1: ~18-20; docs/performance.md, "Decode attention: prefetching into the L2").
 */
#ifndef XLLM_CPU_ATTEND_H
#define XLLM_CPU_ATTEND_H

#include <omp.h>

#include "attend_decode_amx.h"
#include "common.h"

ALWAYS_INLINE void softmax_rows(float *s, int64_t G, int64_t len) {
    for (int64_t j = 0; j < G; j++) {
        float *sj = s + j * len;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sj + t));
        float mx = _mm512_reduce_max_ps(mxv);
        for (; t < len; t++) mx = sj[t] > mx ? sj[t] : mx;
        const __m512 m = _mm512_set1_ps(mx);
        __m512 sumv = _mm512_setzero_ps();
        for (t = 0; t + 16 <= len; t += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sj + t), m));
            _mm512_storeu_ps(sj + t, e);
            sumv = _mm512_add_ps(sumv, e);
        }
        float sum = _mm512_reduce_add_ps(sumv);
        for (; t < len; t++) {
            sj[t] = expf(sj[t] - mx);
            sum += sj[t];
        }
        const float inv = 1.0f / sum;
        for (t = 0; t < len; t++) sj[t] *= inv;
    }
}

/* 16 horizontal sums at once: out[t] = sum of v[t]'s lanes (a transpose-and-add tree,
 * ~3 instructions per sum instead of ~10 for separate reductions). */
ALWAYS_INLINE __m512 hsum16(__m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

/* scores of one query against 16 consecutive keys (D % 32 == 0 for bf16, % 16 for fp32); the
 * common head sizes get a copy with D known at compile time (fully unrolled, registers only) */
ALWAYS_INLINE __m512 scores16_bf16_d(const uint16_t *q, const uint16_t *k, int64_t k_stride, const int64_t D) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) {
        const uint16_t *kt = k + t * k_stride;
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(q + d)),
                                 (__m512bh)_mm512_loadu_si512((const void *)(kt + d)));
        acc[t] = a;
    }
    return hsum16(acc);
}

ALWAYS_INLINE __m512 scores16_f32_d(const float *q, const float *k, int64_t k_stride, const int64_t D) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) {
        const float *kt = k + t * k_stride;
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kt + d), a);
        acc[t] = a;
    }
    return hsum16(acc);
}

static inline __m512 scores16_bf16(const uint16_t *q, const uint16_t *k, int64_t k_stride, int64_t D) {
    if (D == 64) return scores16_bf16_d(q, k, k_stride, 64);
    if (D == 128) return scores16_bf16_d(q, k, k_stride, 128);
    return scores16_bf16_d(q, k, k_stride, D);
}

static inline __m512 scores16_f32(const float *q, const float *k, int64_t k_stride, int64_t D) {
    if (D == 64) return scores16_f32_d(q, k, k_stride, 64);
    if (D == 128) return scores16_f32_d(q, k, k_stride, 128);
    return scores16_f32_d(q, k, k_stride, D);
}

/* acc[j * Dv + c*16 ..] += sum_t p[j][t] * v[t][c*16 ..] with all G x NC accumulators in
 * registers (G and NC = Dv / 16 compile-time constants in each instance). */
#define DEFINE_VALUES_REG(SFX, T, LOAD16)                                                                       \
    ALWAYS_INLINE void values_reg_##SFX(const float *s, int64_t len, const T *v, int64_t v_stride, float *acc,   \
                                        const int G, const int NC) {                                            \
        __m512 a[8][8];                                                                                          \
        for (int j = 0; j < G; j++)                                                                              \
            for (int c = 0; c < NC; c++) a[j][c] = _mm512_setzero_ps();                                         \
        for (int64_t t = 0; t < len; t++) {                                                                      \
            const T *vt = v + t * v_stride;                                                                      \
            __m512 vv[8];                                                                                        \
            for (int c = 0; c < NC; c++) vv[c] = LOAD16(vt + c * 16);                                            \
            for (int j = 0; j < G; j++) {                                                                        \
                const __m512 p = _mm512_set1_ps(s[j * len + t]);                                                 \
                for (int c = 0; c < NC; c++) a[j][c] = _mm512_fmadd_ps(p, vv[c], a[j][c]);                        \
            }                                                                                                    \
        }                                                                                                        \
        for (int j = 0; j < G; j++)                                                                              \
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + (j * NC + c) * 16, a[j][c]);                     \
    }                                                                                                            \
    /* returns 0 when (G, Dv) has no register-resident instance */                                               \
    static inline int values_fast_##SFX(const float *s, int64_t len, const T *v, int64_t v_stride, float *acc,   \
                                        int64_t G, int64_t Dv) {                                                 \
        if (Dv == 64) {                                                                                          \
            switch (G) {                                                                                         \
            case 1: values_reg_##SFX(s, len, v, v_stride, acc, 1, 4); return 1;                                  \
            case 2: values_reg_##SFX(s, len, v, v_stride, acc, 2, 4); return 1;                                  \
            case 3: values_reg_##SFX(s, len, v, v_stride, acc, 3, 4); return 1;                                  \
            case 4: values_reg_##SFX(s, len, v, v_stride, acc, 4, 4); return 1;                                  \
            case 5: values_reg_##SFX(s, len, v, v_stride, acc, 5, 4); return 1;                                  \
            case 6: values_reg_##SFX(s, len, v, v_stride, acc, 6, 4); return 1;                                  \
            default: return 0;                                                                                   \
            }                                                                                                    \
        }                                                                                                        \
        if (Dv == 128) {                                                                                         \
            switch (G) {                                                                                         \
            case 1: values_reg_##SFX(s, len, v, v_stride, acc, 1, 8); return 1;                                  \
            case 2: values_reg_##SFX(s, len, v, v_stride, acc, 2, 8); return 1;                                  \
            case 3: values_reg_##SFX(s, len, v, v_stride, acc, 3, 8); return 1;                                  \
            default: return 0;                                                                                   \
            }                                                                                                    \
        }                                                                                                        \
        return 0;                                                                                                \
    }

DEFINE_VALUES_REG(bf16, uint16_t, load_bf16x16)
DEFINE_VALUES_REG(f32, float, _mm512_loadu_ps)

#define DEFINE_ATTEND_GROUP(SFX, T, DOT, LOAD16, TOF, SCORES16, DMULT)                                                           \
    static inline void attend_group_##SFX(const T *q, int64_t G, int64_t D, const T *k, int64_t k_stride,         \
                                          const T *v, int64_t v_stride, int64_t Dv, int64_t len, float scale,     \
                                          float *s, float *acc) {                                                 \
        int64_t t0 = 0;                                                                                           \
        if (D % DMULT == 0) {                                                                                     \
            const __m512 sc = _mm512_set1_ps(scale);                                                              \
            for (; t0 + 16 <= len; t0 += 16) {                                                                    \
                /* the context comes from DRAM: the next block's keys and this block's values into the L2 */ \
                for (int64_t t = t0 + 16; t < t0 + 32 && t < len; t++)                                            \
                    for (int64_t off = 0; off < D * (int64_t)sizeof(T); off += 64)                                \
                        _mm_prefetch((const char *)(k + t * k_stride) + off, _MM_HINT_T1);                        \
                for (int64_t t = t0; t < t0 + 16; t++)                                                            \
                    for (int64_t off = 0; off < Dv * (int64_t)sizeof(T); off += 64)                               \
                        _mm_prefetch((const char *)(v + t * v_stride) + off, _MM_HINT_T1);                        \
                for (int64_t j = 0; j < G; j++)                                                                   \
                    _mm512_storeu_ps(s + j * len + t0,                                                            \
                                     _mm512_mul_ps(SCORES16(q + j * D, k + t0 * k_stride, k_stride, D), sc));    \
            }                                                                                                     \
        }                                                                                                         \
        for (int64_t t = t0; t < len; t++) {                                                                      \
            const T *kt = k + t * k_stride;                                                                       \
            for (int64_t j = 0; j < G; j++) s[j * len + t] = DOT(q + j * D, kt, D) * scale;                       \
        }                                                                                                         \
        softmax_rows(s, G, len);                                                                                  \
        if (values_fast_##SFX(s, len, v, v_stride, acc, G, Dv)) return;                                           \
        for (int64_t i = 0; i < G * Dv; i++) acc[i] = 0.0f;                                                       \
        const int64_t dv16 = Dv - Dv % 16;                                                                        \
        for (int64_t t = 0; t < len; t++) {                                                                       \
            const T *vt = v + t * v_stride;                                                                       \
            for (int64_t d = 0; d < dv16; d += 16) {                                                              \
                const __m512 vv = LOAD16(vt + d);                                                                 \
                for (int64_t j = 0; j < G; j++) {                                                                 \
                    float *aj = acc + j * Dv + d;                                                                 \
                    _mm512_storeu_ps(aj, _mm512_fmadd_ps(_mm512_set1_ps(s[j * len + t]), vv, _mm512_loadu_ps(aj))); \
                }                                                                                                 \
            }                                                                                                     \
            for (int64_t d = dv16; d < Dv; d++)                                                                   \
                for (int64_t j = 0; j < G; j++) acc[j * Dv + d] += s[j * len + t] * TOF(vt[d]);                   \
        }                                                                                                         \
    }

#define XLLM_F32_ID(x) (x)
DEFINE_ATTEND_GROUP(bf16, uint16_t, dot_bf16, load_bf16x16, bf16_to_f32, scores16_bf16, 32)
DEFINE_ATTEND_GROUP(f32, float, dot_f32, _mm512_loadu_ps, XLLM_F32_ID, scores16_f32, 16)

#include "attend_decode_avx.h" /* after scores16_bf16, which it uses */

/* ---- one decode row's attention, the entry of the decode loops (attention.c, llama_decode.h, attend_varlen.h) ----
 *
 * A loop over decode items calls attend_decode_begin() on every thread before its `omp for` (1: bf16 rows take
 * the AMX kernel, attend_decode_amx.h, whose tiles it configures; 0: attend_group per KV head) and
 * attend_decode_end() after it. attend_row_{bf16,f32}(amx, ..) then attends the KV heads [g0, g1) of one row:
 * query head h at q + h * D (heads packed), KV head g's key of position t at k + t * k_stride + g * D (value:
 * v + t * v_stride + g * Dv), t < len; out + h * Dv gets the result rounded to T once. scratch: G * len + G * Dv
 * floats (attend_group's; the AMX kernel keeps its state on the stack).
 * attend_heads_per_item(): KV heads per item (1 or KVH) for `rows` decode rows over the current team: whole
 * rows (the row's K and V positions stream once, in order, and no two threads share their pages) when there
 * are at least 4 rows per thread, else one head per item (parallelism for a few rows).
 */
static inline int attend_decode_begin(int bf16, int64_t G, int64_t D, int64_t Dv) {
    if (!bf16 || !ar_applies(1, G, D, Dv)) return 0;
    ar_configure(G, D);
    return 1;
}

static inline void attend_decode_end(int amx) {
    if (amx) amx_tile_release();
}

static inline int64_t attend_heads_per_item(int64_t rows, int64_t KVH, int64_t G, int64_t D, int64_t Dv) {
    return rows >= 4 * (int64_t)omp_get_num_threads() && ar_fits(KVH, G, D, Dv) ? KVH : 1;
}

static inline void attend_row_bf16(int amx, const uint16_t *q, int64_t g0, int64_t g1, int64_t G, int64_t D,
                                   const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                   int64_t Dv, int64_t len, float scale, float *scratch, uint16_t *out) {
    if (amx) {
        attend_rows_bf16_amx(q + g0 * G * D, g1 - g0, G, D, k + g0 * D, k_stride, v + g0 * Dv, v_stride, Dv, len,
                             scale, out + g0 * G * Dv);
        return;
    }
    if (av_applies(g1 - g0, G, D, Dv)) {
        attend_rows_bf16_avx(q + g0 * G * D, g1 - g0, G, D, k + g0 * D, k_stride, v + g0 * Dv, v_stride, Dv, len,
                             scale, out + g0 * G * Dv);
        return;
    }
    float *acc = scratch + G * len;
    for (int64_t g = g0; g < g1; g++) {
        attend_group_bf16(q + g * G * D, G, D, k + g * D, k_stride, v + g * Dv, v_stride, Dv, len, scale, scratch, acc);
        for (int64_t j = 0; j < G * Dv; j++) out[g * G * Dv + j] = f32_to_bf16(acc[j]);
    }
}

static inline void attend_row_f32(int amx, const float *q, int64_t g0, int64_t g1, int64_t G, int64_t D,
                                  const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t Dv,
                                  int64_t len, float scale, float *scratch, float *out) {
    (void)amx; /* fp32 rows always take attend_group */
    float *acc = scratch + G * len;
    for (int64_t g = g0; g < g1; g++) {
        attend_group_f32(q + g * G * D, G, D, k + g * D, k_stride, v + g * Dv, v_stride, Dv, len, scale, scratch, acc);
        memcpy(out + g * G * Dv, acc, sizeof(float) * (size_t)(G * Dv));
    }
}


#endif
