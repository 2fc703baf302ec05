/* packloop.h — the token loop of the 16-row packed k-quant layouts (q4kpack.c, q5kpack.c,
 * q6kpack.c, q23pack.c). A layout gives its superblock body, out[t] (16 lanes: the group's rows)
 * += one superblock of SB bytes against NT tokens; the loop gives each superblock the tokens'
 * operands (act_quant.h's fli_xq_sb), prefetches half a superblock on (the layouts that gain
 * from it: pf) and stores the rows (+ bias). fli_pack_scale is the f32 end of a superblock with
 * mins (Q2_K, Q5_K). All are always inline, the body a constant function pointer and NT a
 * constant in each case of fli_pack_group, so every layout and token count compiles to a loop of
 * its own with the body inlined, as when each file wrote its own. Internal: not seen by cffi; AVX-512 VNNI builds
 * only (the layouts' group bytes are 0 elsewhere). */
#ifndef FLASHLLM_PACKLOOP_H
#define FLASHLLM_PACKLOOP_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include "act_quant.h"
#include "base.h"
#include "dtype.h"

#define FLI_PACK_T 4 /* tokens per kernel call at most */

/* out[t] (16 lanes) += superblock blk of a group against tokens x[t], t < NT */
typedef void (*fli_pack_body)(const uint8_t *blk, const fli_xq_sb *x, int NT,
                              __m512 out[FLI_PACK_T]);

/* out[t] (16 lanes) += d_r d_x isum[t]_r - dmin_r d_x msum[t]_r for t < NT: a superblock's f16
 * d and dmin of the 16 rows at blk and blk + 32 */
static inline __attribute__((always_inline)) void fli_pack_scale(const uint8_t *blk,
                                                                 const fli_xq_sb *x, int NT,
                                                                 const __m512i *isum,
                                                                 const __m512i *msum,
                                                                 __m512 out[FLI_PACK_T]) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    for (int t = 0; t < NT; t++) {
        const __m512 dx = _mm512_set1_ps(x[t].dx);
        out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), out[t]);
        out[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[t]), _mm512_mul_ps(dmin, dx), out[t]);
    }
}

/* y[t * ld + r] (+ bias (16)) for the 16 rows of group gp (n / 256 superblocks of sb bytes)
 * and NT tokens xq (xb bytes apart); pf: prefetch a superblock's bytes half a superblock on,
 * else the hardware's prefetchers alone read ahead */
static inline __attribute__((always_inline)) void fli_pack_tokens(fli_pack_body body, size_t sb,
                                                                  int pf,
                                                                  const uint8_t *gp, int64_t n,
                                                                  const uint8_t *xq, size_t xb,
                                                                  int NT, float *y, int64_t ld,
                                                                  const float *bias) {
    __m512 out[FLI_PACK_T];
    for (int t = 0; t < NT; t++) out[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n / FL_QK_K; s++) {
        fli_xq_sb x[FLI_PACK_T];
        for (int t = 0; t < NT; t++) x[t] = fli_xq_superblock(xq + (size_t)t * xb, n, s);
        // half a superblock on and across groups: the next group follows in memory, and a
        // prefetch stopped at the group's end left the stream to stall (docs/MEASUREMENTS.md).
        // q4_k's body is the lightest: there the prefetches cost more than they bring
        // (docs/KERNELS.md, "Prefetch across groups")
        if (pf) fli_prefetch(gp + (size_t)s * sb + sb / 2, sb);
        body(gp + (size_t)s * sb, x, NT, out);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + t * ld, _mm512_add_ps(out[t], b));
}

/* fli_pack_tokens for NT = 1, 2, 3 or 4 (more: 4), each its own specialization */
static inline __attribute__((always_inline)) void fli_pack_group(fli_pack_body body, size_t sb,
                                                                 int pf,
                                                                 const uint8_t *gp, int64_t n,
                                                                 const uint8_t *xq, size_t xb,
                                                                 int NT, float *y, int64_t ld,
                                                                 const float *bias) {
    switch (NT) {
    case 1: fli_pack_tokens(body, sb, pf, gp, n, xq, xb, 1, y, ld, bias); break;
    case 2: fli_pack_tokens(body, sb, pf, gp, n, xq, xb, 2, y, ld, bias); break;
    case 3: fli_pack_tokens(body, sb, pf, gp, n, xq, xb, 3, y, ld, bias); break;
    default: fli_pack_tokens(body, sb, pf, gp, n, xq, xb, 4, y, ld, bias); break;
    }
}
#endif

#endif /* FLASHLLM_PACKLOOP_H */
