/* act_quant.h — a token's int8 activations (act_quant.c), the operand every int8 kernel meets
 * (qdot.c, q4k.c, qk.c, qgemm.c, the packed layouts). Internal: not seen by cffi.
 *
 * Bytes of one token's quantized activations: int8 q (n), then per block FL_XQ_LANES f32 copies
 * of its scale, FL_XQ_LANES int32 (a correction in lane 0, zeros) and FL_XQ_LANES f32 (d * sum(q)
 * in lane 0, zeros: q4_1's msum), then int16 sum(q) per block (k-quants only; 16 bytes per 8
 * blocks), then int16 sum(q) per 16 values (k-quants only; 32 bytes per 8 blocks), the vector
 * layout of qdot.c. The correction depends on the weight dtype, so quantize for the dtype the
 * buffer will meet. */
#ifndef FLASHLLM_ACT_QUANT_H
#define FLASHLLM_ACT_QUANT_H

#include <stdint.h>

#include "dtype.h"

#define FL_XQ_LANES 8 /* f32 / int32 lanes per block in a quantized token's side arrays */

/* the offset qdot.c adds to q8_0 weights (w + 128 where its dot is VNNI's unsigned x signed
 * bytes, else none), paid back through fli_xq_quantize's correction lanes */
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) ||              \
    (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) &&                             \
     (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))))
#define FLI_Q8_BIAS 128
#else
#define FLI_Q8_BIAS 0
#endif

#pragma GCC visibility push(hidden)

int64_t fli_xq_bytes(int64_t n);

/* buf (fli_xq_bytes(n)) = x (n) quantized per block of 32: q = nearest-even(x * 127 / amax),
 * d = f16(amax / 127) (ggml's q8_0); for the k-quants d = 1 / (127 / amax) of the superblock's
 * amax (256 values, ggml's q8_K; a shorter tail per block of 32) */
void fli_xq_quantize(int32_t dtype, const float *x, int64_t n, uint8_t *buf);

#pragma GCC visibility pop

/* a token quantized by fli_xq_quantize for a k-quant (n values): q (n), scales (one d per
 * superblock in lane 0 of its first block), sums of q per 32 values (bsum) and per 16 (bsum16);
 * the k-quant kernels' operand (qk.c, q2k.c) */
typedef struct {
    const int8_t *q;
    const float *scale;
    const int16_t *bsum, *bsum16;
} fli_xq_view;

static inline fli_xq_view fli_xq_token(const uint8_t *buf, int64_t n) {
    const int64_t nb = n / FL_QK;
    fli_xq_view t;
    t.q = (const int8_t *)buf;                                    /* (n) */
    t.scale = (const float *)(buf + n);                           /* (nb, 8) */
    t.bsum = (const int16_t *)(t.scale + 3 * nb * FL_XQ_LANES);   /* (nb) */
    t.bsum16 = t.bsum + (nb + 7) / 8 * 8;                         /* (2 nb) */
    return t;
}

/* superblock s (256 values) of a token quantized for a k-quant into buf (n values): its int8
 * values, d and the int16 sums of its values per 32 and per 16 (the packed kernels' operand) */
typedef struct {
    const int8_t *q;     /* (256) */
    const int16_t *bs32; /* (8) */
    const int16_t *bs16; /* (16) */
    float dx;
} fli_xq_sb;

static inline fli_xq_sb fli_xq_superblock(const uint8_t *buf, int64_t n, int64_t s) {
    const fli_xq_view t = fli_xq_token(buf, n);
    const fli_xq_sb o = {t.q + s * FL_QK_K, t.bsum + 8 * s, t.bsum16 + 16 * s,
                         t.scale[s * 8 * FL_XQ_LANES]};
    return o;
}

#endif /* FLASHLLM_ACT_QUANT_H */
