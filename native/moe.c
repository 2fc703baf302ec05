/* moe.c — a mixture of experts' layer in one call each for its routing and its experts
 * (fl_moe_route, fl_moe_ffn in flashllm.h), as llama.cpp's mul_mat_id computes them.
 *
 * runtime/moe.py ran the routing in numpy and each routed expert as two matmuls and an
 * activation with numpy between them: per decode token 16 layers x 8 experts x ~6 kernel and
 * numpy calls, each a parallel section of its own. Here a layer's pass is four sections:
 *
 *   sort      the pass's (token, k) pairs by expert (then token): expert e's rows are
 *             first[e] .. first[e+1]-1, each token's h quantized once and copied to its rows
 *   gate_up   every routed expert's packed groups of 16 rows against all of its tokens (the
 *             expert's weights read once for the pass, T tokens a group: a panel per expert)
 *   act       act(g) * u of every row, quantized for the down rows
 *   down      as gate_up, into one output row per pair
 *   mix       x[t] += w · y per token, its experts in ascending order
 *
 * Each row's arithmetic is the one-token product's (the packed kernels keep every token's sums
 * apart, fed 4 tokens at a time from the expert's first row, as fl_matmul_packed feeds them), so
 * a token's result does not depend on the tokens beside it, and the sums and their order are
 * runtime/moe.py's before this file: x += w_k * (0 + y_k) for the experts in ascending order.
 * Experts whose matrices are not packed (no layout on this build, or exact) run through
 * fl_matmul, one expert at a time. Scratch is malloc'd per call and freed before returning.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flashllm.h"
#include "act_quant.h"
#include "pool.h"
#include "traits.h"

#define MOE_R 16    /* rows of a packed group (pack.c) */
#define MOE_T 4     /* tokens a group kernel call takes */
#define MOE_CHUNK 4 /* groups a thread takes at a time */

int32_t fl_moe_route(const float *logits, int64_t T, int64_t n_experts, int64_t k, int32_t norm,
                     int32_t *experts, float *weights) {
    if (!logits || !experts || !weights || T <= 0 || n_experts <= 0 || k <= 0 || k > n_experts)
        return FL_EINVAL;
    float *p = malloc((size_t)n_experts * sizeof(float));  // (n_experts)
    if (!p) return FL_ENOMEM;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * n_experts;
        float mx = l[0];
        for (int64_t i = 0; i < n_experts; i++) {
            if (!isfinite(l[i])) {
                free(p);
                return FL_EINVAL;
            }
            mx = l[i] > mx ? l[i] : mx;
        }
        double sum = 0.0;  // ggml's soft_max: expf, the sum in double, one scale
        for (int64_t i = 0; i < n_experts; i++) sum += p[i] = expf(l[i] - mx);
        const float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < n_experts; i++) p[i] *= inv;
        int32_t *e = experts + t * k;
        float *w = weights + t * k, s = 0.0f;
        for (int64_t j = 0; j < k; j++) {  // the largest left, the first of equals
            int64_t best = 0;
            for (int64_t i = 1; i < n_experts; i++) best = p[i] > p[best] ? i : best;
            e[j] = (int32_t)best, w[j] = p[best], p[best] = -1.0f;
            s += w[j];
        }
        for (int64_t j = 0; norm && j < k; j++) w[j] /= s;
    }
    free(p);
    return FL_OK;
}

/* A pass's pairs sorted by expert, and its scratch: per expert e, its c_e = first[e+1] -
 * first[e] rows' gate / up products, activations (f32 and quantized for the down rows) and
 * quantized h at offsets off_*[e]; y (rows, d) the down products, one row per pair. */
typedef struct {
    const fl_expert *ex;
    int64_t n_ex, T, k, d, rows;
    int32_t act, exact;
    const float *h;          // (T, d)
    int64_t *first;          // (n_ex + 1)
    int32_t *tok, *ex_of;    // (rows) token and expert of each sorted row
    int64_t *row_of;         // (T k) the sorted row of pair (t, j)
    size_t *off_gu, *off_a, *off_xh, *off_xa;  // (n_ex) floats, floats, bytes, bytes
    int64_t *item0;          // (n_ex + 1) first packed group of each expert in a product
    float *gu, *a, *y;
    uint8_t *xh, *xa, *xt;   // xt (T, fli_xq_bytes(d)): each token quantized once
} moe_pass;

/* whether expert e's matrix m runs packed (else fl_matmul) */
static int runs_packed(const moe_pass *p, const fl_mat *m) { return m->packed && !p->exact; }

static int expert_ok(const fl_expert *e, int64_t d, int32_t exact) {
    const fl_mat *gu = &e->gate_up, *dn = &e->down;
    for (int i = 0; i < 2; i++) {
        const fl_mat *m = i ? dn : gu;
        if (!m->w || m->rows <= 0 || m->cols <= 0 || (m->packed && exact) ||
            (m->packed ? fl_packed_bytes(m->dtype, m->rows, m->cols) == 0
                       : fl_row_bytes(m->dtype, m->cols) == 0))
            return 0;
    }
    return gu->cols == d && dn->rows == d && gu->rows == 2 * dn->cols;
}

/* the pairs sorted by expert, then token (counting sort); the offsets of each expert's scratch */
static void sort_pairs(moe_pass *p, const int32_t *ids, size_t *sizes) {
    int64_t *fill = p->item0;  // (n_ex + 1) scratch here, the items later
    memset(p->first, 0, (size_t)(p->n_ex + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < p->T * p->k; i++) p->first[ids[i] + 1]++;
    for (int64_t e = 0; e < p->n_ex; e++) p->first[e + 1] += p->first[e];
    memcpy(fill, p->first, (size_t)(p->n_ex + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < p->T * p->k; i++) {
        const int64_t r = fill[ids[i]]++;
        p->tok[r] = (int32_t)(i / p->k), p->ex_of[r] = ids[i], p->row_of[i] = r;
    }
    memset(sizes, 0, 4 * sizeof(size_t));
    for (int64_t e = 0; e < p->n_ex; e++) {
        const fl_mat *gu = &p->ex[e].gate_up, *dn = &p->ex[e].down;
        const size_t c = (size_t)(p->first[e + 1] - p->first[e]), n = (size_t)dn->cols;
        p->off_gu[e] = sizes[0], p->off_a[e] = sizes[1];
        p->off_xh[e] = sizes[2], p->off_xa[e] = sizes[3];
        sizes[0] += c * 2 * n, sizes[1] += c * n;
        sizes[2] += runs_packed(p, gu) ? c * (size_t)fli_xq_bytes(p->d) : 0;
        sizes[3] += runs_packed(p, dn) ? c * (size_t)fli_xq_bytes((int64_t)n) : 0;
    }
}

static void free_pass(moe_pass *p) {
    free(p->first), free(p->tok), free(p->ex_of), free(p->row_of), free(p->off_gu);
    free(p->item0), free(p->gu), free(p->a), free(p->y), free(p->xh), free(p->xa), free(p->xt);
}

/* p's arrays for ids (T, k); FL_ENOMEM when one cannot be had (p freed) */
static int32_t plan_pass(moe_pass *p, const int32_t *ids) {
    const size_t R = (size_t)p->rows, E = (size_t)p->n_ex;
    size_t sizes[4];
    p->first = malloc((E + 1) * sizeof(int64_t)), p->item0 = malloc((E + 1) * sizeof(int64_t));
    p->tok = malloc(R * sizeof(int32_t)), p->ex_of = malloc(R * sizeof(int32_t));
    p->row_of = malloc(R * sizeof(int64_t)), p->off_gu = malloc(4 * E * sizeof(size_t));
    p->xt = malloc((size_t)p->T * (size_t)fli_xq_bytes(p->d));
    if (!p->first || !p->item0 || !p->tok || !p->ex_of || !p->row_of || !p->off_gu || !p->xt) {
        free_pass(p);
        return FL_ENOMEM;
    }
    p->off_a = p->off_gu + E, p->off_xh = p->off_a + E, p->off_xa = p->off_xh + E;
    sort_pairs(p, ids, sizes);
    p->gu = malloc(sizes[0] * sizeof(float)), p->a = malloc(sizes[1] * sizeof(float));
    p->y = malloc(R * (size_t)p->d * sizeof(float));
    p->xh = malloc(sizes[2] + 1), p->xa = malloc(sizes[3] + 1);
    if (!p->gu || !p->a || !p->y || !p->xh || !p->xa) {
        free_pass(p);
        return FL_ENOMEM;
    }
    return FL_OK;
}

typedef struct {
    moe_pass *p;
    atomic_llong next;
} rows_job;

/* each token's h quantized once for the first packed expert's gate / up dtype */
static void quantize_tokens(void *arg) {
    rows_job *j = arg;
    const moe_pass *p = j->p;
    const size_t xb = (size_t)fli_xq_bytes(p->d);
    for (int64_t t, t1; fli_take(&j->next, p->T, 1, &t, &t1);)
        fli_xq_quantize(p->ex[p->ex_of[0]].gate_up.dtype, p->h + t * p->d, p->d, p->xt + t * xb);
}

/* each packed row's quantized h: its token's (a copy), or quantized again for another dtype */
static void gather_rows(void *arg) {
    rows_job *j = arg;
    const moe_pass *p = j->p;
    const size_t xb = (size_t)fli_xq_bytes(p->d);
    const int32_t dt0 = p->ex[p->ex_of[0]].gate_up.dtype;
    for (int64_t r, r1; fli_take(&j->next, p->rows, 8, &r, &r1);)
        for (; r < r1; r++) {
            const int32_t e = p->ex_of[r], t = p->tok[r];
            const fl_mat *m = &p->ex[e].gate_up;
            if (!runs_packed(p, m)) continue;
            uint8_t *dst = p->xh + p->off_xh[e] + (size_t)(r - p->first[e]) * xb;
            if (m->dtype == dt0) memcpy(dst, p->xt + (size_t)t * xb, xb);
            else fli_xq_quantize(m->dtype, p->h + (int64_t)t * p->d, p->d, dst);
        }
}

/* act(g) * u of each row, and for packed down rows its quantized activations */
static void act_rows(void *arg) {
    rows_job *j = arg;
    const moe_pass *p = j->p;
    for (int64_t r, r1; fli_take(&j->next, p->rows, 8, &r, &r1);)
        for (; r < r1; r++) {
            const int32_t e = p->ex_of[r];
            const fl_mat *dn = &p->ex[e].down;
            const int64_t n = dn->cols, i = r - p->first[e];
            const float *g = p->gu + p->off_gu[e] + (size_t)i * 2 * (size_t)n;  // (2n)
            float *a = p->a + p->off_a[e] + (size_t)i * (size_t)n;              // (n)
            fl_act_mul(p->act, g, g + n, a, n);
            if (runs_packed(p, dn))
                fli_xq_quantize(dn->dtype, a, n,
                                p->xa + p->off_xa[e] + (size_t)i * (size_t)fli_xq_bytes(n));
        }
}

typedef struct {
    moe_pass *p;
    int down;         // 0: the gate / up products, 1: the down products
    fli_split split;  // the packed groups of every routed expert, item0's order
} prod_job;

/* matrix, its quantized tokens, its outputs (c_e rows, ld apart) of expert e in product j */
static const fl_mat *product_of(const prod_job *j, int64_t e, const uint8_t **xq, float **out) {
    const moe_pass *p = j->p;
    if (j->down) {
        *xq = p->xa + p->off_xa[e], *out = p->y + p->first[e] * p->d;
        return &p->ex[e].down;
    }
    *xq = p->xh + p->off_xh[e], *out = p->gu + p->off_gu[e];
    return &p->ex[e].gate_up;
}

static void product_part(void *arg) {
    prod_job *j = arg;
    const moe_pass *p = j->p;
    int mine = -1;
    for (int64_t i, i1; fli_split_take(&j->split, &mine, MOE_CHUNK, &i, &i1);)
        for (int64_t e = 0; i < i1; i++) {
            while (p->item0[e + 1] <= i) e++;  // the expert of group i (items ascend in a chunk)
            const uint8_t *xq;
            float *out;
            const fl_mat *m = product_of(j, e, &xq, &out);
            const fli_traits *tr = fli_traits_of(m->dtype);
            const size_t gb = tr->group_bytes(m->cols), xb = (size_t)fli_xq_bytes(m->cols);
            const int64_t g = i - p->item0[e], c = p->first[e + 1] - p->first[e];
            const uint8_t *gp = (const uint8_t *)m->w + (size_t)g * gb;
            for (int64_t t = 0; t < c; t += MOE_T)
                tr->group(gp, m->cols, xq + (size_t)t * xb, xb, c - t < MOE_T ? (int)(c - t) : MOE_T,
                          out + t * m->rows + g * MOE_R, m->rows, m->bias ? m->bias + g * MOE_R : NULL);
        }
}

/* expert e's product through fl_matmul: its rows' f32 inputs gathered (gate / up: h) */
static int32_t product_plain(moe_pass *p, int down, int64_t e, int32_t n_threads) {
    const int64_t c = p->first[e + 1] - p->first[e];
    const uint8_t *xq;
    float *out;
    prod_job j = {.p = p, .down = down};
    const fl_mat *m = product_of(&j, e, &xq, &out);
    if (down)
        return fl_matmul(m->w, m->dtype, m->rows, m->cols, m->bias, p->a + p->off_a[e], c, out,
                         p->exact, n_threads);
    float *hs = malloc((size_t)c * (size_t)p->d * sizeof(float));  // (c, d)
    if (!hs) return FL_ENOMEM;
    for (int64_t i = 0; i < c; i++)
        memcpy(hs + i * p->d, p->h + (int64_t)p->tok[p->first[e] + i] * p->d,
               (size_t)p->d * sizeof(float));
    const int32_t st = fl_matmul(m->w, m->dtype, m->rows, m->cols, m->bias, hs, c, out, p->exact,
                                 n_threads);
    free(hs);
    return st;
}

/* every routed expert's gate / up (down = 0) or down products: the packed ones in one section */
static int32_t products(moe_pass *p, int down, int32_t n_threads) {
    prod_job j = {.p = p, .down = down};
    p->item0[0] = 0;
    for (int64_t e = 0; e < p->n_ex; e++) {
        const fl_mat *m = down ? &p->ex[e].down : &p->ex[e].gate_up;
        const int routed = p->first[e + 1] > p->first[e];
        p->item0[e + 1] = p->item0[e] + (routed && runs_packed(p, m) ? m->rows / MOE_R : 0);
    }
    fli_split_init(&j.split, p->item0[p->n_ex], n_threads);
    if (p->item0[p->n_ex] > 0) fli_parallel(n_threads, product_part, &j);
    for (int64_t e = 0; e < p->n_ex; e++) {
        const fl_mat *m = down ? &p->ex[e].down : &p->ex[e].gate_up;
        if (p->first[e + 1] == p->first[e] || runs_packed(p, m)) continue;
        const int32_t st = product_plain(p, down, e, n_threads);
        if (st != FL_OK) return st;
    }
    return FL_OK;
}

typedef struct {
    moe_pass *p;
    const float *w;  // (T, k)
    float *x;        // (T, d)
    atomic_llong next;
} mix_job;

/* x[t] += w · (0 + y) over token t's pairs in ascending expert order (runtime/moe.py's sums) */
static void mix_tokens(void *arg) {
    mix_job *j = arg;
    const moe_pass *p = j->p;
    for (int64_t t, t1; fli_take(&j->next, p->T, 1, &t, &t1);) {
        const int64_t *rows = p->row_of + t * p->k;  // sorted rows ascend with the expert
        int64_t order[p->k];
        for (int64_t a = 0; a < p->k; a++) {
            int64_t b = a;
            for (; b > 0 && rows[order[b - 1]] > rows[a]; b--) order[b] = order[b - 1];
            order[b] = a;
        }
        float *xt = j->x + t * p->d;
        for (int64_t a = 0; a < p->k; a++) {
            const float wv = j->w[t * p->k + order[a]];
            const float *y = p->y + rows[order[a]] * p->d;
            for (int64_t i = 0; i < p->d; i++) xt[i] += wv * (0.0f + y[i]);
        }
    }
}

/* threads for a section of n rows: one for a decode pass's few */
static int32_t threads_for(int64_t n, int32_t n_threads) { return n < 16 ? 1 : n_threads; }

int32_t fl_moe_ffn(const fl_expert *experts, int64_t n_experts, const int32_t *ids,
                   const float *weights, int64_t T, int64_t k, int32_t act, const float *h,
                   float *x, int64_t d, int32_t exact, int32_t n_threads) {
    if (!experts || !ids || !weights || !h || !x || n_experts <= 0 || T <= 0 || k <= 0 ||
        d <= 0 || n_threads < 1 || act < FL_ACT_SILU || act > FL_ACT_GELU_TANH_F16)
        return FL_EINVAL;
    for (int64_t i = 0; i < T * k; i++)
        if (ids[i] < 0 || ids[i] >= n_experts) return FL_EINVAL;
    for (int64_t e = 0; e < n_experts; e++)
        if (!expert_ok(&experts[e], d, exact)) return FL_EINVAL;
    moe_pass p = {.ex = experts, .n_ex = n_experts, .T = T, .k = k, .d = d, .rows = T * k,
                  .act = act, .exact = exact, .h = h};
    int32_t st = plan_pass(&p, ids);
    if (st != FL_OK) return st;
    rows_job q = {.p = &p};
    fli_parallel(threads_for(T, n_threads), quantize_tokens, &q);
    rows_job g = {.p = &p};
    fli_parallel(threads_for(p.rows, n_threads), gather_rows, &g);
    st = products(&p, 0, n_threads);
    rows_job a = {.p = &p};
    if (st == FL_OK) fli_parallel(threads_for(p.rows, n_threads), act_rows, &a);
    if (st == FL_OK) st = products(&p, 1, n_threads);
    mix_job m = {.p = &p, .w = weights, .x = x};
    if (st == FL_OK) fli_parallel(threads_for(T, n_threads), mix_tokens, &m);
    free_pass(&p);
    return st;
}

int32_t fl_moe_token(const fl_moe_block *b, float *x, int64_t d, int32_t n_threads) {
    if (!b || !x || !b->norm || !b->router.w || b->router.packed || !b->experts || d <= 0 ||
        b->n_experts <= 0 || b->router.rows != b->n_experts || b->router.cols != d ||
        b->k <= 0 || b->k > b->n_experts || n_threads < 1)
        return FL_EINVAL;
    float *buf = malloc((size_t)(d + b->n_experts + b->k) * sizeof(float));
    int32_t *ids = malloc((size_t)b->k * sizeof(int32_t));
    int32_t st = buf && ids ? FL_OK : FL_ENOMEM;
    float *h = buf, *logits = buf + d, *w = logits + b->n_experts;  // (d), (n_experts), (k)
    if (st == FL_OK) st = fl_rmsnorm(x, b->norm, h, 1, d, b->eps);
    if (st == FL_OK)
        st = fl_matmul(b->router.w, b->router.dtype, b->n_experts, d, b->router.bias, h, 1,
                       logits, 1, n_threads);
    if (st == FL_OK) st = fl_moe_route(logits, 1, b->n_experts, b->k, b->norm_topk, ids, w);
    if (st == FL_OK)
        st = fl_moe_ffn(b->experts, b->n_experts, ids, w, 1, b->k, b->act, h, x, d, 0, n_threads);
    free(buf), free(ids);
    return st;
}

