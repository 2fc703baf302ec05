/* qgemm.c — the int8 GEMM of prefill: FL_PR (16) weight rows, repacked once into a panel, meet
 * every token of a call (fl_matmul and fl_ffn_bundles when T > FL_SMALL_T).
 *
 * AVX-512 VNNI (as llama.cpp's repacked q4_0 GEMMs): the 16 rows sit in the 16 int32 lanes. Per
 * block of 32 values the panel holds 8 vectors, vector k = bytes 4k .. 4k+3 of every row's
 * unsigned weight values (q4_0 nibble = value + 8, q4_1 nibble, q8_0 value + 128 = w ^ 0x80), then
 * the 16 rows' d_w and m_w (q4_1) in f32. A token's block is 8 dwords of int8 activations, each
 * broadcast to all lanes (an embedded-broadcast operand of vpdpbusd), so 8 vpdpbusd give the
 * exact integer block dot of 16 rows at once; the activations' correction (-bias * sum(q), qdot.c)
 * starts the integer sum, then one convert, one scale (d_w * d_x) and one FMA per 16 rows and
 * block (+ one FMA m_w * d_x * sum(q) for q4_1): ~1.5 vector ops per 64 multiply-adds, against
 * ~5 for the 4x4 tiles of qdot.c, whose lanes hold values of one row.
 *
 * q4_k packs its sub-blocks into the same records (d_w = d * sc_j, m_w = -dmin * m_j, f32), so
 * its GEMM is q4_1's; q5_0 / q5_1 are q4_0 / q4_1 with bit 4 of each value from qh (q5_0's
 * offset 16 paid by the activations' correction). q5_k / q6_k have no panels (fli_has_panel).
 *
 * Other builds: the panel is the 16 raw rows and their fli_wx_expand copies, and the GEMM runs the
 * FL_QT x FL_QT tiles of qdot.c (same results up to f32 summation order).
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "kblock.h"
#include "qdot.h"
#include "qgemm.h"
#include "traits.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PANEL_VNNI 1
#define REC (8 * 64 + 2 * 64) /* bytes of one block of a panel: 8 byte vectors, d_w, m_w */
#define NT 8                  /* tokens per register block */
#endif

size_t fli_panel_bytes(int64_t n) {
    return (size_t)FL_PR * ((size_t)(n / FL_QK) * FL_Q8_0_BYTES + (size_t)fli_xq_bytes(n));
}

#ifdef PANEL_VNNI
/* 4 rows' 16 bytes at off of block b -> one zmm, row k in 128-bit lane k */
static inline __m512i rows4(const uint8_t *const *w, size_t off) {
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w[0] + off)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(w[1] + off)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(w[2] + off)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(w[3] + off)), 3);
}

/* dst[k] (4 vectors) = dword k of every row: src[g] holds rows 4g..4g+3 as [row][dword] */
static inline void transpose16x4(const __m512i src[4], __m512i *dst) {
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    __m512i s[4];  // [dword][row] within each group
    for (int g = 0; g < 4; g++) s[g] = _mm512_permutexvar_epi32(idx, src[g]);
    const __m512i ab_lo = _mm512_shuffle_i32x4(s[0], s[1], 0x44);  // [s0 d0-1 | s1 d0-1]
    const __m512i ab_hi = _mm512_shuffle_i32x4(s[0], s[1], 0xEE);  // [s0 d2-3 | s1 d2-3]
    const __m512i cd_lo = _mm512_shuffle_i32x4(s[2], s[3], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(s[2], s[3], 0xEE);
    dst[0] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    dst[1] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    dst[2] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    dst[3] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
}

/* q5_0 / q5_1: bit 4 of the values of 4 rows (row k in 128-bit lane k) from their qh, values
 * 0..15 (hi = 0) or 16..31 (hi = 1) of block b */
static inline __m512i bit4_rows4(int32_t dtype, const uint8_t *const *w, size_t bb, int64_t b,
                                 int hi) {
    uint64_t m = 0;
    for (int k = 0; k < 4; k++)
        m |= (uint64_t)((fli_q5_qh(dtype, w[k] + (size_t)b * bb) >> (16 * hi)) & 0xFFFF) << (16 * k);
    return _mm512_maskz_mov_epi8((__mmask64)m, _mm512_set1_epi8(0x10));
}

/* the 8 byte vectors of block b of 16 rows: quantized values 4k .. 4k+3 of every row in vector k */
static void pack_block(int32_t dtype, const uint8_t *const w[FL_PR], size_t bb, int64_t b,
                       uint8_t *rec) {
    __m512i v[4], q[8];
    const __m512i lo = _mm512_set1_epi8(0x0F);
    const int q5 = dtype == FL_Q5_0 || dtype == FL_Q5_1;
    const size_t qs = dtype == FL_Q4_1 ? 4 : dtype == FL_Q5_0 ? 6 : dtype == FL_Q5_1 ? 8 : 2;
    for (int half = 0; half < (dtype == FL_Q8_0 ? 2 : 1); half++) {
        const size_t off = (size_t)b * bb + qs + 16 * (size_t)half;
        for (int g = 0; g < 4; g++) v[g] = rows4(w + 4 * g, off);
        if (dtype == FL_Q8_0) {
            for (int g = 0; g < 4; g++) v[g] = _mm512_xor_si512(v[g], _mm512_set1_epi8((char)0x80));
            transpose16x4(v, q + 4 * half);
        } else {
            __m512i h[4];
            for (int g = 0; g < 4; g++) {
                h[g] = _mm512_and_si512(_mm512_srli_epi16(v[g], 4), lo);
                v[g] = _mm512_and_si512(v[g], lo);
                if (q5) {
                    v[g] = _mm512_or_si512(v[g], bit4_rows4(dtype, w + 4 * g, bb, b, 0));
                    h[g] = _mm512_or_si512(h[g], bit4_rows4(dtype, w + 4 * g, bb, b, 1));
                }
            }
            transpose16x4(v, q);
            transpose16x4(h, q + 4);
        }
    }
    for (int k = 0; k < 8; k++) _mm512_storeu_si512(rec + 64 * k, q[k]);
    uint16_t dm[2][FL_PR];  // (d_w | m_w, row) f16
    const int has_m = dtype == FL_Q4_1 || dtype == FL_Q5_1;
    for (int r = 0; r < FL_PR; r++) {
        memcpy(&dm[0][r], w[r] + (size_t)b * bb, 2);
        memcpy(&dm[1][r], w[r] + (size_t)b * bb + (has_m ? 2 : 0), 2);
    }
    _mm512_storeu_ps(rec + 512, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm[0])));
    _mm512_storeu_ps(rec + 576, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm[1])));
}

/* the same for q4_k sub-block b: its 32 nibble bytes give values 0..15 (bytes 0..15) and
 * 16..31 (bytes 16..31), low nibbles for even b, high for odd; d_w, m_w (FL_PR rows) in f32 */
static void pack_block_q4k(const uint8_t *const w[FL_PR], int64_t b, const float *dw,
                           const float *mw, uint8_t *rec) {
    __m512i v[4], h[4], q[8];
    const __m512i lo = _mm512_set1_epi8(0x0F);
    const __m128i shift = _mm_cvtsi32_si128(4 * (int)(b & 1));
    const size_t off = (size_t)(b / 8) * FL_Q4_K_BYTES + 16 + 32 * (size_t)(b % 8 / 2);  // qs
    for (int g = 0; g < 4; g++) {
        v[g] = _mm512_and_si512(_mm512_srl_epi16(rows4(w + 4 * g, off), shift), lo);
        h[g] = _mm512_and_si512(_mm512_srl_epi16(rows4(w + 4 * g, off + 16), shift), lo);
    }
    transpose16x4(v, q);
    transpose16x4(h, q + 4);
    for (int k = 0; k < 8; k++) _mm512_storeu_si512(rec + 64 * k, q[k]);
    memcpy(rec + 512, dw, FL_PR * sizeof(float));
    memcpy(rec + 576, mw, FL_PR * sizeof(float));
}

/* every q4_k block of a panel: each row's scales unpacked once per superblock */
static void pack_q4k(const uint8_t *const w[FL_PR], int64_t n, uint8_t *buf) {
    float sc[FL_PR][8], mn[FL_PR][8], dw[8][FL_PR], mw[8][FL_PR];  // (row, j), (j, row)
    for (int64_t s = 0; s < n / FL_QK_K; s++) {
        for (int r = 0; r < FL_PR; r++) fli_q4k_scales(w[r] + s * FL_Q4_K_BYTES, sc[r], mn[r]);
        for (int j = 0; j < 8; j++)
            for (int r = 0; r < FL_PR; r++) dw[j][r] = sc[r][j], mw[j][r] = mn[r][j];
        for (int j = 0; j < 8; j++)
            pack_block_q4k(w, 8 * s + j, dw[j], mw[j], buf + (size_t)(8 * s + j) * REC);
    }
}

void fli_panel_pack(int32_t dtype, const uint8_t *const w[FL_PR], int64_t n, uint8_t *buf) {
    const size_t bb = fli_block_bytes(dtype);
    if (dtype == FL_Q4_K) {
        pack_q4k(w, n, buf);
        return;
    }
    for (int64_t b = 0; b < n / FL_QK; b++) pack_block(dtype, w, bb, b, buf + (size_t)b * REC);
}

/* out[r * ld + t] = row r . token t for tokens t0 .. t0+nt-1 (nt <= NT, a constant once inlined) */
static inline __attribute__((always_inline)) void gemm_nt(int32_t dtype, const uint8_t *panel,
                                                          const uint8_t *x, size_t xb, int64_t t0,
                                                          int nt, int64_t n, float *out,
                                                          int64_t ld) {
    const int64_t nb = n / FL_QK;
    const uint8_t *xt[NT];
    const float *side[NT];  // (3, nb, FL_XQ_LANES): scale, corr (int32), msum
    for (int t = 0; t < nt; t++) {
        xt[t] = x + (size_t)(t0 + t) * xb;
        side[t] = (const float *)(xt[t] + n);
    }
    __m512 acc[NT];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = panel + (size_t)b * REC;
        __m512i w[8];
        for (int k = 0; k < 8; k++) w[k] = _mm512_loadu_si512(rec + 64 * k);
        const __m512 dw = _mm512_loadu_ps(rec + 512);
        const size_t s = (size_t)b * FL_XQ_LANES, plane = (size_t)nb * FL_XQ_LANES;
        for (int t = 0; t < nt; t++) {
            int32_t corr, xq[8];
            memcpy(&corr, side[t] + plane + s, 4);
            memcpy(xq, xt[t] + b * FL_QK, 32);
            __m512i a = dtype == FL_Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(corr);
            for (int k = 0; k < 8; k++) a = _mm512_dpbusd_epi32(a, w[k], _mm512_set1_epi32(xq[k]));
            const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(side[t][s]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sc, acc[t]);
            if (dtype == FL_Q4_1)
                acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(rec + 576),
                                         _mm512_set1_ps(side[t][2 * plane + s]), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        float lane[FL_PR];
        _mm512_storeu_ps(lane, acc[t]);
        for (int r = 0; r < FL_PR; r++) out[r * ld + t0 + t] = lane[r];
    }
}

/* every token group of one dtype (the dtype a constant once inlined) */
static inline __attribute__((always_inline)) void gemm_dt(int32_t dtype, const uint8_t *panel,
                                                          const uint8_t *x, size_t xb, int64_t T,
                                                          int64_t n, float *out, int64_t ld) {
    int64_t t = 0;
    for (; t + NT <= T; t += NT) gemm_nt(dtype, panel, x, xb, t, NT, n, out, ld);
    if (T - t >= 4) {
        gemm_nt(dtype, panel, x, xb, t, 4, n, out, ld);
        t += 4;
    }
    for (; t < T; t++) gemm_nt(dtype, panel, x, xb, t, 1, n, out, ld);
}

void fli_panel_gemm(int32_t dtype, const uint8_t *panel, const uint8_t *x, size_t xb, int64_t T,
                    int64_t n, float *out, int64_t ld) {
    if (dtype == FL_Q4_1 || dtype == FL_Q5_1 || dtype == FL_Q4_K)  // d_w * u + m_w
        gemm_dt(FL_Q4_1, panel, x, xb, T, n, out, ld);
    else if (dtype == FL_Q8_0) gemm_dt(FL_Q8_0, panel, x, xb, T, n, out, ld);
    else gemm_dt(FL_Q4_0, panel, x, xb, T, n, out, ld);  // q4_0, q5_0: x's correction pays the offset
}
#else
/* panel: (FL_PR, raw row) then (FL_PR, xb) the rows expanded by fli_wx_expand */
void fli_panel_pack(int32_t dtype, const uint8_t *const w[FL_PR], int64_t n, uint8_t *buf) {
    const size_t rb = fl_row_bytes(dtype, n), xb = (size_t)fli_xq_bytes(n);
    for (int r = 0; r < FL_PR; r++) {
        memcpy(buf + r * rb, w[r], rb);
        fli_wx_expand(dtype, w[r], n, buf + FL_PR * rb + r * xb);
    }
}

void fli_panel_gemm(int32_t dtype, const uint8_t *panel, const uint8_t *x, size_t xb, int64_t T,
                    int64_t n, float *out, int64_t ld) {
    const size_t rb = fl_row_bytes(dtype, n);
    float o[FL_QT][FL_QT];
    for (int r0 = 0; r0 < FL_PR; r0 += FL_QT) {
        const uint8_t *w[FL_QT], *ex[FL_QT], *xt[FL_QT];
        for (int k = 0; k < FL_QT; k++) {
            w[k] = panel + (r0 + k) * rb;
            ex[k] = panel + FL_PR * rb + (r0 + k) * xb;
        }
        for (int64_t t = 0; t < T; t += FL_QT) {
            const int64_t nt = T - t < FL_QT ? T - t : FL_QT;
            for (int64_t j = 0; j < FL_QT; j++) xt[j] = x + (size_t)(t + (j < nt ? j : 0)) * xb;
            fli_qdot_tile(dtype, w, ex, xt, (int32_t)nt, n, o);
            for (int k = 0; k < FL_QT; k++)
                for (int64_t j = 0; j < nt; j++) out[(r0 + k) * ld + t + j] = o[k][j];
        }
    }
}
#endif
