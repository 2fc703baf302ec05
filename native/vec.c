/* vec.c — per-row vector kernels of f32, f16 and the 32-value block dtypes (vec.h): dequantize,
 * fused dequantize+dot, fused dequantize+axpy, 4 rows' axpy. The traits table (traits.c) holds
 * them by dtype.
 *
 * One generic body over a small vector abstraction (vf, VW lanes; vec_simd.h) that is AVX-512,
 * AVX2+FMA+F16C or plain C, chosen at compile time. A 32-value quantized block is loaded unscaled into
 * NV = 32 / VW vectors and scaled once per block.
 */
#include "flashllm.h"
#include "dtype.h"
#include "vec.h"
#include "vec_simd.h"

#define NV (FL_QK / VW) /* vectors per quantized block */

/* q4_1 and q5_1: a block is d * v + m */
#define HAS_MIN(dt) ((dt) == FL_Q4_1 || (dt) == FL_Q5_1)

/* unscaled values of one block of a quantized dtype and its scale; *m its offset (q4_1, q5_1:
 * the block is d * v + m; 0 for the others). Exact small integers, so d * v rounds as ggml's
 * and gguf-py's dequantization does. */
static inline __attribute__((always_inline)) float load_block(int32_t dtype, const uint8_t *blk,
                                                              vf v[NV], float *m) {
    *m = HAS_MIN(dtype) ? fl_load_fp16(blk + 2) : 0.0f;
    if (dtype == FL_Q8_0) load_q8(blk + 2, v);
    else if (dtype == FL_Q4_1) load_q4u(blk + 4, v);
    else if (dtype == FL_Q5_0) load_q5(blk + 6, fli_q5_qh(dtype, blk), 16.0f, v);
    else if (dtype == FL_Q5_1) load_q5(blk + 8, fli_q5_qh(dtype, blk), 0.0f, v);
    else load_q4(blk + 2, v);
    return fl_load_fp16(blk);
}

static inline __attribute__((always_inline)) size_t block_bytes(int32_t dtype) {
    return fli_block_bytes(dtype);
}

/* value i of a f32 (dtype 0) or f16 (dtype 1) row */
static inline float scalar_at(int32_t dtype, const uint8_t *row, int64_t i) {
    if (dtype == FL_F16) return fl_load_fp16(row + 2 * i);
    float f;
    memcpy(&f, row + 4 * i, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) vf vload_dt(int32_t dtype, const uint8_t *row,
                                                         int64_t i) {
    return dtype == FL_F16 ? vload_h(row + 2 * i) : vload((const float *)(row + 4 * i));
}

static inline __attribute__((always_inline)) float dot_plain(int32_t dtype, const uint8_t *row,
                                                             const float *x, int64_t n) {
    vf a0 = vzero(), a1 = vzero();
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        a0 = vfma(vload_dt(dtype, row, i), vload(x + i), a0);
        a1 = vfma(vload_dt(dtype, row, i + VW), vload(x + i + VW), a1);
    }
    float s = vsum(vadd(a0, a1));
    for (; i < n; i++) s += scalar_at(dtype, row, i) * x[i];
    return s;
}

static inline __attribute__((always_inline)) float dot_blocks(int32_t dtype, const uint8_t *row,
                                                              const float *x, int64_t n) {
    vf acc = vzero(), macc = vzero(), v[NV];  // macc: q4_1's m * sum(x) terms
    const size_t bb = block_bytes(dtype);
    for (int64_t b = 0; b < n / FL_QK; b++, row += bb, x += FL_QK) {
        float m;
        const float d = load_block(dtype, row, v, &m);
        vf t = vmul(v[0], vload(x));
        for (int k = 1; k < NV; k++) t = vfma(v[k], vload(x + k * VW), t);
        acc = vfma(vset1(d), t, acc);
        if (HAS_MIN(dtype)) {
            vf sx = vload(x);
            for (int k = 1; k < NV; k++) sx = vadd(sx, vload(x + k * VW));
            macc = vfma(vset1(m), sx, macc);
        }
    }
    return vsum(vadd(acc, macc));
}


static inline __attribute__((always_inline)) void axpy_plain(int32_t dtype, const uint8_t *row,
                                                             float a, float *y, int64_t n) {
    const vf va = vset1(a);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vfma(va, vload_dt(dtype, row, i), vload(y + i)));
    for (; i < n; i++) y[i] += a * scalar_at(dtype, row, i);
}

static inline __attribute__((always_inline)) void axpy_blocks(int32_t dtype, const uint8_t *row,
                                                              float a, float *y, int64_t n) {
    vf v[NV];
    const size_t bb = block_bytes(dtype);
    for (int64_t b = 0; b < n / FL_QK; b++, row += bb, y += FL_QK) {
        float m;
        const vf ad = vset1(a * load_block(dtype, row, v, &m)), am = vset1(a * m);
        for (int k = 0; k < NV; k++) {
            const vf yk = HAS_MIN(dtype) ? vadd(vload(y + k * VW), am) : vload(y + k * VW);
            vstore(y + k * VW, vfma(ad, v[k], yk));
        }
    }
}


static inline __attribute__((always_inline)) void dequant_blocks(int32_t dtype,
                                                                 const uint8_t *row, float *dst,
                                                                 int64_t n) {
    vf v[NV];
    const size_t bb = block_bytes(dtype);
    for (int64_t b = 0; b < n / FL_QK; b++, row += bb, dst += FL_QK) {
        float m;
        const vf d = vset1(load_block(dtype, row, v, &m)), vm = vset1(m);
        for (int k = 0; k < NV; k++)
            vstore(dst + k * VW, HAS_MIN(dtype) ? vadd(vmul(d, v[k]), vm) : vmul(d, v[k]));
    }
}


float fli_dot_f32(const float *a, const float *b, int64_t n) {
    return dot_plain(FL_F32, (const uint8_t *)a, b, n);
}

void fli_axpy_f32(float a, const float *x, float *y, int64_t n) {
    axpy_plain(FL_F32, (const uint8_t *)x, a, y, n);
}

static inline __attribute__((always_inline)) void axpy4_plain(int32_t dtype,
                                                              const uint8_t *const rows[FL_QT],
                                                              const float a[FL_QT], float *y,
                                                              int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf acc = vload(y + i);
        for (int r = 0; r < FL_QT; r++) acc = vfma(vset1(a[r]), vload_dt(dtype, rows[r], i), acc);
        vstore(y + i, acc);
    }
    for (; i < n; i++)
        for (int r = 0; r < FL_QT; r++) y[i] += a[r] * scalar_at(dtype, rows[r], i);
}

static inline __attribute__((always_inline)) void axpy4_blocks(int32_t dtype,
                                                               const uint8_t *const rows[FL_QT],
                                                               const float a[FL_QT], float *y,
                                                               int64_t n) {
    const size_t bb = block_bytes(dtype);
    vf v[NV];
    for (int64_t b = 0; b < n / FL_QK; b++, y += FL_QK) {
        vf acc[NV];
        for (int k = 0; k < NV; k++) acc[k] = vload(y + k * VW);
        float am = 0.0f;  // q4_1: sum over r of a[r] * m_r, added once per value
        for (int r = 0; r < FL_QT; r++) {
            float m;
            const vf ad = vset1(a[r] * load_block(dtype, rows[r] + b * bb, v, &m));
            am += a[r] * m;
            for (int k = 0; k < NV; k++) acc[k] = vfma(ad, v[k], acc[k]);
        }
        for (int k = 0; HAS_MIN(dtype) && k < NV; k++) acc[k] = vadd(acc[k], vset1(am));
        for (int k = 0; k < NV; k++) vstore(y + k * VW, acc[k]);
    }
}

static inline __attribute__((always_inline)) void dequant_f16(const uint8_t *row, float *dst,
                                                              int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(dst + i, vload_h(row + 2 * i));
    for (; i < n; i++) dst[i] = fl_load_fp16(row + 2 * i);
}

/* the kernels of each dtype (vec.h), the dtype a constant in each */
void fli_f32_dequant(const uint8_t *row, float *dst, int64_t n) {
    memcpy(dst, row, (size_t)n * sizeof(float));
}
void fli_f16_dequant(const uint8_t *row, float *dst, int64_t n) { dequant_f16(row, dst, n); }
void fli_q8_0_dequant(const uint8_t *row, float *dst, int64_t n) {
    dequant_blocks(FL_Q8_0, row, dst, n);
}
void fli_q4_0_dequant(const uint8_t *row, float *dst, int64_t n) {
    dequant_blocks(FL_Q4_0, row, dst, n);
}
void fli_q4_1_dequant(const uint8_t *row, float *dst, int64_t n) {
    dequant_blocks(FL_Q4_1, row, dst, n);
}
void fli_q5_0_dequant(const uint8_t *row, float *dst, int64_t n) {
    dequant_blocks(FL_Q5_0, row, dst, n);
}
void fli_q5_1_dequant(const uint8_t *row, float *dst, int64_t n) {
    dequant_blocks(FL_Q5_1, row, dst, n);
}
float fli_f32_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_plain(FL_F32, row, x, n);
}
void fli_f32_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_plain(FL_F32, row, a, y, n);
}
void fli_f32_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_plain(FL_F32, rows, a, y, n);
}
float fli_f16_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_plain(FL_F16, row, x, n);
}
void fli_f16_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_plain(FL_F16, row, a, y, n);
}
void fli_f16_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_plain(FL_F16, rows, a, y, n);
}
float fli_q8_0_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_blocks(FL_Q8_0, row, x, n);
}
void fli_q8_0_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_blocks(FL_Q8_0, row, a, y, n);
}
void fli_q8_0_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_blocks(FL_Q8_0, rows, a, y, n);
}
float fli_q4_0_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_blocks(FL_Q4_0, row, x, n);
}
void fli_q4_0_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_blocks(FL_Q4_0, row, a, y, n);
}
void fli_q4_0_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_blocks(FL_Q4_0, rows, a, y, n);
}
float fli_q4_1_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_blocks(FL_Q4_1, row, x, n);
}
void fli_q4_1_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_blocks(FL_Q4_1, row, a, y, n);
}
void fli_q4_1_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_blocks(FL_Q4_1, rows, a, y, n);
}
float fli_q5_0_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_blocks(FL_Q5_0, row, x, n);
}
void fli_q5_0_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_blocks(FL_Q5_0, row, a, y, n);
}
void fli_q5_0_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_blocks(FL_Q5_0, rows, a, y, n);
}
float fli_q5_1_dot(const uint8_t *row, const float *x, int64_t n) {
    return dot_blocks(FL_Q5_1, row, x, n);
}
void fli_q5_1_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    axpy_blocks(FL_Q5_1, row, a, y, n);
}
void fli_q5_1_axpy4(const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y, int64_t n) {
    axpy4_blocks(FL_Q5_1, rows, a, y, n);
}
