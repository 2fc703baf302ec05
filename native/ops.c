/* ops.c — dense ops: matmul over a weight in any storage dtype, norms, RoPE, causal attention.
 *
 * matmul: f32 / f16 weights (and quantized ones when `exact`) run in f32 on dequantized values;
 * quantized weights otherwise meet int8-quantized activations (qdot.c, qk.c), as in llama.cpp.
 *
 * Threads (pool.c) take the work in chunks: output rows (matvec) and int8 weight tiles from a
 * contiguous part each (fli_split: one forward stream of weights per core), f32 tiles and
 * (token, head) pairs (attention) as they come free; each thread allocates its own scratch and
 * frees it before its part ends.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "flashllm.h"
#include "act_quant.h"
#include "attend.h"
#include "gemm_f32.h"
#include "pool.h"
#include "qgemm.h"
#include "traits.h"
#include "vec.h"

#define TILE 4              /* weight rows dequantized together when T > 1 (fli_dot4x4_f32) */
#define PREFETCH_BYTES 2048 /* how far ahead of the row being read a matvec prefetches */
#define QT_CHUNK 16         /* int8 tiles per work unit when T <= FL_SMALL_T */
#define MATVEC_CHUNK 16     /* least rows per work unit of an f32 / f16 matvec */

typedef struct {
    const uint8_t *w;
    int32_t dtype;
    size_t rb;
    int64_t rows, cols;
    const float *bias, *x;  // (rows) or NULL, (cols)
    float *y;               // (rows)
    fli_split split;        // the rows, a contiguous part per thread
} matvec_job;

static void matvec_part(void *p) {
    matvec_job *j = p;
    const size_t end = (size_t)j->rows * j->rb;
    const int64_t chunk = j->rows / 64 > MATVEC_CHUNK ? j->rows / 64 : MATVEC_CHUNK;
    int mine = -1;
    for (int64_t r0, r1; fli_split_take(&j->split, &mine, chunk, &r0, &r1);)
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = j->w + (size_t)r * j->rb;
            if ((size_t)r * j->rb + PREFETCH_BYTES + j->rb <= end)
                fli_prefetch(row + PREFETCH_BYTES, j->rb);
            j->y[r] = fli_dot(j->dtype, row, j->x, j->cols) + (j->bias ? j->bias[r] : 0.0f);
        }
}

/* y (rows) = w (rows, cols) . x (cols) [+ bias], fused dequantize + dot, one pass over w.
 * Quantized rows are short and compute-heavy and the hardware prefetcher falls behind, so each
 * row asks for the bytes PREFETCH_BYTES ahead (measured on a 151936x896 weight: q4_0 x2.5,
 * q8_0 x1.6, f32/f16 unchanged). */
static void matvec(const uint8_t *w, int32_t dtype, size_t rb, int64_t rows, int64_t cols,
                   const float *bias, const float *x, float *y, int32_t n_threads) {
    matvec_job j = {.w = w, .dtype = dtype, .rb = rb, .rows = rows, .cols = cols, .bias = bias,
                    .x = x, .y = y};
    fli_split_init(&j.split, rows, n_threads);
    fli_parallel(n_threads, matvec_part, &j);
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

typedef struct {
    const uint8_t *w;
    int32_t dtype;
    size_t rb;
    int64_t rows, cols, T;
    const float *bias, *x;  // (rows) or NULL, (T, cols)
    float *y;               // (T, rows)
    atomic_llong next;      // the next tile to take
    atomic_int failed;
} tiles_job;

static void tiles_part(void *p) {
    tiles_job *j = p;
    float *buf = malloc((size_t)TILE * (size_t)j->cols * sizeof(float));  // (TILE, cols)
    if (!buf) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t i, i1; fli_take(&j->next, (j->rows + TILE - 1) / TILE, 1, &i, &i1);) {
        const int64_t r0 = i * TILE;
        const int64_t nr = j->rows - r0 < TILE ? j->rows - r0 : TILE;
        for (int64_t k = 0; k < nr; k++)
            fli_dequant(j->dtype, j->w + (size_t)(r0 + k) * j->rb, buf + k * j->cols, j->cols);
        tile_tokens(buf, r0, nr, j->rows, j->cols, j->bias, j->x, j->T, j->y);
    }
    free(buf);
}

/* y (T, rows) = x (T, cols) @ w^T: each tile of weight rows is dequantized once for all tokens */
static int32_t matmul_tiles(const uint8_t *w, int32_t dtype, size_t rb, int64_t rows,
                            int64_t cols, const float *bias, const float *x, int64_t T, float *y,
                            int32_t n_threads) {
    tiles_job j = {w, dtype, rb, rows, cols, T, bias, x, y, 0, 0};
    fli_parallel(n_threads, tiles_part, &j);
    return atomic_load(&j.failed) ? FL_ENOMEM : FL_OK;
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

/* rows r0 .. r0+FL_PR-1 (fewer at the end) of y (T, rows), T > FL_SMALL_T: the rows packed into one
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

typedef struct {
    const uint8_t *w;
    int32_t dtype;
    size_t rb, xb;
    int64_t rows, cols, T;
    const float *bias, *x;  // (rows) or NULL, (T, cols)
    float *y;               // (T, rows)
    uint8_t *xq;            // (T, xb)
    atomic_llong next_token;  // the next token to quantize
    fli_split split;          // the tiles, a contiguous part per thread
    atomic_int failed;
} matmul_q_job;

static void quantize_part(void *p) {
    matmul_q_job *j = p;
    for (int64_t k, k1; fli_take(&j->next_token, j->T, 1, &k, &k1);)
        fli_xq_quantize(j->dtype, j->x + k * j->cols, j->cols, j->xq + (size_t)k * j->xb);
}

/* T tokens meet FL_PR-row panels of dtype (else FL_QT-row int8 tiles, FL_QT tokens at a time,
 * which give each token its one-token product: so do a decode pass's FL_SMALL_T) */
static int uses_panels(int32_t dtype, int64_t T) {
    return T > FL_SMALL_T && fli_has_panel(dtype);
}

/* tiles taken in chunks, a contiguous part per thread (the others' when it is done) */
static void qtiles_part(void *p) {
    matmul_q_job *j = p;
    const int64_t T = j->T;
    const int panels = uses_panels(j->dtype, T);  // else tiles of FL_QT tokens
    const int64_t step = panels ? FL_PR : FL_QT, chunk = panels ? 1 : QT_CHUNK;
    uint8_t *pan = panels ? malloc(fli_panel_bytes(j->cols) + FL_PR * (size_t)T * sizeof(float))
                          : NULL;
    if (panels && !pan) {
        atomic_store(&j->failed, 1);
        return;
    }
    int mine = -1;
    for (int64_t c, c1; fli_split_take(&j->split, &mine, chunk, &c, &c1);)
        for (int64_t i = c; i < c1; i++) {
            for (int64_t t = 0; !panels && t < T; t += FL_QT)
                qtile_rows(j->w, j->dtype, j->rb, i * step, j->rows, j->cols, j->bias,
                           j->xq + t * j->xb, j->xb, T - t < FL_QT ? T - t : FL_QT,
                           j->y + t * j->rows);
            if (panels)
                panel_rows(j->w, j->dtype, j->rb, i * step, j->rows, j->cols, j->bias, j->xq,
                           j->xb, T, j->y, pan, (float *)(pan + fli_panel_bytes(j->cols)));
        }
    free(pan);
}

/* quantized weights: the tokens are quantized to int8 once (threads split them when T > 1), then
 * FL_QT-row tiles (T <= FL_SMALL_T) or FL_PR-row panels (more) of w meet them in integer dot
 * products (qdot.c, qgemm.c) */
static int32_t matmul_q(const uint8_t *w, int32_t dtype, size_t rb, int64_t rows, int64_t cols,
                        const float *bias, const float *x, int64_t T, float *y,
                        int32_t n_threads) {
    const size_t xb = (size_t)fli_xq_bytes(cols);
    matmul_q_job j = {.w = w, .dtype = dtype, .rb = rb, .xb = xb, .rows = rows, .cols = cols,
                      .T = T, .bias = bias, .x = x, .y = y, .xq = malloc((size_t)T * xb)};
    if (!j.xq) return FL_ENOMEM;
    const int64_t step = uses_panels(dtype, T) ? FL_PR : FL_QT;
    fli_split_init(&j.split, (rows + step - 1) / step, n_threads);
    if (T == 1) quantize_part(&j);
    else fli_parallel(n_threads, quantize_part, &j);
    fli_parallel(n_threads, qtiles_part, &j);
    free(j.xq);
    return atomic_load(&j.failed) ? FL_ENOMEM : FL_OK;
}

int32_t fl_matmul(const void *w, int32_t dtype, int64_t rows, int64_t cols, const float *bias,
                  const float *x, int64_t T, float *y, int32_t exact, int32_t n_threads) {
    const size_t rb = fl_row_bytes(dtype, cols);
    if (!w || !x || !y || rb == 0 || rows <= 0 || T <= 0 || n_threads < 1) return FL_EINVAL;
    if (!exact && fli_is_quant(dtype))
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
                const int32_t *pos, const double *inv_freq) {
    if (!x || !pos || !inv_freq || T <= 0 || n_heads <= 0 || head_dim <= 0 || n_rot <= 0 ||
        n_rot % 2 || n_rot > head_dim)
        return FL_EINVAL;
    const int64_t half = n_rot / 2;
    for (int64_t j = 0; j < half; j++)
        if (!(inv_freq[j] > 0.0 && inv_freq[j] < INFINITY)) return FL_EINVAL;
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * n_heads * head_dim;  // (n_heads, head_dim)
        for (int64_t j = 0; j < half; j++) {
            const double angle = pos[t] * inv_freq[j];
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

typedef struct {
    const float *q;  // (T, n_heads, head_dim)
    const uint8_t *kc, *vc;
    int32_t kv_dtype;
    float *out;      // (T, n_heads, head_dim)
    int64_t T, pos0, n_heads, group, head_dim, row_bytes, esize, window;
    float scale;
    atomic_llong next;  // the next (token, head) pair to take
    atomic_int failed;
} attention_job;

static void attention_part(void *p) {
    attention_job *j = p;
    // (pos0 + T) scores, then (head_dim) for the f16-rounded query
    float *scores = malloc((size_t)(j->pos0 + j->T + j->head_dim) * sizeof(float));
    if (!scores) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t i, i1; fli_take(&j->next, j->T * j->n_heads, 1, &i, &i1);) {
        const int64_t tok = i / j->n_heads, h = i % j->n_heads;
        const int64_t n_keys = j->pos0 + tok + 1;
        const int64_t first = j->window > 0 && n_keys > j->window ? n_keys - j->window : 0;
        const int64_t off = first * j->row_bytes + (h / j->group) * j->head_dim * j->esize;
        fli_attend_one(j->q + i * j->head_dim, j->kc + off, j->vc + off, j->kv_dtype,
                       j->out + i * j->head_dim, n_keys - first, j->row_bytes, j->head_dim,
                       j->scale, scores, scores + j->pos0 + j->T);
    }
    free(scores);
}

int32_t fl_attention(const float *q, const void *k_cache, const void *v_cache, int32_t kv_dtype,
                     float *out, int64_t T, int64_t pos0, int64_t n_heads, int64_t n_kv_heads,
                     int64_t head_dim, float scale, int64_t window, int32_t n_threads) {
    if (!q || !k_cache || !v_cache || !out || T <= 0 || pos0 < 0 || n_heads <= 0 || window < 0 ||
        n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || n_threads < 1 ||
        (kv_dtype != FL_F32 && kv_dtype != FL_F16))
        return FL_EINVAL;
    const int64_t esize = kv_dtype == FL_F32 ? 4 : 2;
    attention_job j = {q,       k_cache, v_cache, kv_dtype, out, T, pos0, n_heads,
                       n_heads / n_kv_heads, head_dim, n_kv_heads * head_dim * esize, esize,
                       window, scale, 0, 0};
    fli_parallel(n_threads, attention_part, &j);
    return atomic_load(&j.failed) ? FL_ENOMEM : FL_OK;
}
