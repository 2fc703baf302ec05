/* q4kpack.h — the packed layout of 16 Q4_K rows and its kernel (q4kpack.c; AVX-512 VNNI builds,
 * else 0 bytes): the bytes of one group of 16 rows of cols values (0: no layout for cols), the
 * packing of rows 0..15 of w (row bytes rb) into dst, and y (NT <= 4 tokens, ld floats apart)
 * [+ bias] for one group gp against tokens xq (xb bytes apart) quantized by fli_xq_quantize.
 * Reached by dtype through the traits table (traits.h). Internal: not seen by cffi. */
#ifndef FLASHLLM_Q4KPACK_H
#define FLASHLLM_Q4KPACK_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

size_t fli_q4k_group_bytes(int64_t cols);
void fli_q4k_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst);
void fli_q4k_unpack_row(const uint8_t *gp, int64_t cols, int r, uint8_t *row);
void fli_q4k_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                   int64_t ld, const float *bias);

#pragma GCC visibility pop

#endif /* FLASHLLM_Q4KPACK_H */
