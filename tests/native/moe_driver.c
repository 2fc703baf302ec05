/* moe_driver.c — native/moe.c under AddressSanitizer + UBSan (make test-asan): routing and a
 * pass's experts over random Q4_0 and Q8_0 experts (packed where this build packs, and not),
 * passes of 1 .. 37 tokens on 1 and 2 threads, each token against its own one-token pass (the
 * same bits), and the inputs fl_moe_route / fl_moe_ffn must refuse. Leaks: ASan's report.
 * Exit 0 when every check holds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashllm.h"

#define D 256
#define NE 5      /* experts; the last one's n_ff twice the others' */
#define NFF 64
#define KMAX 3

static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}
static float rndf(void) { return (float)rnd() / 4294967296.0f * 2.0f - 1.0f; }

/* rows (rows, cols) of dtype quantized from random values, packed when pack and this build can */
static fl_mat random_mat(int32_t dtype, int64_t rows, int64_t cols, int pack) {
    const size_t rb = fl_row_bytes(dtype, cols);
    float *v = malloc((size_t)cols * sizeof(float));
    uint8_t *w = malloc(rows * rb);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) v[i] = rndf() * 0.05f;
        fl_quantize_row(dtype, v, w + r * rb, cols);
    }
    free(v);
    fl_mat m = {.w = w, .dtype = dtype, .packed = 0, .rows = rows, .cols = cols, .bias = NULL};
    if (pack && fl_packed_bytes(dtype, rows, cols) == rows * rb &&
        fl_pack(dtype, w, rows, cols, w) == FL_OK)
        m.packed = 1;
    return m;
}

static int check_pass(const fl_expert *ex, int64_t T, int64_t k, int32_t threads) {
    float *h = malloc(T * D * sizeof(float)), *x = malloc(T * D * sizeof(float));
    float *x0 = malloc(T * D * sizeof(float)), *w = malloc(T * k * sizeof(float));
    float *logits = malloc(T * NE * sizeof(float));
    int32_t *ids = malloc(T * k * sizeof(int32_t));
    int bad = 0;
    for (int64_t i = 0; i < T * D; i++) h[i] = rndf(), x0[i] = x[i] = rndf();
    for (int64_t i = 0; i < T * NE; i++) logits[i] = 4.0f * rndf();
    bad |= fl_moe_route(logits, T, NE, k, (int32_t)(T & 1), ids, w) != FL_OK;
    bad |= fl_moe_ffn(ex, NE, ids, w, T, k, FL_ACT_SILU, h, x, D, 0, threads) != FL_OK;
    for (int64_t t = 0; t < T && !bad; t++) {  // the token alone: the same bits
        float one[D];
        memcpy(one, x0 + t * D, sizeof(one));
        bad |= fl_moe_ffn(ex, NE, ids + t * k, w + t * k, 1, k, FL_ACT_SILU, h + t * D, one, D,
                          0, 1) != FL_OK;
        bad |= memcmp(one, x + t * D, sizeof(one)) != 0 && ex[0].gate_up.packed;
    }
    free(h), free(x), free(x0), free(w), free(logits), free(ids);
    return bad;
}

static int check_refusals(const fl_expert *ex) {
    float h[D] = {0}, x[D] = {0}, w[2] = {1.0f, 1.0f}, lg[NE] = {0};
    int32_t ids[2] = {0, NE}, out[2];
    int bad = fl_moe_ffn(ex, NE, ids, w, 1, 2, FL_ACT_SILU, h, x, D, 0, 1) != FL_EINVAL;
    ids[1] = 1;
    bad |= fl_moe_ffn(ex, NE, ids, w, 1, 2, FL_ACT_SILU, h, x, D + 32, 0, 1) != FL_EINVAL;
    bad |= fl_moe_ffn(ex, NE, ids, w, 1, 2, 99, h, x, D, 0, 1) != FL_EINVAL;
    bad |= fl_moe_ffn(ex, NE, ids, w, 1, 2, FL_ACT_SILU, h, x, D, ex[0].gate_up.packed, 1) !=
           (ex[0].gate_up.packed ? FL_EINVAL : FL_OK);
    lg[2] = NAN;
    bad |= fl_moe_route(lg, 1, NE, 2, 0, out, w) != FL_EINVAL;
    bad |= fl_moe_route(lg, 1, NE, NE + 1, 0, out, w) != FL_EINVAL;
    return bad;
}

int main(void) {
    const int32_t dtypes[2] = {FL_Q4_0, FL_Q8_0};
    int fails = 0;
    for (int d = 0; d < 2; d++)
        for (int pack = 0; pack < 2; pack++) {
            fl_expert ex[NE];
            for (int e = 0; e < NE; e++) {
                const int64_t f = NFF * (e == NE - 1 ? 2 : 1);
                ex[e].gate_up = random_mat(dtypes[d], 2 * f, D, pack);
                ex[e].down = random_mat(dtypes[d], D, f, pack);
            }
            const int64_t Ts[4] = {1, 2, 9, 37};
            for (int i = 0; i < 4; i++)
                for (int32_t threads = 1; threads <= 2; threads++)
                    for (int64_t k = 1; k <= KMAX; k++)
                        if (check_pass(ex, Ts[i], k, threads)) {
                            fprintf(stderr, "dtype %d pack %d T %ld k %ld threads %d: wrong\n",
                                    dtypes[d], pack, (long)Ts[i], (long)k, threads);
                            fails++;
                        }
            if (check_refusals(ex)) {
                fprintf(stderr, "dtype %d pack %d: a bad input was not refused\n", dtypes[d], pack);
                fails++;
            }
            for (int e = 0; e < NE; e++) free((void *)ex[e].gate_up.w), free((void *)ex[e].down.w);
        }
    printf("moe_driver: %s\n", fails ? "FAILED" : "ok");
    return fails != 0;
}
