/* base.h — what every compute file uses (header only, below every other compute module): fp16 <->
 * fp32 conversion (F16C when the build has it, otherwise exact bit manipulation with
 * round-to-nearest-even, as in ggml), horizontal vector sums, cache prefetch, and the size of
 * an int8 tile. Internal to the extension: not part of the C API, not seen by cffi. */
#ifndef FLASHLLM_BASE_H
#define FLASHLLM_BASE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "flashllm.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define FL_QT 4 /* weight rows x tokens of one int8 tile (traits.h: fli_qdot_tile), rows of an axpy4 */

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

/* ask the cache for the n bytes at p (into every level: NTA hints evicted data we reuse) */
static inline void fli_prefetch(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* the same into L2 only (prefetcht1): what a long stream far ahead wants (q0pack.c) */
static inline void fli_prefetch_l2(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 2);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* 4 activation bytes in every int32 lane: what the packed kernels' vpdpbusd meets */
static inline __m512i fli_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#endif

#endif /* FLASHLLM_BASE_H */
