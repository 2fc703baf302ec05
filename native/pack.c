/* pack.c — resident matrices repacked 16 rows at a time (fl_packed_bytes, fl_pack,
 * fl_matmul_packed in flashllm.h): the loop over groups of 16 rows and the threads over groups;
 * which dtypes have a packed layout is in the traits table (traits.c). Each layout and its
 * kernel live in their own file:
 * q4kpack.c (Q4_K), q6kpack.c (Q6_K), q5kpack.c (Q5_K), q23pack.c (Q2_K, Q3_K), q0pack.c (Q8_0,
 * Q5_0, Q4_0). All of them put one row in each int32 lane of a zmm, so one broadcast of 4 int8
 * activations meets 4 values of 16 rows in one vpdpbusd (AVX-512 VNNI builds only; q0pack.c
 * also AVX2; elsewhere fl_packed_bytes is 0 and w is used as it is).
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "flashllm.h"
#include "act_quant.h"
#include "pool.h"
#include "traits.h"

#define PACK_R 16 /* rows per group: the int32 lanes of a zmm */
#define PACK_T 4  /* tokens per kernel call */

/* bytes of one packed group of 16 rows of cols values, 0 when dtype or cols has no layout here */
static size_t group_bytes(int32_t dtype, int64_t cols) {
    if (!fli_dtype_ok(dtype) || !fli_traits_of(dtype)->group_bytes) return 0;
    return fli_traits_of(dtype)->group_bytes(cols);
}

size_t fl_packed_bytes(int32_t dtype, int64_t rows, int64_t cols) {
    if (rows <= 0 || rows % PACK_R != 0 || cols <= 0) return 0;
    return (size_t)(rows / PACK_R) * group_bytes(dtype, cols);
}

/* out may be w when the layout is as large as the rows (all but q4_k's): each
 * group is copied aside first, so packing a large head in place takes no second copy of it */
int32_t fl_pack(int32_t dtype, const void *w, int64_t rows, int64_t cols, void *out) {
    const size_t n = fl_packed_bytes(dtype, rows, cols);
    if (!w || !out || n == 0) return n == 0 ? FL_EUNSUPPORTED : FL_EINVAL;
    const size_t rb = fl_row_bytes(dtype, cols), gb = group_bytes(dtype, cols);
    if (w == out && gb != PACK_R * rb) return FL_EINVAL;
    uint8_t *tmp = w == out ? malloc(gb) : NULL;
    if (w == out && !tmp) return FL_ENOMEM;
    for (int64_t g = 0; g < rows / PACK_R; g++) {
        const uint8_t *src = (const uint8_t *)w + (size_t)g * PACK_R * rb;
        if (tmp) src = memcpy(tmp, src, gb);
        fli_traits_of(dtype)->pack_group(src, rb, cols, (uint8_t *)out + (size_t)g * gb);
    }
    free(tmp);
    return FL_OK;
}

int32_t fl_unpack_rows(const void *p, int32_t dtype, int64_t rows, int64_t cols,
                       const int32_t *ids, int64_t n_ids, void *out) {
    if (fl_packed_bytes(dtype, rows, cols) == 0 || !fli_traits_of(dtype)->unpack_row)
        return FL_EUNSUPPORTED;
    if (n_ids < 0 || (n_ids > 0 && (!p || !ids || !out))) return FL_EINVAL;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= rows) return FL_EINVAL;
    const size_t rb = fl_row_bytes(dtype, cols), gb = group_bytes(dtype, cols);
    for (int64_t i = 0; i < n_ids; i++)
        fli_traits_of(dtype)->unpack_row((const uint8_t *)p + (size_t)(ids[i] / PACK_R) * gb, cols,
                                         ids[i] % PACK_R, (uint8_t *)out + (size_t)i * rb);
    return FL_OK;
}

typedef struct {
    const uint8_t *p;
    int32_t dtype;
    int64_t rows, cols, T;
    const float *bias;
    const uint8_t *xq;
    size_t xb;
    float *y;           // (T, rows)
    fli_split split;    // the groups, a contiguous part per thread
} packed_job;

static void packed_part(void *arg) {
    packed_job *j = arg;
    const size_t gb = group_bytes(j->dtype, j->cols);
    const fli_traits *tr = fli_traits_of(j->dtype);
    int mine = -1;
    for (int64_t g, g1; fli_split_take(&j->split, &mine, 4, &g, &g1);)
        for (; g < g1; g++)
            for (int64_t t = 0; t < j->T; t += PACK_T) {
                const int nt = j->T - t < PACK_T ? (int)(j->T - t) : PACK_T;
                tr->group(j->p + (size_t)g * gb, j->cols, j->xq + (size_t)t * j->xb,
                      j->xb, nt, j->y + t * j->rows + g * PACK_R, j->rows,
                      j->bias ? j->bias + g * PACK_R : NULL);
            }
}

int32_t fl_matmul_packed(const void *p, int32_t dtype, int64_t rows, int64_t cols,
                         const float *bias, const float *x, int64_t T, float *y,
                         int32_t n_threads) {
    if (!p || !x || !y || T <= 0 || n_threads < 1) return FL_EINVAL;
    if (fl_packed_bytes(dtype, rows, cols) == 0) return FL_EUNSUPPORTED;
    const size_t xb = (size_t)fli_xq_bytes(cols);
    uint8_t *xq = malloc((size_t)T * xb);
    if (!xq) return FL_ENOMEM;
    for (int64_t t = 0; t < T; t++) fli_xq_quantize(dtype, x + t * cols, cols, xq + (size_t)t * xb);
    packed_job j = {.p = p, .dtype = dtype, .rows = rows, .cols = cols, .T = T, .bias = bias,
                    .xq = xq, .xb = xb, .y = y};
    fli_split_init(&j.split, rows / PACK_R, n_threads);
    fli_parallel(n_threads, packed_part, &j);
    free(xq);
    return FL_OK;
}
