/* q2k.c — ggml's q2_k rows: one superblock dequantized (the f32 paths of qk.c loop over these),
 * the exact integer sums of one superblock with a token quantized per superblock (qk.c's int8
 * dot, as ggml's q8_K) and the tile of FL_QT rows and 1..FL_QT tokens (the output head's sketch).
 *
 * q2_k (84 bytes / 256 values): scales[16] (scale sc_k in the low nibble, min m_k in the high),
 * qs[64], f16 d, f16 dmin; value 32s + l of half h (128 values) is bits 2s..2s+1 of qs[32h + l],
 * d * sc_k * u - dmin * m_k with k its 16-value sub-block. Dequantization rounds as gguf-py does
 * ((d * scale) in f32, times u, minus dmin * m). The sums are exact integers with AVX-512 BW,
 * AVX2 or plain C, then the same f32 operations on them, so every build gives the same bits.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "q2k.h"

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

void fli_q2k_dequant_sb(const uint8_t *sb, float *dst) {
    const float d = fl_load_fp16(sb + 80), dmin = fl_load_fp16(sb + 82);
    for (int v = 0; v < FL_QK_K; v++) {
        const uint8_t sc = sb[v / 16];
        const int u = (sb[16 + 32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3;
        dst[v] = d * (float)(sc & 0xF) * (float)u - dmin * (float)(sc >> 4);
    }
}

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

void fli_q2k_sums(const uint8_t *sb, const int8_t *q, const int16_t *bsum16, int32_t *isum,
                  int32_t *msum) {
#if defined(QK_256)
    q2k_unpacked o;
    q2k_unpack(sb, &o);
    q2k_sums_u(&o, q, bsum16, isum, msum);
#else
    *isum = q2k_isum(sb, q);
    *msum = q2k_msum(sb, bsum16);
#endif
}

#define Q2K_AHEAD 8  /* rows ahead whose superblock is prefetched (the head's sketch streams) */
void fli_q2k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]) {
    const size_t rb = (size_t)(n / FL_QK_K) * FL_Q2_K_BYTES;
    fli_xq_view t[FL_QT];
    for (int j = 0; j < n_tok; j++) t[j] = fli_xq_token(x[j], n);
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
                fli_q2k_sums(sb, t[j].q + sbi * FL_QK_K, t[j].bsum16 + 16 * sbi, &isum, &msum);
#endif
                s[j] += d * dx * (float)isum;
                s[j] -= dmin * dx * (float)msum;
            }
        }
        for (int j = 0; j < n_tok; j++) out[r][j] = s[j];
    }
}
