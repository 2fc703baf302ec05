/* vec.c — per-row vector kernels: dequantize, fused dequantize+dot, fused dequantize+axpy;
 * the sparse head's logit bounds.
 *
 * One generic body over a small vector abstraction (vf, VW lanes; vec_simd.h) that is AVX-512,
 * AVX2+FMA+F16C or plain C, chosen at compile time. A 32-value quantized block is loaded unscaled into
 * NV = 32 / VW vectors and scaled once per block.
 */
#include "flashllm.h"
#include "compute_internal.h"
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

float fli_dot(int32_t dtype, const uint8_t *row, const float *x, int64_t n) {
    switch (dtype) {
    case FL_F32: return dot_plain(FL_F32, row, x, n);
    case FL_F16: return dot_plain(FL_F16, row, x, n);
    case FL_Q8_0: return dot_blocks(FL_Q8_0, row, x, n);
    case FL_Q4_1: return dot_blocks(FL_Q4_1, row, x, n);
    case FL_Q4_K: return fli_q4k_dot(row, x, n);
    case FL_Q5_0: return dot_blocks(FL_Q5_0, row, x, n);
    case FL_Q5_1: return dot_blocks(FL_Q5_1, row, x, n);
    case FL_Q2_K:
    case FL_Q3_K:
    case FL_Q5_K:
    case FL_Q6_K: return fli_qk_dot(dtype, row, x, n);
    default: return dot_blocks(FL_Q4_0, row, x, n);
    }
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

void fli_axpy(int32_t dtype, const uint8_t *row, float a, float *y, int64_t n) {
    switch (dtype) {
    case FL_F32: axpy_plain(FL_F32, row, a, y, n); break;
    case FL_F16: axpy_plain(FL_F16, row, a, y, n); break;
    case FL_Q8_0: axpy_blocks(FL_Q8_0, row, a, y, n); break;
    case FL_Q4_1: axpy_blocks(FL_Q4_1, row, a, y, n); break;
    case FL_Q5_0: axpy_blocks(FL_Q5_0, row, a, y, n); break;
    case FL_Q5_1: axpy_blocks(FL_Q5_1, row, a, y, n); break;
    case FL_Q4_K:
    case FL_Q5_K:
    case FL_Q6_K: fli_kq_axpy(dtype, &row, &a, 1, y, n); break;  // kaxpy.c
    case FL_Q2_K:
    case FL_Q3_K: fli_qk_axpy(dtype, row, a, y, n); break;
    default: axpy_blocks(FL_Q4_0, row, a, y, n); break;
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

void fli_dequant(int32_t dtype, const uint8_t *row, float *dst, int64_t n) {
    switch (dtype) {
    case FL_F32: memcpy(dst, row, (size_t)n * sizeof(float)); break;
    case FL_F16: {
        int64_t i = 0;
        for (; i + VW <= n; i += VW) vstore(dst + i, vload_h(row + 2 * i));
        for (; i < n; i++) dst[i] = fl_load_fp16(row + 2 * i);
        break;
    }
    case FL_Q8_0: dequant_blocks(FL_Q8_0, row, dst, n); break;
    case FL_Q4_1: dequant_blocks(FL_Q4_1, row, dst, n); break;
    case FL_Q4_K: fli_q4k_dequant(row, dst, n); break;
    case FL_Q5_0: dequant_blocks(FL_Q5_0, row, dst, n); break;
    case FL_Q5_1: dequant_blocks(FL_Q5_1, row, dst, n); break;
    case FL_Q2_K:
    case FL_Q3_K:
    case FL_Q5_K: fli_qk_dequant(dtype, row, dst, n); break;
    case FL_Q6_K: fli_q6k_dequant(row, dst, n); break;  // kaxpy.c
    default: dequant_blocks(FL_Q4_0, row, dst, n); break;
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

void fli_axpy4(int32_t dtype, const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y,
               int64_t n) {
    switch (dtype) {
    case FL_F32: axpy4_plain(FL_F32, rows, a, y, n); break;
    case FL_F16: axpy4_plain(FL_F16, rows, a, y, n); break;
    case FL_Q8_0: axpy4_blocks(FL_Q8_0, rows, a, y, n); break;
    case FL_Q4_1: axpy4_blocks(FL_Q4_1, rows, a, y, n); break;
    case FL_Q5_0: axpy4_blocks(FL_Q5_0, rows, a, y, n); break;
    case FL_Q5_1: axpy4_blocks(FL_Q5_1, rows, a, y, n); break;
    case FL_Q4_K:
    case FL_Q5_K:
    case FL_Q6_K: fli_kq_axpy(dtype, rows, a, FL_QT, y, n); break;  // kaxpy.c
    case FL_Q2_K:
    case FL_Q3_K:
        for (int r = 0; r < FL_QT; r++) fli_qk_axpy(dtype, rows[r], a[r], y, n);
        break;
    default: axpy4_blocks(FL_Q4_0, rows, a, y, n); break;
    }
}

#define BOUND_ROWS 256 /* rows per step: the sums stay in L1 across the blocks */

int32_t fl_logit_bounds(const float *s, const uint16_t *var, const float *e, int64_t nb,
                        int64_t n, float z, float slack, float *hi, float *lo) {
    if (!s || !var || !e || !hi || !lo || nb < 0 || n < 0) return FL_EINVAL;
    float acc[BOUND_ROWS];
    for (int64_t r0 = 0; r0 < n; r0 += BOUND_ROWS) {
        const int64_t m = n - r0 < BOUND_ROWS ? n - r0 : BOUND_ROWS;
        const int64_t mv = m / VW * VW;
        memset(acc, 0, sizeof acc);
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *v = var + b * n + r0;
            const vf eb = vset1(e[b]);
            for (int64_t i = 0; i < mv; i += VW)
                vstore(acc + i, vfma(eb, vload_h((const uint8_t *)(v + i)), vload(acc + i)));
            for (int64_t i = mv; i < m; i++) acc[i] += e[b] * fl_fp16_to_fp32(v[i]);
        }
        const vf vz = vset1(z), vs = vset1(slack);
        for (int64_t i = 0; i < mv; i += VW) {
            const vf d = vfma(vz, vsqrt(vload(acc + i)), vs), x = vload(s + r0 + i);
            vstore(hi + r0 + i, vadd(x, d));
            vstore(lo + r0 + i, vsub(x, d));
        }
        for (int64_t i = mv; i < m; i++) {
            const float d = z * sqrtf(acc[i]) + slack;
            hi[r0 + i] = s[r0 + i] + d;
            lo[r0 + i] = s[r0 + i] - d;
        }
    }
    return FL_OK;
}
