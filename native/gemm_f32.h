/* gemm_f32.h — small f32 GEMM blocks (gemm_f32.c): the 4x4 register tile of fl_matmul's f32 path
 * and the down GEMM of the FFN's panels. Internal: not seen by cffi. */
#ifndef FLASHLLM_GEMM_F32_H
#define FLASHLLM_GEMM_F32_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

/* out[r][t] = w_r . x_t for 4 f32 rows w (4, ldw) and 4 f32 tokens x (4, ldx), n values each */
void fli_dot4x4_f32(const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t n,
                    float out[4][4]);

/* y (T, d) += h^T @ down: y[t][j] += sum over k < K of h[k * ldh + t] * down[k * d + j];
 * down (K, d) f32, d a multiple of the vector width (32 is) */
void fli_down_f32(const float *h, int64_t ldh, const float *down, int64_t K, int64_t d, float *y,
                  int64_t T);

#pragma GCC visibility pop

#endif /* FLASHLLM_GEMM_F32_H */
