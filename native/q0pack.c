/* q0pack.c — Q8_0, Q5_0 and Q4_0 matrices repacked 16 rows at a time for the matmul of resident
 * weights (pack.c dispatches; q4kpack.c's idea: one broadcast of 4 activation bytes meets 4
 * values of 16 rows, one row per int32 lane). Qwen2.5-Coder-0.5B's output head is Q8_0, its
 * attention and gate / up rows Q5_0; a Q4_0 mixture of experts' expert rows Q4_0. The packed group is exactly as large as its rows, so it
 * packs in place. AVX-512 VNNI (16 rows a zmm) and AVX2 (8 rows a ymm: each 64-byte vector
 * below is two, rows 0..7 and 8..15) read the same layout.
 *
 * A group of 16 rows and nb = n / 32 blocks: first the d of every block, [32 b, 32 b + 32): the
 * 16 rows' f16 d of block b (row r at 32 b + 2 r), then from 32 nb the blocks' values, VB bytes
 * each (block b at 32 nb + VB b, so with nb even and an aligned group they start on cache lines):
 *   q8_0 (VB 512 = 16 x 32): vector k < 8 at 64 k holds values 4k .. 4k+3 of row r at 4 r (the
 *        row's int8 bytes qs[4k .. 4k+3]); 16 x 34 bytes a block
 *   q5_0 (VB 320 = 16 x 20): the 5-bit values u = w + 16 (nibble | qh bit << 4) of values 4k + i
 *        (lo) and 16 + 4k + i (hi) of row r, k < 4, i < 4: vector k at 64 k holds lo | (hi & 7)
 *        << 5 at 4 r + i; [256, 320) holds hi >> 3 of every k at bits 2k, 2k+1 of byte 4 r + i;
 *        16 x 22 bytes a block. lo is one AND away, hi a shift and AND of each part and an OR.
 *   q4_0 (VB 256 = 16 x 16): vector k < 4 at 64 k holds the row's bytes qs[4k .. 4k+3] at 4 r:
 *        values 4k + i in their low nibbles, 16 + 4k + i in their high ones (u = w + 8);
 *        16 x 18 bytes a block.
 * Per block and token the 16 rows' exact integer dots with the int8 activations, then one
 * convert and FMA by d_w d_x (fl_matmul's block sums; it adds the blocks in another order, so the
 * bits may differ). The weight side of vpdpbusd / vpmaddubsw is unsigned: q5_0's 5-bit value
 * (w + 16; the xq correction lanes carry -16 sum(q), fli_xq_quantize), q4_0's nibble (w + 8, -8 sum(q)); q8_0 w ^ 0x80 = w + 128
 * against -128 sum(q) under AVX-512 VNNI, |w| against sign(q, w) under AVX2 (no offset, so its
 * sums start from 0 whatever the correction lanes hold).
 */
#include "flashllm.h"
#include "act_quant.h"
#include "base.h"
#include "dtype.h"
#include "q0pack.h"

#define Q0_R 16
#ifndef Q0_AHEAD
#define Q0_AHEAD 32768 /* bytes of values a group's block prefetches ahead (into L2) */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q0_SIMD 512
#define Q0_CHAINS 2 /* accumulators a token (one chain of vpdpbusd would wait on its latency) */
typedef __m512i vi; /* the 16 rows: 4 bytes or one int32 of each */
typedef __m512 vf;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define Q0_SIMD 256
#define Q0_CHAINS 1 /* the two halves are two chains already */
typedef struct { __m256i h[2]; } vi; /* rows 0..7, 8..15 */
typedef struct { __m256 h[2]; } vf;
#endif

/* bytes of one block's values in a group: 16 rows' blocks less their f16 d */
static size_t value_bytes(int32_t dtype) {
    return Q0_R * (size_t)(fli_block_bytes(dtype) - 2);
}

size_t fli_q0_group_bytes(int32_t dtype, int64_t cols) {
#if defined(Q0_SIMD)
    if ((dtype == FL_Q8_0 || dtype == FL_Q5_0 || dtype == FL_Q4_0) && cols > 0 && cols % FL_QK == 0)
        return (size_t)(cols / FL_QK) * (32 + value_bytes(dtype));
#endif
    (void)dtype, (void)cols;
    return 0;
}

/* block b of 16 rows (the row's block at src + r * rb) into the group's d and values (v) */
static void pack_block(int32_t dtype, const uint8_t *src, size_t rb, uint8_t *d, uint8_t *v) {
    if (dtype == FL_Q5_0) memset(v + 256, 0, 64);
    for (int r = 0; r < Q0_R; r++) {
        const uint8_t *blk = src + (size_t)r * rb;
        memcpy(d + 2 * r, blk, 2);
        if (dtype == FL_Q8_0 || dtype == FL_Q4_0) {
            for (int k = 0; k < (dtype == FL_Q8_0 ? 8 : 4); k++)
                memcpy(v + 64 * k + 4 * r, blk + 2 + 4 * k, 4);
            continue;
        }
        const uint32_t qh = fli_q5_qh(dtype, blk);
        for (int j = 0; j < 16; j++) {  // values j (lo) and 16 + j (hi), 5 bits each
            const int lo = (blk[6 + j] & 0x0F) | ((qh >> j) & 1) << 4;
            const int hi = blk[6 + j] >> 4 | ((qh >> (j + 16)) & 1) << 4;
            v[64 * (j / 4) + 4 * r + j % 4] = (uint8_t)(lo | (hi & 7) << 5);
            v[256 + 4 * r + j % 4] |= (uint8_t)((hi >> 3) << (2 * (j / 4)));
        }
    }
}

void fli_q0_pack_group(int32_t dtype, const uint8_t *w, size_t rb, int64_t cols, uint8_t *dst) {
    const int64_t nb = cols / FL_QK;
    const size_t vb = value_bytes(dtype), bb = fli_block_bytes(dtype);
    for (int64_t b = 0; b < nb; b++)
        pack_block(dtype, w + (size_t)b * bb, rb, dst + 32 * b, dst + 32 * nb + vb * (size_t)b);
}

/* row r of a group (gp, cols values) back into its bytes as on file (row: its blocks), the
 * inverse of pack_block */
void fli_q0_unpack_row(int32_t dtype, const uint8_t *gp, int64_t cols, int r, uint8_t *row) {
    const int64_t nb = cols / FL_QK;
    const size_t vb = value_bytes(dtype), bb = fli_block_bytes(dtype);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *v = gp + 32 * nb + vb * (size_t)b;
        uint8_t *blk = row + (size_t)b * bb;
        memcpy(blk, gp + 32 * b + 2 * r, 2);
        if (dtype == FL_Q8_0 || dtype == FL_Q4_0) {
            for (int k = 0; k < (dtype == FL_Q8_0 ? 8 : 4); k++)
                memcpy(blk + 2 + 4 * k, v + 64 * k + 4 * r, 4);
            continue;
        }
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {  // values j (lo) and 16 + j (hi), 5 bits each
            const int a = v[64 * (j / 4) + 4 * r + j % 4];
            const int top = (v[256 + 4 * r + j % 4] >> (2 * (j / 4))) & 3;
            const int lo = a & 0x1F, hi = (a >> 5) | top << 3;
            blk[6 + j] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
            qh |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
        }
        memcpy(blk + 2, &qh, 4);
    }
}

#if defined(Q0_SIMD)
#if Q0_SIMD == 512
static inline vi v_zero(void) { return _mm512_setzero_si512(); }
static inline vi v_set32(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi v_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vi v_add32(vi a, vi b) { return _mm512_add_epi32(a, b); }

/* q5_0's unsigned values of vector a (k): the low values (hi 0) or the high ones, their two top
 * bits from the byte hb that holds them for every k */
static inline vi v_bits5(vi a, vi hb, int k, int hi) {
    if (!hi) return _mm512_and_si512(a, _mm512_set1_epi8(0x1F));
    const __m512i top = k < 2 ? _mm512_slli_epi16(hb, 3 - 2 * k) : _mm512_srli_epi16(hb, 2 * k - 3);
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 5), _mm512_set1_epi8(0x07)),
                           _mm512_and_si512(top, _mm512_set1_epi8(0x18)));
}

/* q4_0's unsigned values of vector a: its low nibbles, or its high ones */
static inline vi v_nib(vi a, int hi) {
    return _mm512_and_si512(hi ? _mm512_srli_epi16(a, 4) : a, _mm512_set1_epi8(0x0F));
}

/* acc + per row the dots of unsigned bytes a, b with the 4 int8 at qa, qb */
static inline vi v_dot_u2(vi acc, vi a, const int8_t *qa, vi b, const int8_t *qb) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, a, fli_bcast4(qa)), b, fli_bcast4(qb));
}

/* q8_0 weights w as the dot's unsigned side: w + 128 (the correction pays it back) */
static inline vi v_unsigned(vi w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }

/* acc + per row the dot of 4 int8 weights w (u: v_unsigned(w)) with the 4 int8 at q */
static inline vi v_dot_s(vi acc, vi w, vi u, const int8_t *q) {
    (void)w;
    return _mm512_dpbusd_epi32(acc, u, fli_bcast4(q));
}

/* out + the block's sums acc times d (16 f16 at d16) * dx */
static inline vf v_scale_add(vf out, vi acc, const uint8_t *d16, float dx) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, _mm512_set1_ps(dx)), out);
}
static inline vf v_fzero(void) { return _mm512_setzero_ps(); }
static inline void v_store(float *y, vf v, const float *bias) {
    _mm512_storeu_ps(y, bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias)) : v);
}
#else
static inline __m256i bcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}
static inline vi v_zero(void) { return (vi){{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
static inline vi v_set32(int32_t v) { return (vi){{_mm256_set1_epi32(v), _mm256_set1_epi32(v)}}; }
static inline vi v_load(const uint8_t *p) {
    return (vi){{_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))}};
}
static inline vi v_add32(vi a, vi b) {
    return (vi){{_mm256_add_epi32(a.h[0], b.h[0]), _mm256_add_epi32(a.h[1], b.h[1])}};
}
static inline vi v_bits5(vi a, vi hb, int k, int hi) {
    vi u;
    for (int i = 0; i < 2; i++) {
        if (!hi) {
            u.h[i] = _mm256_and_si256(a.h[i], _mm256_set1_epi8(0x1F));
            continue;
        }
        const __m256i top = k < 2 ? _mm256_slli_epi16(hb.h[i], 3 - 2 * k)
                                  : _mm256_srli_epi16(hb.h[i], 2 * k - 3);
        u.h[i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a.h[i], 5), _mm256_set1_epi8(0x07)),
                                 _mm256_and_si256(top, _mm256_set1_epi8(0x18)));
    }
    return u;
}
static inline vi v_nib(vi a, int hi) {
    vi u;
    for (int i = 0; i < 2; i++)
        u.h[i] = _mm256_and_si256(hi ? _mm256_srli_epi16(a.h[i], 4) : a.h[i], _mm256_set1_epi8(0x0F));
    return u;
}
/* unsigned a, b < 32: the int16 pairs of both add up without saturating (4 x 31 x 127 < 2^15) */
static inline vi v_dot_u2(vi acc, vi a, const int8_t *qa, vi b, const int8_t *qb) {
    const __m256i xa = bcast4(qa), xb = bcast4(qb), one = _mm256_set1_epi16(1);
    for (int i = 0; i < 2; i++) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a.h[i], xa), _mm256_maddubs_epi16(b.h[i], xb));
        acc.h[i] = _mm256_add_epi32(acc.h[i], _mm256_madd_epi16(p, one));
    }
    return acc;
}
/* |w| (0x80 is 128) times sign(q, w): no offset, at most 2 x 128 x 127 < 2^15 a pair */
static inline vi v_unsigned(vi w) { return (vi){{_mm256_abs_epi8(w.h[0]), _mm256_abs_epi8(w.h[1])}}; }
static inline vi v_dot_s(vi acc, vi w, vi u, const int8_t *q) {
    const __m256i x = bcast4(q), one = _mm256_set1_epi16(1);
    for (int i = 0; i < 2; i++) {
        const __m256i p = _mm256_maddubs_epi16(u.h[i], _mm256_sign_epi8(x, w.h[i]));
        acc.h[i] = _mm256_add_epi32(acc.h[i], _mm256_madd_epi16(p, one));
    }
    return acc;
}
static inline vf v_scale_add(vf out, vi acc, const uint8_t *d16, float dx) {
    for (int i = 0; i < 2; i++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16 + 16 * i)));
        out.h[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc.h[i]), _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                                   out.h[i]);
    }
    return out;
}
static inline vf v_fzero(void) { return (vf){{_mm256_setzero_ps(), _mm256_setzero_ps()}}; }
static inline void v_store(float *y, vf v, const float *bias) {
    for (int i = 0; i < 2; i++)
        _mm256_storeu_ps(y + 8 * i, bias ? _mm256_add_ps(v.h[i], _mm256_loadu_ps(bias + 8 * i)) : v.h[i]);
}
#endif

/* acc[t][c] (the 16 rows' int32 dots, Q0_CHAINS chains) += a q8_0 block's values v against NT
 * tokens' blocks q[t] */
static inline __attribute__((always_inline)) void dots_q8(const uint8_t *v, const int8_t *const *q,
                                                          int NT, vi acc[4][Q0_CHAINS]) {
    for (int k = 0; k < 8; k++) {
        const vi w = v_load(v + 64 * k), u = v_unsigned(w);
        for (int t = 0; t < NT; t++) {
            vi *a = &acc[t][k % Q0_CHAINS];
            *a = v_dot_s(*a, w, u, q[t] + 4 * k);
        }
    }
}

static inline __attribute__((always_inline)) void dots_q5(const uint8_t *v, const int8_t *const *q,
                                                          int NT, vi acc[4][Q0_CHAINS]) {
    const vi hb = v_load(v + 256);
    for (int k = 0; k < 4; k++) {
        const vi a = v_load(v + 64 * k);
        const vi lo = v_bits5(a, hb, k, 0), hi = v_bits5(a, hb, k, 1);
        for (int t = 0; t < NT; t++) {
            vi *a = &acc[t][k % Q0_CHAINS];
            *a = v_dot_u2(*a, lo, q[t] + 4 * k, hi, q[t] + 16 + 4 * k);
        }
    }
}

static inline __attribute__((always_inline)) void dots_q4(const uint8_t *v, const int8_t *const *q,
                                                          int NT, vi acc[4][Q0_CHAINS]) {
    for (int k = 0; k < 4; k++) {
        const vi a = v_load(v + 64 * k);
        const vi lo = v_nib(a, 0), hi = v_nib(a, 1);
        for (int t = 0; t < NT; t++) {
            vi *c = &acc[t][k % Q0_CHAINS];
            *c = v_dot_u2(*c, lo, q[t] + 4 * k, hi, q[t] + 16 + 4 * k);
        }
    }
}

typedef struct {  // the token side (fli_xq_bytes layout)
    const int8_t *q;      // (n)
    const float *d;       // (nb, FL_XQ_LANES) scales, lane 0 read
    const int32_t *corr;  // (nb, FL_XQ_LANES) -bias * sum(q), lane 0 read
} tok0;

/* y[t * ld + r] (+ bias) for the 16 rows r of group gp (n values) and NT tokens; K: the dtype
 * (Q0_Q5, Q0_Q8, Q0_Q4) */
enum { Q0_Q5, Q0_Q8, Q0_Q4 };
static inline __attribute__((always_inline)) void group0(int K, const uint8_t *gp, int64_t n,
                                                         const tok0 *x, int NT, float *y,
                                                         int64_t ld, const float *bias) {
    const int64_t nb = n / FL_QK;
    const int Q8 = K == Q0_Q8;
    const size_t vb = Q8 ? 16 * 32 : K == Q0_Q4 ? 16 * 16 : 16 * 20;
    const uint8_t *vals = gp + 32 * nb;
    const size_t step = 32 + vb;  // a block's bytes in the group: its 16 d, its values
    vf out[4];
    for (int t = 0; t < NT; t++) out[t] = v_fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *v = vals + (size_t)b * vb;
        // Q0_AHEAD bytes on, across groups, into L2: prefetcht0 8 blocks on held L1's misses
        // and one core streamed the q8_0 head at 13-14 GB/s, this at 20-21 (docs/KERNELS.md).
        // The group's bytes (its d and values) at the pace a block takes them: a pointer at the
        // values' pace would skip the next groups' d lines, which then missed
        fli_prefetch_l2(gp + (size_t)b * step + Q0_AHEAD, step);
        vi acc[4][Q0_CHAINS];
        const int8_t *q[4];
        for (int t = 0; t < NT; t++) {  // AVX2's q8_0 sums are signed: no correction
            acc[t][0] = Q8 && Q0_SIMD == 256 ? v_zero() : v_set32(x[t].corr[b * FL_XQ_LANES]);
            for (int c = 1; c < Q0_CHAINS; c++) acc[t][c] = v_zero();
            q[t] = x[t].q + b * FL_QK;
        }
        if (Q8)
            dots_q8(v, q, NT, acc);
        else if (K == Q0_Q4)
            dots_q4(v, q, NT, acc);
        else
            dots_q5(v, q, NT, acc);
        for (int t = 0; t < NT; t++) {
            for (int c = 1; c < Q0_CHAINS; c++) acc[t][0] = v_add32(acc[t][0], acc[t][c]);
            out[t] = v_scale_add(out[t], acc[t][0], gp + 32 * b, x[t].d[b * FL_XQ_LANES]);
        }
    }
    for (int t = 0; t < NT; t++) v_store(y + t * ld, out[t], bias);
}

#define GROUP0(NT)                                                                             \
    (k == Q0_Q8   ? group0(Q0_Q8, gp, n, x, NT, y, ld, bias)                                   \
     : k == Q0_Q4 ? group0(Q0_Q4, gp, n, x, NT, y, ld, bias)                                   \
                  : group0(Q0_Q5, gp, n, x, NT, y, ld, bias))
#endif

void fli_q0_group(int32_t dtype, const uint8_t *gp, int64_t n, const uint8_t *xq, size_t xb,
                  int NT, float *y, int64_t ld, const float *bias) {
#if defined(Q0_SIMD)
    const int64_t nb = n / FL_QK;
    tok0 x[4];
    for (int t = 0; t < NT; t++) {
        const uint8_t *xt = xq + (size_t)t * xb;
        x[t].q = (const int8_t *)xt;
        x[t].d = (const float *)(xt + n);
        x[t].corr = (const int32_t *)(x[t].d + nb * FL_XQ_LANES);
    }
    const int k = dtype == FL_Q8_0 ? Q0_Q8 : dtype == FL_Q4_0 ? Q0_Q4 : Q0_Q5;
    switch (NT) {
    case 1: GROUP0(1); break;
    case 2: GROUP0(2); break;
    case 3: GROUP0(3); break;
    default: GROUP0(4); break;
    }
#else
    (void)dtype, (void)gp, (void)n, (void)xq, (void)xb, (void)NT, (void)y, (void)ld, (void)bias;
#endif
}
