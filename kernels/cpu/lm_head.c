/* The greedy LM head: out[m] = the index of the largest of the logits row m that the head's product
 * writes (y = x . W^T (+ bias); bf16 x: the bf16-rounded values the logits hold), the first one on ties
 * as torch.argmax, without writing the [M, N] logits (SmolLM2's head at 64 rows: 12.6 MB of fp32 written,
 * converted and read back per step).
 *
 * Each thread of the team takes a contiguous range of whole panels (48 output columns) and runs the
 * head's own product (the same TEAM function as the logits path, on a team of one: a nested parallel
 * region of one thread) over chunks of its range into a buffer that stays in its L2, scanning each
 * chunk for the rows' maxima right after. Every output column is computed from its own weight row and
 * x alone, whatever the range (chunks start at panel boundaries), so the values are the logits path's
 * to the last bit and the argmax is theirs. Ties: a lane keeps its first maximum (strictly greater
 * replaces), lanes resolve to the lowest column, later chunks and threads (higher columns) replace only
 * when strictly greater. NaN-free input (as xllm_argmax_f32).
 *
 * Entries: xllm_head_argmax_packed_bf16 / _f32 (gemm_packed.h's packed weights), xllm_head_argmax_quant
 * (gemm_quant.h's formats, xq_linear_team's paths; a w8a8 weight's panels are self-contained, so a
 * range of them is a weight of its own).
 */
#include <omp.h>

#include "gemm_quant.h"

#define XH_BUF_BYTES (1 << 20) /* a thread's chunk of logits (half of a 2 MB L2) */

typedef struct {
    float val;
    int64_t idx;
} XhBest;

/* one chunk's product into buf (row-major [M][cols], bf16 when the head's output is, else fp32) */
typedef void (*XhChunk)(const void *ctx, int64_t n0, int64_t cols, void *buf);

/* best[m] updated with row m of buf [M][cols] (columns col0 .. col0 + cols) */
static void xh_scan(const void *buf, int bf16, int64_t M, int64_t cols, int64_t col0, XhBest *best) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t m = 0; m < M; m++) {
        __m512 bv = _mm512_set1_ps(-INFINITY);
        __m512i bi = _mm512_setzero_si512();
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 k = (__mmask16)(cols - c >= 16 ? 0xffff : (1u << (cols - c)) - 1);
            const __m512 v = bf16 ? load_bf16x16_mask((const uint16_t *)buf + m * cols + c, k)
                                  : _mm512_maskz_loadu_ps(k, (const float *)buf + m * cols + c);
            const __mmask16 gt = _mm512_mask_cmp_ps_mask(k, v, bv, _CMP_GT_OQ);
            bv = _mm512_mask_blend_ps(gt, bv, v);
            bi = _mm512_mask_blend_epi32(gt, bi, _mm512_add_epi32(iota, _mm512_set1_epi32((int)c)));
        }
        const float mx = _mm512_reduce_max_ps(bv);
        if (mx > best[m].val) {
            const __mmask16 at = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(mx), _CMP_EQ_OQ);
            best[m].val = mx;
            best[m].idx = col0 + _mm512_mask_reduce_min_epi32(at, bi);
        }
    }
}

static void xh_argmax(const void *ctx, XhChunk chunk, int64_t M, int64_t N, int bf16, int64_t *out) {
    if (M <= 0) return;
    const int64_t np = (N + GP_NR - 1) / GP_NR, es = bf16 ? 2 : 4;
    int64_t cp = XH_BUF_BYTES / (M * GP_NR * es); /* panels per chunk */
    if (cp < 1) cp = 1;
    XhBest *all = (XhBest *)malloc(sizeof(XhBest) * (size_t)(M * omp_get_max_threads()));
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        XhBest *best = all + t * M;
        for (int64_t m = 0; m < M; m++) best[m] = (XhBest){-INFINITY, 0};
        void *buf = aligned_alloc(64, (size_t)((M * cp * GP_NR * es + 63) / 64 * 64));
        for (int64_t p = p0; p < p1; p += cp) {
            const int64_t n0 = p * GP_NR, n1 = (p + cp < p1 ? p + cp : p1) * GP_NR;
            const int64_t cols = (n1 < N ? n1 : N) - n0;
#pragma omp parallel num_threads(1)
            chunk(ctx, n0, cols, buf);
            xh_scan(buf, bf16, M, cols, n0, best);
        }
        free(buf);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            XhBest b = all[m];
            for (int i = 1; i < nt; i++)
                if (all[i * M + m].val > b.val) b = all[i * M + m];
            out[m] = b.idx;
        }
    }
    free(all);
}

/* ---- packed bf16 / fp32 weights (gemm_packed.h) ---- */

typedef struct {
    const void *x, *Wp, *bias;
    int64_t M, K;
} XhPacked;

static void xh_chunk_packed_bf16(const void *ctx, int64_t n0, int64_t cols, void *buf) {
    const XhPacked *c = (const XhPacked *)ctx;
    gemm_packed_team_bf16((const uint16_t *)c->x, c->K, c->M, c->K, (const uint16_t *)c->Wp + n0 * c->K, cols,
                          c->bias ? (const uint16_t *)c->bias + n0 : NULL, buf, cols, GP_OUT_BF16);
}

static void xh_chunk_packed_f32(const void *ctx, int64_t n0, int64_t cols, void *buf) {
    const XhPacked *c = (const XhPacked *)ctx;
    gemm_packed_team_f32((const float *)c->x, c->K, c->M, c->K, (const float *)c->Wp + n0 * c->K, cols,
                         c->bias ? (const float *)c->bias + n0 : NULL, (float *)buf, cols);
}

/* out[m] = argmax of row m of gemm_packed's bf16 product (x [M, K] contiguous, Wp packed [N, K], bias or NULL) */
void xllm_head_argmax_packed_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *Wp, int64_t N,
                                  const uint16_t *bias, int64_t *out) {
    const XhPacked c = {x, Wp, bias, M, K};
    xh_argmax(&c, xh_chunk_packed_bf16, M, N, 1, out);
}

/* the same for fp32 (the logits unrounded) */
void xllm_head_argmax_packed_f32(const float *x, int64_t M, int64_t K, const float *Wp, int64_t N, const float *bias,
                                 int64_t *out) {
    const XhPacked c = {x, Wp, bias, M, K};
    xh_argmax(&c, xh_chunk_packed_f32, M, N, 0, out);
}

/* ---- quantized weights (gemm_quant.h) ---- */

typedef struct {
    const XllmQWeight *W;
    const void *x, *bias;
    int64_t M, K;
    int x_bf16;
} XhQuant;

/* W's rows from n on as a weight of their own (n a multiple of 48: a w8a8 weight keeps its panels) */
static XllmQWeight xh_rows_from(const XllmQWeight *W, int64_t K, int64_t n) {
    XllmQWeight v = xq_rows_from(W, K, n);
    if (W->fmt == XQ_W8A8 && W->packed != NULL) v.packed = (const uint8_t *)xw_panel_at(W, K, n / XW_NR);
    return v;
}

static void xh_chunk_quant(const void *ctx, int64_t n0, int64_t cols, void *buf) {
    const XhQuant *c = (const XhQuant *)ctx;
    const XllmQWeight v = xh_rows_from(c->W, c->K, n0);
    xq_linear_team(c->x, c->x_bf16, c->M, c->K, &v, cols,
                   c->bias ? (const char *)c->bias + n0 * (c->x_bf16 ? 2 : 4) : NULL, buf, cols, c->x_bf16);
}

/* out[m] = argmax of row m of xq_linear_team's product (bf16 x: its bf16 output; fp32 x: fp32) */
void xllm_head_argmax_quant(const XllmQWeight *W, const void *x, int x_bf16, int64_t M, int64_t K, int64_t N,
                            const void *bias, int64_t *out) {
    const XhQuant c = {W, x, bias, M, K, x_bf16};
    xh_argmax(&c, xh_chunk_quant, M, N, x_bf16, out);
}
