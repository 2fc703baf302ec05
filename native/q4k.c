/* q4k.c — f32 paths of ggml Q4_K rows (the exact / f32-x paths of q4_k bundles' gate and up rows).
 *
 * A superblock of 256 values is 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit sub-block
 * scales sc_j and mins m_j, then 128 nibble bytes; value i of sub-block j (32 values) is
 * d * sc_j * nibble - dmin * m_j, its nibble in byte i of fli_q4k_qs(sb, j), low for even j,
 * high for odd j. Dequantization rounds as gguf-py's numpy reference does (f32 d * sc, then
 * times the nibble, minus dmin * m). Plain C the compiler vectorizes; the int8 paths (qdot.c,
 * qgemm.c) carry the speed.
 */
#include "flashllm.h"
#include "simd.h"

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
