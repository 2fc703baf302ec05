/* gemm_f32.c — f32 products of several rows at once: the FFN prefill's down GEMM (fli_down_f32)
 * and the 4x4 tiles of the f32 matmul (fli_dot4x4_f32), on vec_simd.h's vectors. */
#include "flashllm.h"
#include "gemm_f32.h"
#include "vec_simd.h"

/* y (nt, d) columns j .. j+NC*VW-1 += h^T @ down for nt <= DOWN_T tokens: each loaded down
 * vector feeds nt FMAs and each y vector is loaded and stored once */
#define DOWN_T 6
static inline __attribute__((always_inline)) void down_block(const float *h, int64_t ldh,
                                                             const float *down, int64_t K,
                                                             int64_t d, float *y, int64_t j,
                                                             int64_t nt, int NC) {
    vf acc[DOWN_T][4];
    for (int64_t u = 0; u < nt; u++)
        for (int c = 0; c < NC; c++) acc[u][c] = vload(y + u * d + j + c * VW);
    for (int64_t k = 0; k < K; k++) {
        vf dv[4];
        for (int c = 0; c < NC; c++) dv[c] = vload(down + k * d + j + c * VW);
        for (int64_t u = 0; u < nt; u++) {
            const vf hb = vset1(h[k * ldh + u]);
            for (int c = 0; c < NC; c++) acc[u][c] = vfma(hb, dv[c], acc[u][c]);
        }
    }
    for (int64_t u = 0; u < nt; u++)
        for (int c = 0; c < NC; c++) vstore(y + u * d + j + c * VW, acc[u][c]);
}

/* columns in blocks of 4 vectors, then of 1; full token groups with constant bounds */
static inline __attribute__((always_inline)) void down_tokens(const float *h, int64_t ldh,
                                                              const float *down, int64_t K,
                                                              int64_t d, float *y, int64_t nt) {
    int64_t j = 0;
    for (; j + 4 * VW <= d; j += 4 * VW) down_block(h, ldh, down, K, d, y, j, nt, 4);
    for (; j + VW <= d; j += VW) down_block(h, ldh, down, K, d, y, j, nt, 1);
}

void fli_down_f32(const float *h, int64_t ldh, const float *down, int64_t K, int64_t d, float *y,
                  int64_t T) {
    for (int64_t t = 0; t < T; t += DOWN_T) {
        const int64_t nt = T - t < DOWN_T ? T - t : DOWN_T;
        if (nt == DOWN_T) down_tokens(h + t, ldh, down, K, d, y + t * d, DOWN_T);
        else down_tokens(h + t, ldh, down, K, d, y + t * d, nt);
    }
}

void fli_dot4x4_f32(const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t n,
                    float out[4][4]) {
    vf acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < 4; t++) acc[r][t] = vzero();
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf w0 = vload(w + i), w1 = vload(w + ldw + i);
        const vf w2 = vload(w + 2 * ldw + i), w3 = vload(w + 3 * ldw + i);
        for (int t = 0; t < 4; t++) {
            const vf xv = vload(x + t * ldx + i);
            acc[0][t] = vfma(w0, xv, acc[0][t]);
            acc[1][t] = vfma(w1, xv, acc[1][t]);
            acc[2][t] = vfma(w2, xv, acc[2][t]);
            acc[3][t] = vfma(w3, xv, acc[3][t]);
        }
    }
    for (int r = 0; r < 4; r++) {
        for (int t = 0; t < 4; t++) {
            float s = vsum(acc[r][t]);
            for (int64_t j = i; j < n; j++) s += w[r * ldw + j] * x[t * ldx + j];
            out[r][t] = s;
        }
    }
}
