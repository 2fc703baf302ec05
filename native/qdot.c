/* qdot.c — int8 activation kernels: activations quantized per block of 32 (act_quant.c: as ggml's
 * q8_0, with an f32 scale d; for q4_k one d per superblock), multiplied by q4_0 / q8_0 / q4_1 /
 * q4_k weight blocks in integer arithmetic: the exact integer dot of a weight block with q is
 * scaled by d_w * d.
 * AVX-512 VNNI (two blocks per zmm), AVX2 with or without AVX-VNNI (one block per ymm), or plain
 * C, chosen at compile time. VNNI multiplies unsigned by signed bytes, so the weight side is made
 * unsigned and the offset is paid back through a per-block correction precomputed with the
 * activations (the correction lanes of fli_xq_bytes): q4_0 uses the raw nibble (value + 8) and
 * subtracts 8 * sum(q); q8_0 under VNNI uses w + 128 (w ^ 0x80) and subtracts 128 * sum(q).
 * q4_1 (w = d_w * nibble + m_w) multiplies the raw nibbles and adds m_w * d * sum(q), the block
 * sum kept in the msum lanes (as llama.cpp's q8_1 keeps s = d * sum(q)). q4_k is q4_1 per 32-value
 * sub-block (d_w = d * sc_j, m_w = -dmin * m_j, unpacked once per superblock and row, in f32); a
 * pair of its sub-blocks is one 32-byte load, low nibbles then high. Under AVX-512 VNNI one
 * token's q4_k tiles go to fli_q4k_tile1 (q4k.c), which keeps the scales in integers. The
 * k-quants' other products are in qk.c; the traits table (traits.c) holds them all by dtype.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "kblock.h"
#include "q4k.h"
#include "qdot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define G 2 /* blocks per integer vector */
typedef __m512i vi;
typedef __m512 vs;
/* blocks b, b + bb (nibbles at offset off) -> 64 unsigned nibbles */
static inline vi w_q4(const uint8_t *b, size_t bb, size_t off) {
    const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + off)));
    const __m256i c =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + bb + off)));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
    const __m512i sh = _mm512_srlv_epi64(z, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
    return _mm512_and_si512(sh, _mm512_set1_epi8(0x0F));
}
/* q5_0 / q5_1 blocks b, b + bb: the q4 nibbles with bit 4 from each block's qh */
static inline vi w_q5(const uint8_t *b, size_t bb, size_t off, uint32_t h0, uint32_t h1) {
    const __mmask64 m = (__mmask64)h0 | ((__mmask64)h1 << 32);
    return _mm512_or_si512(w_q4(b, bb, off), _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(0x10)));
}
static inline vi w_q8(const uint8_t *b) {  // blocks b, b + 34 -> 64 values + 128
    const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(b + 2 + FL_Q8_0_BYTES));
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1),
                            _mm512_set1_epi8((char)0x80));
}
/* Q4_K sub-blocks j, j + 1 (j even) from their 32 nibble bytes qs -> 64 unsigned nibbles */
static inline vi w_q4k(const uint8_t *qs, int64_t j) {
    (void)j;
    const __m256i a = _mm256_loadu_si256((const __m256i *)qs);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_srli_epi16(a, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}
static inline vs vs_blocks(__m256 s8, int64_t j) {  // [s8[j] x8 | s8[j + 1] x8]
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)j),
                                         _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(s8));
}
static inline vs w_scale(const uint8_t *b, size_t bb) {  // [d_0 x8 | d_1 x8]
    uint16_t h0, h1;
    memcpy(&h0, b, 2);
    memcpy(&h1, b + bb, 2);
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)h0)),
                                              _mm_set1_epi16((short)h1), 1);
    return _mm512_cvtph_ps(h);
}
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline void vi_store(void *p, vi v) { _mm512_storeu_si512(p, v); }
static inline void vs_store(float *p, vs v) { _mm512_storeu_ps(p, v); }
static inline vs vs_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vs vs_zero(void) { return _mm512_setzero_ps(); }
static inline vi dp(int32_t dtype, vi acc, vi w, vi x) {
    (void)dtype;
    return _mm512_dpbusd_epi32(acc, w, x);
}
static inline vs acc_block(vi p, vs scale, vs acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
}
static inline vs vs_mul(vs a, vs b) { return _mm512_mul_ps(a, b); }
static inline vs vs_fma(vs a, vs b, vs c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vs_sum(vs a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define G 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HAVE_VNNI256 1
#endif
typedef __m256i vi;
typedef __m256 vs;
static inline vi w_q4(const uint8_t *b, size_t bb, size_t off) {
    (void)bb;
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + off));
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
}
/* byte i = 0x10 where bit i of m is set */
static inline __m256i bit4_bytes(uint32_t m) {
    const __m256i rep = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)m), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit),
                            _mm256_set1_epi8(0x10));
}
static inline vi w_q5(const uint8_t *b, size_t bb, size_t off, uint32_t h0, uint32_t h1) {
    (void)h1;
    return _mm256_or_si256(w_q4(b, bb, off), bit4_bytes(h0));
}
static inline vi w_q8(const uint8_t *b) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
    return FLI_Q8_BIAS ? _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)) : w;
}
static inline vi w_q4k(const uint8_t *qs, int64_t j) {  // Q4_K sub-block j: 32 nibbles
    const __m256i a = _mm256_loadu_si256((const __m256i *)qs);
    return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(a, 4) : a, _mm256_set1_epi8(0x0F));
}
static inline vs vs_blocks(__m256 s8, int64_t j) {  // s8[j] x8
    return _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32((int)j));
}
static inline vs w_scale(const uint8_t *b, size_t bb) {
    (void)bb;
    return _mm256_set1_ps(fl_load_fp16(b));
}
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(void *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline void vs_store(float *p, vs v) { _mm256_storeu_ps(p, v); }
static inline vs vs_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vs vs_zero(void) { return _mm256_setzero_ps(); }
static inline vi dp(int32_t dtype, vi acc, vi w, vi x) {
#if defined(HAVE_VNNI256) && defined(__AVXVNNI__)
    (void)dtype;
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#elif defined(HAVE_VNNI256)
    (void)dtype;
    return _mm256_dpbusd_epi32(acc, w, x);
#else  // maddubs saturates at 16 bits: q8_0 goes through |w| * sign(x, w), |w| <= 127
    const __m256i p16 = dtype == FL_Q8_0
                            ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                            : _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}
static inline vs acc_block(vi p, vs scale, vs acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
}
static inline vs vs_mul(vs a, vs b) { return _mm256_mul_ps(a, b); }
static inline vs vs_fma(vs a, vs b, vs c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vs_sum(vs a) { return fli_hsum256(a); }
#else
#define G 0 /* no vector path: every block goes through block_idot */
#endif

/* weights with an offset per block (x = d_w * u + m_w): q4_1, q5_1, and q4_k per sub-block */
#define HAS_M(dt) ((dt) == FL_Q4_1 || (dt) == FL_Q5_1 || (dt) == FL_Q4_K)
/* the same among the 32-value block dtypes (m_w stored as f16 after d_w) */
#define HAS_M32(dt) ((dt) == FL_Q4_1 || (dt) == FL_Q5_1)

#if G > 0
/* the unsigned weight bytes dp multiplies, of G blocks from b */
static inline vi w_load(int32_t dtype, const uint8_t *b) {
    if (dtype == FL_Q8_0) return w_q8(b);
    if (dtype == FL_Q4_1) return w_q4(b, FL_Q4_1_BYTES, 4);
    if (dtype == FL_Q5_0)
        return w_q5(b, FL_Q5_0_BYTES, 6, fli_q5_qh(dtype, b), fli_q5_qh(dtype, b + FL_Q5_0_BYTES));
    if (dtype == FL_Q5_1)
        return w_q5(b, FL_Q5_1_BYTES, 8, fli_q5_qh(dtype, b), fli_q5_qh(dtype, b + FL_Q5_1_BYTES));
    return w_q4(b, FL_Q4_0_BYTES, 2);
}
#endif

/* exact sum over one block of (weight value) * q, in plain C (tails and the portable build).
 * Not auto-vectorized: GCC 12 at -O2/-O3 with AVX512-VNNI turns the q8_0 loop (signed x signed
 * bytes) into vpdpbusd, which reads one side as unsigned, and gets wrong sums. */
__attribute__((noinline, optimize("no-tree-vectorize"))) static int32_t
block_idot(int32_t dtype, const uint8_t *blk, const int8_t *q) {
    int32_t s = 0;
    if (dtype == FL_Q8_0) {
        for (int j = 0; j < FL_QK; j++) s += (int32_t)(int8_t)blk[2 + j] * q[j];
    } else if (dtype == FL_Q4_1) {
        for (int j = 0; j < FL_QK / 2; j++)
            s += (blk[4 + j] & 0x0F) * q[j] + (blk[4 + j] >> 4) * q[j + FL_QK / 2];
    } else if (dtype == FL_Q5_0 || dtype == FL_Q5_1) {
        const uint32_t qh = fli_q5_qh(dtype, blk);
        const uint8_t *qs = blk + (dtype == FL_Q5_1 ? 8 : 6);
        const int off = dtype == FL_Q5_0 ? 16 : 0;
        for (int j = 0; j < FL_QK / 2; j++)
            s += ((int)((qs[j] & 0x0F) | ((qh >> j) & 1) << 4) - off) * q[j] +
                 ((int)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off) * q[j + FL_QK / 2];
    } else {
        for (int j = 0; j < FL_QK / 2; j++)
            s += ((blk[2 + j] & 0x0F) - 8) * q[j] + ((blk[2 + j] >> 4) - 8) * q[j + FL_QK / 2];
    }
    return s;
}

/* exact sum over Q4_K sub-block j (its nibble bytes qs) of nibble * q, plain C as above */
__attribute__((noinline, optimize("no-tree-vectorize"))) static int32_t
q4k_idot(const uint8_t *qs, int64_t j, const int8_t *q) {
    int32_t s = 0;
    const int shift = 4 * (int)(j & 1);
    for (int i = 0; i < FL_QK; i++) s += ((qs[i] >> shift) & 0x0F) * q[i];
    return s;
}

/* the parts of one quantized token inside its fli_xq_bytes buffer */
typedef struct {
    const int8_t *q;
    const float *scale;
    const int32_t *corr;
    const float *msum;
} xq_view;

static inline xq_view view(const uint8_t *buf, int64_t n) {
    const float *scale = (const float *)(buf + n);
    const int32_t *corr = (const int32_t *)(scale + (n / FL_QK) * FL_XQ_LANES);
    const float *msum = (const float *)(corr + (n / FL_QK) * FL_XQ_LANES);
    return (xq_view){(const int8_t *)buf, scale, corr, msum};
}

/* out[r][t] = w_r . x_t for R rows (pointers) and C tokens, blocks [b0, nb) in plain C */
static inline __attribute__((always_inline)) void tail_rc(int32_t dtype, const uint8_t *const *w,
                                                          int R, const xq_view *x, int C,
                                                          int64_t b0, int64_t nb,
                                                          float out[FL_QT][FL_QT]) {
    const size_t bb = fli_block_bytes(dtype);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < C; t++)
            for (int64_t b = b0; b < nb; b++) {
                if (dtype == FL_Q4_K) {
                    float sc[8], mn[8];
                    const uint8_t *sb = w[r] + (b / 8) * FL_Q4_K_BYTES;
                    fli_q4k_scales(sb, sc, mn);
                    out[r][t] += sc[b % 8] * x[t].scale[b * FL_XQ_LANES] *
                                 (float)q4k_idot(fli_q4k_qs(sb, b % 8), b % 8, x[t].q + b * FL_QK);
                    out[r][t] += mn[b % 8] * x[t].msum[b * FL_XQ_LANES];
                    continue;
                }
                const uint8_t *blk = w[r] + b * bb;
                out[r][t] += fl_load_fp16(blk) * x[t].scale[b * FL_XQ_LANES] *
                             (float)block_idot(dtype, blk, x[t].q + b * FL_QK);
                if (HAS_M32(dtype))
                    out[r][t] += fl_load_fp16(blk + 2) * x[t].msum[b * FL_XQ_LANES];
            }
}

/* out[r][t] = w_r . x_t, R rows by C tokens (each 1 or FL_QT), nb blocks; ex (R) the rows
 * expanded by fli_wx_expand when EX, else unused */
static inline __attribute__((always_inline)) void tile_rc(int32_t dtype, const uint8_t *const *w,
                                                          const uint8_t *const *ex, int EX,
                                                          int R, const xq_view *x, int C,
                                                          int64_t nb, float out[FL_QT][FL_QT]) {
    int64_t b = 0;
#if G > 0
    const size_t bb = fli_block_bytes(dtype);
    vs acc[FL_QT][FL_QT];
    __m256 ks[FL_QT], km[FL_QT];  // q4_k: each row's superblock d * sc_j, -dmin * m_j
    for (int r = 0; r < FL_QT; r++) ks[r] = km[r] = _mm256_setzero_ps();
    for (int r = 0; r < R; r++)
        for (int t = 0; t < C; t++) acc[r][t] = vs_zero();
    for (; b + G <= nb; b += G) {
        vi wv[FL_QT];
        vs ws[FL_QT], wm[FL_QT];  // wm: q4_1's / q4_k's m_w lanes
        for (int r = 0; r < R; r++) {
            if (EX) {
                const xq_view e = view(ex[r], nb * FL_QK);
                wv[r] = vi_load(e.q + b * FL_QK);
                ws[r] = vs_load(e.scale + b * FL_XQ_LANES);
                if (HAS_M(dtype)) wm[r] = vs_load(e.msum + b * FL_XQ_LANES);
            } else if (dtype == FL_Q4_K) {  // sub-blocks b .. b+G-1 of superblock b / 8
                const uint8_t *sb = w[r] + (b / 8) * FL_Q4_K_BYTES;
                if (b % 8 == 0) fli_q4k_scales8(sb, &ks[r], &km[r]);
                wv[r] = w_q4k(fli_q4k_qs(sb, b % 8), b % 8);
                ws[r] = vs_blocks(ks[r], b % 8);
                wm[r] = vs_blocks(km[r], b % 8);
            } else {
                wv[r] = w_load(dtype, w[r] + b * bb);
                ws[r] = w_scale(w[r] + b * bb, bb);
                if (HAS_M32(dtype)) wm[r] = w_scale(w[r] + b * bb + 2, bb);
            }
        }
        for (int t = 0; t < C; t++) {
            const vi xv = vi_load(x[t].q + b * FL_QK);
            const vi cv = vi_load(x[t].corr + b * FL_XQ_LANES);
            const vs xs = vs_load(x[t].scale + b * FL_XQ_LANES);
            const vs xm = HAS_M(dtype) ? vs_load(x[t].msum + b * FL_XQ_LANES) : vs_zero();
            for (int r = 0; r < R; r++) {
                acc[r][t] = acc_block(dp(dtype, cv, wv[r], xv), vs_mul(ws[r], xs), acc[r][t]);
                if (HAS_M(dtype)) acc[r][t] = vs_fma(wm[r], xm, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < C; t++) out[r][t] = vs_sum(acc[r][t]);
#else
    (void)ex, (void)EX;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < C; t++) out[r][t] = 0.0f;
#endif
    tail_rc(dtype, w, R, x, C, b, nb, out);
}

void fli_wx_expand(int32_t dtype, const uint8_t *w, int64_t n, uint8_t *buf) {
#if G > 0
    if (dtype == FL_Q4_K) {
        fli_q4k_expand(w, n, buf);
        return;
    }
    const size_t bb = fli_block_bytes(dtype);
    const int64_t nb = n / FL_QK;
    float *scale = (float *)(buf + n);                    // (nb, FL_XQ_LANES)
    float *m = scale + 2 * nb * FL_XQ_LANES;              // (nb, FL_XQ_LANES): the msum lanes
    for (int64_t b = 0; b + G <= nb; b += G) {
        vi_store(buf + b * FL_QK, w_load(dtype, w + b * bb));
        vs_store(scale + b * FL_XQ_LANES, w_scale(w + b * bb, bb));
        if (HAS_M32(dtype)) vs_store(m + b * FL_XQ_LANES, w_scale(w + b * bb + 2, bb));
    }
#else
    (void)dtype, (void)w, (void)n, (void)buf;
#endif
}

/* out[r][t] for FL_QT rows and n_tok tokens of a dtype with no multi-token kernel of its own,
 * the dtype a constant once inlined */
static inline __attribute__((always_inline)) void tile_n(int32_t dtype,
                                                         const uint8_t *const w[FL_QT],
                                                         const uint8_t *const ex[FL_QT],
                                                         const uint8_t *const x[FL_QT],
                                                         int32_t n_tok, int64_t n,
                                                         float out[FL_QT][FL_QT]) {
    xq_view xv[FL_QT];
    for (int t = 0; t < FL_QT; t++) xv[t] = view(x[t], n);
    const int64_t nb = n / FL_QK;
    if (n_tok == 1) tile_rc(dtype, w, ex, 0, FL_QT, xv, 1, nb, out);
    else if (n_tok == 2 && !ex) tile_rc(dtype, w, ex, 0, FL_QT, xv, 2, nb, out);  // draft guesses:
    else if (n_tok == 3 && !ex) tile_rc(dtype, w, ex, 0, FL_QT, xv, 3, nb, out);  // no idle columns
    else if (ex) tile_rc(dtype, w, ex, 1, FL_QT, xv, FL_QT, nb, out);
    else tile_rc(dtype, w, ex, 0, FL_QT, xv, FL_QT, nb, out);
}

/* the kernels of each dtype (qdot.h) */
FLI_QDOT_TILE(fli_q8_0_tile) { tile_n(FL_Q8_0, w, ex, x, n_tok, n, out); }
FLI_QDOT_TILE(fli_q4_0_tile) { tile_n(FL_Q4_0, w, ex, x, n_tok, n, out); }
FLI_QDOT_TILE(fli_q4_1_tile) { tile_n(FL_Q4_1, w, ex, x, n_tok, n, out); }
FLI_QDOT_TILE(fli_q5_0_tile) { tile_n(FL_Q5_0, w, ex, x, n_tok, n, out); }
FLI_QDOT_TILE(fli_q5_1_tile) { tile_n(FL_Q5_1, w, ex, x, n_tok, n, out); }

/* q4_k: whole superblocks go to q4k.c's integer tiles where the build has them (every token as
 * it would be alone), anything else to tile_rc's sub-block products */
FLI_QDOT_TILE(fli_q4k_qtile) {
#ifdef FLI_Q4K_TILEN
    if (n % FL_QK_K == 0) {
        fli_q4k_tile(w, x, n_tok, n, out);
        return;
    }
#endif
#ifdef FLI_Q4K_TILE1
    if (n % FL_QK_K == 0) {
        if (n_tok > 1) {
            fli_q4k_tilen(w, x, n_tok, n, out);
            return;
        }
        float o[FL_QT];
        fli_q4k_tile1(w, x[0], n, o);
        for (int r = 0; r < FL_QT; r++) out[r][0] = o[r];
        return;
    }
#endif
    tile_n(FL_Q4_K, w, ex, x, n_tok, n, out);
}
