/* vec.c — per-row vector kernels: dequantize, fused dequantize+dot, fused dequantize+axpy.
 *
 * One generic body over a small vector abstraction (vf, VW lanes) that is AVX-512, AVX2+FMA+F16C
 * or plain C, chosen at compile time. A 32-value quantized block is loaded unscaled into
 * NV = 32 / VW vectors and scaled once per block.
 */
#include "flashllm.h"
#include "compute_internal.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vload_h(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline void load_q8(const uint8_t *qs, vf v[2]) {
    v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
}
/* nibble -> float by table lookup: vpermps reads only the low 4 bits of each index lane */
static inline void load_q4(const uint8_t *qs, vf v[2]) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    v[0] = _mm512_permutexvar_ps(raw, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
}
static inline void load_q4u(const uint8_t *qs, vf v[2]) {  // unsigned nibbles 0..15, as above
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    v[0] = _mm512_permutexvar_ps(raw, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
}
/* q5 values: nibble - off (off 16 for q5_0, 0 for q5_1), + 16 where bit j of qh is set */
static inline void load_q5(const uint8_t *qs, uint32_t qh, float off, vf v[2]) {
    load_q4u(qs, v);
    const __m512 sixteen = _mm512_set1_ps(16.0f), o = _mm512_set1_ps(off);
    v[0] = _mm512_mask_add_ps(_mm512_sub_ps(v[0], o), (__mmask16)(qh & 0xFFFF),
                              _mm512_sub_ps(v[0], o), sixteen);
    v[1] = _mm512_mask_add_ps(_mm512_sub_ps(v[1], o), (__mmask16)(qh >> 16),
                              _mm512_sub_ps(v[1], o), sixteen);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vload_h(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) { return fli_hsum256(a); }
static inline vf cvt8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
static inline void load_q8(const uint8_t *qs, vf v[4]) {
    const __m128i a = _mm_loadu_si128((const __m128i *)qs);
    const __m128i b = _mm_loadu_si128((const __m128i *)(qs + 16));
    v[0] = cvt8(a);
    v[1] = cvt8(_mm_srli_si128(a, 8));
    v[2] = cvt8(b);
    v[3] = cvt8(_mm_srli_si128(b, 8));
}
static inline void load_q4(const uint8_t *qs, vf v[4]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, m), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m), eight);
    v[0] = cvt8(lo);
    v[1] = cvt8(_mm_srli_si128(lo, 8));
    v[2] = cvt8(hi);
    v[3] = cvt8(_mm_srli_si128(hi, 8));
}
static inline void load_q4u(const uint8_t *qs, vf v[4]) {  // unsigned nibbles 0..15
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    v[0] = cvt8(lo);
    v[1] = cvt8(_mm_srli_si128(lo, 8));
    v[2] = cvt8(hi);
    v[3] = cvt8(_mm_srli_si128(hi, 8));
}
static inline void load_q5(const uint8_t *qs, uint32_t qh, float off, vf v[4]) {
    load_q4u(qs, v);
    for (int k = 0; k < 4; k++) {  // lane i of v[k] is value 8k + i
        const __m256i bits = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (8 * k))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), _mm256_set1_epi32(1));
        v[k] = _mm256_add_ps(_mm256_sub_ps(v[k], _mm256_set1_ps(off)),
                             _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(16.0f)));
    }
}
#else
typedef float vf;
#define VW 1
static inline vf vzero(void) { return 0.0f; }
static inline vf vset1(float a) { return a; }
static inline vf vload(const float *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}
static inline void vstore(float *p, vf v) { *p = v; }
static inline vf vload_h(const uint8_t *p) { return fl_load_fp16(p); }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float vsum(vf a) { return a; }
static inline void load_q8(const uint8_t *qs, vf v[32]) {
    for (int j = 0; j < 32; j++) v[j] = (float)(int8_t)qs[j];
}
static inline void load_q4(const uint8_t *qs, vf v[32]) {
    for (int j = 0; j < 16; j++) {
        v[j] = (float)((qs[j] & 0x0F) - 8);
        v[j + 16] = (float)((qs[j] >> 4) - 8);
    }
}
static inline void load_q4u(const uint8_t *qs, vf v[32]) {
    for (int j = 0; j < 16; j++) {
        v[j] = (float)(qs[j] & 0x0F);
        v[j + 16] = (float)(qs[j] >> 4);
    }
}
static inline void load_q5(const uint8_t *qs, uint32_t qh, float off, vf v[32]) {
    for (int j = 0; j < 16; j++) {
        v[j] = (float)((qs[j] & 0x0F) | ((qh >> j) & 1) << 4) - off;
        v[j + 16] = (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off;
    }
}
#endif

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
    case FL_Q4_K: fli_q4k_axpy(row, a, y, n); break;
    case FL_Q5_0: axpy_blocks(FL_Q5_0, row, a, y, n); break;
    case FL_Q5_1: axpy_blocks(FL_Q5_1, row, a, y, n); break;
    case FL_Q5_K:
    case FL_Q6_K: fli_qk_axpy(dtype, row, a, y, n); break;
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
    case FL_Q5_K:
    case FL_Q6_K: fli_qk_dequant(dtype, row, dst, n); break;
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
    case FL_Q6_K:
        for (int r = 0; r < FL_QT; r++) fli_axpy(dtype, rows[r], a[r], y, n);
        break;
    default: axpy4_blocks(FL_Q4_0, rows, a, y, n); break;
    }
}

/* y (nt, d) columns j .. j+NC*VW-1 += h^T @ down for nt <= DOWN_T tokens: each loaded down
 * vector feeds nt FMAs and each y vector is loaded and stored once */
#define DOWN_T 6
static inline __attribute__((always_inline)) void down_block(const float *h, int64_t ldh,
                                                             const float *down, int64_t K,
                                                             int64_t d, float *y, int64_t j,
                                                             int64_t nt, int NC) {
    vf acc[DOWN_T][4];
    for (int64_t u = 0; u < nt; u++)
        for (int c = 0; c < NC; c++) acc[u][c] = vload(y + u * d + j + c * VW);
    for (int64_t k = 0; k < K; k++) {
        vf dv[4];
        for (int c = 0; c < NC; c++) dv[c] = vload(down + k * d + j + c * VW);
        for (int64_t u = 0; u < nt; u++) {
            const vf hb = vset1(h[k * ldh + u]);
            for (int c = 0; c < NC; c++) acc[u][c] = vfma(hb, dv[c], acc[u][c]);
        }
    }
    for (int64_t u = 0; u < nt; u++)
        for (int c = 0; c < NC; c++) vstore(y + u * d + j + c * VW, acc[u][c]);
}

/* columns in blocks of 4 vectors, then of 1; full token groups with constant bounds */
static inline __attribute__((always_inline)) void down_tokens(const float *h, int64_t ldh,
                                                              const float *down, int64_t K,
                                                              int64_t d, float *y, int64_t nt) {
    int64_t j = 0;
    for (; j + 4 * VW <= d; j += 4 * VW) down_block(h, ldh, down, K, d, y, j, nt, 4);
    for (; j + VW <= d; j += VW) down_block(h, ldh, down, K, d, y, j, nt, 1);
}

void fli_down_f32(const float *h, int64_t ldh, const float *down, int64_t K, int64_t d, float *y,
                  int64_t T) {
    for (int64_t t = 0; t < T; t += DOWN_T) {
        const int64_t nt = T - t < DOWN_T ? T - t : DOWN_T;
        if (nt == DOWN_T) down_tokens(h + t, ldh, down, K, d, y + t * d, DOWN_T);
        else down_tokens(h + t, ldh, down, K, d, y + t * d, nt);
    }
}

void fli_dot4x4_f32(const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t n,
                    float out[4][4]) {
    vf acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < 4; t++) acc[r][t] = vzero();
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf w0 = vload(w + i), w1 = vload(w + ldw + i);
        const vf w2 = vload(w + 2 * ldw + i), w3 = vload(w + 3 * ldw + i);
        for (int t = 0; t < 4; t++) {
            const vf xv = vload(x + t * ldx + i);
            acc[0][t] = vfma(w0, xv, acc[0][t]);
            acc[1][t] = vfma(w1, xv, acc[1][t]);
            acc[2][t] = vfma(w2, xv, acc[2][t]);
            acc[3][t] = vfma(w3, xv, acc[3][t]);
        }
    }
    for (int r = 0; r < 4; r++) {
        for (int t = 0; t < 4; t++) {
            float s = vsum(acc[r][t]);
            for (int64_t j = i; j < n; j++) s += w[r * ldw + j] * x[t * ldx + j];
            out[r][t] = s;
        }
    }
}
