/* qdot.h — int8 activations against the 32-value block dtypes and q4_k (qdot.c; n a multiple of
 * 32): a row expanded for many tokens, and per dtype the tile of FL_QT rows by up to FL_QT
 * tokens. Reached by dtype through the traits table (traits.h).
 * Internal: not seen by cffi. */
#ifndef FLASHLLM_QDOT_H
#define FLASHLLM_QDOT_H

#include <stdint.h>

#include "base.h"

#pragma GCC visibility push(hidden)

/* buf (fli_xq_bytes(n)) = a q4_0 / q4_1 / q5_0 / q5_1 / q8_0 / q4_k weight row unpacked to the
 * unsigned bytes and scale vectors the tiles multiply (its correction lanes unused; q4_1's m_w in
 * the msum lanes): worth it when a row meets more than FL_QT tokens */
void fli_wx_expand(int32_t dtype, const uint8_t *w, int64_t n, uint8_t *buf);

/* out[r][t] = w[r] . x[t] for FL_QT rows and n_tok (1..FL_QT) quantized tokens; every x[t]
 * must point at a quantized token (pad with any of them: results past n_tok are unused).
 * ex: NULL, or the same rows expanded by fli_wx_expand (used when n_tok > 1). */
#define FLI_QDOT_TILE(name)                                                                      \
    void name(const uint8_t *const w[FL_QT], const uint8_t *const ex[FL_QT],                     \
              const uint8_t *const x[FL_QT], int32_t n_tok, int64_t n, float out[FL_QT][FL_QT])
FLI_QDOT_TILE(fli_q8_0_tile);
FLI_QDOT_TILE(fli_q4_0_tile);
FLI_QDOT_TILE(fli_q4_1_tile);
FLI_QDOT_TILE(fli_q5_0_tile);
FLI_QDOT_TILE(fli_q5_1_tile);
FLI_QDOT_TILE(fli_q4k_qtile);

#pragma GCC visibility pop

#endif /* FLASHLLM_QDOT_H */
