/* q4k.h — Q4_K rows (q4k.c; n a multiple of FL_QK_K): the f32 row kernels, a row expanded for
 * the int8 tiles, and the integer superblock tiles of the AVX-512 VNNI and AVX2 builds. Reached
 * by dtype through the traits table (traits.h) and qdot.c. Internal: not seen by cffi. */
#ifndef FLASHLLM_Q4K_H
#define FLASHLLM_Q4K_H

#include <stdint.h>

#include "base.h"

#pragma GCC visibility push(hidden)

/* plain C: dst (n) = dequantized row; row . x; y (n) += a * row */
void fli_q4k_dequant(const uint8_t *row, float *dst, int64_t n);
float fli_q4k_dot(const uint8_t *row, const float *x, int64_t n);
void fli_q4k_axpy(const uint8_t *row, float a, float *y, int64_t n);
/* fli_wx_expand of a Q4_K row: per 32-value sub-block its nibbles, d * sc_j, -dmin * m_j */
void fli_q4k_expand(const uint8_t *w, int64_t n, uint8_t *buf);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLI_Q4K_TILE1 1
/* out[r] = w[r] . x for FL_QT Q4_K rows and one token x quantized by fli_xq_quantize for q4_k
 * (n a multiple of FL_QK_K): fli_qdot_tile's n_tok == 1 in integer superblock sums */
void fli_q4k_tile1(const uint8_t *const w[FL_QT], const uint8_t *x, int64_t n, float out[FL_QT]);
/* out[r][t] for 2..FL_QT tokens, each bit for bit fli_q4k_tile1's (superblocks unpacked once) */
void fli_q4k_tilen(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                   int64_t n, float out[FL_QT][FL_QT]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FLI_Q4K_TILEN 1
/* out[r][t] = w[r] . x[t] for FL_QT Q4_K rows and n_tok (1..FL_QT) tokens quantized by
 * fli_xq_quantize for q4_k (n a multiple of FL_QK_K), in integer superblock sums, each row's
 * superblock unpacked once for the tokens: fli_qdot_tile's q4_k tiles, and prefill's (no
 * panels: the traits' panel flag) */
void fli_q4k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]);
#endif

#pragma GCC visibility pop

#endif /* FLASHLLM_Q4K_H */
