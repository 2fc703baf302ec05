/* q2k.h — q2_k rows (q2k.c): one superblock, for qk.c's q2_k rows, and the q2_k tile (the
 * output head's sketch, through the traits table). Internal: not seen by cffi. */
#ifndef FLASHLLM_Q2K_H
#define FLASHLLM_Q2K_H

#include <stdint.h>

#include "base.h"

#pragma GCC visibility push(hidden)

/* dst (256) = q2_k superblock sb dequantized as gguf-py; the exact isum (sum over the 16
 * sub-blocks k of sc_k * (u . q)) and msum (sum of m_k * bsum16[k]) of sb with a token's int8 q
 * (256) and its sums per 16 values bsum16 (16) */
void fli_q2k_dequant_sb(const uint8_t *sb, float *dst);
void fli_q2k_sums(const uint8_t *sb, const int8_t *q, const int16_t *bsum16, int32_t *isum,
                  int32_t *msum);
/* out[r][t] = w[r] . x[t] for FL_QT q2_k rows and n_tok (1..FL_QT) tokens, each product
 * fli_qk_qdot's bits, each superblock's 2-bit values and scales unpacked once for all the
 * tokens under AVX2 */
void fli_q2k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]);

#pragma GCC visibility pop

#endif /* FLASHLLM_Q2K_H */
