/* attend.c — one query head's attention over the KV cache (fli_attend_one in attend.h).
 *
 * With an f16 cache the operands meet as in llama.cpp's attention over its f16 cache (without
 * flash attention: two matrix products whose f32 operand ggml converts to the cache's type):
 * q_h rounded to f16, the weights softmax in f32 (its sum in double) rounded to f16, then their
 * products with V summed in f32.
 *
 * A decode token reads every cached key and value of every head: at position p, 2 p head_dim
 * f16 a head. Through the per-row kernels (vec.c: an indirect call, a load and store of the
 * output row, per key) that ran at ~6 GB/s a core (an OLMoE-shape layer at p = 128: 89 us on 2
 * threads, docs/KERNELS.md). When head_dim is 4, 8 or 16 vectors (64 / 128 / 256 under
 * AVX-512) the query and the output row stay in registers instead, summed in the same order as
 * the per-row kernels (two chains over alternate vectors for q . k, one FMA a key for the
 * output), so the bits are theirs.
 */
#include <math.h>
#include <string.h>

#include "attend.h"
#include "base.h"
#include "traits.h"
#include "vec_simd.h"

#define ATT_MAXV 16 /* vectors of a head the register path holds */
#ifndef ATT_AHEAD
#define ATT_AHEAD 8 /* keys ahead whose row a head prefetches (each on a page of its own) */
#endif

/* scores[s] = scale * (q . K[s]), K rows of f16 rb bytes apart, NV vectors a row: dot_plain's
 * order (vec.c), chain a0 the even vectors, a1 the odd ones */
static inline __attribute__((always_inline)) void f16_scores(const float *q, const uint8_t *k,
                                                             int64_t n_keys, int64_t rb, int NV,
                                                             float scale, float *scores) {
    vf qv[ATT_MAXV];
    for (int j = 0; j < NV; j++) qv[j] = vload(q + j * VW);
    for (int64_t s = 0; s < n_keys; s++) {
        const uint8_t *ks = k + s * rb;
        if (s + ATT_AHEAD < n_keys) fli_prefetch(ks + ATT_AHEAD * rb, (size_t)NV * VW * 2);
        vf a0 = vzero(), a1 = vzero();
        for (int j = 0; j + 1 < NV; j += 2) {
            a0 = vfma(vload_h(ks + 2 * j * VW), qv[j], a0);
            a1 = vfma(vload_h(ks + 2 * (j + 1) * VW), qv[j + 1], a1);
        }
        scores[s] = scale * vsum(vadd(a0, a1));
    }
}

/* outh (NV vectors) = sum over s of w[s] V[s] (w[s] != 0), V rows of f16 rb bytes apart:
 * axpy_plain's order (one FMA a key into the running sum from 0) */
static inline __attribute__((always_inline)) void f16_mix(const float *w, const uint8_t *v,
                                                          int64_t n_keys, int64_t rb, int NV,
                                                          float *outh) {
    vf acc[ATT_MAXV];
    for (int j = 0; j < NV; j++) acc[j] = vzero();
    for (int64_t s = 0; s < n_keys; s++) {
        if (w[s] == 0.0f) continue;
        const vf ws = vset1(w[s]);
        const uint8_t *vs = v + s * rb;
        if (s + ATT_AHEAD < n_keys) fli_prefetch(vs + ATT_AHEAD * rb, (size_t)NV * VW * 2);
        for (int j = 0; j < NV; j++) acc[j] = vfma(ws, vload_h(vs + 2 * j * VW), acc[j]);
    }
    for (int j = 0; j < NV; j++) vstore(outh + j * VW, acc[j]);
}

/* the register path's vectors a head (0: none for head_dim) */
static int register_vectors(int64_t head_dim) {
    if (head_dim % VW != 0 || VW < 8) return 0;   // plain C (VW 1): the per-row kernels
    const int64_t nv = head_dim / VW;
    return nv == 4 || nv == 8 || nv == 16 ? (int)nv : 0;
}

static void f16_scores_nv(int nv, const float *q, const uint8_t *k, int64_t n_keys, int64_t rb,
                          float scale, float *scores) {
    if (nv == 4) f16_scores(q, k, n_keys, rb, 4, scale, scores);
    else if (nv == 8) f16_scores(q, k, n_keys, rb, 8, scale, scores);
    else f16_scores(q, k, n_keys, rb, 16, scale, scores);
}

static void f16_mix_nv(int nv, const float *w, const uint8_t *v, int64_t n_keys, int64_t rb,
                       float *outh) {
    if (nv == 4) f16_mix(w, v, n_keys, rb, 4, outh);
    else if (nv == 8) f16_mix(w, v, n_keys, rb, 8, outh);
    else f16_mix(w, v, n_keys, rb, 16, outh);
}

/* scores (n_keys) = exp(scores - max); their f32 sum, and in *sum_d their sum in double */
static float softmax_exp(float *scores, int64_t n_keys, double *sum_d) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t s = 0; s < n_keys; s++) mx = scores[s] > mx ? scores[s] : mx;
    *sum_d = 0.0;
    for (int64_t s = 0; s < n_keys; s++) {
        scores[s] = expf(scores[s] - mx);
        sum += scores[s];
        *sum_d += scores[s];
    }
    return sum;
}

void fli_attend_one(const float *qh, const uint8_t *k, const uint8_t *v, int32_t kv_dtype,
                    float *outh, int64_t n_keys, int64_t row_bytes, int64_t head_dim,
                    float scale, float *scores, float *q16) {
    const int f16 = kv_dtype == FL_F16, nv = f16 ? register_vectors(head_dim) : 0;
    if (f16)
        for (int64_t i = 0; i < head_dim; i++) q16[i] = fl_fp16_to_fp32(fl_fp32_to_fp16(qh[i]));
    const float *q = f16 ? q16 : qh;
    if (nv)
        f16_scores_nv(nv, q, k, n_keys, row_bytes, scale, scores);
    else
        for (int64_t s = 0; s < n_keys; s++)
            scores[s] = scale * fli_dot(kv_dtype, k + s * row_bytes, q, head_dim);
    double sum_d;
    const float sum = softmax_exp(scores, n_keys, &sum_d);
    if (f16) {                              // the weights as ggml rounds them to f16
        const float inv = (float)(1.0 / sum_d);
        for (int64_t s = 0; s < n_keys; s++)
            scores[s] = fl_fp16_to_fp32(fl_fp32_to_fp16(scores[s] * inv));
        if (nv) {
            f16_mix_nv(nv, scores, v, n_keys, row_bytes, outh);
            return;
        }
    }
    memset(outh, 0, (size_t)head_dim * sizeof(float));
    for (int64_t s = 0; s < n_keys; s++)    // f16: a weight rounded to 0 adds nothing
        if (!f16 || scores[s] != 0.0f)
            fli_axpy(kv_dtype, v + s * row_bytes, scores[s], outh, head_dim);
    if (f16) return;
    const float inv = 1.0f / sum;           // f32: the weights normalised at the end
    for (int64_t i = 0; i < head_dim; i++) outh[i] *= inv;
}
