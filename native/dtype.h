/* dtype.h — the storage dtypes' block layouts (header only, below every compute module): values
 * and bytes per block of each dtype as a table (FLI_BLOCKS), read by fl_row_bytes and by the
 * kernels (a constant dtype folds to a constant), and the small readers of a 32-value block.
 * The kernels of each dtype are in the traits table above the kernels (traits.h), as ggml keeps
 * type_traits (layout, ggml.c) apart from type_traits_cpu (kernels, ggml-cpu.c). flashllm.h
 * describes every layout; flashllm/model/tensor.py mirrors the table (tests/test_dtype_traits.py
 * checks they agree). Internal: not part of the C API, not seen by cffi. */
#ifndef FLASHLLM_DTYPE_H
#define FLASHLLM_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "flashllm.h"

#define FL_QK 32          /* values per quantized block */
#define FL_Q8_0_BYTES 34  /* f16 scale + 32 int8 */
#define FL_Q4_0_BYTES 18  /* f16 scale + 16 bytes of nibbles */
#define FL_Q4_1_BYTES 20  /* f16 scale + f16 min + 16 bytes of nibbles */
#define FL_QK_K 256       /* values per k-quant superblock: 8 sub-blocks of FL_QK */
#define FL_Q4_K_BYTES 144 /* f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 of nibbles */
#define FL_Q5_0_BYTES 22  /* f16 scale + 32 high bits + 16 bytes of nibbles */
#define FL_Q5_1_BYTES 24  /* f16 scale + f16 min + 32 high bits + 16 bytes of nibbles */
#define FL_Q5_K_BYTES 176 /* Q4_K's head, 32 bytes of high bits, 128 of nibbles */
#define FL_Q6_K_BYTES 210 /* 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, f16 d */
#define FL_Q3_K_BYTES 110 /* 32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit scales, f16 d */
#define FL_Q2_K_BYTES 84  /* 16 bytes of 4-bit scales / mins, 64 of 2-bit values, f16 d, dmin */

#define FLI_N_DTYPES (FL_Q3_K + 1) /* storage dtypes: codes 0 .. FLI_N_DTYPES - 1 */

/* one block of a storage dtype: its values (1 for f32 / f16) and bytes */
typedef struct {
    int32_t values, bytes;
} fli_block;

static const fli_block FLI_BLOCKS[FLI_N_DTYPES] = {
    [FL_F32] = {1, 4},
    [FL_F16] = {1, 2},
    [FL_Q8_0] = {FL_QK, FL_Q8_0_BYTES},
    [FL_Q4_0] = {FL_QK, FL_Q4_0_BYTES},
    [FL_Q4_1] = {FL_QK, FL_Q4_1_BYTES},
    [FL_Q4_K] = {FL_QK_K, FL_Q4_K_BYTES},
    [FL_Q5_0] = {FL_QK, FL_Q5_0_BYTES},
    [FL_Q5_1] = {FL_QK, FL_Q5_1_BYTES},
    [FL_Q5_K] = {FL_QK_K, FL_Q5_K_BYTES},
    [FL_Q6_K] = {FL_QK_K, FL_Q6_K_BYTES},
    [FL_Q2_K] = {FL_QK_K, FL_Q2_K_BYTES},
    [FL_Q3_K] = {FL_QK_K, FL_Q3_K_BYTES},
};

/* a storage dtype this build knows */
static inline int fli_dtype_ok(int32_t dtype) { return dtype >= 0 && dtype < FLI_N_DTYPES; }

/* bytes of one block (a 32-value block, a 256-value superblock, one f32 / f16 value) */
static inline size_t fli_block_bytes(int32_t dtype) { return (size_t)FLI_BLOCKS[dtype].bytes; }

/* the 256-value superblock dtypes (ggml's k-quants) */
static inline int fli_is_kquant(int32_t dtype) {
    return fli_dtype_ok(dtype) && FLI_BLOCKS[dtype].values == FL_QK_K;
}

/* the dtypes whose weights meet int8 activations (every quantized one) */
static inline int fli_is_quant(int32_t dtype) {
    return fli_dtype_ok(dtype) && FLI_BLOCKS[dtype].values > 1;
}

/* the 32 high bits of a q5_0 / q5_1 block (bit j: bit 4 of value j) */
static inline uint32_t fli_q5_qh(int32_t dtype, const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + (dtype == FL_Q5_1 ? 4 : 2), sizeof qh);
    return qh;
}

#endif /* FLASHLLM_DTYPE_H */
