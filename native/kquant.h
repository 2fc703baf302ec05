/* kquant.h — k-quant rows quantized (kquant.c): dst (n / 256 superblocks) = src (n) in q2_k,
 * q4_k, q5_k or q6_k (n a multiple of FL_QK_K), ggml's quantize_row_q*_K_ref bit for bit (no
 * importance matrix). Reached by dtype through the traits table (traits.h). Internal. */
#ifndef FLASHLLM_KQUANT_H
#define FLASHLLM_KQUANT_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

void fli_q2k_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q4k_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q5k_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q6k_quantize(const float *src, uint8_t *dst, int64_t n);

#pragma GCC visibility pop

#endif /* FLASHLLM_KQUANT_H */
