/* q2k_simd.h — the vector q2_k superblock sums of qk.c's tiles (included there only): a
 * superblock unpacked once for every token a tile meets (q2k_unpack), then each token's exact
 * isum and msum (q2k_sums_u). AVX-512 VNNI: 64-byte vectors, products through vpdpbusd; AVX2
 * (also what an AVX-512 build without VNNI runs): 32-byte vectors through maddubs. The same
 * integers as qk.c's one-token sums, so each build gives the same bits. */
#ifndef FLASHLLM_Q2K_SIMD_H
#define FLASHLLM_Q2K_SIMD_H

#if defined(__AVX2__)
#include <immintrin.h>
#define Q2K_UNPACKED 1  /* the tiles unpack each superblock once for their tokens */
#endif
#if defined(Q2K_UNPACKED) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define Q2K_VNNI 1
#endif

#if defined(Q2K_VNNI)
/* q2_k superblock sb unpacked (AVX-512 VNNI; once for all the tokens a tile meets): us[c] the
 * 2-bit values 64c .. 64c + 63 times their sub-block's scale (bytes 0..45; 128-bit lane l of
 * us[c] is sub-block 4c + l), and the 16 sub-blocks' mins as int16 */
typedef struct {
    __m512i us[4];
    __m256i m16;
} q2k_unpacked;

static inline void q2k_unpack(const uint8_t *sb, q2k_unpacked *o) {
    const __m512i m3 = _mm512_set1_epi8(0x03);
    const __m128i sm = _mm_loadu_si128((const __m128i *)sb);  // scale | min << 4, 16 sub-blocks
    const __m512i sc = _mm512_broadcast_i32x4(_mm_and_si128(sm, _mm_set1_epi8(0x0F)));
    o->m16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(sm), 4);
    const long long l0 = (long long)0x8000800080008000ULL;  // int16 lanes of 128-bit lane l:
    const __m512i lane = _mm512_set_epi64(                  // 0x8000 | l (byte l, then zero)
        0x8003800380038003LL, 0x8003800380038003LL, 0x8002800280028002LL, 0x8002800280028002LL,
        0x8001800180018001LL, 0x8001800180018001LL, l0, l0);
    for (int c = 0; c < 4; c++) {  // values 64c ..: shifts 4(c & 1), + 2 of qs[32(c / 2) ..]
        const __m512i qv = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * (c / 2))));
        const int s0 = 4 * (c & 1);
        const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(qv, _mm512_inserti64x4(
            _mm512_set1_epi16((short)s0), _mm256_set1_epi16((short)(s0 + 2)), 1)), m3);
        const __m512i idx = _mm512_add_epi16(lane, _mm512_set1_epi16((short)(4 * c)));
        const __m512i s16 = _mm512_shuffle_epi8(sc, idx);
        o->us[c] = _mm512_mullo_epi16(u, s16);  // u * scale < 256: no byte carries
    }
}

/* the exact isum (sum over sub-blocks of scale * (u . q)) and msum (sum of min * the token's
 * sums of q per 16, bsum16) of an unpacked superblock o with a token's int8 q (256) */
static inline void q2k_sums_u(const q2k_unpacked *o, const int8_t *q, const int16_t *bsum16,
                              int32_t *isum, int32_t *msum) {
    __m512i acc = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++)  // u8 * s8 in fours into int32: |45 * 128 * 4| exact
        acc = _mm512_dpbusd_epi32(acc, o->us[c], _mm512_loadu_si512(q + 64 * c));
    const __m256i m = _mm256_madd_epi16(o->m16, _mm256_loadu_si256((const __m256i *)bsum16));
    const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(acc),
                                       _mm512_extracti64x4_epi64(acc, 1));
    const __m256i h = _mm256_hadd_epi32(a, m);  // both horizontal sums at once
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s = _mm_hadd_epi32(s, s);                      // isum, msum, isum, msum
    *isum = _mm_cvtsi128_si32(s);
    *msum = _mm_extract_epi32(s, 1);
}
#elif defined(Q2K_UNPACKED)
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

#endif
