/* vec_simd.h — the small f32 vector abstraction of vec.c, gemm_f32.c and bounds.c (header
 * only): vf, VW lanes, AVX-512, AVX2 + FMA + F16C or plain C chosen at compile time, and the
 * loads of one 32-value quantized block's unscaled values (q8_0, q4_0, q4_1 / unsigned nibbles,
 * q5_0 / q5_1). */
#ifndef FLASHLLM_VEC_SIMD_H
#define FLASHLLM_VEC_SIMD_H

#include "base.h"
#include "dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vload_h(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vsqrt(vf a) { return _mm512_sqrt_ps(a); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline void load_q8(const uint8_t *qs, vf v[2]) {
    v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
}
/* nibble -> float by table lookup: vpermps reads only the low 4 bits of each index lane */
static inline void load_q4(const uint8_t *qs, vf v[2]) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    v[0] = _mm512_permutexvar_ps(raw, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
}
static inline void load_q4u(const uint8_t *qs, vf v[2]) {  // unsigned nibbles 0..15, as above
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    v[0] = _mm512_permutexvar_ps(raw, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
}
/* q5 values: nibble - off (off 16 for q5_0, 0 for q5_1), + 16 where bit j of qh is set */
static inline void load_q5(const uint8_t *qs, uint32_t qh, float off, vf v[2]) {
    load_q4u(qs, v);
    const __m512 sixteen = _mm512_set1_ps(16.0f), o = _mm512_set1_ps(off);
    v[0] = _mm512_mask_add_ps(_mm512_sub_ps(v[0], o), (__mmask16)(qh & 0xFFFF),
                              _mm512_sub_ps(v[0], o), sixteen);
    v[1] = _mm512_mask_add_ps(_mm512_sub_ps(v[1], o), (__mmask16)(qh >> 16),
                              _mm512_sub_ps(v[1], o), sixteen);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vload_h(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vsqrt(vf a) { return _mm256_sqrt_ps(a); }
static inline float vsum(vf a) { return fli_hsum256(a); }
static inline vf cvt8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
static inline void load_q8(const uint8_t *qs, vf v[4]) {
    const __m128i a = _mm_loadu_si128((const __m128i *)qs);
    const __m128i b = _mm_loadu_si128((const __m128i *)(qs + 16));
    v[0] = cvt8(a);
    v[1] = cvt8(_mm_srli_si128(a, 8));
    v[2] = cvt8(b);
    v[3] = cvt8(_mm_srli_si128(b, 8));
}
static inline void load_q4(const uint8_t *qs, vf v[4]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, m), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m), eight);
    v[0] = cvt8(lo);
    v[1] = cvt8(_mm_srli_si128(lo, 8));
    v[2] = cvt8(hi);
    v[3] = cvt8(_mm_srli_si128(hi, 8));
}
static inline void load_q4u(const uint8_t *qs, vf v[4]) {  // unsigned nibbles 0..15
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    v[0] = cvt8(lo);
    v[1] = cvt8(_mm_srli_si128(lo, 8));
    v[2] = cvt8(hi);
    v[3] = cvt8(_mm_srli_si128(hi, 8));
}
static inline void load_q5(const uint8_t *qs, uint32_t qh, float off, vf v[4]) {
    load_q4u(qs, v);
    for (int k = 0; k < 4; k++) {  // lane i of v[k] is value 8k + i
        const __m256i bits = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (8 * k))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), _mm256_set1_epi32(1));
        v[k] = _mm256_add_ps(_mm256_sub_ps(v[k], _mm256_set1_ps(off)),
                             _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(16.0f)));
    }
}
#else
typedef float vf;
#define VW 1
static inline vf vzero(void) { return 0.0f; }
static inline vf vset1(float a) { return a; }
static inline vf vload(const float *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}
static inline void vstore(float *p, vf v) { *p = v; }
static inline vf vload_h(const uint8_t *p) { return fl_load_fp16(p); }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vsqrt(vf a) { return sqrtf(a); }
static inline float vsum(vf a) { return a; }
static inline void load_q8(const uint8_t *qs, vf v[32]) {
    for (int j = 0; j < 32; j++) v[j] = (float)(int8_t)qs[j];
}
static inline void load_q4(const uint8_t *qs, vf v[32]) {
    for (int j = 0; j < 16; j++) {
        v[j] = (float)((qs[j] & 0x0F) - 8);
        v[j + 16] = (float)((qs[j] >> 4) - 8);
    }
}
static inline void load_q4u(const uint8_t *qs, vf v[32]) {
    for (int j = 0; j < 16; j++) {
        v[j] = (float)(qs[j] & 0x0F);
        v[j + 16] = (float)(qs[j] >> 4);
    }
}
static inline void load_q5(const uint8_t *qs, uint32_t qh, float off, vf v[32]) {
    for (int j = 0; j < 16; j++) {
        v[j] = (float)((qs[j] & 0x0F) | ((qh >> j) & 1) << 4) - off;
        v[j + 16] = (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off;
    }
}
#endif

#endif /* FLASHLLM_VEC_SIMD_H */
