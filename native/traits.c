/* traits.c — the dtype traits table (traits.h): per storage dtype the kernels of the modules
 * below (vec.c, q4k.c, qk.c, q2k.c, kaxpy.c, quant.c, kquant.c, qdot.c and the packed layouts),
 * bound to the table's signatures where a kernel takes its dtype as an argument; and the row API of
 * flashllm.h that reads it: fl_row_bytes, fl_quantize_row, fl_dequantize_row, fl_get_rows.
 */
#include "flashllm.h"
#include "dtype.h"
#include "kaxpy.h"
#include "kquant.h"
#include "q0pack.h"
#include "q2k.h"
#include "q23pack.h"
#include "q4k.h"
#include "q4kpack.h"
#include "q5kpack.h"
#include "q6kpack.h"
#include "qdot.h"
#include "qk.h"
#include "quant.h"
#include "traits.h"
#include "vec.h"

/* a k-quant kernel that takes its dtype, bound to dtype DT under the name of kernel k of t */
#define QK_DEQUANT(t, DT)                                                                      \
    static void t##_dequant(const uint8_t *row, float *dst, int64_t n) {                       \
        fli_qk_dequant(DT, row, dst, n);                                                       \
    }
#define QK_DOT(t, DT)                                                                          \
    static float t##_dot(const uint8_t *row, const float *x, int64_t n) {                      \
        return fli_qk_dot(DT, row, x, n);                                                      \
    }
#define KQ_AXPY(t, DT)                                                                         \
    static void t##_axpy(const uint8_t *row, float a, float *y, int64_t n) {                   \
        fli_kq_axpy(DT, &row, &a, 1, y, n);                                                    \
    }                                                                                          \
    static void t##_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y,    \
                          int64_t n) {                                                         \
        fli_kq_axpy(DT, rows, a, FL_QT, y, n);                                                 \
    }
#define QK_AXPY(t, DT)                                                                         \
    static void t##_axpy(const uint8_t *row, float a, float *y, int64_t n) {                   \
        fli_qk_axpy(DT, row, a, y, n);                                                         \
    }                                                                                          \
    static void t##_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y,    \
                          int64_t n) {                                                         \
        for (int r = 0; r < FL_QT; r++) fli_qk_axpy(DT, rows[r], a[r], y, n);                  \
    }
/* tiles of dtypes with no multi-token kernel: a row and token at a time */
#define QK_ROWS_TILE(t, DT)                                                                    \
    static FLI_QDOT_TILE(t##_tile) {                                                           \
        (void)ex;                                                                              \
        for (int r = 0; r < FL_QT; r++)                                                        \
            for (int t = 0; t < n_tok; t++) out[r][t] = fli_qk_qdot(DT, w[r], x[t], n);        \
    }
#define QK_TILE(t, fn)                                                                         \
    static FLI_QDOT_TILE(t##_tile) {                                                           \
        (void)ex;                                                                              \
        fn(w, x, n_tok, n, out);                                                               \
    }
/* the packed layout of module m (fli_m_group_bytes, ...: q0pack.c, q23pack.c) bound to dtype DT */
#define DT_PACK(t, DT, m)                                                                      \
    static size_t t##_group_bytes(int64_t cols) { return fli_##m##_group_bytes(DT, cols); }    \
    static void t##_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst) {      \
        fli_##m##_pack_group(DT, w, rb, cols, dst);                                            \
    }                                                                                          \
    static void t##_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT,  \
                          float *y, int64_t ld, const float *bias) {                           \
        fli_##m##_group(DT, gp, n, xq, xb, NT, y, ld, bias);                                   \
    }

QK_DEQUANT(q2k, FL_Q2_K)
QK_DEQUANT(q3k, FL_Q3_K)
QK_DEQUANT(q5k, FL_Q5_K)
QK_DOT(q2k, FL_Q2_K)
QK_DOT(q3k, FL_Q3_K)
QK_DOT(q5k, FL_Q5_K)
QK_DOT(q6k, FL_Q6_K)
KQ_AXPY(q4k, FL_Q4_K)
KQ_AXPY(q5k, FL_Q5_K)
KQ_AXPY(q6k, FL_Q6_K)
QK_AXPY(q2k, FL_Q2_K)
QK_AXPY(q3k, FL_Q3_K)
QK_ROWS_TILE(q3k, FL_Q3_K)
QK_ROWS_TILE(q5k, FL_Q5_K)
QK_TILE(q2k, fli_q2k_tile)
QK_TILE(q6k, fli_q6k_tile)
/* q0pack.c's row unpacking bound to dtype DT */
#define DT_UNPACK(t, DT)                                                                       \
    static void t##_unpack_row(const uint8_t *gp, int64_t cols, int r, uint8_t *row) {         \
        fli_q0_unpack_row(DT, gp, cols, r, row);                                               \
    }

DT_PACK(q8_0, FL_Q8_0, q0)
DT_PACK(q5_0, FL_Q5_0, q0)
DT_PACK(q4_0, FL_Q4_0, q0)
DT_PACK(q2k, FL_Q2_K, q23)
DT_PACK(q3k, FL_Q3_K, q23)
DT_UNPACK(q8_0, FL_Q8_0)
DT_UNPACK(q5_0, FL_Q5_0)
DT_UNPACK(q4_0, FL_Q4_0)

#if defined(FLI_Q4K_TILEN)
#define Q4K_PANEL 0 /* AVX2: q4_k's integer tiles beat its expanded panels */
#else
#define Q4K_PANEL 1
#endif
#if defined(FLI_Q4K_TILEN) || defined(FLI_Q4K_TILE1)
#define Q4K_TILE_EXACT 1
#else
#define Q4K_TILE_EXACT 0
#endif

/* the 32-value block dtypes: vec.c's f32 kernels, qdot.c's int8 ones, quant.c's quantizer */
#define BLOCK32(t)                                                                             \
    .name = #t, .dequant = fli_##t##_dequant, .quantize = fli_##t##_quantize,                  \
    .dot = fli_##t##_dot, .axpy = fli_##t##_axpy, .axpy4 = fli_##t##_axpy4,                    \
    .qdot_tile = fli_##t##_tile, .panel = 1

const fli_traits fli_type_traits[FLI_N_DTYPES] = {
    [FL_F32] = {.name = "f32", .dequant = fli_f32_dequant, .quantize = fli_f32_quantize,
                .dot = fli_f32_dot, .axpy = fli_f32_axpy, .axpy4 = fli_f32_axpy4},
    [FL_F16] = {.name = "f16", .dequant = fli_f16_dequant, .quantize = fli_f16_quantize,
                .dot = fli_f16_dot, .axpy = fli_f16_axpy, .axpy4 = fli_f16_axpy4},
    [FL_Q8_0] = {BLOCK32(q8_0), .group_bytes = q8_0_group_bytes,
                 .pack_group = q8_0_pack_group, .group = q8_0_group,
                 .unpack_row = q8_0_unpack_row},
    [FL_Q4_0] = {BLOCK32(q4_0), .group_bytes = q4_0_group_bytes,
                 .pack_group = q4_0_pack_group, .group = q4_0_group,
                 .unpack_row = q4_0_unpack_row},
    [FL_Q4_1] = {BLOCK32(q4_1)},
    [FL_Q5_0] = {BLOCK32(q5_0), .group_bytes = q5_0_group_bytes,
                 .pack_group = q5_0_pack_group, .group = q5_0_group,
                 .unpack_row = q5_0_unpack_row},
    [FL_Q5_1] = {BLOCK32(q5_1)},
    [FL_Q4_K] = {.name = "q4_k", .dequant = fli_q4k_dequant, .quantize = fli_q4k_quantize,
                 .dot = fli_q4k_dot, .axpy = q4k_axpy, .axpy4 = q4k_axpy4,
                 .qdot_tile = fli_q4k_qtile, .panel = Q4K_PANEL,
                 .tile_exact = Q4K_TILE_EXACT, .group_bytes = fli_q4k_group_bytes,
                 .pack_group = fli_q4k_pack_group, .group = fli_q4k_group,
                 .unpack_row = fli_q4k_unpack_row},
    [FL_Q5_K] = {.name = "q5_k", .dequant = q5k_dequant, .quantize = fli_q5k_quantize,
                 .dot = q5k_dot, .axpy = q5k_axpy, .axpy4 = q5k_axpy4,
                 .qdot_tile = q5k_tile, .group_bytes = fli_q5k_group_bytes,
                 .pack_group = fli_q5k_pack_group, .group = fli_q5k_group},
    [FL_Q6_K] = {.name = "q6_k", .dequant = fli_q6k_dequant, .quantize = fli_q6k_quantize,
                 .dot = q6k_dot, .axpy = q6k_axpy, .axpy4 = q6k_axpy4,
                 .qdot_tile = q6k_tile, .tile_exact = 1, .group_bytes = fli_q6k_group_bytes,
                 .pack_group = fli_q6k_pack_group, .group = fli_q6k_group,
                 .unpack_row = fli_q6k_unpack_row},
    [FL_Q2_K] = {.name = "q2_k", .dequant = q2k_dequant, .quantize = fli_q2k_quantize,
                 .dot = q2k_dot, .axpy = q2k_axpy, .axpy4 = q2k_axpy4,
                 .qdot_tile = q2k_tile, .tile_exact = 1, .group_bytes = q2k_group_bytes,
                 .pack_group = q2k_pack_group, .group = q2k_group},
    [FL_Q3_K] = {.name = "q3_k", .dequant = q3k_dequant, .dot = q3k_dot, .axpy = q3k_axpy,
                 .axpy4 = q3k_axpy4, .qdot_tile = q3k_tile, .group_bytes = q3k_group_bytes,
                 .pack_group = q3k_pack_group, .group = q3k_group},
};

size_t fl_row_bytes(int32_t dtype, int64_t n) {
    if (n < 0 || !fli_dtype_ok(dtype)) return 0;
    const fli_block b = FLI_BLOCKS[dtype];
    return n % b.values ? 0 : (size_t)(n / b.values) * (size_t)b.bytes;
}

/* a known dtype, non-null buffers and n > 0 that fits the dtype's block size */
static int row_args_ok(int32_t dtype, const void *src, const void *dst, int64_t n) {
    return src && dst && n > 0 && fl_row_bytes(dtype, n) != 0;
}

int32_t fl_quantize_row(int32_t dtype, const float *src, void *dst, int64_t n) {
    if (!row_args_ok(dtype, src, dst, n)) return FL_EINVAL;
    if (!fli_type_traits[dtype].quantize) return FL_EUNSUPPORTED;  // q3_k: no quantizer
    fli_type_traits[dtype].quantize(src, (uint8_t *)dst, n);
    return FL_OK;
}

int32_t fl_dequantize_row(int32_t dtype, const void *src, float *dst, int64_t n) {
    if (!row_args_ok(dtype, src, dst, n)) return FL_EINVAL;
    fli_dequant(dtype, (const uint8_t *)src, dst, n);
    return FL_OK;
}

int32_t fl_get_rows(const void *w, int32_t dtype, int64_t rows, int64_t cols,
                    const int32_t *ids, int64_t n_ids, float *out) {
    const size_t rb = fl_row_bytes(dtype, cols);
    if (!w || !ids || !out || rb == 0 || rows <= 0 || n_ids < 0) return FL_EINVAL;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= rows) return FL_EINVAL;
    const uint8_t *base = (const uint8_t *)w;
    for (int64_t i = 0; i < n_ids; i++)
        fli_dequant(dtype, base + (size_t)ids[i] * rb, out + i * cols, cols);
    return FL_OK;
}
