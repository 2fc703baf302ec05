/* q6k_simd.h — the vector q6_k superblock sums of qk.c (included there only): a superblock
 * unpacked once for any number of tokens (AVX-512 BW or AVX2: q6k_unpack, q6k_isum_u), and
 * under AVX2 the fused one-token form (q6k_isum1). Every sum is the exact integer
 * sum over k of scales[k] * ((u - 32) . q), so each build gives the same bits. */
#ifndef FLASHLLM_Q6K_SIMD_H
#define FLASHLLM_Q6K_SIMD_H

#if defined(QK_512)
/* a q6_k superblock unpacked once for any number of tokens: u (4 x 64 unsigned 6-bit values:
 * values 0..63, 64..127, 128..191, 192..255), per vector the int16 scales of its int16 pair
 * lanes (lane j of vector v: sub-block 4v + j / 8), and -32 * scales[k] (16 int16) */
typedef struct {
    __m512i u[4], sc[4];
    __m256i neg32;
} q6k_unpacked;

static inline void q6k_unpack(const uint8_t *sb, q6k_unpacked *o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sb + 192)));
    const __m512i sc16 = _mm512_castsi256_si512(s16);  // (16) int16
    const __m512i eighth = _mm512_srli_epi16(  // int16 lane j -> j / 8
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                         13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(sb + 64 * h);  // (64)
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h)));
        const __m512i ha = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0)), m3);
        const __m512i hb = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4)), m3);
        o->u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(ha, 4));
        o->u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                          _mm512_slli_epi16(hb, 4));
        const __m512i ia = _mm512_add_epi16(eighth, _mm512_set1_epi16((short)(8 * h)));
        o->sc[2 * h] = _mm512_permutexvar_epi16(ia, sc16);
        o->sc[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(ia, _mm512_set1_epi16(4)), sc16);
    }
    o->neg32 = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));
}

/* the superblock's exact isum with one token: sum over k of scales[k] * ((u - 32) . q), q (256)
 * the token's int8, bs (16) its sums per 16 values */
static inline int32_t q6k_isum_u(const q6k_unpacked *o, const int8_t *q, const int16_t *bs) {
    __m512i acc = _mm512_castsi256_si512(_mm256_madd_epi16(
        o->neg32, _mm256_loadu_si256((const __m256i *)bs)));  // -32 * scales . sums, lanes 0..7
    acc = _mm512_zextsi256_si512(_mm512_castsi512_si256(acc));
    for (int v = 0; v < 4; v++)
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(
            _mm512_maddubs_epi16(o->u[v], _mm512_loadu_si512(q + 64 * v)), o->sc[v]));
    return _mm512_reduce_add_epi32(acc);
}
#endif

#if defined(QK_256)
/* a q6_k superblock unpacked once for any number of tokens (AVX2): u[4h + g] the unsigned 6-bit
 * values 128h + 32g .. +31 (fli_q6k_half), sc[4h + g] the int16 scales of their two sub-blocks,
 * neg32 (16) -32 * scales */
typedef struct {
    __m256i u[8], sc[8], neg32;
} q6k_unpacked;

/* [scales[k] x8 | scales[k + 1] x8] as int16, from the 16 int8 scales sc8 (k = 8h + 2g: the
 * sub-blocks of values 128h + 32g .. +31) */
static inline __m256i q6k_pair_scales(__m128i sc8, int k) {
    const char a = (char)k, b = (char)(k + 1);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b,
                                                                    b, b, b, b, b)));
}

/* -32 * scales . bs: the offset of u against a token's sums per 16 values bs (16) */
static inline __m256i q6k_offset(__m128i sc8, const int16_t *bs) {
    return _mm256_madd_epi16(_mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_set1_epi16(-32)),
                             _mm256_loadu_si256((const __m256i *)bs));
}

static inline void q6k_unpack(const uint8_t *sb, q6k_unpacked *o) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(sb + 192));  // (16) int8 scales
    o->neg32 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_set1_epi16(-32));
    for (int h = 0; h < 2; h++) {
        fli_q6k_half(sb, h, o->u + 4 * h);
        for (int g = 0; g < 4; g++) o->sc[4 * h + g] = q6k_pair_scales(sc8, 8 * h + 2 * g);
    }
}

/* the superblock's exact isum with one token: sum over k of scales[k] * ((u - 32) . q), q (256)
 * the token's int8, bs (16) its sums per 16 values */
static inline int32_t q6k_isum_u(const q6k_unpacked *o, const int8_t *q, const int16_t *bs) {
    __m256i acc = _mm256_madd_epi16(o->neg32, _mm256_loadu_si256((const __m256i *)bs));
    for (int v = 0; v < 8; v++)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(
            _mm256_maddubs_epi16(o->u[v], _mm256_loadu_si256((const __m256i *)(q + 32 * v))), o->sc[v]));
    return fli_hsum256_i32(acc);
}

/* q6k_isum_u of one token without keeping the unpacked superblock (faster for one token) */
static int32_t q6k_isum1(const uint8_t *sb, const int8_t *q, const int16_t *bs) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(sb + 192));  // (16) int8 scales
    __m256i acc = q6k_offset(sc8, bs);
    for (int h = 0; h < 2; h++) {
        __m256i u[4];
        fli_q6k_half(sb, h, u);
        for (int g = 0; g < 4; g++) {
            const __m256i p = _mm256_maddubs_epi16(
                u[g], _mm256_loadu_si256((const __m256i *)(q + 128 * h + 32 * g)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, q6k_pair_scales(sc8, 8 * h + 2 * g)));
        }
    }
    return fli_hsum256_i32(acc);
}
#endif

#endif
