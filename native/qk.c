/* qk.c — ggml's q2_k, q3_k, q5_k and q6_k rows: f32 paths (dequantize, dot, axpy) and the int8
 * dot of one row with one token quantized per superblock (act_quant.c, as ggml's q8_K), and the
 * q6_k tile. A q2_k or q3_k superblock is q2k.c's or q3k.c's (their formats are there).
 *
 * q5_k (176 bytes / 256 values): q4_k's f16 d, dmin and 12 bytes of 6-bit scales sc_j / mins m_j,
 * then qh[32], then qs[128]; value i of 32-value sub-block j is d * sc_j * u - dmin * m_j with
 * u = its q4_k nibble | bit j of qh[i] << 4.
 * q6_k (210 bytes / 256 values): ql[128], qh[64], int8 scales[16], f16 d; the superblock is two
 * halves of 128 values, value v of half h is d * scales[8h + v / 16] * (u - 32), u (6 bits) a
 * nibble of ql and 2 bits of qh as in ggml's dequantize_row_q6_K (q6k_u).
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
#include "q2k.h"
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
        fli_q2k_dequant_sb(sb, dst);  // q2k.c
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

/* the exact q6_k isum of superblock sbi (its bytes sb) with token t */
static inline int32_t q6k_isum_token(const uint8_t *sb, const fli_xq_view *t, int64_t sbi) {
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
    const fli_xq_view t = fli_xq_token(x, n);
    const size_t kb = fli_block_bytes(dtype);
    float s = 0.0f;
    for (int64_t sbi = 0; sbi < n / FL_QK_K; sbi++) {
        const uint8_t *sb = w + sbi * kb;
        const float dx = t.scale[sbi * 8 * FL_XQ_LANES];
        if (dtype == FL_Q2_K) {
            int32_t isum, msum;
            fli_q2k_sums(sb, t.q + sbi * FL_QK_K, t.bsum16 + 16 * sbi, &isum, &msum);
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

#define Q6K_AHEAD 8  /* rows ahead whose superblock is prefetched (from DRAM the tile waits) */
void fli_q6k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]) {
    const size_t rb = (size_t)(n / FL_QK_K) * FL_Q6_K_BYTES;
    fli_xq_view t[FL_QT];
    for (int j = 0; j < n_tok; j++) t[j] = fli_xq_token(x[j], n);
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
