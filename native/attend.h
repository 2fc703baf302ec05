/* attend.h — one query head's causal attention over a KV cache (attend.c), the inner step of
 * fl_attention (ops.c). */
#ifndef FLASHLLM_ATTEND_H
#define FLASHLLM_ATTEND_H

#include <stdint.h>

#pragma GCC visibility push(hidden)
/* outh (head_dim) = softmax(scale * qh . K[0..n_keys)) @ V[0..n_keys) for one query head, K and
 * V rows of kv_dtype (FL_F32 / FL_F16) row_bytes apart; scores (n_keys) and q16 (head_dim)
 * floats of scratch */
void fli_attend_one(const float *qh, const uint8_t *k, const uint8_t *v, int32_t kv_dtype,
                    float *outh, int64_t n_keys, int64_t row_bytes, int64_t head_dim,
                    float scale, float *scores, float *q16);
#pragma GCC visibility pop

#endif /* FLASHLLM_ATTEND_H */
