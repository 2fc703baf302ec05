/* q0pack.h — the packed layout of 16 q8_0, q5_0 or q4_0 rows and its kernel (q0pack.c; AVX-512 VNNI
 * or AVX2 builds, else 0 bytes), as q4kpack.h's for these dtypes (the dtype an argument).
 * Reached by dtype through the traits table (traits.h). Internal: not seen by cffi. */
#ifndef FLASHLLM_Q0PACK_H
#define FLASHLLM_Q0PACK_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

size_t fli_q0_group_bytes(int32_t dtype, int64_t cols);
void fli_q0_pack_group(int32_t dtype, const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst);
void fli_q0_unpack_row(int32_t dtype, const uint8_t *gp, int64_t cols, int r, uint8_t *row);
void fli_q0_group(int32_t dtype, const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb,
                  int NT, float *y, int64_t ld, const float *bias);

#pragma GCC visibility pop

#endif /* FLASHLLM_Q0PACK_H */
