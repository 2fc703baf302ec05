/* ffn.c — the sparse FFN over row-column bundles (see fl_ffn_bundles in flashllm.h).
 *
 * Activations: SiLU x*sigmoid(x); GELU is the exact erf form 0.5*x*(1+erf(x/sqrt(2))) (Hugging
 * Face "gelu"; models using the tanh approximation "gelu_new"/"gelu_pytorch_tanh" differ by
 * < 1e-3); ReLU. Threads split the bundles; each thread accumulates into its own (T, d) partial
 * and the partials are then summed into y, split over y's elements.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "flashllm.h"
#include "simd.h"

#define MIN_BUNDLES_PER_THREAD 32

/* the bundle layout and arguments shared by every bundle of one call */
typedef struct {
    int64_t d, T;
    size_t rb;
    int32_t dtype, glu, act;
    const int32_t *ids;
    const float *up_bias;
    const float *x;  // (T, d)
} ffn_args;

static inline float activate(int32_t act, float v) {
    switch (act) {
    case FL_ACT_SILU: return v / (1.0f + expf(-v));
    case FL_ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    default: return v > 0.0f ? v : 0.0f;
    }
}

/* acc (T, d) += a(x_t) * down for bundle i */
static void one_bundle(const ffn_args *a, const uint8_t *bundle, int64_t i, float *acc) {
    const uint8_t *up = bundle + (a->glu ? a->rb : 0);
    const uint8_t *down = up + a->rb;
    const float bias = a->up_bias ? a->up_bias[a->ids ? a->ids[i] : i] : 0.0f;
    for (int64_t t = 0; t < a->T; t++) {
        const float *xt = a->x + t * a->d;  // (d)
        const float u = fli_dot(a->dtype, up, xt, a->d) + bias;
        const float h = a->glu ? activate(a->act, fli_dot(a->dtype, bundle, xt, a->d)) * u
                               : activate(a->act, u);
        if (h != 0.0f) fli_axpy(a->dtype, down, h, acc + t * a->d, a->d);
    }
}

/* bundles split over n_threads, per-thread partials (n_threads, T, d) summed into y */
static int32_t ffn_parallel(const ffn_args *a, const uint8_t *bundles, int64_t n, int64_t stride,
                            float *y, int32_t n_threads) {
    const int64_t len = a->T * a->d;
    float *partial = calloc((size_t)n_threads * (size_t)len, sizeof(float));  // (nt, T, d)
    if (!partial) return FL_ENOMEM;
#pragma omp parallel num_threads(n_threads)
    {
        float *mine = partial + (size_t)omp_get_thread_num() * (size_t)len;  // (T, d)
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) one_bundle(a, bundles + i * stride, i, mine);
#pragma omp for schedule(static)
        for (int64_t k = 0; k < len; k++) {
            float s = 0.0f;
            for (int32_t p = 0; p < n_threads; p++) s += partial[(size_t)p * (size_t)len + k];
            y[k] += s;
        }
    }
    free(partial);
    return FL_OK;
}

static int ids_ok(const int32_t *ids, int64_t n) {
    for (int64_t i = 0; ids && i < n; i++)
        if (ids[i] < 0) return 0;
    return 1;
}

int32_t fl_ffn_bundles(const uint8_t *bundles, int64_t n, int64_t stride, int32_t dtype,
                       int64_t d, int32_t glu, int32_t act, const int32_t *ids,
                       const float *up_bias, const float *x, int64_t T, float *y,
                       int32_t n_threads) {
    const size_t rb = fl_row_bytes(dtype, d);
    if (rb == 0 || d <= 0 || n < 0 || stride < (int64_t)rb * (glu ? 3 : 2) || !x || !y ||
        T <= 0 || n_threads < 1 || act < FL_ACT_SILU || act > FL_ACT_RELU || !ids_ok(ids, n) ||
        (n > 0 && !bundles))
        return FL_EINVAL;
    const ffn_args a = {d, T, rb, dtype, glu != 0, act, ids, up_bias, x};
    const int64_t useful = n / MIN_BUNDLES_PER_THREAD;
    const int32_t nt = useful < n_threads ? (int32_t)(useful > 1 ? useful : 1) : n_threads;
    if (nt == 1) {
        for (int64_t i = 0; i < n; i++) one_bundle(&a, bundles + i * stride, i, y);
        return FL_OK;
    }
    return ffn_parallel(&a, bundles, n, stride, y, nt);
}
