/* act.c — the SwiGLU product h = silu(g) * u over a row of values, vectorized (the FFN's
 * prefill computes it for every neuron and token; a libm expf per value cost ~10% of a 64-token
 * FFN layer).
 *
 * exp is Cephes' expf: x = n ln2 + r (ln2 in two parts, |r| <= ln2 / 2), a degree-6 polynomial
 * in r, times 2^n; about 1 ulp from libm's expf. The argument is clamped to [-87.3, 88.3], where
 * silu(g) = g / (1 + exp(-g)) has already reached -0 / g in f32. AVX-512, AVX2 + FMA or plain C
 * (libm expf) at compile time.
 */
#include <math.h>
#include <pthread.h>

#include "flashllm.h"
#include "act.h"
#include "base.h"

#define EXP_HI 88.3f
#define EXP_LO -87.3f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vf vclamp(vf a) {
    return _mm512_min_ps(_mm512_max_ps(a, vset1(EXP_LO)), vset1(EXP_HI));
}
static inline vf vpow2i(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VADD _mm512_add_ps
#define VMUL _mm512_mul_ps
#define VDIV _mm512_div_ps
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vf vclamp(vf a) {
    return _mm256_min_ps(_mm256_max_ps(a, vset1(EXP_LO)), vset1(EXP_HI));
}
static inline vf vpow2i(vf p, vf n) {  // p * 2^n, n in [-126, 127]
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VADD _mm256_add_ps
#define VMUL _mm256_mul_ps
#define VDIV _mm256_div_ps
#endif

#ifdef VW
/* exp(x) per lane, x clamped to [EXP_LO, EXP_HI] */
static inline vf vexp(vf x) {
    x = vclamp(x);
    const vf n = vround(VMUL(x, vset1(LOG2E)));
    vf r = vfma(n, vset1(-LN2_HI), x);
    r = vfma(n, vset1(-LN2_LO), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, VMUL(r, r), VADD(r, vset1(1.0f)));
    return vpow2i(p, n);
}
#endif

void fli_silu_mul(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
#ifdef VW
    for (; i + VW <= n; i += VW) {
        const vf gv = VLOAD(g + i);
        const vf e = vexp(VMUL(gv, vset1(-1.0f)));
        VSTORE(h + i, VMUL(VDIV(gv, VADD(vset1(1.0f), e)), VLOAD(u + i)));
    }
#endif
    for (; i < n; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static float gelu_table[1 << 16];  /* f16 bits -> GELU of that value rounded to f16 */
static pthread_once_t gelu_once = PTHREAD_ONCE_INIT;

static void gelu_fill(void) {  /* ggml_table_gelu_f16: its ggml_gelu_f32 of every f16 value */
    for (uint32_t i = 0; i < (1u << 16); i++) {
        const float x = fl_fp16_to_fp32((uint16_t)i);
        const float y = 0.5f * x * (1.0f + tanhf(0.79788456080286536f * x * (1.0f + 0.044715f * x * x)));
        gelu_table[i] = fl_fp16_to_fp32(fl_fp32_to_fp16(y));
    }
}

const float *fli_gelu_f16_table(void) {
    pthread_once(&gelu_once, gelu_fill);
    return gelu_table;
}

/* h (n) = gelu_f16(g) * u: fli_gelu_f16 of each value, 16 lanes at a time with AVX-512 (the
 * same f16 rounding, table entries and product) */
static void gelu_f16_mul(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const float *tab = fli_gelu_f16_table();
    const __m512 lo = _mm512_set1_ps(-10.0f), hi = _mm512_set1_ps(10.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512i idx = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        __m512 a = _mm512_i32gather_ps(idx, tab, 4);
        a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(v, hi, _CMP_GE_OQ), v);
        a = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(v, lo, _CMP_LE_OQ), a);
        _mm512_storeu_ps(h + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) h[i] = fli_gelu_f16(g[i]) * u[i];
}

int32_t fl_act_mul(int32_t act, const float *g, const float *u, float *h, int64_t n) {
    if (!u || !h || n < 0 || act < FL_ACT_SILU || act > FL_ACT_GELU_TANH_F16) return FL_EINVAL;
    if (g && act == FL_ACT_SILU) {
        fli_silu_mul(g, u, h, n);
        return FL_OK;
    }
    if (g && act == FL_ACT_GELU_TANH_F16) {
        gelu_f16_mul(g, u, h, n);
        return FL_OK;
    }
    for (int64_t i = 0; i < n; i++) h[i] = g ? fli_activate(act, g[i]) * u[i] : fli_activate(act, u[i]);
    return FL_OK;
}
