/* bounds.c — the sparse output head's logit bounds (fl_logit_bounds in flashllm.h): per row an
 * estimate widened by z standard deviations of its error, from f16 error variances per block of
 * the input, vectorized over rows (vec_simd.h). */
#include "flashllm.h"
#include "vec_simd.h"

#define BOUND_ROWS 256 /* rows per step: the sums stay in L1 across the blocks */

int32_t fl_logit_bounds(const float *s, const uint16_t *var, const float *e, int64_t nb,
                        int64_t n, float z, float slack, float *hi, float *lo) {
    if (!s || !var || !e || !hi || !lo || nb < 0 || n < 0) return FL_EINVAL;
    float acc[BOUND_ROWS];
    for (int64_t r0 = 0; r0 < n; r0 += BOUND_ROWS) {
        const int64_t m = n - r0 < BOUND_ROWS ? n - r0 : BOUND_ROWS;
        const int64_t mv = m / VW * VW;
        memset(acc, 0, sizeof acc);
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *v = var + b * n + r0;
            const vf eb = vset1(e[b]);
            for (int64_t i = 0; i < mv; i += VW)
                vstore(acc + i, vfma(eb, vload_h((const uint8_t *)(v + i)), vload(acc + i)));
            for (int64_t i = mv; i < m; i++) acc[i] += e[b] * fl_fp16_to_fp32(v[i]);
        }
        const vf vz = vset1(z), vs = vset1(slack);
        for (int64_t i = 0; i < mv; i += VW) {
            const vf d = vfma(vz, vsqrt(vload(acc + i)), vs), x = vload(s + r0 + i);
            vstore(hi + r0 + i, vadd(x, d));
            vstore(lo + r0 + i, vsub(x, d));
        }
        for (int64_t i = mv; i < m; i++) {
            const float d = z * sqrtf(acc[i]) + slack;
            hi[r0 + i] = s[r0 + i] + d;
            lo[r0 + i] = s[r0 + i] - d;
        }
    }
    return FL_OK;
}
