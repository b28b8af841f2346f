/* Multi-LoRA inside the fused steps (template body; included by llama_step.c once per dtype, before
 * llama_decode.h and llama_forward.h, which call it after each projection when a step has adapter rows).
 *
 * A projection y[M, N] = x[M, K] . W^T of a step whose row m uses the adapter in slot s_m (-1: the base model
 * alone) gets, for every such row, y[m] += scale[s_m] * (x[m] . A[s_m]^T) . B[s_m]^T: the segmented LoRA
 * product of xllm.models.lora (LoraProjection: A [slots, n, K], B [slots, N, rank] in the model dtype,
 * n = n_parts * rank, part p's A rows [p * rank, (p + 1) * rank) feeding its output rows
 * part_start[p] ..) by lora_team.h's two phases, with the rows grouped by slot once per step
 * (XllmLoraStep.groups) and the same rounding points as the eager path's kernel (lora.c).
 */

static void CAT(lora_add_team_, SFX)(const XllmLoraProj *P, const XllmLoraStep *S, const T *x, int64_t M,
                                     int64_t K, T *y, int64_t N) {
    (void)M;
    CAT(lora_team_, SFX)(x, y, K, N, (const T *)P->a, (const T *)P->b, &S->groups, S->scale, P->n_parts,
                         P->part_start, P->part_size, P->rank, S->tmp);
}

/* the projection `proj` of layer l's adapters, when the step has adapter rows and the projection has any */
#define LORA_OF(S, l, proj) ((S) != NULL && (S)->layers[l].proj.a != NULL ? &(S)->layers[l].proj : NULL)
#define LORA_ADD(P, S, x, M, K, y, N) \
    if ((P) != NULL) CAT(lora_add_team_, SFX)(P, S, x, M, K, y, N)
