/* quant.h — rows of f32, f16 and the 32-value block dtypes quantized (quant.c): ggml's reference
 * rounding for q8_0, q4_0, q5_0, q5_1; q4_1's grid search (fl_quantize_row in flashllm.h).
 * dst holds the row's blocks (n a multiple of 32 for the block dtypes). Reached by dtype
 * through the traits table (traits.h). Internal: not seen by cffi. */
#ifndef FLASHLLM_QUANT_H
#define FLASHLLM_QUANT_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

void fli_f32_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_f16_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q8_0_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q4_0_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q4_1_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q5_0_quantize(const float *src, uint8_t *dst, int64_t n);
void fli_q5_1_quantize(const float *src, uint8_t *dst, int64_t n);

#pragma GCC visibility pop

#endif /* FLASHLLM_QUANT_H */
