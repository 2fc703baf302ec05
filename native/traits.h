/* traits.h — the dtype traits table (traits.c), as ggml's type_traits_cpu: per storage dtype its
 * row kernels (dequantize / quantize a row, dot and axpy against f32, the int8 tile) and its
 * packed layout, gathered from the kernel modules below it, so that the modules above (ops.c,
 * pack.c, ffn.c, ffn_quant.c, qgemm.c, block.c) never switch on a dtype. The block layouts are
 * in dtype.h (below the kernels, which read them as constants). fl_row_bytes, fl_quantize_row,
 * fl_dequantize_row and fl_get_rows (flashllm.h) are defined in traits.c. Internal: not part of
 * the C API, not seen by cffi. */
#ifndef FLASHLLM_TRAITS_H
#define FLASHLLM_TRAITS_H

#include <stddef.h>
#include <stdint.h>

#include "base.h"
#include "dtype.h"

/* one storage dtype's kernels; NULL where the dtype has none (the int8 tile of f32 / f16,
 * a packed layout, quantizing to q3_k). n: values of a row (a multiple of the block size). */
typedef struct {
    const char *name;  /* as flashllm/model/tensor.py's DTYPES: "q4_k" */
    /* dst (n) = the row dequantized (rounded as gguf-py's dequantize) */
    void (*dequant)(const uint8_t *row, float *dst, int64_t n);
    /* dst (row bytes) = src (n) quantized (fl_quantize_row) */
    void (*quantize)(const float *src, uint8_t *dst, int64_t n);
    /* row . x, x (n) f32 */
    float (*dot)(const uint8_t *row, const float *x, int64_t n);
    /* y (n) += a * row */
    void (*axpy)(const uint8_t *row, float a, float *y, int64_t n);
    /* y (n) += sum over r < FL_QT of a[r] * rows[r] */
    void (*axpy4)(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n);
    /* out[r][t] = w[r] . x[t], FL_QT rows, n_tok (1..FL_QT) tokens; ex NULL or the rows expanded
     * by fli_wx_expand (dtypes with panels, n_tok > 1) */
    void (*qdot_tile)(const uint8_t *const w[FL_QT], const uint8_t *const ex[FL_QT],
                      const uint8_t *const x[FL_QT], int32_t n_tok, int64_t n,
                      float out[FL_QT][FL_QT]);
    /* whether the int8 GEMM of prefill runs panels (qgemm.c), else its tiles per FL_QT tokens */
    int32_t panel;
    /* whether qdot_tile gives each of 2..FL_QT tokens the bits of its one-token product when n is
     * a multiple of FL_QK_K (the k-quant tiles that unpack a superblock once and keep each
     * token's sums apart), so a pass over a few tokens may take them in one tile */
    int32_t tile_exact;
    /* the packed layout of 16 rows (pack.c): a group's bytes (0: none for these cols), rows
     * 0..15 of w (rb bytes apart) packed into dst, y (NT <= 4 tokens, ld apart) [+ bias] of a
     * group gp against tokens xq (xb apart); NULL: no layout */
    size_t (*group_bytes)(int64_t cols);
    void (*pack_group)(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst);
    void (*group)(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                  int64_t ld, const float *bias);
    /* row r (< 16) of a packed group gp back into its bytes as on file; NULL: the layout is not
     * undone here (fl_unpack_rows) */
    void (*unpack_row)(const uint8_t *gp, int64_t cols, int r, uint8_t *row);
} fli_traits;

#pragma GCC visibility push(hidden)
extern const fli_traits fli_type_traits[FLI_N_DTYPES];
#pragma GCC visibility pop

/* the traits of a known dtype (fli_dtype_ok) */
static inline const fli_traits *fli_traits_of(int32_t dtype) { return &fli_type_traits[dtype]; }

/* the table's kernels by dtype: dst (n) = dequantized row; row . x; y (n) += a * row; y (n) +=
 * sum of FL_QT rows; the int8 tile (quantized dtypes) */
static inline void fli_dequant(int32_t dtype, const uint8_t *row, float *dst, int64_t n) {
    fli_type_traits[dtype].dequant(row, dst, n);
}
static inline float fli_dot(int32_t dtype, const uint8_t *row, const float *x, int64_t n) {
    return fli_type_traits[dtype].dot(row, x, n);
}
static inline void fli_axpy(int32_t dtype, const uint8_t *row, float a, float *y, int64_t n) {
    fli_type_traits[dtype].axpy(row, a, y, n);
}
static inline void fli_axpy4(int32_t dtype, const uint8_t *const rows[FL_QT],
                             const float a[FL_QT], float *y, int64_t n) {
    fli_type_traits[dtype].axpy4(rows, a, y, n);
}
static inline void fli_qdot_tile(int32_t dtype, const uint8_t *const w[FL_QT],
                                 const uint8_t *const ex[FL_QT], const uint8_t *const x[FL_QT],
                                 int32_t n_tok, int64_t n, float out[FL_QT][FL_QT]) {
    fli_type_traits[dtype].qdot_tile(w, ex, x, n_tok, n, out);
}

/* whether dtype has int8 GEMM panels (qgemm.c) */
static inline int fli_has_panel(int32_t dtype) { return fli_type_traits[dtype].panel; }

/* whether fli_qdot_tile keeps each token's bits for rows of n values of dtype */
static inline int fli_tile_exact(int32_t dtype, int64_t n) {
    return fli_type_traits[dtype].tile_exact && n % FL_QK_K == 0;
}

#endif /* FLASHLLM_TRAITS_H */
