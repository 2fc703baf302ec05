/* attend_isa.c — one head's attention over an f16 cache (native/attend.c), built for one
 * instruction set (test_kernel_isa.py compiles it for AVX-512, AVX2 and plain x86-64), against
 * the documented rule in plain C: q rounded to f16, scores q . k in double, their softmax (the
 * max subtracted, exp and the sum in double) rounded to f16 per weight, the weighted sum of V in
 * double. head_dim 64, 128 and 256 (the register path where the build has one) and 80 (the
 * per-row kernels), 1 .. 300 keys, rows of several heads. Prints "ok" and exits 0, or lists the
 * bad outputs and exits 1. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashllm.h"
#include "attend.h"
#include "base.h"

#define KMAX 300
#define HMAX 256
#define HEADS 3 /* heads a cache row holds: the head read is the middle one */

static float uniform(float scale) { return ((float)rand() / (float)RAND_MAX - 0.5f) * scale; }

static double f16(double x) { return fl_fp16_to_fp32(fl_fp32_to_fp16((float)x)); }

/* out (hd) by the rule above for the head at k, v (rows rb bytes apart) */
static void reference(const float *q, const uint8_t *k, const uint8_t *v, int n, int64_t rb,
                      int hd, float scale, double *out) {
    double s[KMAX], mx = -INFINITY, sum = 0.0;
    for (int j = 0; j < n; j++) {
        s[j] = 0.0;
        for (int i = 0; i < hd; i++) s[j] += f16(q[i]) * fl_load_fp16(k + j * rb + 2 * i);
        s[j] = (float)(scale * s[j]);
        mx = s[j] > mx ? s[j] : mx;
    }
    for (int j = 0; j < n; j++) sum += s[j] = exp(s[j] - mx);
    memset(out, 0, (size_t)hd * sizeof(double));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < hd; i++) out[i] += f16(s[j] / sum) * fl_load_fp16(v + j * rb + 2 * i);
}

/* bad outputs of one case (hd, n keys) */
static int check(int hd, int n) {
    const int64_t rb = (int64_t)HEADS * hd * 2;
    uint8_t *k = malloc((size_t)(rb * n)), *v = malloc((size_t)(rb * n));
    float q[HMAX], out[HMAX], scores[KMAX], q16[HMAX];
    double ref[HMAX];
    for (int64_t i = 0; i < rb * n / 2; i++) {
        const uint16_t a = fl_fp32_to_fp16(uniform(2.0f)), b = fl_fp32_to_fp16(uniform(2.0f));
        memcpy(k + 2 * i, &a, 2), memcpy(v + 2 * i, &b, 2);
    }
    for (int i = 0; i < hd; i++) q[i] = uniform(4.0f);
    const float scale = 1.0f / sqrtf((float)hd);
    const uint8_t *kh = k + 2 * hd, *vh = v + 2 * hd;  // the middle head
    fli_attend_one(q, kh, vh, FL_F16, out, n, rb, hd, scale, scores, q16);
    reference(q, kh, vh, n, rb, hd, scale, ref);
    int bad = 0;
    for (int i = 0; i < hd; i++)
        if (!(fabs(out[i] - ref[i]) <= 1e-3 * (1.0 + fabs(ref[i]))) && bad++ < 4)
            printf("hd %d, %d keys: out[%d] %g, reference %g\n", hd, n, i, out[i], ref[i]);
    free(k), free(v);
    return bad;
}

int main(void) {
    const int dims[] = {64, 128, 256, 80}, keys[] = {1, 2, 7, 8, 9, 64, 129, KMAX};
    int bad = 0;
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 8; b++) bad += check(dims[a], keys[b]);
    puts(bad ? "bad" : "ok");
    return bad ? 1 : 0;
}
