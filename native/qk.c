/* qk.c — ggml's q2_k, q5_k and q6_k rows: f32 paths (dequantize, dot, axpy) and the int8 dot of one
 * row with one token quantized per superblock (act_quant.c, as ggml's q8_K).
 *
 * q5_k (176 bytes / 256 values): q4_k's f16 d, dmin and 12 bytes of 6-bit scales sc_j / mins m_j,
 * then qh[32], then qs[128]; value i of 32-value sub-block j is d * sc_j * u - dmin * m_j with
 * u = its q4_k nibble | bit j of qh[i] << 4.
 * q6_k (210 bytes / 256 values): ql[128], qh[64], int8 scales[16], f16 d; the superblock is two
 * halves of 128 values, value v of half h is d * scales[8h + v / 16] * (u - 32), u (6 bits) a
 * nibble of ql and 2 bits of qh as in ggml's dequantize_row_q6_K (q6k_u).
 *
 * q2_k (84 bytes / 256 values): scales[16] (scale sc_k in the low nibble, min m_k in the high),
 * qs[64], f16 d, f16 dmin; value 32s + l of half h (128 values) is bits 2s..2s+1 of qs[32h + l],
 * d * sc_k * u - dmin * m_k with k its 16-value sub-block.
 *
 * Dequantization rounds as gguf-py does: (d * scale) in f32, times u (minus dmin * m for q5_k).
 * The int8 dot computes per superblock exact integers — isum = sum over sub-blocks of scale *
 * (u . q), and the min / offset term against the token's sub-block sums — with AVX-512 BW, AVX2
 * or plain C, then the same f32 operations on them, so every build gives the same bits.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "kblock.h"
#include "q3k.h"
#include "qk.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QK_512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define QK_256 1
#endif
#if defined(__AVX2__)
#define Q2K_UNPACKED 1  /* q2_k tiles unpack each superblock once for their tokens (AVX2 code, */
#endif                  /* which AVX-512 builds run too) */

/* u (0..63) of value v (0..255) of q6_k superblock sb */
static inline int q6k_u(const uint8_t *sb, int v) {
    const int h = v / 128, l = v % 32, g = (v % 128) / 32;  // g: which of the 4 groups of 32
    const uint8_t ql = sb[64 * h + l + (g & 1) * 32];
    const uint8_t qh = sb[128 + 32 * h + l];
    return ((g < 2 ? ql & 0x0F : ql >> 4) | (((qh >> (2 * g)) & 3) << 4));
}

/* u (0..31) of value i of sub-block j of q5_k superblock sb */
static inline int q5k_u(const uint8_t *sb, int j, int i) {
    const uint8_t q = sb[48 + 32 * (j / 2) + i];
    return ((j & 1 ? q >> 4 : q & 0x0F) | (((sb[16 + i] >> j) & 1) << 4));
}

/* dst (256) = one superblock dequantized */
static void dequant_sb(int32_t dtype, const uint8_t *sb, float *dst) {
    if (dtype == FL_Q3_K) {
        fli_q3k_dequant_sb(sb, dst);  // q3k.c
        return;
    }
    if (dtype == FL_Q2_K) {
        const float d = fl_load_fp16(sb + 80), dmin = fl_load_fp16(sb + 82);
        for (int v = 0; v < FL_QK_K; v++) {
            const uint8_t sc = sb[v / 16];
            const int u = (sb[16 + 32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3;
            dst[v] = d * (float)(sc & 0xF) * (float)u - dmin * (float)(sc >> 4);
        }
        return;
    }
    if (dtype == FL_Q6_K) {
        const float d = fl_load_fp16(sb + 208);
        for (int v = 0; v < FL_QK_K; v++) {
            const float dl = d * (float)(int8_t)sb[192 + v / 16];
            dst[v] = dl * (float)(q6k_u(sb, v) - 32);
        }
        return;
    }
    float sc[8], mn[8];  // d * sc_j, -(dmin * m_j)
    fli_q4k_scales(sb, sc, mn);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < FL_QK; i++)
            dst[j * FL_QK + i] = sc[j] * (float)q5k_u(sb, j, i) - (-mn[j]);
}

void fli_qk_dequant(int32_t dtype, const uint8_t *row, float *dst, int64_t n) {
    const size_t kb = fli_block_bytes(dtype);
    for (int64_t s = 0; s < n / FL_QK_K; s++) dequant_sb(dtype, row + s * kb, dst + s * FL_QK_K);
}

float fli_qk_dot(int32_t dtype, const uint8_t *row, const float *x, int64_t n) {
    float w[FL_QK_K], s = 0.0f;  // w (256): one superblock dequantized
    const size_t kb = fli_block_bytes(dtype);
    for (int64_t b = 0; b < n / FL_QK_K; b++) {
        dequant_sb(dtype, row + b * kb, w);
        s += fli_dot_f32(w, x + b * FL_QK_K, FL_QK_K);
    }
    return s;
}

void fli_qk_axpy(int32_t dtype, const uint8_t *row, float a, float *y, int64_t n) {
    float w[FL_QK_K];  // (256)
    const size_t kb = fli_block_bytes(dtype);
    for (int64_t b = 0; b < n / FL_QK_K; b++) {
        dequant_sb(dtype, row + b * kb, w);
        fli_axpy_f32(a, w, y + b * FL_QK_K, FL_QK_K);
    }
}

/* ---- int8: the exact integer sum of one superblock ---------------------------------------- */

#include "q6k_simd.h"

#if !defined(QK_512) && !defined(QK_256)
/* q6_k in plain C: the exact isum of superblock sb with a token, sum over the 16 sub-blocks k
 * of scales[k] * ((u - 32) . q), q (256) the token's int8 (the vector builds: q6k_isum_u) */
static int32_t q6k_isum(const uint8_t *sb, const int8_t *q) {
    int32_t s = 0;
    for (int k = 0; k < 16; k++) {
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += (q6k_u(sb, 16 * k + i) - 32) * q[16 * k + i];
        s += (int8_t)sb[192 + k] * t;
    }
    return s;
}
#endif

#if defined(Q2K_UNPACKED)
/* q2_k superblock sb unpacked (AVX2; once for all the tokens a tile meets): the 2-bit values of
 * runs 32i .. 32i + 31 (i = 4h + g: shift 2g of qs[32h ..]) times their sub-block's scale (bytes
 * 0..45: the low 16 bytes of run i lie in sub-block 8h + 2g, the high 16 in the next), and the
 * 16 sub-blocks' mins as int16 */
typedef struct {
    __m256i us[8], m16;
} q2k_unpacked;

static inline void q2k_unpack(const uint8_t *sb, q2k_unpacked *o) {
    const __m256i m3 = _mm256_set1_epi8(0x03);
    const __m128i sm = _mm_loadu_si128((const __m128i *)sb);  // scale | min << 4, 16 sub-blocks
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_and_si128(sm, _mm_set1_epi8(0x0F)));
    o->m16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(sm), 4);
    for (int h = 0; h < 2; h++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * h));
        for (int g = 0; g < 4; g++) {
            const int k = 8 * h + 2 * g;
            const __m256i u = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * g)), m3);
            const __m256i s16 = _mm256_shuffle_epi8(sc, _mm256_set_m128i(  // int16 lanes: scale
                _mm_set1_epi16((short)(0x8000 | (k + 1))), _mm_set1_epi16((short)(0x8000 | k))));
            o->us[4 * h + g] = _mm256_mullo_epi16(u, s16);  // u * scale < 256: no byte carries
        }
    }
}

/* the exact isum (sum over sub-blocks of scale * (u . q)) and msum (sum of min * the token's
 * sums of q per 16, bsum16) of an unpacked superblock o with a token's int8 q (256) */
static inline void q2k_sums_u(const q2k_unpacked *o, const int8_t *q, const int16_t *bsum16,
                              int32_t *isum, int32_t *msum) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {  // |two maddubs lanes| <= 2 * 2 * 45 * 128 < 2^15
        const __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(o->us[i], _mm256_loadu_si256((const __m256i *)(q + 32 * i))),
            _mm256_maddubs_epi16(o->us[i + 1], _mm256_loadu_si256((const __m256i *)(q + 32 * i + 32))));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, one));
    }
    const __m256i m = _mm256_madd_epi16(o->m16, _mm256_loadu_si256((const __m256i *)bsum16));
    const __m256i h = _mm256_hadd_epi32(acc, m);  // both horizontal sums at once
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s = _mm_hadd_epi32(s, s);                      // isum, msum, isum, msum
    *isum = _mm_cvtsi128_si32(s);
    *msum = _mm_extract_epi32(s, 1);
}
#endif

#if !defined(QK_256)
/* q2_k: sum over the 16 sub-blocks k of sc_k * (u . q) (u in 0..3, q the token's int8) */
static int32_t q2k_isum(const uint8_t *sb, const int8_t *q) {
#if defined(QK_512)
    const __m512i m3 = _mm512_set1_epi8(0x03);
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_and_si256(
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)sb)), _mm256_set1_epi16(0x0F)));
    const __m512i eighth = _mm512_srli_epi16(  // int16 lane j -> j / 8
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                         13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
    __m512i acc = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {  // values 64c .. 64c + 63: shifts 4(c&1), +2 of qs[32(c/2) ..]
        const __m512i qv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * (c / 2))));
        const int s0 = 4 * (c & 1);
        const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(qv, _mm512_inserti64x4(
            _mm512_set1_epi16((short)s0), _mm256_set1_epi16((short)(s0 + 2)), 1)), m3);
        const __m512i p = _mm512_maddubs_epi16(u, _mm512_loadu_si512(q + 64 * c));
        const __m512i idx = _mm512_add_epi16(eighth, _mm512_set1_epi16((short)(4 * c)));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_permutexvar_epi16(idx, sc16)));
    }
    return _mm512_reduce_add_epi32(acc);
#else
    int32_t s = 0;
    for (int v = 0; v < FL_QK_K; v++)
        s += (sb[v / 16] & 0xF) * ((sb[16 + 32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3) * q[v];
    return s;
#endif
}

/* q2_k: sum over the 16 sub-blocks k of m_k * (sum of the token's q over sub-block k), exact */
static inline int32_t q2k_msum(const uint8_t *sb, const int16_t *bsum16) {
#if defined(QK_512)
    const __m256i m = _mm256_srli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)sb)), 4);
    return fli_hsum256_i32(_mm256_madd_epi16(m, _mm256_loadu_si256((const __m256i *)bsum16)));
#else
    int32_t s = 0;
    for (int k = 0; k < 16; k++) s += (sb[k] >> 4) * bsum16[k];
    return s;
#endif
}
#endif

/* the exact isum and msum of q2_k superblock sb with a token's q (256) and bsum16 (16) */
static inline void q2k_sums(const uint8_t *sb, const int8_t *q, const int16_t *bsum16,
                            int32_t *isum, int32_t *msum) {
#if defined(QK_256)
    q2k_unpacked o;
    q2k_unpack(sb, &o);
    q2k_sums_u(&o, q, bsum16, isum, msum);
#else
    *isum = q2k_isum(sb, q);
    *msum = q2k_msum(sb, bsum16);
#endif
}

/* q5_k: sum over the 8 sub-blocks j of sc[j] * (u . q); sc (8) the 6-bit scales */
static int32_t q5k_isum(const uint8_t *sb, const uint8_t sc[8], const int8_t *q) {
#if defined(QK_512)
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 16)));
    __m512i acc = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {  // sub-blocks j (low nibbles), j + 1 (high): one 32-byte load
        const __m256i a = _mm256_loadu_si256((const __m256i *)(sb + 48 + 16 * j));
        const __m512i nib = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_srli_epi16(a, 4), 1), m4);
        const __m512i hb = _mm512_and_si512(
            _mm512_srlv_epi64(qh, _mm512_set_epi64(j + 1, j + 1, j + 1, j + 1, j, j, j, j)), one);
        const __m512i u = _mm512_or_si512(nib, _mm512_slli_epi16(hb, 4));
        const __m512i p = _mm512_maddubs_epi16(u, _mm512_loadu_si512(q + 32 * j));
        const __m512i s = _mm512_inserti64x4(_mm512_set1_epi16(sc[j]), _mm256_set1_epi16(sc[j + 1]), 1);
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
    }
    return _mm512_reduce_add_epi32(acc);
#elif defined(QK_256)
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16));
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(sb + 48 + 32 * (j / 2)));
        const __m256i nib = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(a, 4) : a, m4);
        const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
        const __m256i u = _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4));
        const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)(q + 32 * j)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(sc[j])));
    }
    return fli_hsum256_i32(acc);
#else
    int32_t s = 0;
    for (int j = 0; j < 8; j++) {
        int32_t t = 0;
        for (int i = 0; i < FL_QK; i++) t += q5k_u(sb, j, i) * q[32 * j + i];
        s += sc[j] * t;
    }
    return s;
#endif
}

/* a token quantized by fli_xq_quantize for a k-quant: q (n), scales (one d per superblock in
 * lane 0 of its first block), sums of q per 16 values */
typedef struct {
    const int8_t *q;
    const float *scale;
    const int16_t *bsum, *bsum16;
} qk_token;

static inline qk_token token_view(const uint8_t *x, int64_t n) {
    const int64_t nb = n / FL_QK;
    qk_token t;
    t.q = (const int8_t *)x;                                      // (n)
    t.scale = (const float *)(x + n);                             // (nb, 8)
    t.bsum = (const int16_t *)(t.scale + 3 * nb * FL_XQ_LANES);   // (nb)
    t.bsum16 = t.bsum + (nb + 7) / 8 * 8;                         // (2 nb)
    return t;
}

/* the exact q6_k isum of superblock sbi (its bytes sb) with token t */
static inline int32_t q6k_isum_token(const uint8_t *sb, const qk_token *t, int64_t sbi) {
#if defined(QK_256)
    return q6k_isum1(sb, t->q + sbi * FL_QK_K, t->bsum16 + 16 * sbi);
#elif defined(QK_512)
    q6k_unpacked o;
    q6k_unpack(sb, &o);
    return q6k_isum_u(&o, t->q + sbi * FL_QK_K, t->bsum16 + 16 * sbi);
#else
    return q6k_isum(sb, t->q + sbi * FL_QK_K);
#endif
}

float fli_qk_qdot(int32_t dtype, const uint8_t *w, const uint8_t *x, int64_t n) {
    const qk_token t = token_view(x, n);
    const size_t kb = fli_block_bytes(dtype);
    float s = 0.0f;
    for (int64_t sbi = 0; sbi < n / FL_QK_K; sbi++) {
        const uint8_t *sb = w + sbi * kb;
        const float dx = t.scale[sbi * 8 * FL_XQ_LANES];
        if (dtype == FL_Q2_K) {
            int32_t isum, msum;
            q2k_sums(sb, t.q + sbi * FL_QK_K, t.bsum16 + 16 * sbi, &isum, &msum);
            s += fl_load_fp16(sb + 80) * dx * (float)isum;
            s -= fl_load_fp16(sb + 82) * dx * (float)msum;
            continue;
        }
        if (dtype == FL_Q6_K) {
            s += fl_load_fp16(sb + 208) * dx * (float)q6k_isum_token(sb, &t, sbi);
            continue;
        }
        if (dtype == FL_Q3_K) {
            const int32_t isum = fli_q3k_isum(sb, t.q + sbi * FL_QK_K, t.bsum16 + 16 * sbi);
            s += fl_load_fp16(sb + 108) * dx * (float)isum;
            continue;
        }
        uint32_t u[4];
        uint8_t sm[16];  // sc_0..7, m_0..7
        fli_q4k_unpack(sb, u);
        memcpy(sm, u, sizeof sm);
        int32_t msum = 0;
        for (int j = 0; j < 8; j++) msum += sm[8 + j] * t.bsum[8 * sbi + j];
        s += fl_load_fp16(sb) * dx * (float)q5k_isum(sb, sm, t.q + sbi * FL_QK_K);
        s -= fl_load_fp16(sb + 2) * dx * (float)msum;
    }
    return s;
}

#define Q2K_AHEAD 8  /* rows ahead whose superblock is prefetched (the head's sketch streams) */
void fli_q2k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]) {
    const size_t rb = (size_t)(n / FL_QK_K) * FL_Q2_K_BYTES;
    qk_token t[FL_QT];
    for (int j = 0; j < n_tok; j++) t[j] = token_view(x[j], n);
    for (int r = 0; r < FL_QT; r++) {
        float s[FL_QT] = {0.0f};
        for (int64_t sbi = 0; sbi < n / FL_QK_K; sbi++) {
            const uint8_t *sb = w[r] + sbi * FL_Q2_K_BYTES;
            fli_prefetch(sb + Q2K_AHEAD * rb, FL_Q2_K_BYTES);  // Q2K_AHEAD rows on, if contiguous
            const float d = fl_load_fp16(sb + 80), dmin = fl_load_fp16(sb + 82);
#if defined(Q2K_UNPACKED)
            q2k_unpacked o;  // once for all the tokens
            q2k_unpack(sb, &o);
#endif
            for (int j = 0; j < n_tok; j++) {  // fli_qk_qdot's expressions, term for term
                const float dx = t[j].scale[sbi * 8 * FL_XQ_LANES];
                int32_t isum, msum;
#if defined(Q2K_UNPACKED)
                q2k_sums_u(&o, t[j].q + sbi * FL_QK_K, t[j].bsum16 + 16 * sbi, &isum, &msum);
#else
                q2k_sums(sb, t[j].q + sbi * FL_QK_K, t[j].bsum16 + 16 * sbi, &isum, &msum);
#endif
                s[j] += d * dx * (float)isum;
                s[j] -= dmin * dx * (float)msum;
            }
        }
        for (int j = 0; j < n_tok; j++) out[r][j] = s[j];
    }
}

#define Q6K_AHEAD 8  /* rows ahead whose superblock is prefetched (from DRAM the tile waits) */
void fli_q6k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]) {
    const size_t rb = (size_t)(n / FL_QK_K) * FL_Q6_K_BYTES;
    qk_token t[FL_QT];
    for (int j = 0; j < n_tok; j++) t[j] = token_view(x[j], n);
    for (int r = 0; r < FL_QT; r++) {
        float s[FL_QT] = {0.0f};
        for (int64_t sbi = 0; sbi < n / FL_QK_K; sbi++) {
            const uint8_t *sb = w[r] + sbi * FL_Q6_K_BYTES;
            fli_prefetch(sb + Q6K_AHEAD * rb, FL_Q6_K_BYTES);  // Q6K_AHEAD rows on, if contiguous
            const float d = fl_load_fp16(sb + 208);
#if defined(QK_256)
            if (n_tok == 1) {  // the fused form: nothing to share
                s[0] += d * t[0].scale[sbi * 8 * FL_XQ_LANES] * (float)q6k_isum_token(sb, &t[0], sbi);
                continue;
            }
#endif
#if defined(QK_512) || defined(QK_256)
            q6k_unpacked o;  // once for all the tokens
            q6k_unpack(sb, &o);
#endif
            for (int j = 0; j < n_tok; j++) {
#if defined(QK_512) || defined(QK_256)
                const int32_t isum = q6k_isum_u(&o, t[j].q + sbi * FL_QK_K, t[j].bsum16 + 16 * sbi);
#else
                const int32_t isum = q6k_isum_token(sb, &t[j], sbi);
#endif
                s[j] += d * t[j].scale[sbi * 8 * FL_XQ_LANES] * (float)isum;
            }
        }
        for (int j = 0; j < n_tok; j++) out[r][j] = s[j];
    }
}
