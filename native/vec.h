/* vec.h — the per-row f32 kernels of f32, f16 and the 32-value block dtypes (vec.c): a row
 * dequantized, row . x and y += a * row fused with the dequantization, and 4 rows' axpy in one
 * pass over y; plus f32 dot and axpy of plain vectors (the k-quant kernels build on those). n a
 * multiple of 32 for the quantized dtypes. Reached by dtype through the traits table
 * (traits.h). Internal: not seen by cffi. */
#ifndef FLASHLLM_VEC_H
#define FLASHLLM_VEC_H

#include <stdint.h>

#include "base.h"

#pragma GCC visibility push(hidden)

/* f32 dot of two contiguous vectors (n) */
float fli_dot_f32(const float *a, const float *b, int64_t n);

/* y (n) += a * x (n), both f32 */
void fli_axpy_f32(float a, const float *x, float *y, int64_t n);

/* per dtype: dst (n) = the row dequantized; the row . x (n); y (n) += a * row; y (n) += sum over
 * r < FL_QT of a[r] * rows[r] */
void fli_f32_dequant(const uint8_t *row, float *dst, int64_t n);
void fli_f16_dequant(const uint8_t *row, float *dst, int64_t n);
void fli_q8_0_dequant(const uint8_t *row, float *dst, int64_t n);
void fli_q4_0_dequant(const uint8_t *row, float *dst, int64_t n);
void fli_q4_1_dequant(const uint8_t *row, float *dst, int64_t n);
void fli_q5_0_dequant(const uint8_t *row, float *dst, int64_t n);
void fli_q5_1_dequant(const uint8_t *row, float *dst, int64_t n);
float fli_f32_dot(const uint8_t *row, const float *x, int64_t n);
float fli_f16_dot(const uint8_t *row, const float *x, int64_t n);
float fli_q8_0_dot(const uint8_t *row, const float *x, int64_t n);
float fli_q4_0_dot(const uint8_t *row, const float *x, int64_t n);
float fli_q4_1_dot(const uint8_t *row, const float *x, int64_t n);
float fli_q5_0_dot(const uint8_t *row, const float *x, int64_t n);
float fli_q5_1_dot(const uint8_t *row, const float *x, int64_t n);
void fli_f32_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_f16_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_q8_0_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_q4_0_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_q4_1_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_q5_0_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_q5_1_axpy(const uint8_t *row, float a, float *y, int64_t n);
void fli_f32_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
void fli_f16_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
void fli_q8_0_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
void fli_q4_0_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
void fli_q4_1_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
void fli_q5_0_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
void fli_q5_1_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);

#pragma GCC visibility pop

#endif /* FLASHLLM_VEC_H */
