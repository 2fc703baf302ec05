/* q5kpack.c — Q5_K matrices repacked 16 rows at a time for the AVX-512 VNNI matmul of resident
 * weights (pack.c dispatches; q4kpack.c's layout of the nibbles, one row per int32 lane, plus
 * the fifth bits). A group is exactly as large as its rows (16 x 176 bytes a superblock), so it
 * packs in place: the 6-bit scales stay packed as the rows store them and are unpacked in
 * registers.
 *
 * A group's superblock (Q5_SB bytes):
 *   [0, 32)       d of the 16 rows (f16)       [32, 64)  dmin of the 16 rows (f16)
 *   [64, 256)     the 12 bytes of scales / mins: byte 4c + m (c < 3, m < 4) of row r at
 *                 64 + 64c + 32(m / 2) + 2r + m % 2, so that the unpacked scales (and mins) of
 *                 sub-blocks 2p and 2p + 1 come out as row r's int16 pair
 *   [256, 768)    qh[4k .. +3] of the 16 rows at 256 + 64k (k < 8; bit j: sub-block j)
 *   [768, 2816)   nibbles: bytes 4k .. 4k+3 of row r's 32 bytes qs[32p ..] at 768 + 512p + 64k +
 *                 4r: low nibbles sub-block 2p, high 2p + 1 (q4kpack.c's order)
 * Per superblock and token, exactly as fli_qk_qdot: isum_r = sum_j sc_j * (u . q) and msum_r =
 * sum_j m_j * (the token's sum of q over sub-block j) in integers, then d_r * d_x * isum_r and
 * dmin_r * d_x * msum_r in f32 (added in another order than fli_qk_qdot's).
 * Other builds have no packed layout (group bytes 0): they multiply w as it is.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "packloop.h"
#include "q5kpack.h"

#define Q5_R 16    /* rows per group: the int32 lanes of a zmm */
#define Q5_SB 2816 /* bytes of a group's superblock: 16 x FL_Q5_K_BYTES */
#define Q5_SC 64   /* the 6-bit scales and mins */
#define Q5_QH 256  /* the fifth bits */
#define Q5_QS 768  /* the nibbles */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAS_Q5_PACK 1
#include <immintrin.h>
#endif

size_t fli_q5k_group_bytes(int64_t cols) {
#if defined(HAS_Q5_PACK)
    if (cols > 0 && cols % FL_QK_K == 0) return (size_t)(cols / FL_QK_K) * Q5_SB;
#endif
    (void)cols;
    return 0;
}

/* superblock sb of row r into the group's superblock dst */
static void pack_sb(const uint8_t *sb, int r, uint8_t *dst) {
    memcpy(dst + 2 * r, sb, 2);
    memcpy(dst + 32 + 2 * r, sb + 2, 2);
    for (int c = 0; c < 3; c++)
        for (int m = 0; m < 4; m++)
            dst[Q5_SC + 64 * c + 32 * (m / 2) + 2 * r + m % 2] = sb[4 + 4 * c + m];
    for (int k = 0; k < 8; k++) memcpy(dst + Q5_QH + 64 * k + 4 * r, sb + 16 + 4 * k, 4);
    for (int p = 0; p < 4; p++)
        for (int k = 0; k < 8; k++)
            memcpy(dst + Q5_QS + 512 * p + 64 * k + 4 * r, sb + 48 + 32 * p + 4 * k, 4);
}

void fli_q5k_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst) {
    for (int64_t s = 0; s < cols / FL_QK_K; s++)
        for (int r = 0; r < Q5_R; r++)
            pack_sb(w + (size_t)r * rb + (size_t)s * FL_Q5_K_BYTES, r, dst + (size_t)s * Q5_SB);
}

#if defined(HAS_Q5_PACK)
/* sm (256) = the 6-bit scales (sub-blocks 2p, 2p + 1 of row r at 32p + 2r, + 1) then the mins
 * (at 128 + 32p + 2r, + 1), get_scale_min_k4's values: sub-blocks 0..3 the low 6 bits of bytes
 * 0..3 (mins 4..7); 4..7 the low nibbles of bytes 8..11 with the top 2 bits of bytes 0..3 (mins:
 * the high nibbles, the top bits of 4..7) */
static inline void q5_scales(const uint8_t *blk, uint8_t *sm) {
    const __m512i v0 = _mm512_loadu_si512(blk + Q5_SC), v1 = _mm512_loadu_si512(blk + Q5_SC + 64);
    const __m512i v2 = _mm512_loadu_si512(blk + Q5_SC + 128);
    const __m512i m6 = _mm512_set1_epi8(0x3F), m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i top0 = _mm512_and_si512(_mm512_srli_epi16(v0, 2), m30);
    const __m512i top1 = _mm512_and_si512(_mm512_srli_epi16(v1, 2), m30);
    _mm512_storeu_si512(sm, _mm512_and_si512(v0, m6));
    _mm512_storeu_si512(sm + 64, _mm512_or_si512(_mm512_and_si512(v2, m4), top0));
    _mm512_storeu_si512(sm + 128, _mm512_and_si512(v1, m6));
    _mm512_storeu_si512(sm + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v2, 4), m4), top1));
}

/* hb: bit j of the qh bytes moved to bit 4 */
static inline __m512i bit4(__m512i qh, int j) {
    const __m512i b = j < 4 ? _mm512_slli_epi16(qh, 4 - j) : j > 4 ? _mm512_srli_epi16(qh, j - 4) : qh;
    return _mm512_and_si512(b, _mm512_set1_epi8(0x10));
}

/* out[t] (16 lanes: the group's rows) += superblock blk of the group against NT tokens */
static inline __attribute__((always_inline)) void group_sb(const uint8_t *blk, const fli_xq_sb *x,
                                                           int NT, __m512 out[FLI_PACK_T]) {
    uint8_t sm[256] __attribute__((aligned(64)));
    q5_scales(blk, sm);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i isum[4], msum[4];
    for (int t = 0; t < NT; t++) isum[t] = msum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        __m512i a[4][2][2];  // token, sub-block 2p / 2p + 1, chain (k even / odd for 1 token)
        for (int t = 0; t < NT; t++)
            a[t][0][0] = a[t][0][1] = a[t][1][0] = a[t][1][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512i z = _mm512_loadu_si512(blk + Q5_QS + 512 * p + 64 * k);
            const __m512i qh = _mm512_loadu_si512(blk + Q5_QH + 64 * k);
            const __m512i lo = _mm512_ternarylogic_epi32(z, m4, bit4(qh, 2 * p), 0xEA);  // (z & m4) | hb
            const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(z, 4), m4, bit4(qh, 2 * p + 1), 0xEA);
            for (int t = 0; t < NT; t++) {
                const int8_t *q = x[t].q + 64 * p + 4 * k;
                const int c = NT == 1 ? (k & 1) : 0;  // more tokens: chains enough
                a[t][0][c] = _mm512_dpbusd_epi32(a[t][0][c], lo, fli_bcast4(q));
                a[t][1][c] = _mm512_dpbusd_epi32(a[t][1][c], hi, fli_bcast4(q + 32));
            }
        }
        const __m512i sc = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(sm + 32 * p)));
        const __m512i mn = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(sm + 128 + 32 * p)));
        const __m512i s0 = _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF)), s1 = _mm512_srli_epi32(sc, 16);
        for (int t = 0; t < NT; t++) {
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(a[t][0][0], a[t][0][1]), s0));
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(a[t][1][0], a[t][1][1]), s1));
            int32_t bs;
            memcpy(&bs, x[t].bs32 + 2 * p, 4);
            msum[t] = _mm512_dpwssd_epi32(msum[t], mn, _mm512_set1_epi32(bs));
        }
    }
    fli_pack_scale(blk, x, NT, isum, msum, out);
}
#endif

void fli_q5k_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                   int64_t ld, const float *bias) {
#if defined(HAS_Q5_PACK)
    fli_pack_group(group_sb, Q5_SB, 1, gp, n, xq, xb, NT, y, ld, bias);
#else
    (void)gp, (void)n, (void)xq, (void)xb, (void)NT, (void)y, (void)ld, (void)bias;
#endif
}
