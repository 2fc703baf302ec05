/* compute_internal.h — internal helpers of the compute kernel (not part of the public API, not seen by cffi).
 *
 * fp16 <-> fp32 conversion (F16C when the build has it, otherwise exact bit manipulation with
 * round-to-nearest-even, as in ggml) and the per-row vector kernels of vec.c, which dispatch on
 * dtype and use AVX-512 / AVX2 / portable C chosen at compile time. The inline helpers that read
 * a k-quant superblock's scales and values are in kblock_internal.h.
 */
#ifndef FLASHLLM_SIMD_H
#define FLASHLLM_SIMD_H

#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "flashllm.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define FL_QK 32          /* values per quantized block */
#define FL_Q8_0_BYTES 34  /* f16 scale + 32 int8 */
#define FL_Q4_0_BYTES 18  /* f16 scale + 16 bytes of nibbles */
#define FL_Q4_1_BYTES 20  /* f16 scale + f16 min + 16 bytes of nibbles */
#define FL_QK_K 256       /* values per Q4_K superblock: 8 sub-blocks of FL_QK */
#define FL_Q4_K_BYTES 144 /* f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 of nibbles */
#define FL_Q5_0_BYTES 22  /* f16 scale + 32 high bits + 16 bytes of nibbles */
#define FL_Q5_1_BYTES 24  /* f16 scale + f16 min + 32 high bits + 16 bytes of nibbles */
#define FL_Q5_K_BYTES 176 /* Q4_K's head, 32 bytes of high bits, 128 of nibbles */
#define FL_Q6_K_BYTES 210 /* 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, f16 d */
#define FL_Q3_K_BYTES 110 /* 32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit scales, f16 d */
#define FL_Q2_K_BYTES 84  /* 16 bytes of 4-bit scales / mins, 64 of 2-bit values, f16 d, dmin */
#define FL_QT 4           /* weight rows x tokens of one int8 tile (fli_qdot_tile) */
#define FL_XQ_LANES 8     /* f32 / int32 lanes per block in a quantized token's side arrays */
#define FL_PR 16          /* weight rows of one int8 GEMM panel (qgemm.c) */
#define FL_SMALL_T 10     /* up to this many tokens (a decode pass: a token and its guesses), each
                           * token's product is its one-token one: tiles, never panels */

static inline float fl_bits_to_f32(uint32_t w) {
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline uint32_t fl_f32_to_bits(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    return w;
}

static inline float fl_fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = fl_bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = fl_bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t bits = two_w < (1u << 27) ? fl_f32_to_bits(denormalized)
                                             : fl_f32_to_bits(normalized);
    return fl_bits_to_f32(sign | bits);
#endif
}

static inline uint16_t fl_fp32_to_fp16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = fl_f32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = fl_bits_to_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = fl_f32_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

#if defined(__AVX2__)
#include <immintrin.h>
/* the sum of the 8 lanes of a */
static inline float fli_hsum256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* the sum of the 8 int32 lanes of a */
static inline int32_t fli_hsum256_i32(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

static inline float fl_load_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return fl_fp16_to_fp32(h);
}

/* the offset qdot.c adds to q8_0 weights (w + 128 where its dot is VNNI's unsigned x signed
 * bytes, else none), paid back through fli_xq_quantize's correction lanes */
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) ||              \
    (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) &&                             \
     (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))))
#define FLI_Q8_BIAS 128
#else
#define FLI_Q8_BIAS 0
#endif

/* bytes of one 32-value block of a quantized dtype (q4_0 for anything not listed) */
static inline size_t fli_block_bytes(int32_t dtype) {
    switch (dtype) {
    case FL_Q8_0: return FL_Q8_0_BYTES;
    case FL_Q4_1: return FL_Q4_1_BYTES;
    case FL_Q5_0: return FL_Q5_0_BYTES;
    case FL_Q5_1: return FL_Q5_1_BYTES;
    default: return FL_Q4_0_BYTES;
    }
}

/* the 256-value superblock dtypes (ggml's k-quants) */
static inline int fli_is_kquant(int32_t dtype) {
    return dtype == FL_Q4_K || dtype == FL_Q5_K || dtype == FL_Q6_K || dtype == FL_Q2_K ||
           dtype == FL_Q3_K;
}

/* the dtypes whose weights meet int8 activations (every quantized one) */
static inline int fli_is_quant(int32_t dtype) {
    return dtype == FL_Q8_0 || dtype == FL_Q4_0 || dtype == FL_Q4_1 || dtype == FL_Q5_0 ||
           dtype == FL_Q5_1 || fli_is_kquant(dtype);
}

/* bytes of one k-quant superblock */
static inline size_t fli_kblock_bytes(int32_t dtype) {
    return dtype == FL_Q4_K   ? FL_Q4_K_BYTES
           : dtype == FL_Q5_K ? FL_Q5_K_BYTES
           : dtype == FL_Q2_K ? FL_Q2_K_BYTES
           : dtype == FL_Q3_K ? FL_Q3_K_BYTES
                              : FL_Q6_K_BYTES;
}

/* the 32 high bits of a q5_0 / q5_1 block (bit j: bit 4 of value j) */
static inline uint32_t fli_q5_qh(int32_t dtype, const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + (dtype == FL_Q5_1 ? 4 : 2), sizeof qh);
    return qh;
}

/* ask the cache for the n bytes at p (into every level: NTA hints evicted data we reuse) */
static inline void fli_prefetch(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* ---- vec.c: one row of n values in dtype (n a multiple of 32 for quantized dtypes) ---------- */
/* internal to the extension: not exported from the shared object */
#pragma GCC visibility push(hidden)

/* dst (n) = dequantized row */
void fli_dequant(int32_t dtype, const uint8_t *row, float *dst, int64_t n);

/* row . x, x (n) f32 */
float fli_dot(int32_t dtype, const uint8_t *row, const float *x, int64_t n);

/* y (n) += a * row */
void fli_axpy(int32_t dtype, const uint8_t *row, float a, float *y, int64_t n);

/* q4k.c: Q4_K rows (n a multiple of FL_QK_K), plain C: dst (n) = dequantized row; row . x;
 * y (n) += a * row */
void fli_q4k_dequant(const uint8_t *row, float *dst, int64_t n);
float fli_q4k_dot(const uint8_t *row, const float *x, int64_t n);
void fli_q4k_axpy(const uint8_t *row, float a, float *y, int64_t n);
/* fli_wx_expand of a Q4_K row: per 32-value sub-block its nibbles, d * sc_j, -dmin * m_j */
void fli_q4k_expand(const uint8_t *w, int64_t n, uint8_t *buf);

/* kquant.c: dst (fl_row_bytes(dtype, n)) = src (n) quantized to q4_k, q5_k or q6_k (n a
 * multiple of FL_QK_K), ggml's quantize_row_q*_K_ref bit for bit */
void fli_quantize_kquant(int32_t dtype, const float *src, uint8_t *dst, int64_t n);

/* kaxpy.c: y (n) += sum over r < nr (<= 4) of a[r] * rows[r], k-quant rows (q4_k, q5_k, q6_k;
 * n a multiple of FL_QK_K): one load and store of y per superblock; dst (n) = a q6_k row
 * dequantized, rounded as gguf-py */
void fli_kq_axpy(int32_t dtype, const uint8_t *const *rows, const float *a, int nr, float *y,
                 int64_t n);
void fli_q6k_dequant(const uint8_t *row, float *dst, int64_t n);

/* qk.c: q2_k / q3_k / q5_k / q6_k rows (n a multiple of FL_QK_K): dst (n) = dequantized row, rounded as
 * gguf-py's dequantize; row . x; y (n) += a * row (f32 x, through one superblock at a time) */
void fli_qk_dequant(int32_t dtype, const uint8_t *row, float *dst, int64_t n);
float fli_qk_dot(int32_t dtype, const uint8_t *row, const float *x, int64_t n);
void fli_qk_axpy(int32_t dtype, const uint8_t *row, float a, float *y, int64_t n);
/* w . x for one q2_k / q3_k / q5_k / q6_k row and one token quantized by fli_xq_quantize for that dtype:
 * per superblock the exact integer sums of the sub-blocks times their integer scales, then
 * d * d_x * isum - dmin * d_x * msum in f32; AVX-512 BW, AVX2 and plain C give the same bits */
float fli_qk_qdot(int32_t dtype, const uint8_t *w, const uint8_t *x, int64_t n);
/* q3k.c: dst (256) = q3_k superblock sb dequantized as gguf-py; the exact integer sum over its
 * 16 sub-blocks of (scale - 32) * ((u - 4) . q) with a token's int8 q (256) and its sums per 16
 * values bsum16 (16) */
void fli_q3k_dequant_sb(const uint8_t *sb, float *dst);
int32_t fli_q3k_isum(const uint8_t *sb, const int8_t *q, const int16_t *bsum16);
/* out[r][t] = w[r] . x[t] for FL_QT q6_k rows and n_tok (1..FL_QT) tokens, each product
 * fli_qk_qdot's bits; under AVX-512 BW each superblock's 6-bit values are unpacked once for all
 * the tokens */
void fli_q6k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]);
/* the same for q2_k rows (the output head's sketch): each product fli_qk_qdot's bits, each
 * superblock's 2-bit values and scales unpacked once for all the tokens under AVX2 */
void fli_q2k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLI_Q4K_TILE1 1
/* out[r] = w[r] . x for FL_QT Q4_K rows and one token x quantized by fli_xq_quantize for q4_k
 * (n a multiple of FL_QK_K): fli_qdot_tile's n_tok == 1 in integer superblock sums (q4k.c) */
void fli_q4k_tile1(const uint8_t *const w[FL_QT], const uint8_t *x, int64_t n, float out[FL_QT]);
/* out[r][t] for 2..FL_QT tokens, each bit for bit fli_q4k_tile1's (superblocks unpacked once) */
void fli_q4k_tilen(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                   int64_t n, float out[FL_QT][FL_QT]);

/* 4 activation bytes in every int32 lane: what the packed kernels' vpdpbusd meets */
static inline __m512i fli_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FLI_Q4K_TILEN 1
/* out[r][t] = w[r] . x[t] for FL_QT Q4_K rows and n_tok (1..FL_QT) tokens quantized by
 * fli_xq_quantize for q4_k (n a multiple of FL_QK_K), in integer superblock sums, each row's
 * superblock unpacked once for the tokens (q4k.c): fli_qdot_tile's q4_k tiles, and prefill's
 * (no panels: fli_has_panel) */
void fli_q4k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]);
#endif

/* f32 dot of two contiguous vectors (n) */
float fli_dot_f32(const float *a, const float *b, int64_t n);

/* out[r][t] = w_r . x_t for 4 f32 rows w (4, ldw) and 4 f32 tokens x (4, ldx), n values each */
void fli_dot4x4_f32(const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t n,
                    float out[4][4]);

/* y (n) += a * x (n), both f32 */
void fli_axpy_f32(float a, const float *x, float *y, int64_t n);

/* y (n) += sum over r < FL_QT of a[r] * row r (dtype; a quantized, f32 or f16 row each) */
void fli_axpy4(int32_t dtype, const uint8_t *const rows[FL_QT], const float a[FL_QT], float *y,
               int64_t n);

/* y (T, d) += h^T @ down: y[t][j] += sum over k < K of h[k * ldh + t] * down[k * d + j];
 * down (K, d) f32, d a multiple of the vector width (32 is) */
void fli_down_f32(const float *h, int64_t ldh, const float *down, int64_t K, int64_t d, float *y,
                  int64_t T);

/* ---- qdot.c: int8 activations against quantized weights (n a multiple of 32) ------------ */

/* Bytes of one token's quantized activations (act_quant.c): int8 q (n), then per block FL_XQ_LANES f32
 * copies of its scale, FL_XQ_LANES int32 (a correction in lane 0, zeros) and FL_XQ_LANES f32
 * (d * sum(q) in lane 0, zeros: q4_1's msum), then int16 sum(q) per block (k-quants only; 16
 * bytes per 8 blocks), then int16 sum(q) per 16 values (k-quants only; 32 bytes per 8 blocks),
 * the vector layout of qdot.c.
 * The correction depends on the weight dtype, so quantize for the dtype the buffer will meet. */
/* Packed layouts of 16 rows (pack.c dispatches; AVX-512 VNNI builds, else 0 bytes): the bytes of
 * one group of 16 rows of cols values (0: no layout for dtype / cols), the packing of rows 0..15
 * of w (row bytes rb) into dst, and y (NT <= 4 tokens, ld floats apart) [+ bias] for one group gp
 * against tokens xq (xb bytes apart) quantized by fli_xq_quantize for the dtype.
 * q4kpack.c: Q4_K; q6kpack.c: Q6_K; q0pack.c: Q8_0 and Q5_0 */
size_t fli_q4k_group_bytes(int64_t cols);
void fli_q4k_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst);
void fli_q4k_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                   int64_t ld, const float *bias);
size_t fli_q6k_group_bytes(int64_t cols);
void fli_q6k_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst);
void fli_q6k_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                   int64_t ld, const float *bias);
size_t fli_q0_group_bytes(int32_t dtype, int64_t cols);
void fli_q0_pack_group(int32_t dtype, const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst);
void fli_q0_group(int32_t dtype, const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb,
                  int NT, float *y, int64_t ld, const float *bias);

int64_t fli_xq_bytes(int64_t n);

/* buf (fli_xq_bytes(n)) = x (n) quantized per block of 32: d = amax / 127, q = nearest-even(x/d);
 * for q4_k d is the superblock's (256 values; a shorter tail per block of 32) */
void fli_xq_quantize(int32_t dtype, const float *x, int64_t n, uint8_t *buf);

/* w . x for one weight row (dtype q4_0, q4_1 or q8_0) and one quantized token */
float fli_qdot(int32_t dtype, const uint8_t *w, const uint8_t *x, int64_t n);

/* buf (fli_xq_bytes(n)) = a q4_0 / q4_1 / q8_0 weight row unpacked to the unsigned bytes and
 * scale vectors fli_qdot_tile multiplies (its correction lanes unused; q4_1's m_w in the msum
 * lanes): worth it when a row meets more
 * than FL_QT tokens */
void fli_wx_expand(int32_t dtype, const uint8_t *w, int64_t n, uint8_t *buf);

/* out[r][t] = w[r] . x[t] for FL_QT rows and n_tok (1..FL_QT) quantized tokens; every x[t]
 * must point at a quantized token (pad with any of them: results past n_tok are unused).
 * ex: NULL, or the same rows expanded by fli_wx_expand (used when n_tok > 1). */
void fli_qdot_tile(int32_t dtype, const uint8_t *const w[FL_QT], const uint8_t *const ex[FL_QT],
                   const uint8_t *const x[FL_QT], int32_t n_tok, int64_t n,
                   float out[FL_QT][FL_QT]);

/* ---- qgemm.c: the int8 GEMM of prefill over panels of FL_PR weight rows ------------------ */

/* whether dtype has int8 GEMM panels (every quantized dtype but the k-quants q2_k, q3_k, q5_k
 * and q6_k, whose T > 1 products run their tiles of FL_QT tokens (q2_k, q6_k) or the one-token
 * dots per token, and under AVX2 q4_k, whose tiles of FL_QT tokens are faster) */
static inline int fli_has_panel(int32_t dtype) {
#if defined(FLI_Q4K_TILEN)  /* AVX2: q4_k's integer tiles beat its expanded panels */
    if (dtype == FL_Q4_K) return 0;
#endif
    return fli_is_quant(dtype) && dtype != FL_Q5_K && dtype != FL_Q6_K && dtype != FL_Q2_K &&
           dtype != FL_Q3_K;
}

/* whether fli_qdot_tile gives each of 2..FL_QT tokens the bits of its one-token product for
 * rows of n values of dtype (the k-quant tiles that unpack a superblock once and keep each
 * token's sums apart), so that a pass over a few tokens may take them in one tile */
static inline int fli_tile_exact(int32_t dtype, int64_t n) {
#if defined(FLI_Q4K_TILEN) || defined(FLI_Q4K_TILE1)
    if (dtype == FL_Q4_K) return n % FL_QK_K == 0;
#endif
    return (dtype == FL_Q6_K || dtype == FL_Q2_K) && n % FL_QK_K == 0;
}

/* bytes of one panel of FL_PR rows of n values (a dtype with panels) */
size_t fli_panel_bytes(int64_t n);

/* buf (fli_panel_bytes(n)) = FL_PR rows w (pointers; repeat one to pad) repacked for
 * fli_panel_gemm */
void fli_panel_pack(int32_t dtype, const uint8_t *const w[FL_PR], int64_t n, uint8_t *buf);

/* out[r * ld + t] = w_r . x_t for the FL_PR rows of a panel and T tokens x (T, xb) quantized
 * by fli_xq_quantize for dtype */
void fli_panel_gemm(int32_t dtype, const uint8_t *panel, const uint8_t *x, size_t xb, int64_t T,
                    int64_t n, float *out, int64_t ld);

/* ---- act.c ------------------------------------------------------------------------------- */

/* one FFN activation (FL_ACT_*): SiLU x*sigmoid(x); GELU the erf form; GELU_TANH the tanh
 * approximation; ReLU */
static inline float fli_activate(int32_t act, float v) {
    switch (act) {
    case FL_ACT_SILU: return v / (1.0f + expf(-v));
    case FL_ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case FL_ACT_GELU_TANH:
        return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    default: return v > 0.0f ? v : 0.0f;
    }
}

/* h (n) = silu(g) * u = g / (1 + exp(-g)) * u, g u h (n) f32 */
void fli_silu_mul(const float *g, const float *u, float *h, int64_t n);

#pragma GCC visibility pop

#include "pool_internal.h"

#endif /* FLASHLLM_SIMD_H */
