/* Multi-LoRA inside the fused steps (template body; included by llama_step.c once per dtype, before
 * llama_decode.h and llama_forward.h, which call it after each projection when a step has adapter rows).
 *
 * A projection y[M, N] = x[M, K] . W^T of a step whose row m uses the adapter in slot s_m (-1: the base model
 * alone) gets, for every such row, y[m] += scale[s_m] * round(round(x[m] . A[s_m]^T) . B[s_m]^T): the
 * segmented LoRA product of xllm.models.lora (LoraProjection: A [slots, n, K], B [slots, N, n] in the model
 * dtype, n = n_parts * rank, part p's rank columns [p * rank, (p + 1) * rank) feeding its output rows
 * [part_end[p - 1], part_end[p])), with the eager path's rounding points (each product rounded to T, then
 * added with its scale). Two worksharing loops, each ending with a barrier: the shrink over (row, rank
 * index) items into the shared fp32 scratch, then the expand over output rows, which reads only a part's own
 * rank columns of B (the zero blocks of a fused projection are skipped).
 */

static void CAT(lora_add_team_, SFX)(const XllmLoraProj *P, const XllmLoraStep *S, const T *x, int64_t M,
                                     int64_t K, T *y, int64_t N) {
    const int64_t n = P->n, r = P->rank;
    const T *A = (const T *)P->a, *Bw = (const T *)P->b;
    float *tmp = S->tmp;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < M * n; item++) {
        const int64_t m = item / n, j = item % n, s = S->row_slot[m];
        tmp[item] = s < 0 ? 0.0f : RND(DOT(x + m * K, A + (s * n + j) * K, K));
    }
#pragma omp for schedule(static)
    for (int64_t o = 0; o < N; o++) {
        int64_t p = 0;
        while (p + 1 < P->n_parts && o >= P->part_end[p]) p++;
        for (int64_t m = 0; m < M; m++) {
            const int64_t s = S->row_slot[m];
            if (s < 0) continue;
            const T *bw = Bw + (s * N + o) * n + p * r;
            const float *t = tmp + m * n + p * r;
            float d = 0.0f;
#pragma omp simd reduction(+ : d)
            for (int64_t j = 0; j < r; j++) d += t[j] * TOF(bw[j]);
            y[m * N + o] = STORE(TOF(y[m * N + o]) + S->scale[s] * RND(d));
        }
    }
}

/* the projection `proj` of layer l's adapters, when the step has adapter rows and the projection has any */
#define LORA_OF(S, l, proj) ((S) != NULL && (S)->layers[l].proj.a != NULL ? &(S)->layers[l].proj : NULL)
#define LORA_ADD(P, S, x, M, K, y, N) \
    if ((P) != NULL) CAT(lora_add_team_, SFX)(P, S, x, M, K, y, N)
