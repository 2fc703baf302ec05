/* kaxpy.c — y += sum over up to 4 k-quant rows (q4_k, q5_k, q6_k) of a_r * row_r: the FFN's
 * down columns of a native conversion (fli_axpy / fli_axpy4 route them here), and q6_k's
 * dequantization (fli_dequant: one row, a = 1, on zeros).
 *
 * One group of a superblock at a time (q6_k: 4 x 16 values sharing the byte positions of ql /
 * qh; q4_k / q5_k: a 32-value sub-block): y's values are loaded once into registers, each row
 * adds its values scaled by a_r times their sub-block scale, and they are stored once (the mins
 * of q4_k / q5_k are summed per sub-block over the rows and added once). The loops are
 * plain C over fixed 16- and 32-value runs with one scale each, which -O3 vectorizes (ggml's
 * dequantize_row_q6_K order: four values per byte position l); a scale and a_r meet in one f32
 * product per sub-block, so the arithmetic is dequantize-then-scale's up to that rounding. With
 * a = 1 (fli_q6k_dequant) each value is (d * scale) * u exactly as gguf-py rounds it.
 * AVX-512 and AVX2 (q4_k, q6_k): each row's 256 values of a superblock are first unpacked to
 * bytes by 64- / 32-byte vector operations (q6_k: u - 32 as int8), then every run of 16 (8)
 * values is one widen, convert and FMA into its own accumulator: 16 (8) independent FMA chains,
 * where one chain per run waited out the FMA latency row after row. The same products and sums
 * in the same order on both, so both builds give the same bits (4 rows of 1536 values, one
 * core: AVX-512 1.4x the per-run kernel; AVX2 3x / 4x the plain loops for q4_k / q6_k).
 */
#include "flashllm.h"
#include "base.h"
#include "dtype.h"
#include "kaxpy.h"
#include "kblock.h"

#define KQ_MAX 4 /* rows per call */

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

/* sc (8) = a * d * sc_j, mn (8) = a * -(dmin * m_j) of Q4_K / Q5_K superblock sb */
static inline void q4k_row_scales(const uint8_t *sb, float a, float sc[8], float mn[8]) {
    __m256 vs, vm;
    fli_q4k_scales8(sb, &vs, &vm);
    _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(a), vs));
    _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(a), vm));
}
#endif

/* the 4 x 16 values of byte positions l = 16g .. 16g + 15 of half h of a q6_k superblock sb,
 * times s[k] = a * d * scale (value 128h + 32k + l, k = 0..3) */
static inline __attribute__((always_inline)) void q6k_group(const uint8_t *sb, int h, int g,
                                                            const float s[4], float v[4][16]) {
    const uint8_t *l0 = sb + 64 * h + 16 * g, *l1 = l0 + 32, *hb = sb + 128 + 32 * h + 16 * g;
    for (int i = 0; i < 16; i++) {
        v[0][i] = s[0] * (float)(((l0[i] & 0x0F) | ((hb[i] & 3) << 4)) - 32);
        v[1][i] = s[1] * (float)(((l1[i] & 0x0F) | (((hb[i] >> 2) & 3) << 4)) - 32);
        v[2][i] = s[2] * (float)(((l0[i] >> 4) | (((hb[i] >> 4) & 3) << 4)) - 32);
        v[3][i] = s[3] * (float)(((l1[i] >> 4) | (((hb[i] >> 6) & 3) << 4)) - 32);
    }
}

/* s (4) of group (h, g) of q6_k superblock sb for coefficient a */
static inline void q6k_scales(const uint8_t *sb, int h, int g, float a, float s[4]) {
    const float d = fl_load_fp16(sb + 208);
    const int8_t *sc = (const int8_t *)(sb + 192) + 8 * h + g;
    for (int k = 0; k < 4; k++) s[k] = a * (d * sc[2 * k]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512i u8x16(const uint8_t *p) {  // 16 bytes -> 16 int32 lanes
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* the 256 values u - 32 of q6_k superblock sb as int8, in value order, into u (256): per half
 * h, 64-byte vector operations on ql's 64 bytes (low nibbles: runs k = 0, 1; high: k = 2, 3)
 * and qh's 32 bytes twice over (shifted right by 0 for runs 0 / 2, by 2 for runs 1 / 3) */
static inline void q6k_values(const uint8_t *sb, int8_t *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i k32 = _mm512_set1_epi8(32);
    const __m512i by = _mm512_maskz_set1_epi16((__mmask32)0xFFFF0000u, 2);  // words: 0 | 2
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_loadu_si512(sb + 64 * h);        // ql bytes of half h
        const __m512i hq = _mm512_srlv_epi16(_mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h))), by);
        /* low: bits 0..3 from ql, 4..5 from hq's bits 0..1; high: ql >> 4 and hq's bits 4..5 */
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(q, m4),
                                                     _mm512_slli_epi16(hq, 4), m30, 0xF8);
        const __m512i hi = _mm512_ternarylogic_epi32(
            _mm512_and_si512(_mm512_srli_epi16(q, 4), m4), hq, m30, 0xF8);
        _mm512_storeu_si512(u + 128 * h, _mm512_sub_epi8(lo, k32));
        _mm512_storeu_si512(u + 128 * h + 64, _mm512_sub_epi8(hi, k32));
    }
}

/* y (256) += sum over r of a[r] * q6_k superblocks sb[r]: each row's values made int8 by
 * q6k_values, then per run of 16 values (one scale) one zmm accumulator across the rows */
static void q6k_axpy_sb(const uint8_t *const sb[KQ_MAX], const float *a, int nr, float *y) {
    float sc[KQ_MAX][16];  // per row: a_r * (d * scale_k), as q6k_scales
    int8_t u[KQ_MAX][256] __attribute__((aligned(64)));
    for (int r = 0; r < nr; r++) {
        const __m512 d = _mm512_set1_ps(fl_load_fp16(sb[r] + 208));
        const __m512 k = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb[r] + 192))));
        _mm512_storeu_ps(sc[r], _mm512_mul_ps(_mm512_set1_ps(a[r]), _mm512_mul_ps(d, k)));
        q6k_values(sb[r], u[r]);
    }
    __m512 acc[16];  // 16 independent chains: an FMA's latency is not waited for
    for (int g = 0; g < 16; g++) acc[g] = _mm512_loadu_ps(y + 16 * g);
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < 16; g++)
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r][g]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                         _mm_load_si128((const __m128i *)(u[r] + 16 * g)))), acc[g]);
    for (int g = 0; g < 16; g++) _mm512_storeu_ps(y + 16 * g, acc[g]);
}

/* y (256) += sum over r of a[r] * q4_k superblocks sb[r]: each row's 128 nibble bytes split
 * into low and high nibbles by 64-byte vector operations, then per run of 16 values one zmm
 * accumulator across the rows; the mins summed over the rows and added once per sub-block (the
 * arithmetic of kx_axpy_sb, value for value) */
static void q4k_axpy_sb(const uint8_t *const sb[KQ_MAX], const float *a, int nr, float *y) {
    float sc[KQ_MAX][8], mn[KQ_MAX][8];  // per row: a_r * d * sc_j, a_r * -(dmin * m_j)
    uint8_t lo[KQ_MAX][128] __attribute__((aligned(64))), hi[KQ_MAX][128] __attribute__((aligned(64)));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < nr; r++) {
        q4k_row_scales(sb[r], a[r], sc[r], mn[r]);
        for (int c = 0; c < 2; c++) {
            const __m512i q = _mm512_loadu_si512(sb[r] + 16 + 64 * c);
            _mm512_store_si512(lo[r] + 64 * c, _mm512_and_si512(q, m4));
            _mm512_store_si512(hi[r] + 64 * c, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
        }
    }
    __m512 acc[16];  // run g: values 16g .. 16g + 15 of sub-block g / 2; independent chains
    for (int g = 0; g < 16; g++) acc[g] = _mm512_loadu_ps(y + 16 * g);
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < 16; g++) {  // nibbles (high in odd sub-blocks) of bytes 32 (g / 4) ..
            const uint8_t *b = ((g / 2) & 1 ? hi[r] : lo[r]) + 32 * (g / 4) + 16 * (g & 1);
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r][g / 2]), _mm512_cvtepi32_ps(
                                         _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)b))), acc[g]);
        }
    for (int j = 0; j < 8; j++) {
        float off = 0.0f;
        for (int r = 0; r < nr; r++) off += mn[r][j];
        const __m512 vo = _mm512_set1_ps(off);
        _mm512_storeu_ps(y + 32 * j, _mm512_add_ps(acc[2 * j], vo));
        _mm512_storeu_ps(y + 32 * j + 16, _mm512_add_ps(acc[2 * j + 1], vo));
    }
}

/* y (256) += sum over r of a[r] * q4_k / q5_k superblocks sb[r], a 32-value sub-block in two
 * zmm accumulators across the rows; the mins summed over the rows and added once */
static void kx_axpy_sb(int32_t dtype, const uint8_t *const sb[KQ_MAX], const float *a, int nr,
                       float *y) {
    float sc[KQ_MAX][8], mn[KQ_MAX][8];  // per row: a_r * d * sc_j, a_r * -(dmin * m_j)
    for (int r = 0; r < nr; r++) {
        q4k_row_scales(sb[r], a[r], sc[r], mn[r]);
    }
    const int q5 = dtype == FL_Q5_K;
    const __m512i m4 = _mm512_set1_epi32(0x0F), one = _mm512_set1_epi32(1);
    for (int j = 0; j < 8; j++) {
        const int shift = 4 * (j & 1);
        __m512 acc0 = _mm512_loadu_ps(y + 32 * j), acc1 = _mm512_loadu_ps(y + 32 * j + 16);
        float off = 0.0f;
        for (int r = 0; r < nr; r++) {
            const __m512 s = _mm512_set1_ps(sc[r][j]);
            const uint8_t *q = sb[r] + (q5 ? 48 : 16) + 32 * (j / 2), *qh = sb[r] + 16;
            off += mn[r][j];
            __m512i u0 = _mm512_and_si512(_mm512_srli_epi32(u8x16(q), (unsigned)shift), m4);
            __m512i u1 = _mm512_and_si512(_mm512_srli_epi32(u8x16(q + 16), (unsigned)shift), m4);
            if (q5) {
                u0 = _mm512_or_si512(u0, _mm512_slli_epi32(_mm512_and_si512(
                         _mm512_srli_epi32(u8x16(qh), (unsigned)j), one), 4));
                u1 = _mm512_or_si512(u1, _mm512_slli_epi32(_mm512_and_si512(
                         _mm512_srli_epi32(u8x16(qh + 16), (unsigned)j), one), 4));
            }
            acc0 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(u0), acc0);
            acc1 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(u1), acc1);
        }
        const __m512 vo = _mm512_set1_ps(off);
        _mm512_storeu_ps(y + 32 * j, _mm512_add_ps(acc0, vo));
        _mm512_storeu_ps(y + 32 * j + 16, _mm512_add_ps(acc1, vo));
    }
}
#else
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_Q4K_VEC 1

/* AVX2: q6k_values with 32-byte vectors: runs k = 0..3 of half h, 32 values each */
static inline void q6k_values(const uint8_t *sb, int8_t *u) {
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        __m256i v[4];
        fli_q6k_half(sb, h, v);
        for (int k = 0; k < 4; k++)
            _mm256_storeu_si256((__m256i *)(u + 128 * h + 32 * k), _mm256_sub_epi8(v[k], k32));
    }
}

/* AVX2: q6k_axpy_sb's arithmetic, 64 values (8 accumulators of 8) at a time across the rows */
static void q6k_axpy_sb(const uint8_t *const sb[KQ_MAX], const float *a, int nr, float *y) {
    float sc[KQ_MAX][16];  // per row: a_r * (d * scale_k)
    int8_t u[KQ_MAX][256] __attribute__((aligned(32)));
    for (int r = 0; r < nr; r++) {  // 8 scales at a time: the scalar loop took ~1/5 of a row
        const __m256 d = _mm256_set1_ps(fl_load_fp16(sb[r] + 208)), ar = _mm256_set1_ps(a[r]);
        for (int c = 0; c < 2; c++) {
            const __m256 k = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sb[r] + 192 + 8 * c))));
            _mm256_storeu_ps(sc[r] + 8 * c, _mm256_mul_ps(ar, _mm256_mul_ps(d, k)));
        }
        q6k_values(sb[r], u[r]);
    }
    for (int p = 0; p < 4; p++) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_loadu_ps(y + 64 * p + 8 * i);
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r][4 * p + i / 2]), _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u[r] + 64 * p + 8 * i)))), acc[i]);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + 64 * p + 8 * i, acc[i]);
    }
}

/* AVX2: q4k_axpy_sb's arithmetic, one pair of sub-blocks (8 accumulators of 8) at a time */
static void q4k_axpy_sb(const uint8_t *const sb[KQ_MAX], const float *a, int nr, float *y) {
    float sc[KQ_MAX][8], mn[KQ_MAX][8];  // per row: a_r * d * sc_j, a_r * -(dmin * m_j)
    uint8_t lo[KQ_MAX][128] __attribute__((aligned(32))), hi[KQ_MAX][128] __attribute__((aligned(32)));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < nr; r++) {
        q4k_row_scales(sb[r], a[r], sc[r], mn[r]);
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(sb[r] + 16 + 32 * c));
            _mm256_store_si256((__m256i *)(lo[r] + 32 * c), _mm256_and_si256(q, m4));
            _mm256_store_si256((__m256i *)(hi[r] + 32 * c), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        }
    }
    for (int p = 0; p < 4; p++) {  // sub-blocks 2p (low nibbles), 2p + 1 (high) of bytes 32p ..
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_loadu_ps(y + 64 * p + 8 * i);
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < 8; i++) {
                const uint8_t *b = (i < 4 ? lo[r] : hi[r]) + 32 * p + 8 * (i & 3);
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r][2 * p + i / 4]), _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b))), acc[i]);
            }
        for (int n = 0; n < 2; n++) {
            float off = 0.0f;
            for (int r = 0; r < nr; r++) off += mn[r][2 * p + n];
            const __m256 vo = _mm256_set1_ps(off);
            for (int i = 4 * n; i < 4 * n + 4; i++)
                _mm256_storeu_ps(y + 64 * p + 8 * i, _mm256_add_ps(acc[i], vo));
        }
    }
}
#else
/* y (256) += sum over r of a[r] * q6_k superblocks sb[r]; accumulated in registers per group */
static void q6k_axpy_sb(const uint8_t *const sb[KQ_MAX], const float *a, int nr, float *y) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 2; g++) {
            float *o = y + 128 * h + 16 * g, acc[4][16], v[4][16], s[4];
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 16; i++) acc[k][i] = o[32 * k + i];
            for (int r = 0; r < nr; r++) {
                q6k_scales(sb[r], h, g, a[r], s);
                q6k_group(sb[r], h, g, s, v);
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < 16; i++) acc[k][i] += v[k][i];
            }
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 16; i++) o[32 * k + i] = acc[k][i];
        }
}

#endif

/* y (256) += sum over r of a[r] * q4_k / q5_k superblocks sb[r], one 32-value sub-block at a
 * time in registers; the mins (-dmin * m_j) are summed over the rows and added once */
static void kx_axpy_sb(int32_t dtype, const uint8_t *const sb[KQ_MAX], const float *a, int nr,
                       float *y) {
    float sc[KQ_MAX][8], mn[KQ_MAX][8];  // per row: d * sc_j, -(dmin * m_j)
    for (int r = 0; r < nr; r++) fli_q4k_scales(sb[r], sc[r], mn[r]);
    const int q5 = dtype == FL_Q5_K;
    for (int j = 0; j < 8; j++) {
        const int shift = 4 * (j & 1);
        float acc[32], off = 0.0f;
        for (int i = 0; i < 32; i++) acc[i] = y[32 * j + i];
        for (int r = 0; r < nr; r++) {
            const float s = a[r] * sc[r][j];
            const uint8_t *q = sb[r] + (q5 ? 48 : 16) + 32 * (j / 2), *qh = sb[r] + 16;
            off += a[r] * mn[r][j];
            if (q5)
                for (int i = 0; i < 32; i++)
                    acc[i] += s * (float)(((q[i] >> shift) & 0x0F) | (((qh[i] >> j) & 1) << 4));
            else
                for (int i = 0; i < 32; i++) acc[i] += s * (float)((q[i] >> shift) & 0x0F);
        }
        for (int i = 0; i < 32; i++) y[32 * j + i] = acc[i] + off;
    }
}
#endif

void fli_kq_axpy(int32_t dtype, const uint8_t *const *rows, const float *a, int nr, float *y,
                 int64_t n) {
    const size_t kb = fli_block_bytes(dtype);
    for (int64_t b = 0; b < n / FL_QK_K; b++, y += FL_QK_K) {
        const uint8_t *sb[KQ_MAX];
        for (int r = 0; r < nr; r++) sb[r] = rows[r] + b * kb;
        if (dtype == FL_Q6_K) q6k_axpy_sb(sb, a, nr, y);
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(KQ_Q4K_VEC)
        else if (dtype == FL_Q4_K) q4k_axpy_sb(sb, a, nr, y);
#endif
        else kx_axpy_sb(dtype, sb, a, nr, y);
    }
}

void fli_q6k_dequant(const uint8_t *row, float *dst, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* y = -0 + 1 * (d * scale) * u: the fused add to -0 returns the product, its sign kept */
    const float one = 1.0f;
    for (int64_t i = 0; i < n; i++) dst[i] = -0.0f;
    for (int64_t b = 0; b < n / FL_QK_K; b++) {
        const uint8_t *sb[KQ_MAX] = {row + b * FL_Q6_K_BYTES};
        q6k_axpy_sb(sb, &one, 1, dst + b * FL_QK_K);
    }
    return;
#endif
    for (int64_t b = 0; b < n / FL_QK_K; b++) {
        const uint8_t *sb = row + b * FL_Q6_K_BYTES;
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 2; g++) {
                float v[4][16], s[4];
                q6k_scales(sb, h, g, 1.0f, s);   // 1 * (d * scale): gguf-py's product
                q6k_group(sb, h, g, s, v);
                for (int k = 0; k < 4; k++)
                    memcpy(dst + b * FL_QK_K + 128 * h + 32 * k + 16 * g, v[k], sizeof v[k]);
            }
    }
}
