/* Packing and standalone entries of the blocked packed-weight GEMM (layout and contract in
 * gemm_packed.h). */
#include "gemm_packed.h"

/* elements of the packed copy of an [N, K] weight (bf16 or fp32) */
int64_t xllm_gemm_packed_numel(int64_t N, int64_t K) { return gp_panels(N) * GP_NR * K; }

/* W [N, K] bf16 (K even) -> Wp [ceil(N/48)][K/2][48][2], padding columns zero */
void xllm_gemm_pack_bf16(const uint16_t *W, int64_t N, int64_t K, uint16_t *Wp) {
    const int64_t np = gp_panels(N);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        uint16_t *dst = Wp + p * GP_NR * K;
        for (int64_t c = 0; c < GP_NR; c++) {
            const int64_t n = p * GP_NR + c;
            for (int64_t k = 0; k < K; k++) dst[(k / 2) * 2 * GP_NR + c * 2 + (k & 1)] = n < N ? W[n * K + k] : 0;
        }
    }
}

/* W [N, K] fp32 -> Wp [ceil(N/48)][K][48], padding columns zero */
void xllm_gemm_pack_f32(const float *W, int64_t N, int64_t K, float *Wp) {
    const int64_t np = gp_panels(N);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        float *dst = Wp + p * GP_NR * K;
        for (int64_t c = 0; c < GP_NR; c++) {
            const int64_t n = p * GP_NR + c;
            for (int64_t k = 0; k < K; k++) dst[k * GP_NR + c] = n < N ? W[n * K + k] : 0.0f;
        }
    }
}

void xllm_gemm_packed_strided_bf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *Wp,
                                   int64_t N, const uint16_t *bias, void *y, int64_t ldy, int out_bf16) {
#pragma omp parallel
    gemm_packed_team_bf16(x, ldx, M, K, Wp, N, bias, y, ldy, out_bf16);
}

int xllm_amx_ready(void) { return amx_ready(); }

/* 1 where the W8A8 GEMM can run on AMX-INT8 (amx.h) */
int xllm_amx_int8_ready(void) { return amx_int8_ready(); }

/* path: 0 automatic, 1 AVX-512, 2 AMX (returns -1 where AMX cannot run this product) */
int xllm_gemm_packed_path_bf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *Wp, int64_t N,
                               const uint16_t *bias, void *y, int64_t ldy, int out_bf16, int path) {
    if (path == 2 && !(K % 32 == 0 && amx_ready())) return -1;
#pragma omp parallel
    {
        if (path == 1)
            gemm_packed_avx_team_bf16(x, ldx, M, K, Wp, N, bias, y, ldy, out_bf16);
        else if (path == 2)
            gemm_packed_amx_team_bf16(x, ldx, M, K, Wp, N, bias, y, ldy, out_bf16);
        else
            gemm_packed_team_bf16(x, ldx, M, K, Wp, N, bias, y, ldy, out_bf16);
    }
    return 0;
}

void xllm_gemm_packed_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *Wp, int64_t N,
                           const uint16_t *bias, void *y, int out_bf16) {
    xllm_gemm_packed_strided_bf16(x, K, M, K, Wp, N, bias, y, N, out_bf16);
}

void xllm_gemm_packed_strided_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *Wp, int64_t N,
                                  const float *bias, float *y, int64_t ldy) {
#pragma omp parallel
    gemm_packed_team_f32(x, ldx, M, K, Wp, N, bias, y, ldy);
}

void xllm_gemm_packed_f32(const float *x, int64_t M, int64_t K, const float *Wp, int64_t N, const float *bias,
                          float *y) {
    xllm_gemm_packed_strided_f32(x, K, M, K, Wp, N, bias, y, N);
}
