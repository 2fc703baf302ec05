/* q3k.h — one q3_k superblock (q3k.c), for qk.c's q3_k rows. Internal: not seen by cffi. */
#ifndef FLASHLLM_Q3K_H
#define FLASHLLM_Q3K_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

/* dst (256) = q3_k superblock sb dequantized as gguf-py; the exact integer sum over its 16
 * sub-blocks of (scale - 32) * ((u - 4) . q) with a token's int8 q (256) and its sums per 16
 * values bsum16 (16) */
void fli_q3k_dequant_sb(const uint8_t *sb, float *dst);
int32_t fli_q3k_isum(const uint8_t *sb, const int8_t *q, const int16_t *bsum16);

#pragma GCC visibility pop

#endif /* FLASHLLM_Q3K_H */
