/* ffn.c — the sparse FFN over row-column bundles (see fl_ffn_bundles in flashllm.h).
 *
 * Activations: SiLU x*sigmoid(x); GELU is the exact erf form 0.5*x*(1+erf(x/sqrt(2))) (Hugging
 * Face "gelu"); GELU_TANH the tanh approximation 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))
 * (Hugging Face "gelu_pytorch_tanh" / "gelu_new", Gemma's GeGLU); ReLU. The bundles are cut
 * into a number of chunks that depends on the work alone (never on the thread count, so results
 * are the same bits on any number of threads); threads take chunks from a contiguous part each
 * (fli_split), then from the others' parts, each chunk accumulates into its own (T, d) partial,
 * and the partials are then summed into y in chunk order, split over y's elements. The
 * quantized range paths (int8 x) are in ffn_quant.c (ffn_quant.h).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "flashllm.h"
#include "act.h"
#include "act_quant.h"
#include "ffn_quant.h"
#include "pool.h"
#include "qgemm.h"
#include "traits.h"
#include "vec.h"

#define FOLD_FLOATS (1 << 18)  /* partial floats computed before a fold: the blocks' window */
#define PREFETCH_BUNDLES 2 /* bundles ahead of the one being computed */
#define SUM_CHUNK 512      /* floats of y per work unit of the partials' sum */

/* acc (T, d) += h_t * down_i for bundle i (its down column at down), reading the quantized rows
 * in place (T == 1) */
static void bundle_fused(const ffn_args *a, const uint8_t *bundle, const uint8_t *down, int64_t i,
                         float *acc) {
    const uint8_t *up = bundle + (a->glu ? a->rb : 0);
    const float bias = a->up_bias ? a->up_bias[a->ids ? a->ids[i] : i] : 0.0f;
    const float u = fli_dot(a->dtype, up, a->x, a->d) + bias;
    const float h = a->glu ? fli_activate(a->act, fli_dot(a->dtype, bundle, a->x, a->d)) * u
                           : fli_activate(a->act, u);
    if (h != 0.0f && fabsf(h) >= a->threshold) fli_axpy(a->ddt, down, h, acc, a->d);
}

/* the same for T > 1 tokens: the bundle is dequantized once into scratch (3, d) */
static void bundle_tokens(const ffn_args *a, const uint8_t *bundle, const uint8_t *down_q,
                          int64_t i, float *acc, float *scratch) {
    const int64_t d = a->d;
    float *gate = scratch, *up = scratch + d, *down = scratch + 2 * d;  // (d) each
    if (a->glu) fli_dequant(a->dtype, bundle, gate, d);
    const uint8_t *up_q = bundle + (a->glu ? a->rb : 0);
    fli_dequant(a->dtype, up_q, up, d);
    fli_dequant(a->ddt, down_q, down, d);
    const float bias = a->up_bias ? a->up_bias[a->ids ? a->ids[i] : i] : 0.0f;
    for (int64_t t = 0; t < a->T; t++) {
        const float *xt = a->x + t * d;  // (d)
        const float u = fli_dot_f32(up, xt, d) + bias;
        const float h = a->glu ? fli_activate(a->act, fli_dot_f32(gate, xt, d)) * u
                               : fli_activate(a->act, u);
        if (h != 0.0f && fabsf(h) >= a->threshold) fli_axpy_f32(h, down, acc + t * d, d);
    }
}

/* floats of per-thread scratch: f32 path (3, d) when T > 1; int8 path (FL_QT, T) when
 * T <= SMALL_T, else (DOWN_K, T + d), the gate and up outputs (2, DOWN_K, T) and two panels;
 * none when T == 1 */
static size_t scratch_floats(const ffn_args *a) {
    if (a->T == 1) return 0;
    if (!a->xq) return 3 * (size_t)a->d;
    if (a->T <= SMALL_T) return FL_QT * (size_t)a->T;
    return DOWN_K * (size_t)(a->T + a->d) + 2 * FL_PR * (size_t)a->T +
           2 * fli_panel_bytes(a->d) / sizeof(float) + 1;
}

/* acc (T, d) += the FFN over bundles j0 .. j1-1 (rows[j] when rows are given) */
static void bundle_range(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t i0,
                         int64_t i1, float *acc, float *scratch) {
    if (a->xq) {
        if (a->T == 1) fli_ffn_range_q1(a, bundles, stride, i0, i1, acc);
        else if (a->T <= SMALL_T) fli_ffn_range_qs(a, bundles, stride, i0, i1, acc, scratch);
        else fli_ffn_range_qp(a, bundles, stride, i0, i1, acc, scratch);
        return;
    }
    for (int64_t j = i0; j < i1; j++) {
        if (j + PREFETCH_BUNDLES < i1) {
            const int64_t ahead = a->rows ? a->rows[j + PREFETCH_BUNDLES] : j + PREFETCH_BUNDLES;
            fli_prefetch(bundles + ahead * stride, (size_t)stride);
        }
        const int64_t i = a->rows ? a->rows[j] : j;
        const uint8_t *down = fli_down_of(a, bundles, stride, i);
        if (scratch) bundle_tokens(a, bundles + i * stride, down, i, acc, scratch);
        else bundle_fused(a, bundles + i * stride, down, i, acc);
    }
}

typedef struct {
    const ffn_args *a;
    const uint8_t *bundles;
    int64_t n, stride, len;            // len = T * d
    int64_t b0, nb;                    // this window: blocks b0 .. b0 + nb - 1
    float *partial;                    // (nb, T, d)
    float *y;                          // (T, d)
    fli_split split;                   // the window's blocks, a contiguous part per thread
    atomic_llong next_sum;             // the next floats of y to fold
    atomic_int failed;
} ffn_job;

/* the window's blocks taken a contiguous part per thread (then the others'), each into its own
 * zeroed partial: a block's sum starts empty, whoever computes it */
static void blocks_part(void *p) {
    ffn_job *j = p;
    const size_t ns = scratch_floats(j->a);
    float *scratch = ns ? malloc(ns * sizeof(float)) : NULL;
    if (ns && !scratch) {
        atomic_store(&j->failed, 1);
        return;
    }
    int mine = -1;
    for (int64_t c, c1; fli_split_take(&j->split, &mine, 1, &c, &c1);) {
        const int64_t i0 = (j->b0 + c) * FL_FFN_BLOCK;
        const int64_t i1 = i0 + FL_FFN_BLOCK < j->n ? i0 + FL_FFN_BLOCK : j->n;
        float *part = j->partial + (size_t)c * (size_t)j->len;  // (T, d)
        memset(part, 0, (size_t)j->len * sizeof(float));
        bundle_range(j->a, j->bundles, j->stride, i0, i1, part, scratch);
    }
    free(scratch);
}

/* y = ((y + partial_0) + partial_1) + ..., element by element (a partial at a time over a run
 * of y: the same additions in the same order, vectorized), y's elements split over the threads */
static void fold_part(void *p) {
    ffn_job *j = p;
    for (int64_t k0, k1; fli_take(&j->next_sum, j->len, SUM_CHUNK, &k0, &k1);) {
        float *y = j->y + k0;
        for (int64_t c = 0; c < j->nb; c++) {
            const float *part = j->partial + (size_t)c * (size_t)j->len + k0;  // (k1 - k0)
            for (int64_t k = 0; k < k1 - k0; k++) y[k] += part[k];
        }
    }
}

/* y (T, d) += the FFN over n bundles as a left fold of blocks of FL_FFN_BLOCK bundles in order,
 * each block's partial computed from zero: the bits depend on the blocks only, never on
 * n_threads — and a caller that cuts a layer's bundles into calls at multiples of FL_FFN_BLOCK
 * (the neuron caches and the read-ahead chunks of a static pass) gets the bits of one call over
 * the whole layer, so a run's text does not depend on its budget's plan. Blocks are computed in
 * windows of at most FOLD_FLOATS partial floats (a long prompt's partials stay small). */
static int32_t ffn_blocks(const ffn_args *a, const uint8_t *bundles, int64_t n, int64_t stride,
                          float *y, int32_t n_threads) {
    const int64_t len = a->T * a->d, blocks = (n + FL_FFN_BLOCK - 1) / FL_FFN_BLOCK;
    if (blocks == 0) return FL_OK;
    int64_t w = FOLD_FLOATS / len;
    w = w < 1 ? 1 : w > blocks ? blocks : w;
    float *partial = malloc((size_t)w * (size_t)len * sizeof(float));  // (w, T, d)
    if (!partial) return FL_ENOMEM;
    int32_t status = FL_OK;
    for (int64_t b0 = 0; b0 < blocks && status == FL_OK; b0 += w) {
        const int64_t nb = blocks - b0 < w ? blocks - b0 : w;
        const int32_t nt = nb < n_threads ? (int32_t)nb : n_threads;
        ffn_job j = {.a = a, .bundles = bundles, .n = n, .stride = stride, .len = len, .b0 = b0,
                     .nb = nb, .partial = partial, .y = y};
        fli_split_init(&j.split, nb, nt);
        fli_parallel(nt, blocks_part, &j);
        if (atomic_load(&j.failed)) status = FL_ENOMEM;
        else fli_parallel(len >= 2 * SUM_CHUNK ? n_threads : 1, fold_part, &j);
    }
    free(partial);
    return status;
}

/* every index in [0, bound) (NULL is fine) */
static int indices_ok(const int32_t *idx, int64_t n, int64_t bound) {
    for (int64_t i = 0; idx && i < n; i++)
        if (idx[i] < 0 || idx[i] >= bound) return 0;
    return 1;
}

/* xq (T, fli_xq_bytes(d)) = x quantized for dtype, or NULL when the f32 paths run */
static uint8_t *quantize_x(int32_t dtype, int32_t exact, const float *x, int64_t T, int64_t d,
                           int32_t *status) {
    *status = FL_OK;
    if (exact || !fli_is_quant(dtype)) return NULL;
    const size_t xb = (size_t)fli_xq_bytes(d);
    uint8_t *xq = malloc((size_t)T * xb);
    if (!xq) *status = FL_ENOMEM;
    for (int64_t t = 0; xq && t < T; t++) fli_xq_quantize(dtype, x + t * d, d, xq + t * xb);
    return xq;
}

/* a dtype a down column may have: applied in f32 by fli_axpy / fli_axpy4 (every dtype) */
static int down_dtype_ok(int32_t ddt) {
    return ddt >= FL_F32 && ddt <= FL_Q6_K;
}

/* the gate / up rows (rb bytes each) fit the stride, and the down column (rd) its bundle or
 * its own array's stride */
static int parts_fit(const fl_ffn_layer *layer, size_t rb, size_t rd) {
    const int64_t rows = (int64_t)rb * (layer->glu ? 2 : 1);
    if (!layer->down) return layer->stride >= rows + (int64_t)rd;
    return layer->stride >= rows && layer->down_stride >= (int64_t)rd;
}

static int32_t ffn_checked(const fl_ffn_layer *layer, const int32_t *rows, int64_t n_rows,
                           float threshold, const float *x, int64_t T, float *y, int32_t exact,
                           int32_t n_threads) {
    const uint8_t *bundles = layer->bundles;
    const int64_t stride = layer->stride, d = layer->d;
    const int32_t dtype = layer->dtype, glu = layer->glu, act = layer->act;
    const int32_t *ids = layer->ids;
    int64_t n = layer->n;
    const int32_t ddt = layer->down_dtype;
    const size_t rb = fl_row_bytes(dtype, d), rd = fl_row_bytes(ddt, d);
    if (rb == 0 || rd == 0 || !down_dtype_ok(ddt) || d <= 0 || n < 0 ||
        !parts_fit(layer, rb, rd) || n_threads < 1 || act < FL_ACT_SILU ||
        act > FL_ACT_GELU_TANH_F16 || !indices_ok(ids, n, INT32_MAX) ||
        !indices_ok(rows, n_rows, n) ||
        n_rows < 0 || !(threshold >= 0.0f) || (n > 0 && !bundles))
        return FL_EINVAL;
    int32_t status;
    uint8_t *xq = quantize_x(dtype, exact, x, T, d, &status);
    if (status != FL_OK) return status;
    const ffn_args a = {d,   T,    rb,             dtype, glu != 0,  act, ddt,
                        ids, rows, layer->up_bias, x,     threshold, xq,  (size_t)fli_xq_bytes(d),
                        layer->down, layer->down_stride, rd};
    if (rows) n = n_rows;
    status = ffn_blocks(&a, bundles, n, stride, y, n_threads);
    free(xq);
    return status;
}

int32_t fl_ffn_bundles(const fl_ffn_layer *layer, const int32_t *rows, int64_t n_rows,
                       float threshold, const float *x, int64_t T, float *y, int32_t exact,
                       int32_t n_threads) {
    if (!layer || !x || !y || T <= 0) return FL_EINVAL;
    if (T <= SMALL_T || exact || !fli_is_quant(layer->dtype) || fli_has_panel(layer->dtype))
        return ffn_checked(layer, rows, n_rows, threshold, x, T, y, exact, n_threads);
    /* gate / up without int8 panels (q5_k, q6_k): SMALL_T tokens at a time, each token's
     * arithmetic that of fli_ffn_range_qs */
    for (int64_t t = 0; t < T; t += SMALL_T) {
        const int64_t nt = T - t < SMALL_T ? T - t : SMALL_T;
        const int32_t st = ffn_checked(layer, rows, n_rows, threshold, x + t * layer->d, nt,
                                       y + t * layer->d, exact, n_threads);
        if (st != FL_OK) return st;
    }
    return FL_OK;
}
