/* Constrained decoding: a grammar's allowed-token bitmask applied to logits in place.
 *
 * bitmask row r (``words`` int32 words, bit j of word w = token 32w + j allowed, llguidance's layout)
 * masks logits row rows[r]: every token whose bit is clear becomes -inf; allowed tokens are left
 * as they are. One pass of 16-token masked stores per row (the mask register is the bitmask's own
 * 16 bits, on a little-endian CPU), instead of expanding the bitmask into a float mask and adding it.
 */
#include "common.h"

void xllm_apply_token_bitmask_f32(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                                  const int64_t *rows, int64_t nrows, int64_t vocab) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < nrows; r++) {
        float *row = logits + rows[r] * row_stride;
        const int32_t *bits = bitmask + r * words;
        const uint16_t *halves = (const uint16_t *)bits;
        int64_t t = 0;
        for (; t + 16 <= vocab; t += 16)
            _mm512_mask_storeu_ps(row + t, (__mmask16)~halves[t / 16], ninf);
        for (; t < vocab; t++)
            if (!((bits[t / 32] >> (t % 32)) & 1)) row[t] = -INFINITY;
    }
}
