/* The segmented LoRA product of one projection over a step's rows (multi-LoRA, xllm.kernels.lora):
 *
 *   out[t, P] += scales[s] * (x[t] @ A[s, p]^T) @ B[s, P]^T   for every row t with s = slots[t] in [0, n_slots)
 *                                                            and every part p (output columns P)
 *
 * (rows with another slot, -1 the base model, are untouched). Layout of xllm.models.lora.LoraStack: per slot
 * A [n_parts * rank, in] and B [out_dim, rank], contiguous, zero padded; a fused projection (qkv, gate_up) has
 * one part per checkpoint projection: part p's A rows are p*rank .. p*rank+rank-1, and its output rows
 * part_start[p] .. part_start[p]+part_size[p]-1 (P) hold that part's rank columns of B.
 *
 * The rows come grouped by slot (order, gslot, gstart, groups: xllm.kernels.lora.LoraRows, made once per
 * forward); one OpenMP team runs lora_team.h's two phases:
 *   shrink: h[t, p*rank + k] = x[t] . A[s][p*rank + k], fp32 accumulation (vdpbf16ps for bf16, FMA for fp32),
 *      h rounded to the model dtype as torch's bf16 matmul rounds its output (fp32: no rounding); work items
 *      (group, A row) so each A row is streamed once per call for all the group's rows;
 *   expand: per (group, part, block of 64 output columns) the block's B rows are transposed once into an fp32
 *      tile [rank][64], then each row of the group gets delta = h[t, part] @ tile (fp32 FMA, exact products of
 *      the rounded h) and out = round(out + round(scale) * round(delta)).
 * The rounding points (bf16) are those of the torch loop it replaces (xllm.kernels.lora.torch_segmented_lora):
 * torch's bf16 matmuls round h and the delta to bf16, and index_add_(alpha=scale) rounds alpha to bf16 and then
 * out + alpha * delta once (in its 32-column vectors; its scalar tail, a row's last out % 32 columns, rounds
 * alpha * delta first). Elsewhere the two differ only where the fp32 sums' order flips a rounding. fp32: no
 * rounding but the output's; summation order only.
 * Returns 0, or 1 when the scratch rows cannot be allocated or there are more than LORA_MAX_PARTS parts (out
 * untouched).
 */
#include "lora_team.h"

#define DEFINE_LORA(SFX, T)                                                                                        \
    int xllm_lora_segmented_##SFX(const T *x, T *out, int64_t n_rows, int64_t in_dim, int64_t out_dim,           \
                                   const T *a, const T *b, const int64_t *order, const int64_t *gslot,            \
                                   const int64_t *gstart, int64_t groups, const float *scales, int64_t n_parts,   \
                                   const int64_t *part_start, const int64_t *part_size, int64_t rank) {          \
        if (n_parts > LORA_MAX_PARTS) return 1;                                                                   \
        const int64_t nh = n_parts * rank; /* A rows / B columns per slot */                                      \
        float *h = malloc(sizeof(float) * (size_t)(n_rows * nh + 1));                                             \
        if (!h) return 1;                                                                                         \
        const XllmLoraGroups G = {order, gslot, gstart, groups};                                                  \
        const int64_t work = gstart[groups] * (nh * in_dim + rank * out_dim);                                     \
        _Pragma("omp parallel if (work >= (1 << 16))")                                                            \
            lora_team_##SFX(x, out, in_dim, out_dim, a, b, &G, scales, n_parts, part_start, part_size, rank, h);  \
        free(h);                                                                                                  \
        return 0;                                                                                                 \
    }

DEFINE_LORA(bf16, uint16_t)
DEFINE_LORA(f32, float)
