/* kaxpy.h — the k-quant down-column kernels (kaxpy.c): y += a * row for up to 4 q4_k / q5_k /
 * q6_k rows in one pass over y, and a q6_k row dequantized. Reached by dtype through the traits
 * table (traits.h). Internal: not seen by cffi. */
#ifndef FLASHLLM_KAXPY_H
#define FLASHLLM_KAXPY_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

/* y (n) += sum over r < nr (<= 4) of a[r] * rows[r], k-quant rows (q4_k, q5_k, q6_k; n a
 * multiple of FL_QK_K): one load and store of y per superblock */
void fli_kq_axpy(int32_t dtype, const uint8_t *const *rows, const float *a, int nr, float *y,
                 int64_t n);
/* dst (n) = a q6_k row dequantized, rounded as gguf-py */
void fli_q6k_dequant(const uint8_t *row, float *dst, int64_t n);

#pragma GCC visibility pop

#endif /* FLASHLLM_KAXPY_H */
