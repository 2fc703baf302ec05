/* quant.c — rows of f32, f16 and the 32-value block dtypes quantized, ggml-compatible (quant.h).
 *
 * Rounding follows ggml's reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref,
 * quantize_row_q5_0_ref, quantize_row_q5_1_ref) bit for bit; q4_1 searches the step of its grid (see fl_quantize_row in flashllm.h). This file relies on the build not contracting x * id + 8.5f into an FMA
 * (-std=c11 implies -ffp-contract=off in GCC), or q4_0 could round differently on ties.
 */
#include <math.h>

#include "flashllm.h"
#include "base.h"
#include "dtype.h"
#include "quant.h"

#define REFITS 4 /* least-squares refits of a q4_1 block that is on no grid */

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

/* the signed value of a block's largest |x| (the first of equal ones), as ggml's q4_0 / q5_0 */
static float signed_max(const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < FL_QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

/* one q4_0 block: d = max / -8 (max = signed value of the largest |x|), q = min(15, x/d + 8.5) */
static void quantize_block_q4_0(const float *x, uint8_t *blk) {
    const float d = signed_max(x) / -8.0f;
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

/* the 5-bit values q (32) of a q5_0 / q5_1 block packed into blk's qh and nibbles */
static void pack_q5(const uint8_t q[FL_QK], uint8_t *qh_at, uint8_t *qs) {
    uint32_t qh = 0;
    for (int j = 0; j < FL_QK; j++) qh |= (uint32_t)(q[j] >> 4) << j;
    memcpy(qh_at, &qh, sizeof qh);
    for (int j = 0; j < FL_QK / 2; j++)
        qs[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + FL_QK / 2] & 0x0F) << 4));
}

/* one q5_0 block, as ggml's quantize_row_q5_0_ref: d = max / -16 (max = signed value of the
 * largest |x|), q = min(31, trunc(x / d + 16.5)) */
static void quantize_block_q5_0(const float *x, uint8_t *blk) {
    const float d = signed_max(x) / -16.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[FL_QK];
    for (int j = 0; j < FL_QK; j++) {
        const int8_t i = (int8_t)(x[j] * id + 16.5f);
        q[j] = i < 31 ? (uint8_t)i : 31;
    }
    store_fp16(blk, d);
    pack_q5(q, blk + 2, blk + 6);
}

/* one q5_1 block, as ggml's quantize_row_q5_1_ref: d = (max - min) / 31, m = min,
 * q = min(31, trunc((x - min) / d + 0.5)) */
static void quantize_block_q5_1(const float *x, uint8_t *blk) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < FL_QK; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    const float d = (hi - lo) / 31.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[FL_QK];
    for (int j = 0; j < FL_QK; j++) {
        const uint8_t i = (uint8_t)((x[j] - lo) * id + 0.5f);
        q[j] = i < 31 ? i : 31;
    }
    store_fp16(blk, d);
    store_fp16(blk + 2, lo);
    pack_q5(q, blk + 4, blk + 8);
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

/* out = src (n) quantized one 32-value block at a time by quantize_block, bb bytes a block */
static void quantize_blocks(void (*quantize_block)(const float *, uint8_t *), size_t bb,
                            const float *src, uint8_t *out, int64_t n) {
    for (int64_t b = 0; b < n / FL_QK; b++) quantize_block(src + b * FL_QK, out + b * bb);
}

void fli_f32_quantize(const float *src, uint8_t *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * 4);
}
void fli_f16_quantize(const float *src, uint8_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) store_fp16(dst + 2 * i, src[i]);
}
void fli_q8_0_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_blocks(quantize_block_q8_0, FL_Q8_0_BYTES, src, dst, n);
}
void fli_q4_0_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_blocks(quantize_block_q4_0, FL_Q4_0_BYTES, src, dst, n);
}
void fli_q4_1_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_blocks(quantize_block_q4_1, FL_Q4_1_BYTES, src, dst, n);
}
void fli_q5_0_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_blocks(quantize_block_q5_0, FL_Q5_0_BYTES, src, dst, n);
}
void fli_q5_1_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_blocks(quantize_block_q5_1, FL_Q5_1_BYTES, src, dst, n);
}
