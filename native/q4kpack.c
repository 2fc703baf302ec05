/* q4kpack.c — Q4_K matrices repacked 16 rows at a time for the AVX-512 VNNI matmul of resident
 * weights (fl_pack / fl_matmul_packed in flashllm.h, dispatched by pack.c), as llama.cpp's repacked q4_K_8x8 does:
 * one broadcast of 4 activation bytes meets 4 values of 16 rows at once (one row per int32
 * lane), where fli_q4k_tile1 multiplies the values of one row per vector and pays a shuffle for
 * every sub-block's scale. The values are the source's, only their order changes.
 *
 * A group of 16 rows is n / 256 blocks of PACK_SB bytes, one per superblock s:
 *   [0, 32)      d of the 16 rows (f16)          [32, 64)    dmin of the 16 rows (f16)
 *   [64, 192)    sc_j of row r at 64 + 16 j + r  (the 6-bit scales, unpacked)
 *   [192, 320)   m_{2i}, m_{2i+1} of row r at 192 + 32 i + 2 r, + 1   (mins, unpacked, paired)
 *   [320, 2368)  nibbles: sub-blocks 2p, 2p+1 (p < 4), bytes 4k .. 4k+3 (k < 8) of row r's 32
 *                bytes of qs at 320 + 512 p + 64 k + 4 r: low nibbles sub-block 2p, high 2p+1
 * Per superblock and token, exactly as fli_q4k_tile1: isum_r = sum_j sc_j * (nibbles . q) and
 * msum_r = sum_j m_j * sum(q over sub-block j) in integers, then d_r * d_x * isum_r and
 * dmin_r * d_x * msum_r in f32 (added in another order than tile1's, so the bits may differ).
 * Other builds have no packed layout (group bytes 0): they multiply w as it is.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "kblock.h"
#include "packloop.h"
#include "q4kpack.h"

#define PACK_R 16     /* rows per group: the int32 lanes of a zmm */
#define PACK_SB 2368  /* bytes of one superblock of a group */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAS_PACK 1
#include <immintrin.h>
#endif

size_t fli_q4k_group_bytes(int64_t cols) {
#if defined(HAS_PACK)
    if (cols > 0 && cols % FL_QK_K == 0) return (size_t)(cols / FL_QK_K) * PACK_SB;
#endif
    (void)cols;
    return 0;
}

/* superblock s of rows r0 .. r0+15 of w (row bytes rb) into dst (PACK_SB) */
static void pack_sb(const uint8_t *w, size_t rb, int64_t r0, int64_t s, uint8_t *dst) {
    for (int r = 0; r < PACK_R; r++) {
        const uint8_t *sb = w + (size_t)(r0 + r) * rb + (size_t)s * FL_Q4_K_BYTES;
        uint32_t u[4];
        uint8_t q[16];  // sc_0..7, m_0..7
        fli_q4k_unpack(sb, u);
        memcpy(q, u, sizeof q);
        memcpy(dst + 2 * r, sb, 2);
        memcpy(dst + 32 + 2 * r, sb + 2, 2);
        for (int j = 0; j < 8; j++) dst[64 + 16 * j + r] = q[j];
        for (int i = 0; i < 4; i++) {
            dst[192 + 32 * i + 2 * r] = q[8 + 2 * i];
            dst[192 + 32 * i + 2 * r + 1] = q[8 + 2 * i + 1];
        }
        for (int p = 0; p < 4; p++)
            for (int k = 0; k < 8; k++)
                memcpy(dst + 320 + 512 * p + 64 * k + 4 * r, sb + 16 + 32 * p + 4 * k, 4);
    }
}

void fli_q4k_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst) {
    for (int64_t s = 0; s < cols / FL_QK_K; s++) pack_sb(w, rb, 0, s, dst + (size_t)s * PACK_SB);
}

/* row r of a group (cols values) back into its superblocks as on file: pack_sb's inverse, the
 * 6-bit scales and mins put back in their 12 bytes (kblock.h's fli_q4k_unpack undone) */
void fli_q4k_unpack_row(const uint8_t *gp, int64_t cols, int r, uint8_t *row) {
    for (int64_t s = 0; s < cols / FL_QK_K; s++) {
        const uint8_t *src = gp + (size_t)s * PACK_SB;
        uint8_t *sb = row + (size_t)s * FL_Q4_K_BYTES;
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = src[64 + 16 * j + r];
            m[j] = src[192 + 32 * (j / 2) + 2 * r + j % 2];
        }
        memcpy(sb, src + 2 * r, 2);
        memcpy(sb + 2, src + 32 + 2 * r, 2);
        for (int j = 0; j < 4; j++) {
            sb[4 + j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            sb[8 + j] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
            sb[12 + j] = (uint8_t)((sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4);
        }
        for (int p = 0; p < 4; p++)
            for (int k = 0; k < 8; k++)
                memcpy(sb + 16 + 32 * p + 4 * k, src + 320 + 512 * p + 64 * k + 4 * r, 4);
    }
}

#if defined(HAS_PACK)
/* out[t] (16 lanes: the group's rows) += superblock blk of the group against NT tokens */
static inline __attribute__((always_inline)) void group_sb(const uint8_t *blk, const fli_xq_sb *x,
                                                           int NT, __m512 out[FLI_PACK_T]) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512i isum[FLI_PACK_T];
    for (int t = 0; t < NT; t++) isum[t] = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
        __m512i a[FLI_PACK_T][2][2];  // token, sub-block 2p / 2p+1, chain (k even / odd for 1 token)
        for (int t = 0; t < NT; t++)
            a[t][0][0] = a[t][0][1] = a[t][1][0] = a[t][1][1] = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {
            const __m512i z = _mm512_loadu_si512(blk + 320 + 512 * p + 64 * k);
            const __m512i lo = _mm512_and_si512(z, lo4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), lo4);
            for (int t = 0; t < NT; t++) {
                const int8_t *q = x[t].q + 64 * p + 4 * k;
                const int c = NT == 1 ? (k & 1) : 0;  // more tokens: chains enough
                a[t][0][c] = _mm512_dpbusd_epi32(a[t][0][c], lo, fli_bcast4(q));
                a[t][1][c] = _mm512_dpbusd_epi32(a[t][1][c], hi, fli_bcast4(q + 32));
            }
        }
        const __m512i s0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + 32 * p)));
        const __m512i s1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 80 + 32 * p)));
        for (int t = 0; t < NT; t++) {
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(
                _mm512_add_epi32(a[t][0][0], a[t][0][1]), s0));
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(
                _mm512_add_epi32(a[t][1][0], a[t][1][1]), s1));
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    for (int t = 0; t < NT; t++) {
        __m512i msum = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            const __m512i m = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 192 + 32 * i)));
            int32_t bs;
            memcpy(&bs, x[t].bs32 + 2 * i, 4);
            msum = _mm512_dpwssd_epi32(msum, m, _mm512_set1_epi32(bs));
        }
        const __m512 dx = _mm512_set1_ps(x[t].dx);
        out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), out[t]);
        out[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), out[t]);
    }
}
#endif

void fli_q4k_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                   int64_t ld, const float *bias) {
#if defined(HAS_PACK)
    fli_pack_group(group_sb, PACK_SB, 0, gp, n, xq, xb, NT, y, ld, bias);
#else
    (void)gp, (void)n, (void)xq, (void)xb, (void)NT, (void)y, (void)ld, (void)bias;
#endif
}
