/* act_quant.c — a token's int8 activations for qdot.c / qgemm.c / q4k.c (the fli_xq_bytes layout).
 *
 * Per block b of 32 values: q[32] = nearest-even(x * (1/d)), d = amax / 127 (f32, so x = d * q up
 * to d/2 per value), as ggml's q8_0; for k-quant weights one d per 256-value superblock (the amax
 * of all its blocks, as ggml's q8_K), so the sub-block scales combine in integer arithmetic
 * (fli_q4k_tile1, qk.c), and the sums of q per 32 and per 16 values are kept as int16 too
 * (ggml's bsums). Every block
 * also carries FL_XQ_LANES copies of d, the correction -bias * sum(q) of weights stored with an
 * offset (q4_0 nibbles + 8; q5_0 values + 16; q8_0 + 128 where the dot is VNNI's unsigned x signed, FLI_Q8_BIAS)
 * and d * sum(q) (the m_w term of q4_1 and q4_k, as llama.cpp's q8_1 keeps s = d * sum(q)).
 * AVX-512, AVX2 or plain C: the same f32 operations, so every build gives the same bytes.
 */
#include <math.h>

#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define XQ_W 16 /* f32 lanes of a vector */
#elif defined(__AVX2__)
#include <immintrin.h>
#define XQ_W 8
#else
#define XQ_W 0
#endif

int64_t fli_xq_bytes(int64_t n) {
    const int64_t nb = n / FL_QK;
    return n + nb * FL_XQ_LANES * 12 + (nb + 7) / 8 * 48;
}

/* q (32) = nearest-even(xb * id), id = 127 / top, top = max(amax, amax0); *sum = sum of q; the
 * block's d (its return value) is ggml's: f16(top / 127) for a block of its own (q8_0 / q8_1 keep
 * d in f16, and their dots multiply that), 1 / id for a k-quant superblock (q8_K's d = 1 /
 * iscale, f32). (q4_1 / q5_1's m term uses d * sum(q) of this d; ggml's q8_1 keeps
 * f16(top / 127 * sum(q)) instead, a difference left alone.)
 * amax0: 0, or the amax of the k-quant superblock xb is part of (kq: xb is in one).
 * Vector paths: the same f32 operations (cvtps rounds to nearest even as nearbyintf does under
 * the default rounding mode), so every path gives the same bytes. */
static inline float quantize_block(const float *xb, float amax0, int kq, int8_t *q,
                                   int32_t *sum) {
#if XQ_W == 16
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#elif XQ_W == 8
    __m256 v[4], m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.0f;
    for (int j = 0; j < FL_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
#endif
    const float top = amax > amax0 ? amax : amax0;
    const float id = top != 0.0f ? 127.0f / top : 0.0f;
    const float d = kq   ? (id != 0.0f ? 1.0f / id : 0.0f)
                    : fl_fp16_to_fp32(fl_fp32_to_fp16(top / 127.0f));
#if XQ_W == 16
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(a));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(b));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
#elif XQ_W == 8
    __m256i acc = _mm256_setzero_si256(), w[4];
    for (int k = 0; k < 4; k++) {
        w[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
        acc = _mm256_add_epi32(acc, w[k]);
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]),
                                         _mm256_packs_epi32(w[2], w[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *sum = fli_hsum256_i32(acc);
#else
    int32_t s = 0;
    for (int j = 0; j < FL_QK; j++) {
        q[j] = (int8_t)nearbyintf(xb[j] * id);
        s += q[j];
    }
    *sum = s;
#endif
    return d;
}

/* the largest |x| of a superblock x (FL_QK_K): exact in any order, so every build agrees */
static float amax_of(const float *x) {
#if XQ_W == 16
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < FL_QK_K; j += 16)
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    return _mm512_reduce_max_ps(m);
#else
    float m = 0.0f;
    for (int j = 0; j < FL_QK_K; j++) m = fabsf(x[j]) > m ? fabsf(x[j]) : m;
    return m;
#endif
}

void fli_xq_quantize(int32_t dtype, const float *x, int64_t n, uint8_t *buf) {
    const int64_t nb = n / FL_QK;
    int8_t *q = (int8_t *)buf;                                // (n)
    float *scale = (float *)(buf + n);                        // (nb, 8)
    int32_t *corr = (int32_t *)(scale + nb * FL_XQ_LANES);     // (nb, 8)
    float *msum = (float *)(corr + nb * FL_XQ_LANES);           // (nb, 8)
    int16_t *bsum = (int16_t *)(msum + nb * FL_XQ_LANES);       // (nb) k-quants only
    int16_t *bsum16 = bsum + (nb + 7) / 8 * 8;                  // (2 nb) k-quants only
    const int32_t bias = dtype == FL_Q4_0   ? 8
                         : dtype == FL_Q5_0 ? 16
                         : dtype == FL_Q8_0 ? FLI_Q8_BIAS
                                            : 0;
    const int kq = fli_is_kquant(dtype);
    float amax0 = 0.0f;  // k-quants: one d per superblock (as ggml's q8_K), so their scales combine
    int sb = 0;          // this block is part of a whole superblock of a k-quant
    for (int64_t b = 0; b < nb; b++) {
        if (b % 8 == 0) {
            sb = kq && b + 8 <= nb;
            amax0 = sb ? amax_of(x + b * FL_QK) : 0.0f;
        }
        int32_t sum;
        const float d = quantize_block(x + b * FL_QK, amax0, sb, q + b * FL_QK, &sum);
        if (kq) {
            int32_t half = 0;
            for (int j = 0; j < FL_QK / 2; j++) half += q[b * FL_QK + j];
            bsum[b] = (int16_t)sum;
            bsum16[2 * b] = (int16_t)half;
            bsum16[2 * b + 1] = (int16_t)(sum - half);
        }
        for (int l = 0; l < FL_XQ_LANES; l++) {
            scale[b * FL_XQ_LANES + l] = d;
            corr[b * FL_XQ_LANES + l] = l == 0 ? -bias * sum : 0;
            msum[b * FL_XQ_LANES + l] = l == 0 ? d * (float)sum : 0.0f;
        }
    }
}
