/* qgemm.h — the int8 GEMM of prefill over panels of FL_PR weight rows (qgemm.c), for the dtypes
 * whose traits have panels (fli_has_panel). Offered to ops.c (fl_matmul) and ffn_quant.c.
 * Internal: not seen by cffi. */
#ifndef FLASHLLM_QGEMM_H
#define FLASHLLM_QGEMM_H

#include <stddef.h>
#include <stdint.h>

#define FL_PR 16      /* weight rows of one int8 GEMM panel */
#define FL_SMALL_T 10 /* up to this many tokens (a decode pass: a token and its guesses), each
                       * token's product is its one-token one: tiles, never panels */

#pragma GCC visibility push(hidden)

/* bytes of one panel of FL_PR rows of n values (a dtype with panels) */
size_t fli_panel_bytes(int64_t n);

/* buf (fli_panel_bytes(n)) = FL_PR rows w (pointers; repeat one to pad) repacked for
 * fli_panel_gemm */
void fli_panel_pack(int32_t dtype, const uint8_t *const w[FL_PR], int64_t n, uint8_t *buf);

/* out[r * ld + t] = w_r . x_t for the FL_PR rows of a panel and T tokens x (T, xb) quantized
 * by fli_xq_quantize for dtype */
void fli_panel_gemm(int32_t dtype, const uint8_t *panel, const uint8_t *x, size_t xb, int64_t T,
                    int64_t n, float *out, int64_t ld);

#pragma GCC visibility pop

#endif /* FLASHLLM_QGEMM_H */
