/* quant.c — row sizes, ggml-compatible quantize / dequantize of rows, embedding lookup.
 *
 * Rounding follows ggml's reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref)
 * bit for bit; q4_1 searches the step of its grid (see fl_quantize_row in flashllm.h). This file relies on the build not contracting x * id + 8.5f into an FMA
 * (-std=c11 implies -ffp-contract=off in GCC), or q4_0 could round differently on ties.
 */
#include <math.h>

#include "flashllm.h"
#include "compute_internal.h"

#define REFITS 4 /* least-squares refits of a q4_1 block that is on no grid */

size_t fl_row_bytes(int32_t dtype, int64_t n) {
    if (n < 0) return 0;
    switch (dtype) {
    case FL_F32: return (size_t)n * 4;
    case FL_F16: return (size_t)n * 2;
    case FL_Q8_0: return n % FL_QK ? 0 : (size_t)(n / FL_QK) * FL_Q8_0_BYTES;
    case FL_Q4_0: return n % FL_QK ? 0 : (size_t)(n / FL_QK) * FL_Q4_0_BYTES;
    case FL_Q4_1: return n % FL_QK ? 0 : (size_t)(n / FL_QK) * FL_Q4_1_BYTES;
    case FL_Q4_K: return n % FL_QK_K ? 0 : (size_t)(n / FL_QK_K) * FL_Q4_K_BYTES;
    default: return 0;
    }
}

/* a known dtype, non-null buffers and n > 0 that fits the dtype's block size */
static int row_args_ok(int32_t dtype, const void *src, const void *dst, int64_t n) {
    return src && dst && n > 0 && fl_row_bytes(dtype, n) != 0;
}

static void store_fp16(uint8_t *p, float f) {
    const uint16_t h = fl_fp32_to_fp16(f);
    memcpy(p, &h, sizeof h);
}

/* one q8_0 block: d = amax / 127, q = roundf(x / d) */
static void quantize_block_q8_0(const float *x, uint8_t *blk) {
    float amax = 0.0f;
    for (int j = 0; j < FL_QK; j++) {
        const float v = fabsf(x[j]);
        if (v > amax) amax = v;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_fp16(blk, d);
    int8_t *q = (int8_t *)(blk + 2);
    for (int j = 0; j < FL_QK; j++) q[j] = (int8_t)roundf(x[j] * id);
}

/* one q4_0 block: d = max / -8 (max = signed value of the largest |x|), q = min(15, x/d + 8.5) */
static void quantize_block_q4_0(const float *x, uint8_t *blk) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < FL_QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_fp16(blk, d);
    for (int j = 0; j < FL_QK / 2; j++) {
        const float x0 = x[j] * id;
        const float x1 = x[j + FL_QK / 2] * id;
        const int8_t i0 = (int8_t)(x0 + 8.5f);
        const int8_t i1 = (int8_t)(x1 + 8.5f);
        const uint8_t q0 = i0 < 15 ? (uint8_t)i0 : 15;
        const uint8_t q1 = i1 < 15 ? (uint8_t)i1 : 15;
        blk[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

/* nibbles q (32) of x on the grid d * q + m (d, m as stored: f16), nearest level in 0..15;
 * returns the squared error */
static float grid_q4_1(const float *x, float d, float m, uint8_t q[FL_QK]) {
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    float err = 0.0f;
    for (int j = 0; j < FL_QK; j++) {
        const float v = nearbyintf((x[j] - m) * id);
        q[j] = (uint8_t)(v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v);
        const float e = x[j] - (d * q[j] + m);
        err += e * e;
    }
    return err;
}

/* the least-squares (d, m) of x on the levels q, both rounded to f16; 0 when q is constant */
static int refit_q4_1(const float *x, const uint8_t q[FL_QK], float *d, float *m) {
    float sq = 0.0f, sqq = 0.0f, sx = 0.0f, sqx = 0.0f;
    for (int j = 0; j < FL_QK; j++) {
        sq += q[j];
        sqq += (float)(q[j] * q[j]);
        sx += x[j];
        sqx += q[j] * x[j];
    }
    const float det = FL_QK * sqq - sq * sq;
    if (det <= 0.0f) return 0;
    const float dd = (FL_QK * sqx - sq * sx) / det;
    if (!(dd > 0.0f)) return 0;
    *d = fl_fp16_to_fp32(fl_fp32_to_fp16(dd));
    *m = fl_fp16_to_fp32(fl_fp32_to_fp16((sx - dd * sq) / FL_QK));
    return 1;
}

/* one q4_1 block: m = min, d = (max - min) / k for the k in 15 .. 1 with the least squared
 * error (the first on ties); stops early at a k whose rms error is within the f16 rounding of m
 * and of 15 steps (the block is on that grid) */
static void quantize_block_q4_1(const float *x, uint8_t *blk) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < FL_QK; j++) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    const float m = fl_fp16_to_fp32(fl_fp32_to_fp16(lo));
    uint8_t q[FL_QK], best_q[FL_QK];
    float best_err = INFINITY, best_d = 0.0f, best_m = m;
    int on_grid = 0;
    for (int k = 15; k >= 1 && !on_grid; k--) {
        const float d = fl_fp16_to_fp32(fl_fp32_to_fp16((hi - lo) / (float)k));
        const float err = grid_q4_1(x, d, m, q);
        if (err < best_err) {
            best_err = err;
            best_d = d;
            memcpy(best_q, q, sizeof q);
        }
        const float tol = (fabsf(m) + 15.0f * d) * 0x1.0p-11f;  // f16 rounding of m, d * 15
        on_grid = err <= FL_QK * tol * tol;
    }
    float d2, m2;
    for (int it = 0; it < REFITS && !on_grid && refit_q4_1(x, best_q, &d2, &m2); it++) {
        const float err = grid_q4_1(x, d2, m2, q);
        if (!(err < best_err)) break;
        best_err = err, best_d = d2, best_m = m2;
        memcpy(best_q, q, sizeof q);
    }
    store_fp16(blk, best_d);
    store_fp16(blk + 2, best_m);
    for (int j = 0; j < FL_QK / 2; j++)
        blk[4 + j] = (uint8_t)(best_q[j] | (best_q[j + FL_QK / 2] << 4));
}

int32_t fl_quantize_row(int32_t dtype, const float *src, void *dst, int64_t n) {
    if (!row_args_ok(dtype, src, dst, n)) return FL_EINVAL;
    if (dtype == FL_Q4_K) return FL_EUNSUPPORTED;  // q4_k rows are copied from Q4_K sources
    uint8_t *out = (uint8_t *)dst;
    switch (dtype) {
    case FL_F32:
        memcpy(out, src, (size_t)n * 4);
        break;
    case FL_F16:
        for (int64_t i = 0; i < n; i++) store_fp16(out + 2 * i, src[i]);
        break;
    case FL_Q8_0:
        for (int64_t b = 0; b < n / FL_QK; b++)
            quantize_block_q8_0(src + b * FL_QK, out + b * FL_Q8_0_BYTES);
        break;
    case FL_Q4_0:
        for (int64_t b = 0; b < n / FL_QK; b++)
            quantize_block_q4_0(src + b * FL_QK, out + b * FL_Q4_0_BYTES);
        break;
    case FL_Q4_1:
        for (int64_t b = 0; b < n / FL_QK; b++)
            quantize_block_q4_1(src + b * FL_QK, out + b * FL_Q4_1_BYTES);
        break;
    }
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
