/* block.c — one decode token through a transformer block's attention or dense FFN in one call
 * (fl_attn_token, fl_ffn_token in flashllm.h).
 *
 * runtime/model.py runs a block as about twelve kernel calls with numpy between them; for one
 * token on a small model that Python is a third of the token's time (SmolLM2-135M: ~1.6 of
 * ~5.5 ms, docs/MEASUREMENTS.md). Here the same steps run back to back through the same API
 * functions, in the same order and on the same values, so the result is that sequence's to the
 * bit (tests/test_block.py compares the two on every architecture). Scratch is malloc'd per
 * call and freed before returning.
 */
#include <stdlib.h>
#include <string.h>

#include "flashllm.h"
#include "base.h"

/* y (m.rows) = m . x (+ bias), one token, int8 activations */
static int32_t mat_vec(const fl_mat *m, const float *x, float *y, int32_t n_threads) {
    if (m->packed)
        return fl_matmul_packed(m->w, m->dtype, m->rows, m->cols, m->bias, x, 1, y, n_threads);
    return fl_matmul(m->w, m->dtype, m->rows, m->cols, m->bias, x, 1, y, 0, n_threads);
}

/* position pos of a (n_ctx, n, head_dim) cache of kv_dtype = src (n * head_dim) */
static void kv_store(void *cache, int32_t kv_dtype, int64_t pos, int64_t n, const float *src) {
    if (kv_dtype == FL_F32) {
        memcpy((float *)cache + pos * n, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)cache + pos * n;
    for (int64_t j = 0; j < n; j++) dst[j] = fl_fp32_to_fp16(src[j]);
}

/* q / k / v fused (k.w, v.w NULL) or three matrices, of the block's shapes */
static int qkv_ok(const fl_attn_block *b, int64_t d, int64_t nq, int64_t nk) {
    if (!b->k.w && !b->v.w) return b->qkv.w && b->qkv.rows == nq + 2 * nk && b->qkv.cols == d;
    return b->qkv.w && b->k.w && b->v.w && b->qkv.rows == nq && b->qkv.cols == d &&
           b->k.rows == nk && b->k.cols == d && b->v.rows == nk && b->v.cols == d;
}

static int attn_ok(const fl_attn_block *b, int64_t d, int64_t pos) {
    const int64_t nq = b->n_heads * b->head_dim, nk = b->n_kv * b->head_dim;
    return b->norm && b->o.w && b->k_cache && b->v_cache && d > 0 &&
           b->n_heads > 0 && b->n_kv > 0 && b->n_heads % b->n_kv == 0 && b->head_dim > 0 &&
           qkv_ok(b, d, nq, nk) && b->o.rows == d && b->o.cols == nq &&
           (b->kv_dtype == FL_F32 || b->kv_dtype == FL_F16) && pos >= 0 && pos < b->n_ctx &&
           (!b->inv_freq || (b->n_rot > 0 && b->n_rot <= b->head_dim && b->n_rot % 2 == 0));
}

/* the steps after q / k / v: QK norms, RoPE, the caches, attention, the output */
static int32_t attend(const fl_attn_block *b, float *qkv, float *o, float *y, int64_t d,
                      int64_t pos, int32_t n_threads) {
    const int64_t hd = b->head_dim, nq = b->n_heads * hd, nk = b->n_kv * hd;
    float *q = qkv, *k = qkv + nq, *v = qkv + nq + nk;   // (n_heads, hd), (n_kv, hd) x 2
    int32_t st = FL_OK;
    const int full = b->qk_norm_full != 0;  // one row of the whole projection, else per head
    if (b->q_norm) st = fl_rmsnorm(q, b->q_norm, q, full ? 1 : b->n_heads, full ? nq : hd, b->eps);
    if (st == FL_OK && b->k_norm)
        st = fl_rmsnorm(k, b->k_norm, k, full ? 1 : b->n_kv, full ? nk : hd, b->eps);
    const int32_t p = (int32_t)pos;
    if (st == FL_OK && b->inv_freq) st = fl_rope(q, 1, b->n_heads, hd, b->n_rot, &p, b->inv_freq);
    if (st == FL_OK && b->inv_freq) st = fl_rope(k, 1, b->n_kv, hd, b->n_rot, &p, b->inv_freq);
    if (st != FL_OK) return st;
    kv_store(b->k_cache, b->kv_dtype, pos, nk, k);
    kv_store(b->v_cache, b->kv_dtype, pos, nk, v);
    st = fl_attention(q, b->k_cache, b->v_cache, b->kv_dtype, o, 1, pos, b->n_heads, b->n_kv, hd,
                      b->scale, b->window, n_threads);
    if (st == FL_OK) st = mat_vec(&b->o, o, y, n_threads);
    if (st == FL_OK && b->post_norm) st = fl_rmsnorm(y, b->post_norm, y, 1, d, b->eps);
    return st;
}

int32_t fl_attn_token(const fl_attn_block *b, float *x, int64_t d, int64_t pos,
                      int32_t n_threads) {
    if (!b || !x || n_threads < 1 || !attn_ok(b, d, pos)) return FL_EINVAL;
    const int64_t nq = b->n_heads * b->head_dim;
    const int64_t n_qkv = nq + 2 * b->n_kv * b->head_dim;
    float *buf = malloc((size_t)(2 * d + n_qkv + nq) * sizeof(float));
    if (!buf) return FL_ENOMEM;
    float *h = buf, *y = buf + d, *qkv = buf + 2 * d, *o = qkv + n_qkv;
    int32_t st = fl_rmsnorm(x, b->norm, h, 1, d, b->eps);
    if (st == FL_OK) st = mat_vec(&b->qkv, h, qkv, n_threads);        // q (and k, v when fused)
    if (st == FL_OK && b->k.w) st = mat_vec(&b->k, h, qkv + nq, n_threads);
    if (st == FL_OK && b->v.w) st = mat_vec(&b->v, h, qkv + nq + b->k.rows, n_threads);
    if (st == FL_OK) st = attend(b, qkv, o, y, d, pos, n_threads);
    if (st == FL_OK)
        for (int64_t i = 0; i < d; i++) x[i] += y[i];
    free(buf);
    return st;
}

static int ffn_ok(const fl_ffn_block *b, int64_t d) {
    return b->norm && b->gate_up.w && b->down.w && d > 0 && b->n_ff > 0 &&
           b->gate_up.rows == (b->glu ? 2 : 1) * b->n_ff && b->gate_up.cols == d &&
           b->down.rows == d && b->down.cols == b->n_ff;
}

int32_t fl_ffn_token(const fl_ffn_block *b, float *x, int64_t d, int32_t n_threads) {
    if (!b || !x || n_threads < 1 || !ffn_ok(b, d)) return FL_EINVAL;
    float *buf = malloc((size_t)(2 * d + b->gate_up.rows + b->n_ff) * sizeof(float));
    if (!buf) return FL_ENOMEM;
    float *h = buf, *y = buf + d, *gu = buf + 2 * d, *a = gu + b->gate_up.rows;
    float *u = b->glu ? gu + b->n_ff : gu;           // (n_ff): gate rows come first
    int32_t st = fl_rmsnorm(x, b->norm, h, 1, d, b->eps);
    if (st == FL_OK) st = mat_vec(&b->gate_up, h, gu, n_threads);
    if (st == FL_OK && b->up_bias)
        for (int64_t j = 0; j < b->n_ff; j++) u[j] += b->up_bias[j];
    if (st == FL_OK) st = fl_act_mul(b->act, b->glu ? gu : NULL, u, a, b->n_ff);
    if (st == FL_OK) st = mat_vec(&b->down, a, y, n_threads);
    if (st == FL_OK && b->post_norm) {     // model.py sums the FFN into zeros, then norms it
        for (int64_t i = 0; i < d; i++) y[i] = 0.0f + y[i];
        st = fl_rmsnorm(y, b->post_norm, y, 1, d, b->eps);
    }
    if (st == FL_OK)
        for (int64_t i = 0; i < d; i++) x[i] += y[i];
    if (st == FL_OK && b->down_bias)
        for (int64_t i = 0; i < d; i++) x[i] += b->down_bias[i];
    free(buf);
    return st;
}
