/* ops.c — dense ops: matmul over a weight in any storage dtype, norms, RoPE, causal attention.
 *
 * matmul: f32 / f16 weights (and quantized ones when `exact`) run in f32 on dequantized values;
 * q4_0 / q4_1 / q8_0 weights otherwise meet int8-quantized activations (qdot.c), as in llama.cpp.
 *
 * Threads: OpenMP over output rows (matmul) or over (token, head) pairs (attention); each
 * thread allocates its own scratch and frees it before the parallel region ends.
 */
#include <math.h>
#include <stdlib.h>

#include "flashllm.h"
#include "simd.h"

#define TILE 4              /* weight rows dequantized together when T > 1 (fli_dot4x4_f32) */
#define PREFETCH_BYTES 2048 /* how far ahead of the row being read a matvec prefetches */
#define QT_CHUNK 16         /* int8 tiles per work unit when T <= FL_QT */

/* y (rows) = w (rows, cols) . x (cols) [+ bias], fused dequantize + dot, one pass over w.
 * Quantized rows are short and compute-heavy and the hardware prefetcher falls behind, so each
 * row asks for the bytes PREFETCH_BYTES ahead (measured on a 151936x896 weight: q4_0 x2.5,
 * q8_0 x1.6, f32/f16 unchanged). */
static void matvec(const uint8_t *w, int32_t dtype, size_t rb, int64_t rows, int64_t cols,
                   const float *bias, const float *x, float *y, int32_t n_threads) {
    const size_t end = (size_t)rows * rb;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + (size_t)r * rb;
        if ((size_t)r * rb + PREFETCH_BYTES + rb <= end) fli_prefetch(row + PREFETCH_BYTES, rb);
        y[r] = fli_dot(dtype, row, x, cols) + (bias ? bias[r] : 0.0f);
    }
}

/* rows r0 .. r0+nr-1 (nr <= TILE) of y (T, rows), with those rows of w dequantized in buf:
 * 4 rows x 4 tokens per register block, so each loaded value feeds 4 FMAs */
static void tile_tokens(const float *buf, int64_t r0, int64_t nr, int64_t rows, int64_t cols,
                        const float *bias, const float *x, int64_t T, float *y) {
    float out[TILE][4];
    for (int64_t t = 0; t < T; t += 4) {
        const int64_t nt = T - t < 4 ? T - t : 4;
        if (nr == TILE && nt == 4) {
            fli_dot4x4_f32(buf, cols, x + t * cols, cols, cols, out);
        } else {
            for (int64_t k = 0; k < nr; k++)
                for (int64_t j = 0; j < nt; j++)
                    out[k][j] = fli_dot_f32(buf + k * cols, x + (t + j) * cols, cols);
        }
        for (int64_t j = 0; j < nt; j++)
            for (int64_t k = 0; k < nr; k++)
                y[(t + j) * rows + r0 + k] = out[k][j] + (bias ? bias[r0 + k] : 0.0f);
    }
}

/* y (T, rows) = x (T, cols) @ w^T: each tile of weight rows is dequantized once for all tokens */
static int32_t matmul_tiles(const uint8_t *w, int32_t dtype, size_t rb, int64_t rows,
                            int64_t cols, const float *bias, const float *x, int64_t T, float *y,
                            int32_t n_threads) {
    int failed = 0;
    const int64_t n_tiles = (rows + TILE - 1) / TILE;
#pragma omp parallel num_threads(n_threads)
    {
        float *buf = malloc((size_t)TILE * (size_t)cols * sizeof(float));  // (TILE, cols)
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_tiles; i++) {
            if (!buf) continue;
            const int64_t r0 = i * TILE;
            const int64_t nr = rows - r0 < TILE ? rows - r0 : TILE;
            for (int64_t k = 0; k < nr; k++)
                fli_dequant(dtype, w + (size_t)(r0 + k) * rb, buf + k * cols, cols);
            tile_tokens(buf, r0, nr, rows, cols, bias, x, T, y);
        }
        free(buf);
    }
    return failed ? FL_ENOMEM : FL_OK;
}

/* rows r0 .. r0+FL_QT-1 (fewer at the end) of y (T, rows) from quantized tokens xq (T, xb),
 * T <= FL_QT: one int8 tile */
static void qtile_rows(const uint8_t *w, int32_t dtype, size_t rb, int64_t r0, int64_t rows,
                       int64_t cols, const float *bias, const uint8_t *xq, size_t xb, int64_t T,
                       float *y) {
    const int64_t nr = rows - r0 < FL_QT ? rows - r0 : FL_QT;
    const uint8_t *wr[FL_QT], *xt[FL_QT];
    for (int64_t k = 0; k < FL_QT; k++) {
        wr[k] = w + (size_t)(r0 + (k < nr ? k : 0)) * rb;
        xt[k] = xq + (size_t)(k < T ? k : 0) * xb;
    }
    if ((size_t)(r0 + FL_QT) * rb + PREFETCH_BYTES <= (size_t)rows * rb)
        fli_prefetch(wr[0] + PREFETCH_BYTES, FL_QT * rb);
    float out[FL_QT][FL_QT];
    fli_qdot_tile(dtype, wr, NULL, xt, (int32_t)T, cols, out);
    for (int64_t j = 0; j < T; j++)
        for (int64_t k = 0; k < nr; k++)
            y[j * rows + r0 + k] = out[k][j] + (bias ? bias[r0 + k] : 0.0f);
}

/* rows r0 .. r0+FL_PR-1 (fewer at the end) of y (T, rows), T > FL_QT: the rows packed into one
 * int8 GEMM panel (qgemm.c) that meets every token; pan (panel bytes), out (FL_PR, T) scratch */
static void panel_rows(const uint8_t *w, int32_t dtype, size_t rb, int64_t r0, int64_t rows,
                       int64_t cols, const float *bias, const uint8_t *xq, size_t xb, int64_t T,
                       float *y, uint8_t *pan, float *out) {
    const int64_t nr = rows - r0 < FL_PR ? rows - r0 : FL_PR;
    const uint8_t *wr[FL_PR];
    for (int64_t k = 0; k < FL_PR; k++) wr[k] = w + (size_t)(r0 + (k < nr ? k : 0)) * rb;
    fli_panel_pack(dtype, wr, cols, pan);
    fli_panel_gemm(dtype, pan, xq, xb, T, cols, out, T);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < nr; k++)
            y[t * rows + r0 + k] = out[k * T + t] + (bias ? bias[r0 + k] : 0.0f);
}

/* quantized weights: the tokens are quantized to int8 once (threads split them when T > 1), then
 * FL_QT-row tiles (T <= FL_QT) or FL_PR-row panels (T > FL_QT) of w meet them in integer dot
 * products (qdot.c, qgemm.c) */
static int32_t matmul_q(const uint8_t *w, int32_t dtype, size_t rb, int64_t rows, int64_t cols,
                        const float *bias, const float *x, int64_t T, float *y,
                        int32_t n_threads) {
    const size_t xb = (size_t)fli_xq_bytes(cols), pb = fli_panel_bytes(cols);
    uint8_t *xq = malloc((size_t)T * xb);  // (T, xb)
    if (!xq) return FL_ENOMEM;
    if (T == 1) fli_xq_quantize(dtype, x, cols, xq);
    const int64_t step = T > FL_QT ? FL_PR : FL_QT;
    const int64_t n_tiles = (rows + step - 1) / step;
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        uint8_t *pan = T > FL_QT ? malloc(pb + FL_PR * (size_t)T * sizeof(float)) : NULL;
        if (T > FL_QT && !pan) {
#pragma omp atomic write
            failed = 1;
        }
        if (T > 1) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                fli_xq_quantize(dtype, x + t * cols, cols, xq + (size_t)t * xb);
        }
#pragma omp for schedule(dynamic, T > FL_QT ? 1 : QT_CHUNK)  // balanced when a core is shared
        for (int64_t i = 0; i < n_tiles; i++) {
            if (T <= FL_QT)
                qtile_rows(w, dtype, rb, i * step, rows, cols, bias, xq, xb, T, y);
            else if (pan)
                panel_rows(w, dtype, rb, i * step, rows, cols, bias, xq, xb, T, y, pan,
                           (float *)(pan + pb));
        }
        free(pan);
    }
    free(xq);
    return failed ? FL_ENOMEM : FL_OK;
}

int32_t fl_matmul(const void *w, int32_t dtype, int64_t rows, int64_t cols, const float *bias,
                  const float *x, int64_t T, float *y, int32_t exact, int32_t n_threads) {
    const size_t rb = fl_row_bytes(dtype, cols);
    if (!w || !x || !y || rb == 0 || rows <= 0 || T <= 0 || n_threads < 1) return FL_EINVAL;
    if (!exact && (dtype == FL_Q4_0 || dtype == FL_Q4_1 || dtype == FL_Q8_0 || dtype == FL_Q4_K))
        return matmul_q((const uint8_t *)w, dtype, rb, rows, cols, bias, x, T, y, n_threads);
    if (T == 1) {
        matvec((const uint8_t *)w, dtype, rb, rows, cols, bias, x, y, n_threads);
        return FL_OK;
    }
    return matmul_tiles((const uint8_t *)w, dtype, rb, rows, cols, bias, x, T, y, n_threads);
}

int32_t fl_rmsnorm(const float *x, const float *w, float *y, int64_t T, int64_t n, float eps) {
    if (!x || !w || !y || T <= 0 || n <= 0 || !(eps >= 0.0f)) return FL_EINVAL;
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;  // (n)
        float *yt = y + t * n;        // (n)
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) ss += (double)xt[i] * xt[i];
        const float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (int64_t i = 0; i < n; i++) yt[i] = xt[i] * inv * w[i];
    }
    return FL_OK;
}

int32_t fl_layernorm(const float *x, const float *w, const float *b, float *y, int64_t T,
                     int64_t n, float eps) {
    if (!x || !w || !y || T <= 0 || n <= 0 || !(eps >= 0.0f)) return FL_EINVAL;
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;  // (n)
        float *yt = y + t * n;        // (n)
        double sum = 0.0, var = 0.0;
        for (int64_t i = 0; i < n; i++) sum += xt[i];
        const double mean = sum / (double)n;
        for (int64_t i = 0; i < n; i++) var += (xt[i] - mean) * (xt[i] - mean);
        const double inv = 1.0 / sqrt(var / (double)n + (double)eps);
        for (int64_t i = 0; i < n; i++)
            yt[i] = (float)((xt[i] - mean) * inv) * w[i] + (b ? b[i] : 0.0f);
    }
    return FL_OK;
}

int32_t fl_rope(float *x, int64_t T, int64_t n_heads, int64_t head_dim, int64_t n_rot,
                const int32_t *pos, float theta) {
    if (!x || !pos || T <= 0 || n_heads <= 0 || head_dim <= 0 || n_rot <= 0 || n_rot % 2 ||
        n_rot > head_dim || !(theta > 0.0f))
        return FL_EINVAL;
    const int64_t half = n_rot / 2;
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * n_heads * head_dim;  // (n_heads, head_dim)
        for (int64_t j = 0; j < half; j++) {
            const double angle = pos[t] * pow((double)theta, -2.0 * (double)j / (double)n_rot);
            const float c = (float)cos(angle), s = (float)sin(angle);
            for (int64_t h = 0; h < n_heads; h++) {
                float *xh = xt + h * head_dim;  // (head_dim)
                const float x0 = xh[j], x1 = xh[j + half];
                xh[j] = x0 * c - x1 * s;
                xh[j + half] = x0 * s + x1 * c;
            }
        }
    }
    return FL_OK;
}

/* out_h (head_dim) = softmax(scale * q_h . K[0..n_keys)) @ V[0..n_keys) for one query head;
 * K and V rows of kv_dtype, row_bytes apart */
static void attend_one(const float *qh, const uint8_t *k, const uint8_t *v, int32_t kv_dtype,
                       float *outh, int64_t n_keys, int64_t row_bytes, int64_t head_dim,
                       float scale, float *scores) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < n_keys; s++) {
        scores[s] = scale * fli_dot(kv_dtype, k + s * row_bytes, qh, head_dim);
        if (scores[s] > mx) mx = scores[s];
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < n_keys; s++) {
        scores[s] = expf(scores[s] - mx);
        sum += scores[s];
    }
    memset(outh, 0, (size_t)head_dim * sizeof(float));
    for (int64_t s = 0; s < n_keys; s++)
        fli_axpy(kv_dtype, v + s * row_bytes, scores[s], outh, head_dim);
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < head_dim; i++) outh[i] *= inv;
}

int32_t fl_attention(const float *q, const void *k_cache, const void *v_cache, int32_t kv_dtype,
                     float *out, int64_t T, int64_t pos0, int64_t n_heads, int64_t n_kv_heads,
                     int64_t head_dim, float scale, int32_t n_threads) {
    if (!q || !k_cache || !v_cache || !out || T <= 0 || pos0 < 0 || n_heads <= 0 ||
        n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || n_threads < 1 ||
        (kv_dtype != FL_F32 && kv_dtype != FL_F16))
        return FL_EINVAL;
    const int64_t group = n_heads / n_kv_heads, esize = kv_dtype == FL_F32 ? 4 : 2;
    const int64_t row_bytes = n_kv_heads * head_dim * esize;
    const uint8_t *kc = k_cache, *vc = v_cache;
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        float *scores = malloc((size_t)(pos0 + T) * sizeof(float));  // (pos0 + T)
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * n_heads; i++) {
            if (!scores) continue;
            const int64_t t = i / n_heads, h = i % n_heads, off = (h / group) * head_dim * esize;
            attend_one(q + i * head_dim, kc + off, vc + off, kv_dtype, out + i * head_dim,
                       pos0 + t + 1, row_bytes, head_dim, scale, scores);
        }
        free(scores);
    }
    return failed ? FL_ENOMEM : FL_OK;
}
