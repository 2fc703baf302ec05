/* qdot_isa.c — the int8 tiles of native/qdot.c and the panel GEMM of native/qgemm.c, built for
 * one instruction set (test_kernel_isa.py compiles it for AVX-512 VNNI, AVX2 + AVX-VNNI, AVX2 and
 * plain x86-64), against a double reference on the same quantized activations (q8_0, q4_0, q4_1
 * weights): raw and expanded weights, 1 and 4 tokens, block counts even and odd; panels of 16
 * rows (4 distinct, repeated) against 1 .. 13 tokens (register blocks of 8, 4 and 1); and the
 * vectorized silu(g) * u of native/act.c against double exp over g in [-120, 120]; the activation
 * quantization against the documented rule in plain C, byte for byte. Prints "ok"
 * and exits 0, or lists the bad outputs and exits 1. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "flashllm.h"
#include "act.h"
#include "act_quant.h"
#include "qdot.h"
#include "qgemm.h"
#include "traits.h"

#define NMAX 320

static float uniform(float scale) { return ((float)rand() / (float)RAND_MAX - 0.5f) * scale; }

/* |out - exact| over every way to compute w_r . x_t; its worst value */
static double worst(int32_t dt, int n, const uint8_t *const w[4], const uint8_t *const e[4],
                    const uint8_t *const x[4], int r, int t, double ref) {
    float a[FL_QT][FL_QT], b[FL_QT][FL_QT], c[FL_QT][FL_QT];
    fli_qdot_tile(dt, w, NULL, x, 4, n, a);
    fli_qdot_tile(dt, w, e, x, 4, n, b);
    const uint8_t *xt[FL_QT] = {x[t], x[t], x[t], x[t]};
    fli_qdot_tile(dt, w, NULL, xt, 1, n, c);
    double m = fmax(fabs(a[r][t] - ref), fabs(b[r][t] - ref));
    return fmax(m, fabs(c[r][0] - ref));
}

/* the panel GEMM: rows r % 4 of w against tokens t % 4 of x, T = 1 .. 13; its worst error
 * against ref (4, 4) relative to mag (4, 4) above the tolerance, counted */
static int check_panel(int32_t dt, int n, const uint8_t *const w[4], const uint8_t *x,
                       size_t xb, double ref[4][4], double mag[4][4]) {
    const uint8_t *rows[FL_PR];
    for (int r = 0; r < FL_PR; r++) rows[r] = w[r % 4];
    uint8_t *pan = malloc(fli_panel_bytes(n));
    uint8_t *xs = malloc(13 * xb);  // (13, xb): the 4 tokens repeated
    float out[FL_PR * 13];          // (FL_PR, T)
    for (int t = 0; t < 13; t++) memcpy(xs + t * xb, x + (t % 4) * xb, xb);
    fli_panel_pack(dt, rows, n, pan);
    int bad = 0;
    for (int T = 1; T <= 13; T += 1) {
        fli_panel_gemm(dt, pan, xs, xb, T, n, out, T);
        for (int r = 0; r < FL_PR; r++)
            for (int t = 0; t < T; t++)
                if (fabs(out[r * T + t] - ref[r % 4][t % 4]) > 1e-5 * mag[r % 4][t % 4] + 1e-6) {
                    printf("panel dtype %d n %d T %d row %d token %d: %g vs %g\n", dt, n, T, r, t,
                           out[r * T + t], ref[r % 4][t % 4]);
                    bad++;
                }
    }
    free(xs);
    free(pan);
    return bad;
}

static int check(int32_t dt, int n) {
    const size_t rb = fl_row_bytes(dt, n), xb = (size_t)fli_xq_bytes(n);
    uint8_t *buf = malloc(4 * rb + 8 * xb);  // w (4, rb), e (4, xb), x (4, xb) contiguous
    double refs[4][4], mags[4][4];
    uint8_t *w[4], *e[4], *x[4];
    float f[NMAX], wd[4][NMAX], xd[4][NMAX];
    for (int r = 0; r < 4; r++) {
        w[r] = buf + r * rb, e[r] = buf + 4 * rb + r * xb, x[r] = buf + 4 * rb + (4 + r) * xb;
        for (int i = 0; i < n; i++) f[i] = uniform(1.0f + r);
        fl_quantize_row(dt, f, w[r], n);
        fl_dequantize_row(dt, w[r], wd[r], n);
        fli_wx_expand(dt, w[r], n, e[r]);
        for (int i = 0; i < n; i++) f[i] = uniform(3.0f);
        fli_xq_quantize(dt, f, n, x[r]);
        const float *scale = (const float *)(x[r] + n);  // (nb, FL_XQ_LANES)
        for (int i = 0; i < n; i++) xd[r][i] = ((int8_t *)x[r])[i] * scale[(i / 32) * FL_XQ_LANES];
    }
    int bad = 0;
    for (int r = 0; r < 4; r++) {
        for (int t = 0; t < 4; t++) {
            double ref = 0, mag = 0;
            for (int i = 0; i < n; i++) {
                ref += (double)wd[r][i] * xd[t][i];
                mag += fabs((double)wd[r][i] * xd[t][i]);
            }
            const double err = worst(dt, n, (const uint8_t *const *)w,
                                     (const uint8_t *const *)e, (const uint8_t *const *)x, r, t,
                                     ref);
            refs[r][t] = ref, mags[r][t] = mag;
            if (err > 1e-5 * mag + 1e-6) {
                printf("dtype %d n %d row %d token %d: error %g of %g\n", dt, n, r, t, err, mag);
                bad++;
            }
        }
    }
    bad += check_panel(dt, n, (const uint8_t *const *)w, x[0], xb, refs, mags);
    free(buf);
    return bad;
}

/* fli_silu_mul against g / (1 + exp(-g)) * u in double, n = 1003 (vectors and a tail) */
static int check_silu(void) {
    enum { N = 1003 };
    float g[N], u[N], h[N];
    for (int i = 0; i < N; i++) {
        g[i] = i < 8 ? (float[]){-120, -88, -87, 0, 87, 88, 120, -1e-30f}[i] : uniform(40.0f);
        u[i] = uniform(4.0f);
    }
    fli_silu_mul(g, u, h, N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        const double ref = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        if (fabs(h[i] - ref) > 1e-6 * fabs(ref) + 1e-30) {
            printf("silu g %g u %g: %g vs %g\n", g[i], u[i], h[i], ref);
            bad++;
        }
    }
    return bad;
}

/* fli_xq_quantize against ggml's q8_0: q = nearbyintf(x * (127 / amax)), d = f16(amax / 127);
 * bytes and scales equal */
static int check_quantize(void) {
    enum { N = 32 * 7 };
    float x[N];
    for (int i = 0; i < N; i++) x[i] = i < 32 ? 0.0f : uniform(i < 64 ? 1e-3f : 10.0f);
    x[70] = 127.0f, x[71] = -3.5f, x[72] = 2.5f;  // d = 1 in that block: ties round to even
    uint8_t *buf = malloc(fli_xq_bytes(N));
    fli_xq_quantize(FL_Q4_0, x, N, buf);
    const float *scale = (const float *)(buf + N);
    const int32_t *corr = (const int32_t *)(scale + (N / 32) * FL_XQ_LANES);
    int bad = 0;
    for (int b = 0; b < N / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const float d = fl_fp16_to_fp32(fl_fp32_to_fp16(amax / 127.0f));
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            const int8_t q = (int8_t)nearbyintf(x[b * 32 + j] * id);
            sum += q;
            bad += q != ((int8_t *)buf)[b * 32 + j];
        }
        bad += scale[b * FL_XQ_LANES] != d || corr[b * FL_XQ_LANES] != -8 * sum;
    }
    if (bad) printf("quantize: %d values differ\n", bad);
    free(buf);
    return bad;
}

int main(void) {
    srand(1);
    int bad = check_silu() + check_quantize();
    for (int32_t dt = FL_Q8_0; dt <= FL_Q4_1; dt++)
        for (int n = 32; n <= NMAX; n += 96) bad += check(dt, n);
    printf(bad ? "FAIL\n" : "ok\n");
    return bad != 0;
}
