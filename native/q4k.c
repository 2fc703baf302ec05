/* q4k.c — ggml Q4_K rows: f32 paths (the exact / f32-x paths of q4_k bundles' gate and up rows)
 * and, under AVX-512 VNNI or AVX2, the int8 dot of 4 rows and one token (fli_q4k_tile1).
 *
 * A superblock of 256 values is 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit sub-block
 * scales sc_j and mins m_j, then 128 nibble bytes; value i of sub-block j (32 values) is
 * d * sc_j * nibble - dmin * m_j, its nibble in byte i of fli_q4k_qs(sb, j), low for even j,
 * high for odd j. Dequantization rounds as gguf-py's numpy reference does (f32 d * sc, then
 * times the nibble, minus dmin * m). Plain C the compiler vectorizes; the int8 paths (qdot.c,
 * qgemm.c, fli_q4k_tile1) carry the speed.
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "kblock.h"
#include "q4k.h"
#include "vec.h"

void fli_q4k_dequant(const uint8_t *row, float *dst, int64_t n) {
    float sc[8], mn[8];
    for (int64_t s = 0; s < n / FL_QK_K; s++, row += FL_Q4_K_BYTES) {
        fli_q4k_scales(row, sc, mn);
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = fli_q4k_qs(row, j);  // (32)
            const int shift = 4 * (j & 1);
            float *o = dst + s * FL_QK_K + j * FL_QK;  // (32)
            for (int i = 0; i < FL_QK; i++) o[i] = sc[j] * (float)((qs[i] >> shift) & 0x0F) + mn[j];
        }
    }
}

float fli_q4k_dot(const uint8_t *row, const float *x, int64_t n) {
    float w[FL_QK_K], s = 0.0f;  // w (256): one superblock dequantized
    for (int64_t b = 0; b < n / FL_QK_K; b++) {
        fli_q4k_dequant(row + b * FL_Q4_K_BYTES, w, FL_QK_K);
        s += fli_dot_f32(w, x + b * FL_QK_K, FL_QK_K);
    }
    return s;
}

void fli_q4k_axpy(const uint8_t *row, float a, float *y, int64_t n) {
    float w[FL_QK_K];  // (256)
    for (int64_t b = 0; b < n / FL_QK_K; b++) {
        fli_q4k_dequant(row + b * FL_Q4_K_BYTES, w, FL_QK_K);
        fli_axpy_f32(a, w, y + b * FL_QK_K, FL_QK_K);
    }
}

void fli_q4k_expand(const uint8_t *w, int64_t n, uint8_t *buf) {
    const int64_t nb = n / FL_QK;
    float *scale = (float *)(buf + n);        // (nb, FL_XQ_LANES)
    float *m = scale + 2 * nb * FL_XQ_LANES;  // (nb, FL_XQ_LANES): the msum lanes
    float sc[8], mn[8];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = w + (b / 8) * FL_Q4_K_BYTES, *qs = fli_q4k_qs(sb, b % 8);  // (32)
        if (b % 8 == 0) fli_q4k_scales(sb, sc, mn);
        const int shift = 4 * (int)(b & 1);
        for (int i = 0; i < FL_QK; i++) buf[b * FL_QK + i] = (qs[i] >> shift) & 0x0F;
        for (int l = 0; l < FL_XQ_LANES; l++) {
            scale[b * FL_XQ_LANES + l] = sc[b % 8];
            m[b * FL_XQ_LANES + l] = mn[b % 8];
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
/* AVX-512 VNNI: a superblock of 4 rows against one token quantized with one d per superblock
 * (fli_xq_quantize), so the 6-bit scales combine in integers as in ggml's Q4_K x Q8_K dot:
 * per row the 128 nibble bytes are 4 vectors of 64 nibbles (sub-blocks [0 | 2], [1 | 3], [4 | 6],
 * [5 | 7]), each maddubs against x, then vpdpwssd with the int16 scales of its two sub-blocks;
 * one convert and FMA by d * d_x per row and superblock. The mins meet the token's sub-block
 * sums (int16) for the 4 rows at once: one madd, convert and FMA by -dmin * d_x. */

/* bytes 0..15 of superblock s of the 4 rows, row r in 128-bit lane r */
static inline __m512i head4(const uint8_t *const w[FL_QT], size_t off) {
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w[0] + off)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(w[1] + off)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(w[2] + off)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(w[3] + off)), 3);
}

/* per 128-bit lane, dwords [d | dmin, a, b, c] -> the bytes sc_0..7, m_0..7 (fli_q4k_unpack) */
static inline __m512i unpack4(__m512i v) {
    const __m512i A = _mm512_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1));  // a, c, b, c
    const __m512i B = _mm512_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1));  // a, a, b, b
    const __m512i C = _mm512_srlv_epi32(A, _mm512_set4_epi32(4, 0, 0, 0));
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(C, _mm512_set1_epi8(0x0F)),
                                       _mm512_and_si512(_mm512_srli_epi32(B, 2),
                                                        _mm512_set1_epi8(0x30)));
    return _mm512_mask_blend_epi32(0xAAAA, _mm512_and_si512(A, _mm512_set1_epi8(0x3F)), hi);
}

/* the int16 lanes [b0 x16 | b1 x16] (pshufb control: byte b of each lane, then a zero byte) */
static inline __m512i pick16(int b0, int b1) {
    const __m512i lo = _mm512_set1_epi16((short)(0x8000 | b0));
    return _mm512_mask_blend_epi64(0xF0, lo, _mm512_set1_epi16((short)(0x8000 | b1)));
}

/* one row's nibbles of superblock qs (128 bytes) as v (4) in the sub-block order [0 | 2], [1 | 3],
 * [4 | 6], [5 | 7], and its int16 scales sc (4) of the same sub-blocks; u: the row's sc / m
 * bytes in every lane */
static inline void row_parts(const uint8_t *qs, __m512i u, __m512i v[4], __m512i sc[4]) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    const __m512i z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
    v[0] = _mm512_and_si512(z0, lo);
    v[1] = _mm512_and_si512(_mm512_srli_epi16(z0, 4), lo);
    v[2] = _mm512_and_si512(z1, lo);
    v[3] = _mm512_and_si512(_mm512_srli_epi16(z1, 4), lo);
    const int sb[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int k = 0; k < 4; k++) sc[k] = _mm512_shuffle_epi8(u, pick16(sb[k][0], sb[k][1]));
}

/* the int32 lanes of sum_j sc_j * (nibbles_j . q_j) for one row (row_parts) and one token's
 * q x (4) in the same sub-block order: exact integers, whatever the order */
static inline __m512i row_dot(const __m512i v[4], const __m512i sc[4], const __m512i x[4]) {
    __m512i p = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[k], x[k]), sc[k]);
    return p;
}

/* one row's int32 sum over superblock qs (128 nibble bytes) of sc_j * (nibbles . q) per lane;
 * u: the row's sc / m bytes in every lane, x[4]: the token's q in the same sub-block order */
static inline __m512i row_sum(const uint8_t *qs, __m512i u, const __m512i x[4]) {
    __m512i v[4], sc[4];
    row_parts(qs, u, v, sc);
    return row_dot(v, sc, x);
}

/* xv (4) = the q of one superblock (256) as sub-blocks [0 | 2], [1 | 3], [4 | 6], [5 | 7] */
static inline void token_sb(const int8_t *qx, __m512i xv[4]) {
    for (int k = 0; k < 4; k++) {
        const int8_t *p = qx + 128 * (k / 2) + 32 * (k % 2);  // (32), then (32) at p + 64
        xv[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                                   _mm256_loadu_si256((const __m256i *)(p + 64)), 1);
    }
}

/* permutexvar_epi16 control: each row's f16 d (the superblock head's first half-word) into lanes
 * 4r .. 4r+3 (add 1 for its dmin) */
static inline __m512i d_lanes(void) {
    return _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x00180018, 0x00180018, 0x00100010,
                            0x00100010, 0x00080008, 0x00080008, 0, 0);
}

/* pshufb control: bytes 8 .. 15 of each 128-bit lane (unpack4's m_0..7) to int16 lanes */
static inline __m512i m_lanes(void) {
    return _mm512_set4_epi32((int)0x800F800E, (int)0x800D800C, (int)0x800B800A, (int)0x80098008);
}

/* row r's sc / m bytes (lane r of unpack4's u) in every 128-bit lane */
static inline __m512i row_lane(__m512i u, int r) {
    return _mm512_permutexvar_epi64(
        _mm512_add_epi64(_mm512_set1_epi64(2 * r), _mm512_set4_epi64(1, 0, 1, 0)), u);
}

void fli_q4k_tile1(const uint8_t *const w[FL_QT], const uint8_t *x, int64_t n, float out[FL_QT]) {
    const int64_t nb = n / FL_QK;
    const int8_t *q = (const int8_t *)x;                                       // (n)
    const float *scale = (const float *)(x + n);                               // (nb, 8)
    const int16_t *bsum = (const int16_t *)(scale + 3 * nb * FL_XQ_LANES);     // (nb)
    const __m512i idx_d = d_lanes(), idx_m = _mm512_add_epi16(idx_d, _mm512_set1_epi16(1));
    const __m512i m_of = m_lanes();
    __m512 acc[FL_QT], macc = _mm512_setzero_ps();  // macc: lanes 4r .. 4r+3 of row r's min terms
    for (int r = 0; r < FL_QT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n / FL_QK_K; s++) {
        __m512i xv[4];  // the token's sub-blocks [0 | 2], [1 | 3], [4 | 6], [5 | 7]
        token_sb(q + s * FL_QK_K, xv);
        const float dx = scale[s * 8 * FL_XQ_LANES];
        const __m512i head = head4(w, (size_t)s * FL_Q4_K_BYTES);
        const __m512i u = unpack4(head);
        float dd[16];  // lanes 4r .. 4r+3: d of row r * dx
        _mm512_storeu_ps(dd, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(
                                               _mm512_permutexvar_epi16(idx_d, head))),
                                           _mm512_set1_ps(dx)));
        const __m512 dm = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx_m, head))),
            _mm512_set1_ps(-dx));
        const __m512i bs = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(bsum + 8 * s)));
        const __m512i mins = _mm512_shuffle_epi8(u, m_of);  // (FL_QT, 8) int16 m_j
        macc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(mins, bs)), dm, macc);
        for (int r = 0; r < FL_QT; r++) {
            const __m512i p = row_sum(w[r] + s * FL_Q4_K_BYTES + 16, row_lane(u, r), xv);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dd[4 * r]), acc[r]);
        }
    }
    float m[16];  // (FL_QT, 4)
    _mm512_storeu_ps(m, macc);
    for (int r = 0; r < FL_QT; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]) + ((m[4 * r] + m[4 * r + 1]) +
                                                 (m[4 * r + 2] + m[4 * r + 3]));
}


/* fli_q4k_tile1's arithmetic for NT (2..FL_QT, a constant) tokens, each superblock's scales and
 * nibbles unpacked once for all of them: out[r][t] is bit for bit fli_q4k_tile1(w, x[t]) (a pass
 * over draft guesses gives each token its one-token numbers); acc, macc: per token, as tile1's.
 * NT a constant keeps the 4 x NT accumulators in registers (a runtime count spilled them: 2
 * tokens cost 2.3x one); the tokens' q go through the stack as memory operands. */
static inline __attribute__((always_inline)) void q4k_tilen(const uint8_t *const w[FL_QT],
                                                            const uint8_t *const x[FL_QT],
                                                            const int NT, int64_t n,
                                                            float out[FL_QT][FL_QT]) {
    const int64_t nb = n / FL_QK;
    const __m512i idx_d = d_lanes(), idx_m = _mm512_add_epi16(idx_d, _mm512_set1_epi16(1));
    const __m512i m_of = m_lanes();
    const float *scale[FL_QT];    // token t's (nb, 8) scale lanes
    const int16_t *bsum[FL_QT];   // token t's (nb) sums per sub-block
    __m512 acc[FL_QT][FL_QT], macc[FL_QT];  // (row, token), (token): tile1's acc and macc
    for (int t = 0; t < NT; t++) {
        scale[t] = (const float *)(x[t] + n);
        bsum[t] = (const int16_t *)(scale[t] + 3 * nb * FL_XQ_LANES);
        macc[t] = _mm512_setzero_ps();
        for (int r = 0; r < FL_QT; r++) acc[r][t] = _mm512_setzero_ps();
    }
    for (int64_t s = 0; s < n / FL_QK_K; s++) {
        const __m512i head = head4(w, (size_t)s * FL_Q4_K_BYTES);
        const __m512i u = unpack4(head);
        const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx_d, head)));
        const __m512 m = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx_m, head)));
        const __m512i mins = _mm512_shuffle_epi8(u, m_of);
        __m512i xv[FL_QT][4];
        float dd[FL_QT][16];  // per token, lanes 4r .. 4r+3: d of row r * dx
        for (int t = 0; t < NT; t++) {
            const float dx = scale[t][s * 8 * FL_XQ_LANES];
            token_sb((const int8_t *)x[t] + s * FL_QK_K, xv[t]);
            _mm512_storeu_ps(dd[t], _mm512_mul_ps(d, _mm512_set1_ps(dx)));
            const __m512i bs = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(bsum[t] + 8 * s)));
            macc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(mins, bs)),
                                      _mm512_mul_ps(m, _mm512_set1_ps(-dx)), macc[t]);
        }
        for (int r = 0; r < FL_QT; r++) {
            __m512i v[4], sc[4];
            row_parts(w[r] + s * FL_Q4_K_BYTES + 16, row_lane(u, r), v, sc);
            for (int t = 0; t < NT; t++)
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(row_dot(v, sc, xv[t])),
                                            _mm512_set1_ps(dd[t][4 * r]), acc[r][t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        float mt[16];  // (FL_QT, 4)
        _mm512_storeu_ps(mt, macc[t]);
        for (int r = 0; r < FL_QT; r++)
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]) + ((mt[4 * r] + mt[4 * r + 1]) +
                                                           (mt[4 * r + 2] + mt[4 * r + 3]));
    }
}

void fli_q4k_tilen(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                   int64_t n, float out[FL_QT][FL_QT]) {
    switch (n_tok) {
    case 2: q4k_tilen(w, x, 2, n, out); break;
    case 3: q4k_tilen(w, x, 3, n, out); break;
    default: q4k_tilen(w, x, FL_QT, n, out); break;
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* AVX2: the same integer superblock sums 32 bytes at a time, for 1..FL_QT tokens. Per row and
 * superblock the 6-bit scales unpack once (fli_q4k_unpack) and each 32 nibble bytes once, for
 * every token: two sub-blocks (low nibbles 2k, high 2k + 1), each maddubs against the token's
 * 32 bytes and madd by its int16 scale into one int32 sum; one convert and FMA by d * d_x per
 * row, token and superblock. The mins meet each token's 8 sub-block sums in one madd. */
#define Q4K_AHEAD 8  /* rows ahead whose superblock is prefetched: measured 4, 8, 16 alike, 0 slower */

typedef struct {  // one token's side of superblock s
    const int8_t *q;  // (256)
    __m128i bs;       // (8) int16 sums per sub-block
    float dx;
} q4k_tok;

static inline __attribute__((always_inline)) void q4k_row(const uint8_t *sb, const q4k_tok *t,
                                                          int NT, __m256 acc[FL_QT],
                                                          __m128 macc[FL_QT]) {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    uint32_t u[4];
    fli_q4k_unpack(sb, u);
    const __m128i scm = _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_srli_si128(scm, 8));  // (8) mins
    const __m256i scv = _mm256_broadcastsi128_si256(scm);
    const float d = fl_load_fp16(sb), dmin = fl_load_fp16(sb + 2);
    __m256i p[FL_QT];
    for (int j = 0; j < NT; j++) p[j] = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {  // sub-blocks 2k (low nibbles) and 2k + 1 (high)
        const __m256i z = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * k));
        const __m256i vl = _mm256_and_si256(z, lo), vh = _mm256_and_si256(_mm256_srli_epi16(z, 4), lo);
        const __m256i sl = _mm256_shuffle_epi8(scv, _mm256_set1_epi16((short)(0x8000 | (2 * k))));
        const __m256i sh = _mm256_shuffle_epi8(scv, _mm256_set1_epi16((short)(0x8000 | (2 * k + 1))));
        for (int j = 0; j < NT; j++) {
            const __m256i pl = _mm256_maddubs_epi16(vl, _mm256_loadu_si256((const __m256i *)(t[j].q + 64 * k)));
            const __m256i ph = _mm256_maddubs_epi16(vh, _mm256_loadu_si256((const __m256i *)(t[j].q + 64 * k + 32)));
            p[j] = _mm256_add_epi32(p[j], _mm256_add_epi32(_mm256_madd_epi16(pl, sl), _mm256_madd_epi16(ph, sh)));
        }
    }
    for (int j = 0; j < NT; j++) {
        macc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(m16, t[j].bs)),
                               _mm_set1_ps(-dmin * t[j].dx), macc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[j]), _mm256_set1_ps(d * t[j].dx), acc[j]);
    }
}

static inline __attribute__((always_inline)) void q4k_tile(const uint8_t *const w[FL_QT],
                                                           const uint8_t *const x[FL_QT], int NT,
                                                           int64_t n, float out[FL_QT][FL_QT]) {
    const int64_t nb = n / FL_QK;
    const size_t rb = (size_t)(n / FL_QK_K) * FL_Q4_K_BYTES;
    const float *scale[FL_QT];    // token j's (nb, 8) scale lanes
    const int16_t *bsum[FL_QT];   // token j's (nb) sums per sub-block
    for (int j = 0; j < NT; j++) {
        scale[j] = (const float *)(x[j] + n);
        bsum[j] = (const int16_t *)(scale[j] + 3 * nb * FL_XQ_LANES);
    }
    for (int r = 0; r < FL_QT; r++) {
        __m256 acc[FL_QT];
        __m128 macc[FL_QT];  // the min terms, 4 lanes
        for (int j = 0; j < NT; j++) acc[j] = _mm256_setzero_ps(), macc[j] = _mm_setzero_ps();
        for (int64_t s = 0; s < n / FL_QK_K; s++) {
            q4k_tok t[FL_QT];
            for (int j = 0; j < NT; j++) {
                t[j].q = (const int8_t *)x[j] + s * FL_QK_K;
                t[j].bs = _mm_loadu_si128((const __m128i *)(bsum[j] + 8 * s));
                t[j].dx = scale[j][s * 8 * FL_XQ_LANES];
            }
            const uint8_t *sb = w[r] + (size_t)s * FL_Q4_K_BYTES;
            fli_prefetch(sb + Q4K_AHEAD * rb, FL_Q4_K_BYTES);  // the rows Q4K_AHEAD on, if contiguous
            q4k_row(sb, t, NT, acc, macc);
        }
        for (int j = 0; j < NT; j++) {
            const __m128 m = _mm_add_ps(macc[j], _mm_movehl_ps(macc[j], macc[j]));
            out[r][j] = fli_hsum256(acc[j]) + (_mm_cvtss_f32(m) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
        }
    }
}

void fli_q4k_tile(const uint8_t *const w[FL_QT], const uint8_t *const x[FL_QT], int32_t n_tok,
                  int64_t n, float out[FL_QT][FL_QT]) {
    switch (n_tok) {
    case 1: q4k_tile(w, x, 1, n, out); break;
    case 2: q4k_tile(w, x, 2, n, out); break;
    case 3: q4k_tile(w, x, 3, n, out); break;
    default: q4k_tile(w, x, 4, n, out); break;
    }
}
#endif
