/* q23pack.c — Q2_K and Q3_K matrices repacked 16 rows at a time for the AVX-512 VNNI matmul of
 * resident weights (pack.c dispatches; q4kpack.c's idea: one broadcast of 4 activation bytes
 * meets 4 values of 16 rows, one row per int32 lane). A group is exactly as large as its rows
 * (16 x 84, 16 x 110 bytes a superblock), so it packs in place; only the order of the bytes
 * changes.
 *
 * The 2-bit values (qs, 64 bytes a row) are laid out alike in both: for half h < 2 and k < 8,
 * qs[32h + 4k .. +3] of the 16 rows (4 bytes each, row r at 4r) make one 64-byte vector; shifted
 * right by 2s and masked it holds values 128h + 32s + 4k .. +3 (s < 4) of every row, which lie
 * in sub-block 8h + 2s + k / 4 (16 values a sub-block).
 *
 * Q2_K, a group's superblock (Q2_SB bytes):
 *   [0, 32)      d of the 16 rows (f16)       [32, 64)  dmin of the 16 rows (f16)
 *   [64, 320)    scales byte 2i + e (scale | min << 4, i < 8, e < 2) of row r at 64 + 32i + 2r + e
 *   [320, 1344)  the 2-bit values
 * Q3_K (Q3_SB bytes):
 *   [0, 32)      d of the 16 rows (f16)
 *   [32, 224)    the 12 bytes of 6-bit scales: byte 4c + m (c < 3, m < 4) of row r at
 *                32 + 64c + 32(m / 2) + 2r + m % 2, so that the unpacked scales of sub-blocks 2i
 *                and 2i + 1 come out as row r's int16 pair (ggml's get_scale order)
 *   [224, 736)   hmask[4k .. +3] of the 16 rows at 224 + 64k (bit 4h + s: value 128h + 32s + l)
 *   [736, 1760)  the 2-bit values
 * Per superblock and token, exactly as fli_qk_qdot: each sub-block's dot of the unsigned values u
 * (Q2_K 0..3, Q3_K low | high << 2 in 0..7) with the int8 activations by vpdpbusd, two
 * sub-blocks' dots as one int16 pair against their scales by vpdpwssd; Q2_K's mins against the
 * token's sums per 16 values (msum), Q3_K's offset 4 sum(sc_k - 32) * sums; then one convert
 * and FMA by d·d_x (and dmin·d_x) in f32, added in another order than fli_qk_qdot's.
 * Other builds have no packed layout (group bytes 0): they multiply w as it is.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "packloop.h"
#include "q23pack.h"

#define Q23_R 16   /* rows per group: the int32 lanes of a zmm */
#define Q2_SB 1344 /* bytes of a group's superblock: 16 x FL_Q2_K_BYTES */
#define Q3_SB 1760 /* 16 x FL_Q3_K_BYTES */
#define Q2_SC 64   /* Q2_K: the scale / min pairs */
#define Q2_QS 320  /* Q2_K: the 2-bit values */
#define Q3_SC 32   /* Q3_K: the 6-bit scales */
#define Q3_HM 224  /* Q3_K: the high bits */
#define Q3_QS 736  /* Q3_K: the 2-bit values */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAS_Q23_PACK 1
#include <immintrin.h>
#endif

static size_t sb_bytes(int32_t dtype) { return dtype == FL_Q2_K ? Q2_SB : Q3_SB; }

size_t fli_q23_group_bytes(int32_t dtype, int64_t cols) {
#if defined(HAS_Q23_PACK)
    if ((dtype == FL_Q2_K || dtype == FL_Q3_K) && cols > 0 && cols % FL_QK_K == 0)
        return (size_t)(cols / FL_QK_K) * sb_bytes(dtype);
#endif
    (void)dtype, (void)cols;
    return 0;
}

/* row r's 64 bytes of 2-bit values qs into the group's vectors at dst */
static void pack_qs(const uint8_t *qs, int r, uint8_t *dst) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 8; k++) memcpy(dst + 64 * (8 * h + k) + 4 * r, qs + 32 * h + 4 * k, 4);
}

/* superblock sb of row r into the group's superblock dst */
static void pack_q2(const uint8_t *sb, int r, uint8_t *dst) {
    memcpy(dst + 2 * r, sb + 80, 2);
    memcpy(dst + 32 + 2 * r, sb + 82, 2);
    for (int k = 0; k < 16; k++) dst[Q2_SC + 32 * (k / 2) + 2 * r + k % 2] = sb[k];
    pack_qs(sb + 16, r, dst + Q2_QS);
}

static void pack_q3(const uint8_t *sb, int r, uint8_t *dst) {
    memcpy(dst + 2 * r, sb + 108, 2);
    for (int c = 0; c < 3; c++)
        for (int m = 0; m < 4; m++)
            dst[Q3_SC + 64 * c + 32 * (m / 2) + 2 * r + m % 2] = sb[96 + 4 * c + m];
    for (int k = 0; k < 8; k++) memcpy(dst + Q3_HM + 64 * k + 4 * r, sb + 4 * k, 4);
    pack_qs(sb + 32, r, dst + Q3_QS);
}

void fli_q23_pack_group(int32_t dtype, const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst) {
    const size_t kb = fli_block_bytes(dtype), gb = sb_bytes(dtype);
    for (int64_t s = 0; s < cols / FL_QK_K; s++)
        for (int r = 0; r < Q23_R; r++) {
            const uint8_t *sb = w + (size_t)r * rb + (size_t)s * kb;
            if (dtype == FL_Q2_K)
                pack_q2(sb, r, dst + (size_t)s * gb);
            else
                pack_q3(sb, r, dst + (size_t)s * gb);
        }
}

#if defined(HAS_Q23_PACK)
/* int16 lanes 2r, 2r + 1 = lane r of a, lane r of b (both within int16) */
static inline __m512i pair16(__m512i a, __m512i b) {
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, a, _mm512_slli_epi32(b, 16));
}

/* the int16 pair p[0], p[1] in every int32 lane */
static inline __m512i bcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc[t][e][j] (16 lanes: the rows) = the exact dot of token t with the values 128h + 32s + 16j
 * .. +15 (sub-block 8h + 2s + j) for s = 2sp + e: the 2-bit values at qs, and for Q3_K (hm not
 * NULL) the high bits at hm as bit 2 */
static inline __attribute__((always_inline)) void dots(const uint8_t *qs, const uint8_t *hm, int h,
                                                       int sp, const fli_xq_sb *x, int NT,
                                                       __m512i acc[4][2][2]) {
    const __m512i m3 = _mm512_set1_epi8(3), bit2 = _mm512_set1_epi8(4);
    for (int t = 0; t < NT; t++)
        acc[t][0][0] = acc[t][0][1] = acc[t][1][0] = acc[t][1][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * (8 * h + k));
        const __m512i hv = hm ? _mm512_loadu_si512(hm + 64 * k) : v;
#pragma GCC unroll 2
        for (int e = 0; e < 2; e++) {
            const int s = 2 * sp + e, sh = 4 * h + s - 2;  // sh: hmask bit 4h + s to bit 2
            __m512i u = s ? _mm512_srli_epi16(v, 2 * s) : v;
            if (hm) {
                const __m512i hb = sh > 0 ? _mm512_srli_epi16(hv, sh)
                                   : sh < 0 ? _mm512_slli_epi16(hv, -sh) : hv;
                u = _mm512_ternarylogic_epi32(u, m3, _mm512_and_si512(hb, bit2), 0xEA);  // (u & 3) | hb
            } else {
                u = _mm512_and_si512(u, m3);
            }
            for (int t = 0; t < NT; t++) {
                __m512i *a = &acc[t][e][k / 4];
                *a = _mm512_dpbusd_epi32(*a, u, fli_bcast4(x[t].q + 128 * h + 32 * s + 4 * k));
            }
        }
    }
}

/* out[t] (16 lanes) += Q2_K superblock blk of the group against NT tokens */
static inline __attribute__((always_inline)) void q2_sb(const uint8_t *blk, const fli_xq_sb *x,
                                                        int NT, __m512 out[FLI_PACK_T]) {
    __m512i isum[4], msum[4], acc[4][2][2];
    for (int t = 0; t < NT; t++) isum[t] = msum[t] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int sp = 0; sp < 2; sp++) {
            dots(blk + Q2_QS, NULL, h, sp, x, NT, acc);
            for (int e = 0; e < 2; e++) {
                const int i = 4 * h + 2 * sp + e;  // sub-blocks 2i, 2i + 1
                const __m512i p = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + Q2_SC + 32 * i)));
                const __m512i sc = _mm512_and_si512(p, _mm512_set1_epi16(0x0F));
                const __m512i mn = _mm512_srli_epi16(p, 4);
                for (int t = 0; t < NT; t++) {
                    isum[t] = _mm512_dpwssd_epi32(isum[t], pair16(acc[t][e][0], acc[t][e][1]), sc);
                    msum[t] = _mm512_dpwssd_epi32(msum[t], mn, bcast_pair(x[t].bs16 + 2 * i));
                }
            }
        }
    fli_pack_scale(blk, x, NT, isum, msum, out);
}

/* sc (256) = the signed scales sc_k - 32 of the group's 16 rows, sub-blocks 2i, 2i + 1 of row r
 * at 32i + 2r, + 1 (four vectors: sub-blocks 0..3 from the low nibbles of bytes 0..3 and bits
 * 0, 1 of bytes 8..11; 4..7 bytes 4..7, bits 2, 3; 8..11 the high nibbles of 0..3, bits 4, 5;
 * 12..15 those of 4..7, bits 6, 7) */
static inline void q3_scales(const uint8_t *blk, int8_t *sc) {
    const __m512i l0 = _mm512_loadu_si512(blk + Q3_SC), l1 = _mm512_loadu_si512(blk + Q3_SC + 64);
    const __m512i hi = _mm512_loadu_si512(blk + Q3_SC + 128);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i low[4] = {l0, l1, _mm512_srli_epi16(l0, 4), _mm512_srli_epi16(l1, 4)};
    const __m512i top[4] = {_mm512_slli_epi16(hi, 4), _mm512_slli_epi16(hi, 2), hi,
                            _mm512_srli_epi16(hi, 2)};
    for (int q = 0; q < 4; q++) {
        const __m512i z = _mm512_or_si512(_mm512_and_si512(low[q], m4), _mm512_and_si512(top[q], m30));
        _mm512_storeu_si512(sc + 64 * q, _mm512_sub_epi8(z, _mm512_set1_epi8(32)));
    }
}

/* out[t] (16 lanes) += Q3_K superblock blk of the group against NT tokens */
static inline __attribute__((always_inline)) void q3_sb(const uint8_t *blk, const fli_xq_sb *x,
                                                        int NT, __m512 out[FLI_PACK_T]) {
    int8_t sc[256] __attribute__((aligned(64)));
    q3_scales(blk, sc);
    __m512i isum[4], osum[4], acc[4][2][2];
    for (int t = 0; t < NT; t++) isum[t] = osum[t] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int sp = 0; sp < 2; sp++) {
            dots(blk + Q3_QS, blk + Q3_HM, h, sp, x, NT, acc);
            for (int e = 0; e < 2; e++) {
                const int i = 4 * h + 2 * sp + e;  // sub-blocks 2i, 2i + 1
                const __m512i s = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)(sc + 32 * i)));
                for (int t = 0; t < NT; t++) {
                    isum[t] = _mm512_dpwssd_epi32(isum[t], pair16(acc[t][e][0], acc[t][e][1]), s);
                    osum[t] = _mm512_dpwssd_epi32(osum[t], s, bcast_pair(x[t].bs16 + 2 * i));
                }
            }
        }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    for (int t = 0; t < NT; t++) {  // sum sc_k (u - 4) . q = sum sc_k (u . q) - 4 sum sc_k sums_k
        const __m512i v = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(osum[t], 2));
        out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(d, _mm512_set1_ps(x[t].dx)), out[t]);
    }
}
#endif

void fli_q23_group(int32_t dtype, const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb,
                   int NT, float *y, int64_t ld, const float *bias) {
#if defined(HAS_Q23_PACK)
    if (dtype == FL_Q3_K)
        fli_pack_group(q3_sb, Q3_SB, 1, gp, n, xq, xb, NT, y, ld, bias);
    else
        fli_pack_group(q2_sb, Q2_SB, 1, gp, n, xq, xb, NT, y, ld, bias);
#else
    (void)dtype, (void)gp, (void)n, (void)xq, (void)xb, (void)NT, (void)y, (void)ld, (void)bias;
#endif
}
