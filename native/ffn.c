/* ffn.c — the sparse FFN over row-column bundles (see fl_ffn_bundles in flashllm.h).
 *
 * Activations: SiLU x*sigmoid(x); GELU is the exact erf form 0.5*x*(1+erf(x/sqrt(2))) (Hugging
 * Face "gelu"); GELU_TANH the tanh approximation 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))
 * (Hugging Face "gelu_pytorch_tanh" / "gelu_new", Gemma's GeGLU); ReLU. The bundles are cut
 * into a number of chunks that depends on the work alone (never on the thread count, so results
 * are the same bits on any number of threads); threads take chunks from a contiguous part each
 * (fli_split), then from the others' parts, each chunk accumulates into its own (T, d) partial,
 * and the partials are then summed into y in chunk order, split over y's elements.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "flashllm.h"
#include "compute_internal.h"

#define MIN_BUNDLES_PER_CHUNK 32
#define CHUNKS_SMALL 8 /* work units of a call while T * d <= PARTIAL_FLOATS (decode): dynamic
                        * balance over up to 8 threads, and under load */
#define CHUNKS_LARGE 4 /* above it (prefill): each chunk has a (T, d) partial */
#define PARTIAL_FLOATS (1 << 18)
#define PREFETCH_BUNDLES 2 /* bundles ahead of the one being computed */
#define PREFETCH_GROUPS 3  /* int8 paths: groups of FL_QT bundles ahead (prefetch_l2) */
#define DOWN_K FL_PR       /* neurons per f32 down GEMM when T > 1 (a multiple of FL_QT) */
#define SMALL_T 10         /* up to this many tokens: per-token arithmetic (range_qs); more: GEMM
                            * panels (range_qp), faster from ~11 tokens on real q4_k layers */
#define SUM_CHUNK 512      /* floats of y per work unit of the partials' sum */

/* the bundle layout and arguments shared by every bundle of one call */
typedef struct {
    int64_t d, T;
    size_t rb;  // bytes of the gate and up rows (the down column follows the up row)
    int32_t dtype, glu, act;
    int32_t ddt;  // dtype of the down column
    const int32_t *ids;
    const int32_t *rows;  // (m) bundle rows to use, NULL = every row in order
    const float *up_bias;
    const float *x;  // (T, d)
    float threshold;  // |h| below it contributes nothing
    const uint8_t *xq;  // (T, xb) x quantized to int8 (qdot.c), NULL: the f32 paths
    size_t xb;
} ffn_args;


/* acc (T, d) += h_t * down_i for bundle i, reading the quantized rows in place (T == 1) */
static void bundle_fused(const ffn_args *a, const uint8_t *bundle, int64_t i, float *acc) {
    const uint8_t *up = bundle + (a->glu ? a->rb : 0);
    const float bias = a->up_bias ? a->up_bias[a->ids ? a->ids[i] : i] : 0.0f;
    const float u = fli_dot(a->dtype, up, a->x, a->d) + bias;
    const float h = a->glu ? fli_activate(a->act, fli_dot(a->dtype, bundle, a->x, a->d)) * u
                           : fli_activate(a->act, u);
    if (h != 0.0f && fabsf(h) >= a->threshold) fli_axpy(a->ddt, up + a->rb, h, acc, a->d);
}

/* the same for T > 1 tokens: the bundle is dequantized once into scratch (3, d) */
static void bundle_tokens(const ffn_args *a, const uint8_t *bundle, int64_t i, float *acc,
                          float *scratch) {
    const int64_t d = a->d;
    float *gate = scratch, *up = scratch + d, *down = scratch + 2 * d;  // (d) each
    if (a->glu) fli_dequant(a->dtype, bundle, gate, d);
    const uint8_t *up_q = bundle + (a->glu ? a->rb : 0);
    fli_dequant(a->dtype, up_q, up, d);
    fli_dequant(a->ddt, up_q + a->rb, down, d);
    const float bias = a->up_bias ? a->up_bias[a->ids ? a->ids[i] : i] : 0.0f;
    for (int64_t t = 0; t < a->T; t++) {
        const float *xt = a->x + t * d;  // (d)
        const float u = fli_dot_f32(up, xt, d) + bias;
        const float h = a->glu ? fli_activate(a->act, fli_dot_f32(gate, xt, d)) * u
                               : fli_activate(a->act, u);
        if (h != 0.0f && fabsf(h) >= a->threshold) fli_axpy_f32(h, down, acc + t * d, d);
    }
}

/* the neuron's activation from its gate and up dot products; 0 when thresholded away */
static inline float neuron_h(const ffn_args *a, int64_t i, float g, float u) {
    u += a->up_bias ? a->up_bias[a->ids ? a->ids[i] : i] : 0.0f;
    const float h = a->glu ? fli_activate(a->act, g) * u : fli_activate(a->act, u);
    return h != 0.0f && fabsf(h) >= a->threshold ? h : 0.0f;
}

/* n bytes at p into L2: a bundle's gate and up rows (its down column is read only if kept);
 * prefetched into L1, the stream was no faster than with none (docs/KERNELS.md) */
static inline void prefetch_l2(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* one group of up to FL_QT bundles (rows j .. j+nr-1 of the call): bundle row ids, gate and up
 * row pointers (a short group repeats its first bundle) */
typedef struct {
    int64_t id[FL_QT];
    const uint8_t *gate[FL_QT], *up[FL_QT];
    int nr;
} group;

static void group_at(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j,
                     int64_t j1, group *g) {
    g->nr = j1 - j < FL_QT ? (int)(j1 - j) : FL_QT;
    for (int k = 0; k < FL_QT; k++) {
        const int64_t jj = j + (k < g->nr ? k : 0);
        g->id[k] = a->rows ? a->rows[jj] : jj;
        g->gate[k] = bundles + g->id[k] * stride;
        g->up[k] = g->gate[k] + (a->glu ? a->rb : 0);
    }
    const int64_t ahead = j + FL_QT * PREFETCH_GROUPS;
    for (int64_t k = ahead; k < ahead + FL_QT && k < j1; k++)
        prefetch_l2(bundles + (a->rows ? a->rows[k] : k) * stride, (size_t)(a->glu ? 2 : 1) * a->rb);
}

/* h (FL_QT, T) of a group for tokens t .. t+nt-1 from int8 tiles (column stride ld); ex: NULL
 * or the group's gate and up rows expanded by fli_wx_expand (2, FL_QT, xb) */
static void group_h(const ffn_args *a, const group *g, int64_t t, int64_t nt, float *h,
                    int64_t ld, const uint8_t *ex) {
    const uint8_t *xt[FL_QT], *eg[FL_QT], *eu[FL_QT];
    for (int64_t j = 0; j < FL_QT; j++) {
        xt[j] = a->xq + (size_t)(t + (j < nt ? j : 0)) * a->xb;
        eg[j] = ex ? ex + j * a->xb : NULL;
        eu[j] = ex ? ex + (FL_QT + j) * a->xb : NULL;
    }
    float go[FL_QT][FL_QT] = {{0}}, uo[FL_QT][FL_QT];
    fli_qdot_tile(a->dtype, g->up, ex ? eu : NULL, xt, (int32_t)nt, a->d, uo);
    if (a->glu) fli_qdot_tile(a->dtype, g->gate, ex ? eg : NULL, xt, (int32_t)nt, a->d, go);
    for (int k = 0; k < FL_QT; k++)
        for (int64_t j = 0; j < nt; j++)
            h[k * ld + t + j] = k < g->nr ? neuron_h(a, g->id[k], go[k][j], uo[k][j]) : 0.0f;
}

/* T == 1, quantized: int8 gate/up tiles; the kept neurons queue up for fused 4-row down axpys */
static void range_q1(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                     int64_t j1, float *acc) {
    const uint8_t *down[FL_QT];
    float hq[FL_QT], h[FL_QT];
    int nq = 0;
    group g;
    for (int64_t j = j0; j < j1; j += FL_QT) {
        group_at(a, bundles, stride, j, j1, &g);
        group_h(a, &g, 0, 1, h, 1, NULL);
        for (int k = 0; k < g.nr; k++) {
            if (h[k] == 0.0f) continue;
            down[nq] = g.up[k] + a->rb;
            hq[nq++] = h[k];
            if (nq == FL_QT) {
                fli_axpy4(a->ddt, down, hq, acc, a->d);
                nq = 0;
            }
        }
    }
    for (int k = 0; k < nq; k++) fli_axpy(a->ddt, down[k], hq[k], acc, a->d);
}

/* 1 < T <= SMALL_T, quantized (a decode pass with draft guesses): per token exactly range_q1's
 * arithmetic — the same tiles, each token's own queue of kept neurons and its fused 4-row down
 * axpys — with each group's rows read from memory once for all T tokens; h: scratch (FL_QT, T) */
static void range_qs(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                     int64_t j1, float *acc, float *h) {
    const int64_t T = a->T, d = a->d;
    const uint8_t *down[SMALL_T][FL_QT];
    float hq[SMALL_T][FL_QT];
    int nq[SMALL_T] = {0};
    group g;
#ifdef FLI_Q4K_TILE1  /* tokens one tile takes at once, each as alone (fli_q4k_tilen), evenly */
    const int64_t tiles = (T + FL_QT - 1) / FL_QT;
    const int64_t step = a->dtype == FL_Q4_K && d % FL_QK_K == 0 ? (T + tiles - 1) / tiles : 1;
#else
    const int64_t step = 1;
#endif
    for (int64_t j = j0; j < j1; j += FL_QT) {
        group_at(a, bundles, stride, j, j1, &g);
        for (int64_t t = 0; t < T; t++) {
            if (t % step == 0) group_h(a, &g, t, T - t < step ? T - t : step, h, T, NULL);
            for (int k = 0; k < g.nr; k++) {
                if (h[k * T + t] == 0.0f) continue;
                down[t][nq[t]] = g.up[k] + a->rb;
                hq[t][nq[t]++] = h[k * T + t];
                if (nq[t] == FL_QT) {
                    fli_axpy4(a->ddt, down[t], hq[t], acc + t * d, d);
                    nq[t] = 0;
                }
            }
        }
    }
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < nq[t]; k++) fli_axpy(a->ddt, down[t][k], hq[t][k], acc + t * d, d);
}

/* the gate and up rows of bundles j .. j+nr-1 (nr <= FL_PR) packed into two int8 GEMM panels
 * (qgemm.c) that meet all T tokens: h (FL_PR, T), their down columns
 * dequantized into down (FL_PR, d); gu (2, FL_PR, T) and pan (2, panel bytes) scratch */
static void panel_h(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j,
                    int nr, float *h, float *down, float *gu, uint8_t *pan) {
    const int64_t T = a->T, d = a->d;
    const size_t pb = fli_panel_bytes(d);
    const uint8_t *gate[FL_PR], *up[FL_PR];
    int64_t id[FL_PR];
    for (int k = 0; k < FL_PR; k++) {
        id[k] = a->rows ? a->rows[j + (k < nr ? k : 0)] : j + (k < nr ? k : 0);
        gate[k] = bundles + id[k] * stride;
        up[k] = gate[k] + (a->glu ? a->rb : 0);
    }
    float *go = gu, *uo = gu + FL_PR * T;  // (FL_PR, T) each
    fli_panel_pack(a->dtype, up, d, pan);
    fli_panel_gemm(a->dtype, pan, a->xq, a->xb, T, d, uo, T);
    if (a->glu) {
        fli_panel_pack(a->dtype, gate, d, pan + pb);
        fli_panel_gemm(a->dtype, pan + pb, a->xq, a->xb, T, d, go, T);
    }
    if (a->glu && a->act == FL_ACT_SILU && !a->up_bias) {  // vectorized (act.c)
        fli_silu_mul(go, uo, h, FL_PR * T);
        for (int64_t i = 0; i < FL_PR * T; i++)
            if (i >= nr * T || !(fabsf(h[i]) >= a->threshold)) h[i] = 0.0f;
    } else {
        for (int k = 0; k < FL_PR; k++)
            for (int64_t t = 0; t < T; t++)
                h[k * T + t] = k < nr ? neuron_h(a, id[k], a->glu ? go[k * T + t] : 0.0f,
                                                 uo[k * T + t])
                                      : 0.0f;
    }
    for (int k = 0; k < FL_PR; k++) {
        if (k < nr) fli_dequant(a->ddt, up[k] + a->rb, down + k * d, d);
        else memset(down + k * d, 0, (size_t)d * sizeof(float));
    }
}

/* T > SMALL_T, quantized: h (DOWN_K, T) and the dequantized down columns (DOWN_K, d) of DOWN_K
 * neurons from DOWN_K / FL_PR panels (panel_h), then one f32 GEMM into acc. scratch: h, down,
 * gate / up outputs (2, FL_PR, T), then the two panels */
static void range_qp(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                     int64_t j1, float *acc, float *scratch) {
    const int64_t T = a->T, d = a->d;
    float *h = scratch, *down = h + DOWN_K * T, *gu = down + DOWN_K * d;
    uint8_t *pan = (uint8_t *)(gu + 2 * FL_PR * T);
    for (int64_t j = j0; j < j1;) {
        int64_t K = 0;
        for (; K < DOWN_K && j < j1; K += FL_PR) {
            const int nr = j1 - j < FL_PR ? (int)(j1 - j) : FL_PR;
            panel_h(a, bundles, stride, j, nr, h + K * T, down + K * d, gu, pan);
            j += nr;
        }
        fli_down_f32(h, T, down, K, d, acc, T);
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
        if (a->T == 1) range_q1(a, bundles, stride, i0, i1, acc);
        else if (a->T <= SMALL_T) range_qs(a, bundles, stride, i0, i1, acc, scratch);
        else range_qp(a, bundles, stride, i0, i1, acc, scratch);
        return;
    }
    for (int64_t j = i0; j < i1; j++) {
        if (j + PREFETCH_BUNDLES < i1) {
            const int64_t ahead = a->rows ? a->rows[j + PREFETCH_BUNDLES] : j + PREFETCH_BUNDLES;
            fli_prefetch(bundles + ahead * stride, (size_t)stride);
        }
        const int64_t i = a->rows ? a->rows[j] : j;
        if (scratch) bundle_tokens(a, bundles + i * stride, i, acc, scratch);
        else bundle_fused(a, bundles + i * stride, i, acc);
    }
}

/* one thread over every bundle, straight into y */
static int32_t ffn_serial(const ffn_args *a, const uint8_t *bundles, int64_t n, int64_t stride,
                          float *y) {
    const size_t ns = scratch_floats(a);
    float *scratch = ns ? malloc(ns * sizeof(float)) : NULL;
    if (ns && !scratch) return FL_ENOMEM;
    bundle_range(a, bundles, stride, 0, n, y, scratch);
    free(scratch);
    return FL_OK;
}

typedef struct {
    const ffn_args *a;
    const uint8_t *bundles;
    int64_t n, stride, n_chunks, len;  // len = T * d
    float *partial;                    // (n_chunks, T, d)
    float *y;                          // (T, d)
    fli_split split;                   // the chunks, a contiguous part per thread
    atomic_llong next_sum;             // the next floats to sum
    atomic_int failed;
} ffn_job;

/* chunks taken a contiguous part per thread (then the others'), each into its own partial */
static void chunks_part(void *p) {
    ffn_job *j = p;
    const size_t ns = scratch_floats(j->a);
    float *scratch = ns ? malloc(ns * sizeof(float)) : NULL;
    if (ns && !scratch) {
        atomic_store(&j->failed, 1);
        return;
    }
    int mine = -1;
    for (int64_t c, c1; fli_split_take(&j->split, &mine, 1, &c, &c1);)
        bundle_range(j->a, j->bundles, j->stride, j->n * c / j->n_chunks,
                     j->n * (c + 1) / j->n_chunks, j->partial + (size_t)c * (size_t)j->len,
                     scratch);
    free(scratch);
}

/* y += the partials summed in chunk order, y's elements split over the threads */
static void sum_part(void *p) {
    ffn_job *j = p;
    for (int64_t k0, k1; fli_take(&j->next_sum, j->len, SUM_CHUNK, &k0, &k1);)
        for (int64_t k = k0; k < k1; k++) {
            float s = 0.0f;
            for (int64_t c = 0; c < j->n_chunks; c++)
                s += j->partial[(size_t)c * (size_t)j->len + k];
            j->y[k] += s;
        }
}

/* the bundles cut into n_chunks ranges, a contiguous part of them per thread and the rest to
 * whichever is free (a thread slowed by another process does less), one partial (T, d) per
 * chunk summed into y in chunk order: the result does not depend on who took which chunk */
static int32_t ffn_parallel(const ffn_args *a, const uint8_t *bundles, int64_t n, int64_t stride,
                            float *y, int32_t n_threads, int64_t n_chunks) {
    const int64_t len = a->T * a->d;
    float *partial = calloc((size_t)n_chunks * (size_t)len, sizeof(float));  // (n_chunks, T, d)
    if (!partial) return FL_ENOMEM;
    ffn_job j = {.a = a, .bundles = bundles, .n = n, .stride = stride, .n_chunks = n_chunks,
                 .len = len, .partial = partial, .y = y};
    fli_split_init(&j.split, n_chunks, n_threads);
    fli_parallel(n_threads, chunks_part, &j);
    if (!atomic_load(&j.failed)) fli_parallel(n_threads, sum_part, &j);
    free(partial);
    return atomic_load(&j.failed) ? FL_ENOMEM : FL_OK;
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
        stride < (int64_t)(rb * (glu ? 2 : 1) + rd) || n_threads < 1 || act < FL_ACT_SILU ||
        act > FL_ACT_GELU_TANH || !indices_ok(ids, n, INT32_MAX) || !indices_ok(rows, n_rows, n) ||
        n_rows < 0 || !(threshold >= 0.0f) || (n > 0 && !bundles))
        return FL_EINVAL;
    int32_t status;
    uint8_t *xq = quantize_x(dtype, exact, x, T, d, &status);
    if (status != FL_OK) return status;
    const ffn_args a = {d,   T,    rb,             dtype, glu != 0,  act, ddt,
                        ids, rows, layer->up_bias, x,     threshold, xq,  (size_t)fli_xq_bytes(d)};
    if (rows) n = n_rows;
    /* The chunks, and so the grouping of the sum, depend on the work only, never on n_threads:
     * the same call gives the same bits on any number of threads. */
    const int64_t useful = n / MIN_BUNDLES_PER_CHUNK;
    const int64_t want = T * d <= PARTIAL_FLOATS ? CHUNKS_SMALL : CHUNKS_LARGE;  // partials' DRAM
    const int64_t chunks = want < useful ? want : (useful > 1 ? useful : 1);
    const int32_t nt = chunks < n_threads ? (int32_t)chunks : n_threads;
    status = chunks == 1 ? ffn_serial(&a, bundles, n, stride, y)
                         : ffn_parallel(&a, bundles, n, stride, y, nt, chunks);
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
     * arithmetic that of range_qs */
    for (int64_t t = 0; t < T; t += SMALL_T) {
        const int64_t nt = T - t < SMALL_T ? T - t : SMALL_T;
        const int32_t st = ffn_checked(layer, rows, n_rows, threshold, x + t * layer->d, nt,
                                       y + t * layer->d, exact, n_threads);
        if (st != FL_OK) return st;
    }
    return FL_OK;
}
