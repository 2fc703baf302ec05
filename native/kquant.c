/* kquant.c — quantize rows to ggml's Q2_K, Q4_K, Q5_K and Q6_K, by ggml's reference algorithm
 * (quantize_row_q2_K_ref / q4_K_ref / q5_K_ref / q6_K_ref: no importance matrix), bit for bit
 * (tests/test_kquant.py checks it against ggml_quantize_chunk of llama.cpp's library).
 *
 * Q4_K / Q5_K: each 32-value sub-block gets an asymmetric fit (scale s_j, min m_j) by a search
 * of the grid step weighted by av + |x| (av the sub-block's rms), 20 steps for 15 levels, 15 for
 * 31; the 8 scales and mins are then quantized to 6 bits against their largest (d, dmin in f16),
 * and every value is re-rounded to the stored grid. Q6_K: each 16-value sub-block gets a
 * symmetric scale (make_qx_quants, 64 levels, x^2-weighted, 18 trial steps), the 16 scales go to
 * int8 against the largest |scale| (d in f16), and the values are re-rounded. Q2_K: each 16-value
 * sub-block gets Q4_K's asymmetric fit on 4 levels (|x|-weighted, absolute errors, 16 trial
 * steps); its scale and min go to 4 bits against the largest (d, dmin in f16).
 * The float arithmetic is ggml's, operation for operation: this file relies on the build not
 * contracting a * b + c into an FMA (-std=c11 implies -ffp-contract=off in GCC).
 */
#include <math.h>

#include "flashllm.h"
#include "base.h"
#include "dtype.h"
#include "kblock.h"
#include "kquant.h"

#define GROUP_EPS 1e-15f /* ggml's GROUP_MAX_EPS: a q6_k superblock with smaller scales is zero */

/* round to nearest, ties to even, as ggml's nearest_int (|x| < 2^22) */
static inline int nearest(float x) {
    float v = x + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static inline float f16_round(float x) { return fl_fp16_to_fp32(fl_fp32_to_fp16(x)); }

/* x (n) on levels L (n) in 0..nmax with scale s and min -*the_min: s * L - the_min, the weighted
 * least-squares fit over nstep + 1 trial steps, each judged by its weighted squared (or, with
 * mad, absolute) error (ggml's make_qkx2_quants); returns s */
static float fit_qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L,
                      float *the_min, float rmin, float rdelta, int nstep, int mad) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; ++i) {
        L[i] = (uint8_t)clampi(nearest(iscale * (x[i] - min)), 0, nmax);
        const float diff = scale * L[i] + min - x[i];
        best += w[i] * (mad ? fabsf(diff) : diff * diff);
    }
    uint8_t aux[32];
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; ++i) {
            const int l = clampi(nearest(iscale * (x[i] - min)), 0, nmax);
            aux[i] = (uint8_t)l;
            sl += w[i] * l;
            sl2 += w[i] * l * l;
            sxl += w[i] * l * x[i];
        }
        const float D = sum_w * sl2 - sl * sl;
        if (!(D > 0)) continue;
        float s = (sum_w * sxl - sum_x * sl) / D, m = (sl2 * sum_x - sl * sxl) / D;
        if (m > 0) {
            m = 0;
            s = sxl / sl2;
        }
        float err = 0;
        for (int i = 0; i < n; ++i) {
            const float diff = s * aux[i] + m - x[i];
            err += w[i] * (mad ? fabsf(diff) : diff * diff);
        }
        if (err < best) {
            memcpy(L, aux, (size_t)n);
            best = err, scale = s, min = m;
        }
    }
    *the_min = -min;
    return scale;
}

/* one q4_k (nmax 15) or q5_k (nmax 31) superblock's d, dmin and packed 6-bit scales into blk
 * (its first 16 bytes), and its levels L (256) on the stored grid */
static void kx_superblock(const float *x, int nmax, uint8_t *blk, uint8_t L[FL_QK_K]) {
    const float rmin = nmax == 15 ? -1.f : -0.5f;
    const int nstep = nmax == 15 ? 20 : 15;
    float scales[8], mins[8], w[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
        const float *xj = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += xj[l] * xj[l];
        const float av = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) w[l] = av + fabsf(xj[l]);
        scales[j] = fit_qkx2(32, nmax, xj, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *sc = blk + 4;  // (12)
    memset(sc, 0, 12);
    for (int j = 0; j < 8; ++j) {
        uint8_t ls = (uint8_t)nearest(inv_scale * scales[j]), lm = (uint8_t)nearest(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t d = fl_fp32_to_fp16(max_scale / 63.f), dmin = fl_fp32_to_fp16(max_min / 63.f);
    memcpy(blk, &d, 2);
    memcpy(blk + 2, &dmin, 2);
    float ds[8], dm[8];  // d * sc_j, -(dmin * m_j): the stored grid
    fli_q4k_scales(blk, ds, dm);
    for (int j = 0; j < 8; ++j) {
        if (!ds[j]) continue;
        for (int i = 0; i < 32; ++i)
            L[32 * j + i] = (uint8_t)clampi(nearest((x[32 * j + i] + -dm[j]) / ds[j]), 0, nmax);
    }
}

static void quantize_sb_q4_k(const float *x, uint8_t *blk) {
    uint8_t L[FL_QK_K];
    kx_superblock(x, 15, blk, L);
    uint8_t *q = blk + 16;  // qs (128): sub-blocks 2k, 2k + 1 in the low / high nibbles
    for (int j = 0; j < FL_QK_K; j += 64, q += 32)
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

static void quantize_sb_q5_k(const float *x, uint8_t *blk) {
    uint8_t L[FL_QK_K];
    kx_superblock(x, 31, blk, L);
    uint8_t *qh = blk + 16, *ql = blk + 48;  // qh (32), qs (128)
    memset(qh, 0, 32 + 128);
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 32; ++i) {
            const uint8_t l = L[32 * j + i];
            qh[i] |= (uint8_t)((l >> 4) << j);
            ql[32 * (j / 2) + i] |= (uint8_t)((l & 0xF) << (4 * (j & 1)));
        }
}

/* x (16) on a symmetric 64-level grid, ggml's make_qx_quants(16, 32, x, L, 1, NULL): L (16) in
 * 0..63 for l + 32; returns the scale */
static float fit_qx(const float *x, int8_t *L) {
    const int nmax = 32;
    float max = 0, amax = 0;
    for (int i = 0; i < 16; ++i)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < GROUP_EPS) {
        memset(L, 0, 16);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < 16; ++i) {
        const int l = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < 16; ++i) {
            const int l = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < 16; ++i)
                L[i] = (int8_t)(nmax + clampi(nearest(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static void quantize_sb_q6_k(const float *x, uint8_t *blk) {
    int8_t L[FL_QK_K];
    float scales[16], max_scale = 0, max_abs = 0;
    for (int ib = 0; ib < 16; ++ib) {
        scales[ib] = fit_qx(x + 16 * ib, L + 16 * ib);
        if (fabsf(scales[ib]) > max_abs) max_abs = fabsf(scales[ib]), max_scale = scales[ib];
    }
    memset(blk, 0, FL_Q6_K_BYTES);
    if (max_abs < GROUP_EPS) return;  // d = +0
    uint8_t *ql = blk, *qh = blk + 128, *sc = blk + 192;
    const float iscale = -128.f / max_scale;
    const uint16_t dh = fl_fp32_to_fp16(1 / iscale);
    memcpy(blk + 208, &dh, 2);
    const float d = fl_fp16_to_fp32(dh);
    for (int ib = 0; ib < 16; ++ib) {
        const int s = nearest(iscale * scales[ib]);
        sc[ib] = (uint8_t)(int8_t)(s < 127 ? s : 127);
    }
    for (int j = 0; j < 16; ++j) {
        const float dj = d * (int8_t)sc[j];
        if (!dj) continue;
        for (int i = 0; i < 16; ++i)
            L[16 * j + i] = (int8_t)(clampi(nearest(x[16 * j + i] / dj), -32, 31) + 32);
    }
    for (int j = 0; j < FL_QK_K; j += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; ++l) {
            const int q1 = L[j + l], q2 = L[j + l + 32], q3 = L[j + l + 64], q4 = L[j + l + 96];
            ql[l] = (uint8_t)((q1 & 0xF) | ((q3 & 0xF) << 4));
            ql[l + 32] = (uint8_t)((q2 & 0xF) | ((q4 & 0xF) << 4));
            qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
        }
}

/* blk: scales[16] (4-bit scale | 4-bit min << 4), qs[64] (value 32k + l of each half of 128 in
 * bits 2k of byte l), f16 d, f16 dmin */
static void quantize_sb_q2_k(const float *x, uint8_t *blk) {
    uint8_t L[FL_QK_K], *sc = blk, *qs = blk + 16;
    float scales[16], mins[16], w[16], max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; ++j) {
        for (int l = 0; l < 16; ++l) w[l] = fabsf(x[16 * j + l]);
        scales[j] = fit_qkx2(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, 1);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float is = max_scale > 0 ? 15.f / max_scale : 0.f, im = max_min > 0 ? 15.f / max_min : 0.f;
    for (int j = 0; j < 16; ++j)
        sc[j] = (uint8_t)((max_scale > 0 ? nearest(is * scales[j]) : 0) |
                          (max_min > 0 ? nearest(im * mins[j]) << 4 : 0));
    const uint16_t d = fl_fp32_to_fp16(max_scale > 0 ? max_scale / 15.f : 0.f);
    const uint16_t dmin = fl_fp32_to_fp16(max_min > 0 ? max_min / 15.f : 0.f);
    memcpy(blk + 80, &d, 2);
    memcpy(blk + 82, &dmin, 2);
    for (int j = 0; j < 16; ++j) {
        const float dj = fl_fp16_to_fp32(d) * (sc[j] & 0xF);
        if (!dj) continue;
        const float mj = fl_fp16_to_fp32(dmin) * (sc[j] >> 4);
        for (int i = 0; i < 16; ++i)
            L[16 * j + i] = (uint8_t)clampi(nearest((x[16 * j + i] + mj) / dj), 0, 3);
    }
    for (int j = 0; j < FL_QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/* dst = src (n) quantized one superblock at a time by sb, kb bytes a superblock */
static void quantize_sbs(void (*sb)(const float *, uint8_t *), size_t kb, const float *src,
                         uint8_t *dst, int64_t n) {
    for (int64_t s = 0; s < n / FL_QK_K; s++) sb(src + s * FL_QK_K, dst + s * kb);
}

void fli_q2k_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_sbs(quantize_sb_q2_k, FL_Q2_K_BYTES, src, dst, n);
}
void fli_q4k_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_sbs(quantize_sb_q4_k, FL_Q4_K_BYTES, src, dst, n);
}
void fli_q5k_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_sbs(quantize_sb_q5_k, FL_Q5_K_BYTES, src, dst, n);
}
void fli_q6k_quantize(const float *src, uint8_t *dst, int64_t n) {
    quantize_sbs(quantize_sb_q6_k, FL_Q6_K_BYTES, src, dst, n);
}
