/* q6kpack.c — Q6_K matrices repacked 16 rows at a time for the AVX-512 VNNI matmul of resident
 * weights (q4kpack.c's layout idea for Q6_K: one broadcast of 4 activation bytes meets 4 values
 * of 16 rows, one row per int32 lane). The 6-bit values stay 6-bit (the same bytes as the
 * source's, in another order); they are put together in registers.
 *
 * A group of 16 rows is n / 256 blocks of Q6_PACK_SB bytes, one per superblock s:
 *   [0, 32)      d of the 16 rows (f16)
 *   [32, 288)    scale j (int8) of row r at 32 + 16 j + r (j < 16: the sub-blocks of 16 values)
 *   [288, 3360)  for half c < 2 and k < 8 (values 128c + 4k .. +3 and their +32, +64, +96):
 *                at 288 + 192 (8c + k): ql[64c + 4k ..+3] of the 16 rows (4 bytes each), then
 *                ql[64c + 32 + 4k ..+3], then qh[32c + 4k ..+3]
 * A value v = 128c + 32g + l (g < 4, l < 32) is (ql nibble | 2 bits of qh << 4) - 32, as ggml's
 * dequantize_row_q6_K; per superblock and token isum_r = sum_j sc_rj * (u . q - 32 sum_j(q)) in
 * integers, then d_r * d_x * isum_r in f32 (the unpacked path adds in another order, so the
 * bits may differ). 16 x 210 bytes: no larger than the rows.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "packloop.h"
#include "q6kpack.h"

#define Q6_R 16
#define Q6_PACK_SB 3360

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAS_Q6_PACK 1
#include <immintrin.h>
#endif

size_t fli_q6k_group_bytes(int64_t cols) {
#if defined(HAS_Q6_PACK)
    if (cols > 0 && cols % FL_QK_K == 0) return (size_t)(cols / FL_QK_K) * Q6_PACK_SB;
#endif
    (void)cols;
    return 0;
}

/* superblock s of rows r0 .. r0+15 of w (row bytes rb) into dst (Q6_PACK_SB) */
static void pack_sb(const uint8_t *w, size_t rb, int64_t r0, int64_t s, uint8_t *dst) {
    for (int r = 0; r < Q6_R; r++) {
        const uint8_t *sb = w + (size_t)(r0 + r) * rb + (size_t)s * FL_Q6_K_BYTES;
        memcpy(dst + 2 * r, sb + 208, 2);
        for (int j = 0; j < 16; j++) dst[32 + 16 * j + r] = sb[192 + j];
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 8; k++) {
                uint8_t *o = dst + 288 + 192 * (8 * c + k) + 4 * r;
                memcpy(o, sb + 64 * c + 4 * k, 4);
                memcpy(o + 64, sb + 64 * c + 32 + 4 * k, 4);
                memcpy(o + 128, sb + 128 + 32 * c + 4 * k, 4);
            }
    }
}

void fli_q6k_pack_group(const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst) {
    for (int64_t s = 0; s < cols / FL_QK_K; s++) pack_sb(w, rb, 0, s, dst + (size_t)s * Q6_PACK_SB);
}

/* row r of a group (cols values) back into its superblocks as on file: pack_sb's inverse */
void fli_q6k_unpack_row(const uint8_t *gp, int64_t cols, int r, uint8_t *row) {
    for (int64_t s = 0; s < cols / FL_QK_K; s++) {
        const uint8_t *src = gp + (size_t)s * Q6_PACK_SB;
        uint8_t *sb = row + (size_t)s * FL_Q6_K_BYTES;
        memcpy(sb + 208, src + 2 * r, 2);
        for (int j = 0; j < 16; j++) sb[192 + j] = src[32 + 16 * j + r];
        for (int c = 0; c < 2; c++)
            for (int k = 0; k < 8; k++) {
                const uint8_t *o = src + 288 + 192 * (8 * c + k) + 4 * r;
                memcpy(sb + 64 * c + 4 * k, o, 4);
                memcpy(sb + 64 * c + 32 + 4 * k, o + 64, 4);
                memcpy(sb + 128 + 32 * c + 4 * k, o + 128, 4);
            }
    }
}

#if defined(HAS_Q6_PACK)
/* out[t] (16 lanes: the group's rows) += superblock blk of the group against NT tokens */
static inline __attribute__((always_inline)) void group_sb6(const uint8_t *blk, const fli_xq_sb *x,
                                                            int NT, __m512 out[FLI_PACK_T]) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    __m512i isum[4];
    for (int t = 0; t < NT; t++) isum[t] = _mm512_setzero_si512();
    for (int c = 0; c < 2; c++)
        for (int h = 0; h < 2; h++) {  // k in 4h .. 4h + 3: sub-blocks 8c + 2g + h
            __m512i acc[4][4];         // token, g
            for (int t = 0; t < NT; t++)
                for (int g = 0; g < 4; g++) acc[t][g] = _mm512_setzero_si512();
            for (int k = 4 * h; k < 4 * h + 4; k++) {
                const uint8_t *p = blk + 288 + 192 * (8 * c + k);
                const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
                const __m512i qh = _mm512_loadu_si512(p + 128);
                const __m512i u[4] = {
                    _mm512_or_si512(_mm512_and_si512(a, lo4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), hi2)),
                    _mm512_or_si512(_mm512_and_si512(b, lo4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), hi2)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), lo4), _mm512_and_si512(qh, hi2)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), lo4),
                                    _mm512_and_si512(_mm512_srli_epi16(qh, 2), hi2))};
                for (int t = 0; t < NT; t++) {
                    const int8_t *q = x[t].q + 128 * c + 4 * k;
                    for (int g = 0; g < 4; g++)
                        acc[t][g] = _mm512_dpbusd_epi32(acc[t][g], u[g], fli_bcast4(q + 32 * g));
                }
            }
            for (int g = 0; g < 4; g++) {
                const int j = 8 * c + 2 * g + h;
                const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * j)));
                for (int t = 0; t < NT; t++) {
                    const __m512i v = _mm512_sub_epi32(acc[t][g], _mm512_set1_epi32(32 * x[t].bs16[j]));
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(v, sc));
                }
            }
        }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    for (int t = 0; t < NT; t++)
        out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, _mm512_set1_ps(x[t].dx)),
                                 out[t]);
}
#endif

void fli_q6k_group(const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb, int NT, float *y,
                   int64_t ld, const float *bias) {
#if defined(HAS_Q6_PACK)
    fli_pack_group(group_sb6, Q6_PACK_SB, 1, gp, n, xq, xb, NT, y, ld, bias);
#else
    (void)gp, (void)n, (void)xq, (void)xb, (void)NT, (void)y, (void)ld, (void)bias;
#endif
}
