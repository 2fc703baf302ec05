/* kblock.h — inline helpers that read one k-quant superblock (internal to the compute
 * kernel, not seen by cffi): Q4_K's 6-bit scales and mins unpacked, plain and (AVX2 + F16C) as
 * vectors, the nibbles of a Q4_K sub-block, and (AVX2 + F16C) a Q6_K half's 6-bit values.
 * Included by the files that read k-quant superblocks. */
#ifndef FLASHLLM_KBLOCK_H
#define FLASHLLM_KBLOCK_H

#include <stdint.h>
#include <string.h>

#include "base.h"
#include "dtype.h"

/* Q4_K superblock sb: the bytes of u (4) = its 6-bit scales sc_0..7 then mins m_0..7, unpacked
 * from scales[12] four at a time with 32-bit masks as ggml's AVX2 q4_K dot does (the values of
 * get_scale_min_k4) */
static inline void fli_q4k_unpack(const uint8_t *sb, uint32_t u[4]) {
    uint32_t a, b, c;  // scales bytes 0..3, 4..7, 8..11
    memcpy(&a, sb + 4, 4);
    memcpy(&b, sb + 8, 4);
    memcpy(&c, sb + 12, 4);
    u[0] = a & 0x3f3f3f3fu;
    u[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    u[2] = b & 0x3f3f3f3fu;
    u[3] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
}

/* sc (8) = d * sc_j and mn (8) = -(dmin * m_j) of superblock sb's 32-value sub-blocks, so
 * value i of sub-block j is sc[j] * nibble + mn[j] */
static inline void fli_q4k_scales(const uint8_t *sb, float sc[8], float mn[8]) {
    uint32_t u[4];
    uint8_t q[16];  // sc_0..7, m_0..7
    fli_q4k_unpack(sb, u);
    memcpy(q, u, sizeof q);
    const float d = fl_load_fp16(sb), dmin = fl_load_fp16(sb + 2);
    for (int j = 0; j < 8; j++) {
        sc[j] = d * (float)q[j];
        mn[j] = -(dmin * (float)q[8 + j]);
    }
}

#if defined(__AVX2__) && defined(__F16C__)
/* Q6_K superblock sb, half h (values 128h ..): u[g] (32 bytes) the unsigned 6-bit values
 * 128h + 32g .. +31 — a nibble of ql (low for g < 2) and bits 2g, 2g + 1 of qh as bits 4, 5 */
static inline void fli_q6k_half(const uint8_t *sb, int h, __m256i u[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i qa = _mm256_loadu_si256((const __m256i *)(sb + 64 * h));
    const __m256i qb = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
    u[0] = _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    u[1] = _mm256_or_si256(_mm256_and_si256(qb, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(qh, m30));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

/* Q4_K superblock sb: *sc (8) = d * sc_j, *mn (8) = -dmin * m_j (fli_q4k_scales in vectors) */
static inline void fli_q4k_scales8(const uint8_t *sb, __m256 *sc, __m256 *mn) {
    uint32_t u[4];
    fli_q4k_unpack(sb, u);
    const __m128i v = _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);  // sc, m bytes
    *sc = _mm256_mul_ps(_mm256_set1_ps(fl_load_fp16(sb)),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *mn = _mm256_mul_ps(_mm256_set1_ps(-fl_load_fp16(sb + 2)),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
#endif

/* the 32 nibble bytes of sub-block j of Q4_K superblock sb: its values are their low nibbles
 * (j even) or high nibbles (j odd) */
static inline const uint8_t *fli_q4k_qs(const uint8_t *sb, int64_t j) {
    return sb + 16 + 32 * (j / 2);
}

#endif /* FLASHLLM_KBLOCK_H */
