/* act.h — FFN activations (act.c): one value's activation inline, SiLU * up vectorized. Offered
 * to the FFN paths (ffn.c, ffn_quant.c); fl_act_mul is in flashllm.h. Internal: not seen by cffi. */
#ifndef FLASHLLM_ACT_H
#define FLASHLLM_ACT_H

#include <math.h>
#include <stdint.h>

#include "base.h"
#include "flashllm.h"

#pragma GCC visibility push(hidden)
/* ggml's GELU table (GGML_GELU_FP16): entry h the GELU (tanh form) of the f16 value h, rounded
 * to f16, as f32; filled on first use */
const float *fli_gelu_f16_table(void);
#pragma GCC visibility pop

/* ggml's GELU value of v through its f16 table: v and the result rounded to f16 */
static inline float fli_gelu_f16(float v) {
    if (v <= -10.0f) return 0.0f;
    if (v >= 10.0f) return v;
    return fli_gelu_f16_table()[fl_fp32_to_fp16(v)];
}

/* one FFN activation (FL_ACT_*): SiLU x*sigmoid(x); GELU the erf form; GELU_TANH the tanh
 * approximation (GELU_TANH_F16 as llama.cpp rounds it); ReLU */
static inline float fli_activate(int32_t act, float v) {
    switch (act) {
    case FL_ACT_SILU: return v / (1.0f + expf(-v));
    case FL_ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case FL_ACT_GELU_TANH:
        return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case FL_ACT_GELU_TANH_F16: return fli_gelu_f16(v);
    default: return v > 0.0f ? v : 0.0f;
    }
}

#pragma GCC visibility push(hidden)
/* h (n) = silu(g) * u = g / (1 + exp(-g)) * u, g u h (n) f32 */
void fli_silu_mul(const float *g, const float *u, float *h, int64_t n);
#pragma GCC visibility pop

#endif /* FLASHLLM_ACT_H */
