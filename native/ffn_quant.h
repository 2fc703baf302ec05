/* ffn_quant.h — the bundled FFN's range paths with int8 activations (ffn_quant.c), offered to
 * ffn.c (checks, threads, blocks and their fold, the f32 paths): a call's bundle layout and
 * arguments (ffn_args) and the FFN over a range of bundles for 1, up to SMALL_T and more tokens.
 * Not part of the C API (that is flashllm.h only): no fl_ names are declared here. */
#ifndef FLASHLLM_FFN_QUANT_H
#define FLASHLLM_FFN_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "base.h"
#include "qgemm.h"

#define DOWN_K FL_PR       /* neurons per f32 down GEMM when T > 1 (a multiple of FL_QT) */
#define SMALL_T FL_SMALL_T /* up to this many tokens: per-token arithmetic (fli_ffn_range_qs);
                            * more: GEMM panels (fli_ffn_range_qp), faster from ~11 tokens on
                            * real q4_k layers */

/* the bundle layout and arguments shared by every bundle of one call */
typedef struct {
    int64_t d, T;
    size_t rb;  // bytes of the gate and up rows (the down column follows the up row)
    int32_t dtype, glu, act;
    int32_t ddt;  // dtype of the down column
    const int32_t *ids;
    const int32_t *rows;  // (m) bundle rows to use, NULL = every row in order
    const float *up_bias;
    const float *x;  // (T, d)
    float threshold;  // |h| below it contributes nothing
    const uint8_t *xq;  // (T, xb) x quantized to int8 (qdot.c), NULL: the f32 paths
    size_t xb;
    const uint8_t *down;  // (n, down_stride) the down columns apart, or NULL: after the up row
    int64_t down_stride;
    size_t down_bytes;  // bytes of one down column (fl_row_bytes(ddt, d))
} ffn_args;

/* the down column of bundle row i (bundles of stride bytes) */
static inline const uint8_t *fli_down_of(const ffn_args *a, const uint8_t *bundles, int64_t stride,
                                         int64_t i) {
    return a->down ? a->down + i * a->down_stride : bundles + i * stride + (a->glu ? 2 : 1) * a->rb;
}

/* ---- ffn_quant.c: acc (T, d) += the FFN over bundles j0 .. j1-1 (rows[j] when rows are
 * given) with x quantized (a->xq), by T: 1, up to SMALL_T, more (scratch: scratch_floats) ---- */
#pragma GCC visibility push(hidden)

void fli_ffn_range_q1(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                      int64_t j1, float *acc);
void fli_ffn_range_qs(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                      int64_t j1, float *acc, float *h);
void fli_ffn_range_qp(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                      int64_t j1, float *acc, float *scratch);

#pragma GCC visibility pop

#endif /* FLASHLLM_FFN_QUANT_H */
