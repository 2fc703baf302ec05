/* qk.h — q2_k / q3_k / q5_k / q6_k rows (qk.c; n a multiple of FL_QK_K; the q2_k tile: q2k.h).
 * Reached by dtype through the traits table (traits.h). Internal: not seen by cffi. */
#ifndef FLASHLLM_QK_H
#define FLASHLLM_QK_H

#include <stdint.h>

#include "base.h"

#pragma GCC visibility push(hidden)

/* dst (n) = dequantized row, rounded as gguf-py's dequantize; row . x; y (n) += a * row (f32 x,
 * through one superblock at a time) */
void fli_qk_dequant(int32_t dtype, const uint8_t *row, float *dst, int64_t n);
float fli_qk_dot(int32_t dtype, const uint8_t *row, const float *x, int64_t n);
void fli_qk_axpy(int32_t dtype, const uint8_t *row, float a, float *y, int64_t n);
/* w . x for one row and one token quantized by fli_xq_quantize for that dtype: per superblock
 * the exact integer sums of the sub-blocks times their integer scales, then
 * d * d_x * isum - dmin * d_x * msum in f32; AVX-512 BW, AVX2 and plain C give the same bits */
float fli_qk_qdot(int32_t dtype, const uint8_t *w, const uint8_t *x, int64_t n);
/* out[r][t] = w[r] . x[t] for FL_QT q6_k rows and n_tok (1..FL_QT) tokens, each product
 * fli_qk_qdot's bits; under AVX-512 BW each superblock's 6-bit values are unpacked once for all
 * the tokens */
void fli_q6k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]);

#pragma GCC visibility pop

#endif /* FLASHLLM_QK_H */
