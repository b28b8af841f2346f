/* The quantized weight formats of xllm.kernels.quant as the kernels see them (ISA-neutral: included by
 * gemm_quant.h, the AVX-512 kernels, and by avx2/quant_avx2.c): the XQ_* tags (mirrored by
 * xllm.kernels.quant_native.QUANT_TAGS), the weight view XllmQWeight (mirrored by native.QWeight) and a
 * row's bytes. Needs F16C for xq_h2f. */
#ifndef XLLM_CPU_QUANT_FORMATS_H
#define XLLM_CPU_QUANT_FORMATS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#endif

enum { XQ_NONE = 0, XQ_Q8_0 = 1, XQ_Q4_0 = 2, XQ_Q4_1 = 3, XQ_INT8 = 4, XQ_INT4_G32 = 5, XQ_INT4_G128 = 6,
       XQ_W8A8 = 7 /* int8's layout; gemm_w8a8.h from XW_MIN_M rows, the int8 paths below that */ };

typedef struct {
    int64_t fmt;           /* XQ_* (XQ_NONE: not quantized) */
    const uint8_t *data;   /* [N, row_bytes] */
    const void *scales;    /* int8: float [N]; int4: fp16 [N, K / group]; else NULL */
    const uint8_t *zeros;  /* int4: uint8 [N, K / group]; else NULL */
    const uint8_t *packed; /* w8a8: the VNNI panels and their offset sums (gemm_w8a8.h), or NULL; else NULL */
} XllmQWeight;

ALWAYS_INLINE int64_t xq_row_bytes(int64_t fmt, int64_t K) {
    switch (fmt) {
    case XQ_Q8_0: return K / 32 * 34;
    case XQ_Q4_0: return K / 32 * 18;
    case XQ_Q4_1: return K / 32 * 20;
    case XQ_INT8: case XQ_W8A8: return K;
    default: return K / 2;
    }
}

ALWAYS_INLINE int xq_signed(int fmt) { return fmt == XQ_Q8_0 || fmt == XQ_INT8 || fmt == XQ_W8A8; }

/* row n of W as its block readers see it: the row's bytes and, for int4, its fp16 scales and zero points */
typedef struct {
    const uint8_t *row, *sc, *zp;
} XqRowView;

ALWAYS_INLINE int xq_is_int4(int fmt) { return fmt == XQ_INT4_G32 || fmt == XQ_INT4_G128; }

ALWAYS_INLINE XqRowView xq_row_view(const int FMT, const XllmQWeight *W, int64_t K, int64_t n) {
    const int64_t gpr = FMT == XQ_INT4_G128 ? K / 128 : K / 32;
    const int int4 = xq_is_int4(FMT);
    XqRowView v = {W->data + n * xq_row_bytes(FMT, K), int4 ? (const uint8_t *)W->scales + 2 * n * gpr : NULL,
                   int4 ? W->zeros + n * gpr : NULL};
    return v;
}

/* the integer offset dequantization takes from block blk's codes first: Q4_0's 8, int4's zero point, else 0 */
ALWAYS_INLINE int xq_block_offset(const int FMT, XqRowView v, int64_t blk) {
    if (FMT == XQ_Q4_0) return 8;
    if (xq_is_int4(FMT)) return v.zp[FMT == XQ_INT4_G32 ? blk : blk >> 2];
    return 0;
}

ALWAYS_INLINE float xq_h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#endif
