/* ffn_quant.c — ffn.c's quantized range paths: the gate and up rows of a group of bundles meet
 * x quantized to int8 (ffn.c's quantize_x) in int8 tiles (fli_qdot_tile) for up to SMALL_T
 * tokens, or in int8 GEMM panels (qgemm.c) for more (dtypes with panels: fl_ffn_bundles runs the
 * others SMALL_T tokens at a time); the kept neurons' down columns are added in f32. ffn.c's
 * bundle_range picks the path through ffn_quant.h.
 */
#include <math.h>
#include <string.h>

#include "flashllm.h"
#include "act.h"
#include "ffn_quant.h"
#include "gemm_f32.h"
#include "qgemm.h"
#include "traits.h"

#define PREFETCH_GROUPS 3  /* int8 paths: groups of FL_QT bundles ahead (prefetch_l2) */

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

/* n bytes at p into L1: a kept down column, shortly before its axpy */
static inline void prefetch_l1(const uint8_t *p, size_t n) {
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* one group of up to FL_QT bundles (rows j .. j+nr-1 of the call): bundle row ids, gate and up
 * row pointers (a short group repeats its first bundle) */
typedef struct {
    int64_t id[FL_QT];
    const uint8_t *gate[FL_QT], *up[FL_QT], *down[FL_QT];
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
        g->down[k] = fli_down_of(a, bundles, stride, g->id[k]);
    }
    const int64_t ahead = j + FL_QT * PREFETCH_GROUPS;
    for (int64_t k = ahead; k < ahead + FL_QT && k < j1; k++) {
        const int64_t i = a->rows ? a->rows[k] : k;
        prefetch_l2(bundles + i * stride, (size_t)(a->glu ? 2 : 1) * a->rb);
    }
}

/* h (FL_QT, T) of a group for tokens t .. t+nt-1 from int8 tiles (column stride ld). A GLU
 * bundle's up row follows its gate row, so a tile takes the rows of half the group in memory
 * order (gate 0, up 0, gate 1, up 1): one forward stream, where four gate rows and then four up
 * rows went back over the same bundles (1.2-1.4x faster from DRAM on Zen 3, docs/KERNELS.md).
 * A row's result does not depend on the rows beside it in a tile. */
static void group_h(const ffn_args *a, const group *g, int64_t t, int64_t nt, float *h,
                    int64_t ld) {
    const uint8_t *xt[FL_QT];
    for (int64_t j = 0; j < FL_QT; j++) xt[j] = a->xq + (size_t)(t + (j < nt ? j : 0)) * a->xb;
    float go[FL_QT][FL_QT] = {{0}}, uo[FL_QT][FL_QT];
    if (!a->glu) fli_qdot_tile(a->dtype, g->up, NULL, xt, (int32_t)nt, a->d, uo);
    for (int b = 0; a->glu && b < FL_QT; b += FL_QT / 2) {  // bundles b .. b + FL_QT/2 - 1
        const uint8_t *w[FL_QT];
        float o[FL_QT][FL_QT];  // (row, token): rows 2k, 2k + 1 = bundle b + k's gate, up
        for (int k = 0; k < FL_QT / 2; k++) w[2 * k] = g->gate[b + k], w[2 * k + 1] = g->up[b + k];
        fli_qdot_tile(a->dtype, w, NULL, xt, (int32_t)nt, a->d, o);
        for (int k = 0; k < FL_QT / 2; k++)
            for (int64_t j = 0; j < nt; j++) go[b + k][j] = o[2 * k][j], uo[b + k][j] = o[2 * k + 1][j];
    }
    for (int k = 0; k < FL_QT; k++)
        for (int64_t j = 0; j < nt; j++)
            h[k * ld + t + j] = k < g->nr ? neuron_h(a, g->id[k], go[k][j], uo[k][j]) : 0.0f;
}

/* a kept neuron's down column joins a queue of up to 2 FL_QT: it is prefetched as it comes, and
 * the older FL_QT go in one fused 4-row axpy when the queue is full — the same groups of 4 in
 * the same order as adding each group the moment it forms, one group later, so its columns have
 * arrived (a prefetch of every column of the groups ahead, kept or not, read twice the bytes) */
typedef struct {
    const uint8_t *down[2 * FL_QT];
    float h[2 * FL_QT];
    int n;
} down_queue;

static inline void queue_push(const ffn_args *a, down_queue *q, const uint8_t *down, float h,
                              float *acc) {
    prefetch_l1(down, a->down_bytes);
    q->down[q->n] = down;
    q->h[q->n++] = h;
    if (q->n == 2 * FL_QT) {
        fli_axpy4(a->ddt, q->down, q->h, acc, a->d);
        memcpy(q->down, q->down + FL_QT, FL_QT * sizeof q->down[0]);
        memcpy(q->h, q->h + FL_QT, FL_QT * sizeof q->h[0]);
        q->n = FL_QT;
    }
}

/* the queue's rest: a group of 4 if there is one, then one column at a time */
static inline void queue_flush(const ffn_args *a, down_queue *q, float *acc) {
    int k = 0;
    if (q->n >= FL_QT) fli_axpy4(a->ddt, q->down, q->h, acc, a->d), k = FL_QT;
    for (; k < q->n; k++) fli_axpy(a->ddt, q->down[k], q->h[k], acc, a->d);
    q->n = 0;
}

/* T == 1, quantized: int8 gate/up tiles; the kept neurons queue up for fused 4-row down axpys */
void fli_ffn_range_q1(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                      int64_t j1, float *acc) {
    float h[FL_QT];
    down_queue q = {.n = 0};
    group g;
    for (int64_t j = j0; j < j1; j += FL_QT) {
        group_at(a, bundles, stride, j, j1, &g);
        group_h(a, &g, 0, 1, h, 1);
        for (int k = 0; k < g.nr; k++)
            if (h[k] != 0.0f) queue_push(a, &q, g.down[k], h[k], acc);
    }
    queue_flush(a, &q, acc);
}

/* 1 < T <= SMALL_T, quantized (a decode pass with draft guesses): per token exactly
 * fli_ffn_range_q1's arithmetic — the same tiles, each token's own queue of kept neurons and its
 * fused 4-row down axpys — with each group's rows read from memory once for all T tokens, and
 * unpacked once for up to FL_QT of them where the tile keeps each token's bits (q4_k, q6_k:
 * fli_tile_exact); h: scratch (FL_QT, T) */
void fli_ffn_range_qs(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
                      int64_t j1, float *acc, float *h) {
    const int64_t T = a->T, d = a->d;
    down_queue q[SMALL_T];
    for (int64_t t = 0; t < T; t++) q[t].n = 0;
    group g;
    const int64_t tiles = (T + FL_QT - 1) / FL_QT;  /* tokens a tile takes at once, evenly */
    const int64_t step = fli_tile_exact(a->dtype, d) ? (T + tiles - 1) / tiles : 1;
    for (int64_t j = j0; j < j1; j += FL_QT) {
        group_at(a, bundles, stride, j, j1, &g);
        for (int64_t t = 0; t < T; t++) {
            if (t % step == 0) group_h(a, &g, t, T - t < step ? T - t : step, h, T);
            for (int k = 0; k < g.nr; k++)
                if (h[k * T + t] != 0.0f)
                    queue_push(a, &q[t], g.down[k], h[k * T + t], acc + t * d);
        }
    }
    for (int64_t t = 0; t < T; t++) queue_flush(a, &q[t], acc + t * d);
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
        if (k < nr) fli_dequant(a->ddt, fli_down_of(a, bundles, stride, id[k]), down + k * d, d);
        else memset(down + k * d, 0, (size_t)d * sizeof(float));
    }
}

/* T > SMALL_T, quantized: h (DOWN_K, T) and the dequantized down columns (DOWN_K, d) of DOWN_K
 * neurons from DOWN_K / FL_PR panels (panel_h), then one f32 GEMM into acc. scratch: h, down,
 * gate / up outputs (2, FL_PR, T), then the two panels */
void fli_ffn_range_qp(const ffn_args *a, const uint8_t *bundles, int64_t stride, int64_t j0,
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
