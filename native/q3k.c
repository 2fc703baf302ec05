/* q3k.c — ggml's q3_k rows: one superblock dequantized (the f32 paths of qk.c loop over these)
 * and the exact integer sum of one superblock with a token quantized per superblock (the int8
 * dot, as ggml's q8_K).
 *
 * q3_k (110 bytes / 256 values): hmask[32], qs[64], scales[12], f16 d. Value v = 128 h + 32 j + l
 * (h < 2, j < 4, l < 32) has the low bits (qs[32 h + l] >> 2 j) & 3 and the high bit
 * (hmask[l] >> (4 h + j)) & 1; its signed value is low - 4 when the high bit is 0, low when it is
 * 1 (u = low | high << 2 in 0..7, minus 4). Sub-block k = v / 16 has the 6-bit scale sc_k - 32:
 * its low 4 bits are the low (k < 8) or high (k >= 8) nibble of scales[k % 8], its top 2 bits
 * bits 2 (k / 4) .. +1 of scales[8 + k % 4]. Value = (d * (sc_k - 32)) * (u - 4), rounded as
 * gguf-py's dequantize (the product d * scale in f32 first).
 */
#include "flashllm.h"
#include "base.h"
#include "dtype.h"
#include "q3k.h"

/* the 16 signed scales sc_k - 32 of superblock sb (as ggml: four 32-bit words, low nibbles of
 * bytes 0..7 then their high nibbles, each with its 2 top bits from bytes 8..11) */
static void q3k_scales(const uint8_t *sb, int8_t sc[16]) {
    uint32_t a[3], o[4];
    memcpy(a, sb + 96, 12);
    const uint32_t m4 = 0x0F0F0F0F, m2 = 0x03030303;
    o[0] = (a[0] & m4) | ((a[2] & m2) << 4);
    o[1] = (a[1] & m4) | (((a[2] >> 2) & m2) << 4);
    o[2] = ((a[0] >> 4) & m4) | (((a[2] >> 4) & m2) << 4);
    o[3] = ((a[1] >> 4) & m4) | (((a[2] >> 6) & m2) << 4);
    memcpy(sc, o, 16);
    for (int k = 0; k < 16; k++) sc[k] = (int8_t)(sc[k] - 32);
}

/* u (0..7) of value v: the low 2 bits and the high bit; the value is u - 4 */
static inline int q3k_u(const uint8_t *sb, int v) {
    const int h = v / 128, j = (v % 128) / 32, l = v % 32;
    return ((sb[32 + 32 * h + l] >> (2 * j)) & 3) | ((sb[l] >> (4 * h + j)) & 1) << 2;
}

void fli_q3k_dequant_sb(const uint8_t *sb, float *dst) {
    int8_t sc[16];
    q3k_scales(sb, sc);
    const float d = fl_load_fp16(sb + 108);
    for (int v = 0; v < FL_QK_K; v++) dst[v] = d * (float)sc[v / 16] * (float)(q3k_u(sb, v) - 4);
}

/* sum over the 16 sub-blocks k of (sc_k - 32) * ((u - 4) . q), exact: q (256) the token's int8,
 * bsum16 (16) its sums per 16 values. Computed as sum sc_k (u . q) - 4 sum sc_k bsum16_k, u >= 0
 * being the unsigned side of vpmaddubsw. */
int32_t fli_q3k_isum(const uint8_t *sb, const int8_t *q, const int16_t *bsum16) {
    int8_t sc[16];
    q3k_scales(sb, sc);
#if defined(__AVX2__)
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)sc);
    const __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8),
                                          _mm256_loadu_si256((const __m256i *)bsum16));  // (8)
    const __m256i m3 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(1);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)sb);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(sb + 32 + 32 * h));
        for (int j = 0; j < 4; j++) {  // values 128h + 32j .. +31: sub-blocks k = 8h + 2j, k + 1
            const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * j)), m3);
            const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(4 * h + j)), one);
            const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));  // 0..7: no carry
            const __m256i p = _mm256_maddubs_epi16(
                u, _mm256_loadu_si256((const __m256i *)(q + 128 * h + 32 * j)));
            const int k = 8 * h + 2 * j;  // int16 lanes 0..7: sc_k, 8..15: sc_k+1
            const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (k + 1),
                                                0x0101010101010101LL * k);
            const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
        }
    }
    return fli_hsum256_i32(_mm256_sub_epi32(acc, _mm256_slli_epi32(off, 2)));
#else
    int32_t s = 0;
    for (int k = 0; k < 16; k++) {
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += (q3k_u(sb, 16 * k + i) - 4) * q[16 * k + i];
        s += sc[k] * t;
    }
    (void)bsum16;
    return s;
#endif
}
