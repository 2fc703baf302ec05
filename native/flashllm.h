/* flashllm.h — the whole C API of flashllm's native kernel, in two parts: compute (part 1) and
 * I/O (part 2), after the status codes and dtypes both share. What the API does not show is in
 * the internal header of each module (X.h for X.c), docs/KERNELS.md has the map.
 *
 * Conventions
 *  - Every function returns an int32_t status (FL_OK on success) and never exits or prints.
 *  - Arrays are row-major. Shapes are given in comments as (rows, cols).
 *  - A "row" of a weight tensor holds `cols` values stored in `dtype`; its size in bytes is
 *    fl_row_bytes(dtype, cols). Quantized rows are ggml-compatible blocks of 32 values:
 *      q8_0: { f16 scale; int8 q[32]; }         34 bytes / 32 values, x = d * q
 *      q4_0: { f16 scale; uint8 nibbles[16]; }   18 bytes / 32 values, x = d * (nibble - 8),
 *            value j (0..15) in the low nibble of byte j, value j+16 in the high nibble.
 *      q4_1: { f16 d; f16 m; uint8 nibbles[16]; } 20 bytes / 32 values, x = d * nibble + m,
 *            nibbles placed as in q4_0.
 *      q4_k: ggml's block_q4_K, 144 bytes / 256 values: { f16 d; f16 dmin; uint8 scales[12];
 *            uint8 qs[128]; }: 8 sub-blocks of 32 with 6-bit scale sc_j and min m_j packed in
 *            scales as ggml's get_scale_min_k4; value i of sub-block j = d * sc_j * nibble -
 *            dmin * m_j, its nibble the low (j even) or high (j odd) half of qs[32 * (j / 2) + i].
 *            Rows need n a multiple of 256.
 *      q5_0: { f16 d; uint32 qh; uint8 nibbles[16]; } 22 bytes / 32 values, x = d * (u - 16),
 *            u = nibble (placed as in q4_0) | bit j of qh << 4 for value j.
 *      q5_1: { f16 d; f16 m; uint32 qh; uint8 nibbles[16]; } 24 bytes / 32, x = d * u + m.
 *      q5_k: ggml's block_q5_K, 176 bytes / 256 values: { f16 d; f16 dmin; uint8 scales[12];
 *            uint8 qh[32]; uint8 qs[128]; }: q4_k's scales and nibbles, plus bit j of qh[i] as
 *            bit 4 of value i of sub-block j.
 *      q6_k: ggml's block_q6_K, 210 bytes / 256 values: { uint8 ql[128]; uint8 qh[64];
 *            int8 scales[16]; f16 d; }: 16 sub-blocks of 16 values, x = d * scales[k] * (u - 32),
 *            u (6 bits) as in ggml's dequantize_row_q6_K.
 *  - Threading is explicit: functions that take n_threads use at most that many threads.
 *  - The section between CDEF-BEGIN and CDEF-END is fed verbatim to cffi: no preprocessor there.
 */
#ifndef FLASHLLM_H
#define FLASHLLM_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */

/* status codes */
enum {
    FL_OK = 0,
    FL_EINVAL = 1,       /* bad argument: null pointer, bad size, unknown dtype */
    FL_ENOMEM = 2,       /* allocation failed */
    FL_EIO = 3,          /* read error from the device */
    FL_ERANGE = 4,       /* request outside the file */
    FL_EUNSUPPORTED = 5  /* valid request this build cannot do */
};

/* storage dtypes (values are part of the on-disk format, see docs/FORMAT.md) */
enum {
    FL_F32 = 0, FL_F16 = 1, FL_Q8_0 = 2, FL_Q4_0 = 3, FL_Q4_1 = 4, FL_Q4_K = 5,
    FL_Q5_0 = 6, FL_Q5_1 = 7, FL_Q5_K = 8, FL_Q6_K = 9, FL_Q2_K = 10,
    FL_Q3_K = 11
};

/* FFN activations. GELU_TANH_F16: llama.cpp's CPU GELU (ggml's GGML_GELU_FP16 table): the
 * tanh approximation of x rounded to f16, its value rounded to f16; 0 below -10, x from 10 */
enum { FL_ACT_SILU = 0, FL_ACT_GELU = 1, FL_ACT_RELU = 2, FL_ACT_GELU_TANH = 3,
       FL_ACT_GELU_TANH_F16 = 4 };

/* ====================================================================================== */
/* PART 1 — compute: quantization, dense ops, the bundled FFN                              */
/* (the modules below traits.h, the dtype traits table, and above it)                      */
/* ====================================================================================== */

/* ---- CPU check (cpu.c) ------------------------------------------------------------------- */

/* FL_OK when this CPU has every SIMD extension the library was compiled for; otherwise
 * FL_EUNSUPPORTED with the first missing one's name written to missing (n bytes). Call it before
 * anything else: the rest of the library may use those instructions. */
int32_t fl_cpu_check(char *missing, size_t n);

/* ---- rows of a dtype (traits.c; quantizers quant.c, kquant.c) ------------------------------ */

/* Bytes of one row of n values in dtype; 0 when dtype is unknown or n is not a multiple of the
 * block size (32; 256 for q4_k, q5_k, q6_k) for a quantized dtype. */
size_t fl_row_bytes(int32_t dtype, int64_t n);

/* dst (n) f32 = dequantized src row (fl_row_bytes(dtype, n) bytes). */
int32_t fl_dequantize_row(int32_t dtype, const void *src, float *dst, int64_t n);

/* dst (fl_row_bytes(dtype, n) bytes) = src (n) f32 quantized, ggml reference rounding for q8_0,
 * q4_0, q5_0 and q5_1. q4_1 blocks take m = min and d = (max - min) / k for the k in 1..15 whose grid
 * (d, m rounded to f16, q = nearest in 0..15) has the least squared error: k = 15 is ggml's
 * choice; a block that already lies on a 16-level grid of k + 1 used levels (a dequantized
 * Q4_K sub-block) is then reproduced up to the f16 rounding of d and m. A block on no grid
 * then gets up to 4 least-squares refits of (d, m) to its levels, each kept if it lowers the
 * squared error. q2_k, q4_k, q5_k and q6_k rows (n a multiple of 256) are ggml's
 * quantize_row_q2_K_ref / q4_K_ref / q5_K_ref / q6_K_ref (no importance matrix), bit for bit
 * (kquant.c). q3_k has no quantizer (its rows are copied from GGUF files): FL_EUNSUPPORTED. */
int32_t fl_quantize_row(int32_t dtype, const float *src, void *dst, int64_t n);

/* out (n_ids, cols) f32 = rows ids[] of w (rows, cols) in dtype, dequantized (embedding lookup).
 * Every id must be in [0, rows). */
int32_t fl_get_rows(const void *w, int32_t dtype, int64_t rows, int64_t cols,
                    const int32_t *ids, int64_t n_ids, float *out);

/* ---- dense ops (ops.c) ------------------------------------------------------------------- */

/* y (T, rows) = x (T, cols) @ w (rows, cols)^T  [+ bias (rows) when bias != NULL]
 * For quantized weights each token of x is first quantized to int8 (q = nearest-even(x * 127 /
 * amax), d = amax / 127 rounded to f16 as ggml's q8_0 keeps it), per block of 32 for q4_0 / q4_1
 * / q5_0 / q5_1 / q8_0 and per superblock of 256 (as ggml's q8_K: d = 1 / (127 / amax) in f32)
 * for q4_k / q5_k / q6_k, and the
 * block products are exact integer sums scaled by d_w * d (q4_1 / q5_1 add m_w * d * sum(q),
 * the block sum llama.cpp's q8_1 keeps; the k-quants combine their sub-block scales in integers
 * within a superblock), as llama.cpp does; exact != 0 keeps x in f32 instead (the dequantized
 * weights times f32 x). f32 / f16 weights are always f32. */
int32_t fl_matmul(const void *w, int32_t dtype, int64_t rows, int64_t cols, const float *bias,
                  const float *x, int64_t T, float *y, int32_t exact, int32_t n_threads);

/* Resident weights repacked for the matmul (pack.c; layouts q4kpack.c, q6kpack.c, q5kpack.c,
 * q23pack.c, q0pack.c): a q4_k, q6_k, q5_k, q2_k, q3_k, q8_0, q5_0 or q4_0 w (rows, cols)
 * rearranged 16 rows at a time so one broadcast of 4 int8 activations meets 4 values of 16 rows
 * (llama.cpp's repacked q4_K idea); the values are w's, only their order changes.
 * fl_packed_bytes: the packed size, or 0 when this build or shape has no packed kernel (the
 * k-quants: AVX-512 VNNI; q8_0 / q5_0 / q4_0: AVX-512 VNNI or AVX2; rows a multiple of 16): then
 * multiply w as it is. Every one but q4_k may be packed in place (out == w: the packed bytes are
 * as many). fl_pack writes it (FL_EUNSUPPORTED when 0); fl_matmul_packed is fl_matmul on it, int8
 * activations as fl_matmul's (its sums in another order, so not fl_matmul's bits). */
size_t fl_packed_bytes(int32_t dtype, int64_t rows, int64_t cols);
int32_t fl_pack(int32_t dtype, const void *w, int64_t rows, int64_t cols, void *out);
/* Rows ids (n_ids) of a packed p (fl_pack's, rows x cols of dtype) back into their bytes as on
 * file, out (n_ids, fl_row_bytes): what a tied head's packed token_embd gives the embedding
 * lookup (fl_get_rows on them). q8_0, q5_0, q4_0, q4_k and q6_k layouts; FL_EUNSUPPORTED for the
 * others (then n_ids 0 answers whether the layout unpacks), FL_EINVAL for an id out of range. */
int32_t fl_unpack_rows(const void *p, int32_t dtype, int64_t rows, int64_t cols,
                       const int32_t *ids, int64_t n_ids, void *out);
int32_t fl_matmul_packed(const void *p, int32_t dtype, int64_t rows, int64_t cols,
                         const float *bias, const float *x, int64_t T, float *y,
                         int32_t n_threads);

/* y (T, n) = x / rms(x) * w, per row; y may alias x */
int32_t fl_rmsnorm(const float *x, const float *w, float *y, int64_t T, int64_t n, float eps);

/* y (T, n) = (x - mean) / sqrt(var + eps) * w + b, per row; y may alias x */
int32_t fl_layernorm(const float *x, const float *w, const float *b, float *y, int64_t T,
                     int64_t n, float eps);

/* In place rotary embedding, rotate-half (NEOX / Hugging Face) pairing: for each head, value j
 * pairs with j + n_rot/2, j < n_rot/2; values at n_rot.. are left alone.
 * x (T, n_heads, head_dim); pos (T) the absolute position of each row; inv_freq (n_rot/2) the
 * angle per position of pair j, e.g. theta^(-2j/n_rot) / factor_j (rope scaling folds in here).
 * The angle pos * inv_freq[j] is formed in double. */
int32_t fl_rope(float *x, int64_t T, int64_t n_heads, int64_t head_dim, int64_t n_rot,
                const int32_t *pos, const double *inv_freq);

/* Causal multi-head attention with grouped KV heads.
 * q (T, n_heads, head_dim) holds the queries of positions pos0 .. pos0+T-1;
 * k_cache, v_cache (n_ctx, n_kv_heads, head_dim) of kv_dtype (FL_F32 or FL_F16) already hold
 * keys/values of positions 0 .. pos0+T-1; out (T, n_heads * head_dim). Query head h reads KV head
 * h / (n_heads / n_kv_heads). scores are scaled by `scale` (normally 1/sqrt(head_dim)).
 * window > 0: sliding-window attention, the query at position p sees the keys of positions
 * p - window + 1 .. p only (Hugging Face's sliding_window, llama.cpp's n_swa); 0: all of 0 .. p. */
int32_t fl_attention(const float *q, const void *k_cache, const void *v_cache, int32_t kv_dtype,
                     float *out, int64_t T, int64_t pos0, int64_t n_heads, int64_t n_kv_heads,
                     int64_t head_dim, float scale, int64_t window, int32_t n_threads);

/* ---- one decode token through a block (block.c) ------------------------------------------ */

/* A matrix as fl_matmul (packed == 0: rows of dtype) or fl_matmul_packed (packed != 0: fl_pack's
 * layout) takes it, int8 activations, with its bias. */
typedef struct {
    const void *w;       /* (rows, cols) */
    int32_t dtype;       /* FL_* */
    int32_t packed;
    int64_t rows, cols;
    const float *bias;   /* (rows) or NULL */
} fl_mat;

/* A transformer block's attention for one token: RMSNorm, q / k / v as one matrix (or three,
 * when their dtypes differ), optional RMSNorm of q and k (per head, or each whole), rotate-half
 * RoPE, the layer's KV cache, output projection, optional RMSNorm of the output (sandwich-norm
 * models). */
typedef struct {
    const float *norm;               /* (d) */
    fl_mat qkv;                      /* (n_heads * head_dim + 2 * n_kv * head_dim, d), or with
                                        k and v given q's (n_heads * head_dim, d) */
    fl_mat k, v;                     /* (n_kv * head_dim, d) each, or both w NULL (fused) */
    fl_mat o;                        /* (d, n_heads * head_dim) */
    const float *q_norm, *k_norm;    /* (head_dim) per-head RMSNorm weights, or NULL */
    int32_t qk_norm_full;            /* 1: q_norm (n_heads * head_dim) and k_norm (n_kv *
                                        head_dim) norm the whole q and k (OLMoE) */
    const float *post_norm;          /* (d) or NULL */
    const double *inv_freq;          /* (n_rot / 2) as fl_rope takes it, or NULL: no RoPE */
    int64_t n_rot;
    void *k_cache, *v_cache;         /* the layer's (n_ctx, n_kv, head_dim) of kv_dtype */
    int32_t kv_dtype;                /* FL_F32 or FL_F16 (rounded to nearest even) */
    int64_t n_ctx, n_heads, n_kv, head_dim, window;
    float eps, scale;
} fl_attn_block;

/* A dense FFN whose matrices are rows (the source's own down rows), for one token. */
typedef struct {
    const float *norm;               /* (d) */
    fl_mat gate_up;                  /* (2 n_ff, d): gate rows then up rows (glu), else (n_ff, d) */
    fl_mat down;                     /* (d, n_ff) */
    const float *up_bias;            /* (n_ff) or NULL */
    const float *post_norm;          /* (d) or NULL */
    const float *down_bias;          /* (d) or NULL: added last */
    int64_t n_ff;
    int32_t glu, act;                /* act: FL_ACT_* */
    float eps;
} fl_ffn_block;

/* x (d) += the block's attention of one token at position pos (the caches holding positions
 * 0 .. pos-1; its key and value enter them at pos), and x (d) += the block's FFN of it: each
 * step through the function of this API that runtime/model.py calls for it, in the same order,
 * so the bits of that sequence (a decode token then needs one call a sub-block, not twelve). */
int32_t fl_attn_token(const fl_attn_block *b, float *x, int64_t d, int64_t pos,
                      int32_t n_threads);
int32_t fl_ffn_token(const fl_ffn_block *b, float *x, int64_t d, int32_t n_threads);

/* ---- a mixture of experts' layer (moe.c) ------------------------------------------------- */

/* Routing as llama.cpp's MoE graph: p = softmax(logits) per token (expf of the logit less the
 * largest, summed in double, times 1 / sum), the k largest p in falling order (the lower expert of
 * equals first) and their p, divided by their sum when norm != 0.
 * logits (T, n_experts); experts (T, k) int32 and weights (T, k) f32 written. FL_EINVAL for a
 * logit that is not finite. */
int32_t fl_moe_route(const float *logits, int64_t T, int64_t n_experts, int64_t k, int32_t norm,
                     int32_t *experts, float *weights);

/* One expert: its gate rows then its up rows, and its down rows, each as fl_matmul (packed == 0)
 * or fl_matmul_packed (packed != 0) takes it (int8 activations; exact: fl_matmul's f32). */
typedef struct {
    fl_mat gate_up;      /* (2 n_ff, d) */
    fl_mat down;         /* (d, n_ff) */
} fl_expert;

/* x (T, d) += sum over j < k of weights[t, j] * expert_{ids[t, j]}(h[t]), expert(h) =
 * down . (act(gate . h) * (up . h)), for the T tokens of a pass at once: the pairs grouped by
 * expert, so each expert's rows meet all of its tokens in one pass over them (llama.cpp's
 * mul_mat_id). Each product is the one-token product of fl_matmul_packed (packed) or fl_matmul
 * on the expert's tokens (not packed), and x[t] gets x[t] + w * (0 + y) for its experts in
 * ascending id order (a pair with an id of another's, in j order): a token's result does not
 * depend on the other tokens of the pass when the experts are packed.
 * experts (n_experts); ids (T, k) in [0, n_experts); weights (T, k); h (T, d). */
int32_t fl_moe_ffn(const fl_expert *experts, int64_t n_experts, const int32_t *ids,
                   const float *weights, int64_t T, int64_t k, int32_t act, const float *h,
                   float *x, int64_t d, int32_t exact, int32_t n_threads);

/* A mixture of experts' layer for one token: its RMSNorm, router (run as fl_matmul's exact f32
 * product), routing (fl_moe_route) and experts (fl_moe_ffn, int8 activations), the calls
 * runtime/moe.py makes, in its order, so their bits. x (d) += the layer's FFN of x. */
typedef struct {
    const float *norm;          /* (d) */
    fl_mat router;              /* (n_experts, d), not packed */
    const fl_expert *experts;   /* (n_experts) */
    int64_t n_experts, k;
    int32_t norm_topk, act;     /* act: FL_ACT_* */
    float eps;
} fl_moe_block;

int32_t fl_moe_token(const fl_moe_block *b, float *x, int64_t d, int32_t n_threads);

/* ---- bundled FFN (ffn.c) ----------------------------------------------------------------- */

/* One FFN neuron is one bundle of `stride` bytes: [gate row | up row | down column], gate and up
 * fl_row_bytes(dtype, d) bytes each (no gate part when glu == 0), the down column
 * fl_row_bytes(down_dtype, d) bytes, padding up to stride. The down column may be any dtype
 * (it is applied in f32); so may gate / up.
 *
 * y (T, d) += sum over the used bundles i of  a_i(x) * down_i, where for each token t
 *   glu:     a_i = act(gate_i . x_t) * (up_i . x_t + up_bias[id_i])
 *   non-glu: a_i = act(up_i . x_t + up_bias[id_i])
 * and a term with |a_i| < threshold is dropped (magnitude sparsity; 0 keeps every term).
 * The layer's bundles and their layout are described by an fl_ffn_layer (ids index up_bias
 * only); with `down` given, a bundle holds [gate | up] (or [up]) and row i's down column is
 * row i of `down` (a resident cache kept as two streams: the same arithmetic, the same bits);
 * rows (n_rows) the bundle rows to use, each in [0, n) (rows == NULL uses all n rows in order,
 * n_rows is then ignored);
 * x (T, d); y (T, d) is accumulated into (the caller zeroes it or passes the residual).
 * Quantized gate / up rows: gate_i . x and up_i . x use int8-quantized x as fl_matmul does
 * unless exact != 0; the down columns are always applied in f32. */
typedef struct {
    const uint8_t *bundles;  /* (n, stride) bytes */
    int64_t n;               /* bundles */
    int64_t stride;          /* bytes per bundle, >= the parts' bytes */
    int32_t dtype;           /* FL_* of the gate / up rows */
    int32_t down_dtype;      /* FL_* of the down column */
    int64_t d;               /* d_model: values per row */
    int32_t glu;             /* 1: [gate | up | down]; 0: [up | down] */
    int32_t act;             /* FL_ACT_*: GELU is erf's, GELU_TANH the tanh approximation */
    const int32_t *ids;      /* (n) neuron id of each bundle, or NULL: bundle i is neuron i */
    const float *up_bias;    /* (n_ff) up bias by neuron id, or NULL */
    const uint8_t *down;     /* (n, down_stride) the down columns apart, or NULL: in the bundle */
    int64_t down_stride;     /* bytes per down column when down is given */
} fl_ffn_layer;

/* y gets the sum as a left fold, in order, of partials over FL_FFN_BLOCK consecutive rows (each
 * from zero): two calls over rows [0, k) and [k, n) with k a multiple of FL_FFN_BLOCK give y the
 * bits of one call over [0, n), on any number of threads. */
enum { FL_FFN_BLOCK = 64 };

int32_t fl_ffn_bundles(const fl_ffn_layer *layer, const int32_t *rows, int64_t n_rows,
                       float threshold, const float *x, int64_t T, float *y, int32_t exact,
                       int32_t n_threads);

/* h (n) = act(g) * u (a GLU's gate g and up u), or act(u) when g is NULL: an FFN's activations
 * from its gate / up products (act.c; SiLU vectorized, ~1 ulp from libm's expf). */
int32_t fl_act_mul(int32_t act, const float *g, const float *u, float *h, int64_t n);

/* The ends of n logits known to within a bound (the sparse output head): for each row r,
 * dev = z * sqrt(sum_b e[b] * var[b][r]) + slack, hi[r] = s[r] + dev, lo[r] = s[r] - dev.
 * s (n) estimates, var (nb, n) f16 error variances per block of the input, e (nb) the input's
 * energy per block (bounds.c). */
int32_t fl_logit_bounds(const float *s, const uint16_t *var, const float *e, int64_t nb,
                        int64_t n, float z, float slack, float *hi, float *lo);

/* ====================================================================================== */
/* PART 2 — I/O: the direct-I/O reader and the read-ahead (internal headers: io_plan.h,   */
/* io_uring.h)                                                                             */
/* ====================================================================================== */

/* ---- direct-I/O reader (io.c; io_uring engine io_uring.c; batch planning io_plan.c) ------- */

/* A reader owns one open file (O_DIRECT when possible) and either a pool of n_threads reader
 * threads (the calling thread is one of them) or an io_uring. One batch at a time per reader. */
typedef struct fl_reader fl_reader;

/* Counters since open or the last fl_reader_reset_stats. */
typedef struct {
    int64_t batches;          /* fl_reader_read calls that succeeded */
    int64_t requests;         /* (offset, length) requests in them */
    int64_t reads;            /* pread runs issued after merging */
    int64_t bytes_requested;  /* sum of request lengths */
    int64_t bytes_read;       /* bytes fetched from the device: requests + page padding + gaps */
    int64_t gap_bytes;        /* bytes of holes between requests read to save a read */
    int64_t merged_requests;  /* requests that joined the run of an earlier request */
    double seconds;           /* wall time inside fl_reader_read */
} fl_reader_stats_t;

/* fl_reader_open flags (fl_reader_info reports those in effect) */
enum {
    FL_READ_DIRECT = 1,  /* O_DIRECT; falls back to buffered reads where the filesystem refuses it */
    FL_READ_RING = 2     /* io_uring: one thread keeps n_threads reads in flight; falls back to
                            the thread pool where the kernel refuses io_uring */
};

/* Open path for reading with n_threads (1..256) threads (or reads in flight, FL_READ_RING) and a
 * staging buffer of stage_bytes (a multiple of 4096, also the largest single read) per thread. */
int32_t fl_reader_open(const char *path, int32_t n_threads, int32_t flags,
                       int64_t stage_bytes, fl_reader **out);

/* flags: FL_READ_* in effect; file_size in bytes (at open). */
int32_t fl_reader_info(const fl_reader *r, int32_t *flags, int64_t *file_size,
                       int32_t *n_threads);

/* Read n requests: file bytes [offsets[i], offsets[i] + lengths[i]) land at dst + dst_offsets[i].
 * Requests may come in any order and overlap. Neighbours are merged into page-aligned reads
 * across holes of at most max_gap bytes (max_gap < 0: no merging at all); one read is at most
 * max_run bytes (<= 0 or above stage_bytes: stage_bytes). A run that is one 4096-aligned piece of
 * one request whose destination is 4096-aligned is read in place, anything else is copied from
 * staging. FL_ERANGE when a request leaves [0, file_size), FL_EIO on a read error (dst is then
 * partly written). */
int32_t fl_reader_read(fl_reader *r, const int64_t *offsets, const int64_t *lengths,
                       uint8_t *dst, const int64_t *dst_offsets, int64_t n, int64_t max_gap,
                       int64_t max_run);

int32_t fl_reader_stats(const fl_reader *r, fl_reader_stats_t *out);
int32_t fl_reader_reset_stats(fl_reader *r);

/* Joins the threads, closes the file, frees r; r == NULL is fine. */
int32_t fl_reader_close(fl_reader *r);

/* The reads fl_reader_read would issue for these requests, without a file: their count, bytes
 * (page padding and gaps included) and gap bytes. Pure; for the cost model. */
int32_t fl_io_plan(const int64_t *offsets, const int64_t *lengths, int64_t n, int64_t max_gap,
                   int64_t max_run, int64_t *n_reads, int64_t *bytes_read, int64_t *gap_bytes);

/* ---- read-ahead (readahead.c) ------------------------------------------------------------ */

/* One thread reads a fixed schedule of n_entries batches over and over into n_buf buffers of
 * buf_bytes each (buffers: n_buf * buf_bytes, not owned); the consumer takes them in order.
 * Entry e: fl_reader_read(readers[reader_of[e]], the requests [first[e], first[e + 1]) of
 * offsets / lengths / dst_offsets (byte offsets inside the buffer), max_gap[e], max_run[e]).
 * The schedule's arrays are copied; the readers must stay open, and no one else may use them while the
 * ring runs (fl_readahead_stop first). FL_EINVAL for a request that leaves its buffer. */
typedef struct fl_readahead fl_readahead;

typedef struct {
    int64_t n_entries;
    const int32_t *reader_of;    /* (n_entries) index into the readers of each entry */
    const int64_t *first;        /* (n_entries + 1) entry e's requests are first[e] .. first[e+1]-1 */
    const int64_t *offsets;      /* (first[n_entries]) file offsets */
    const int64_t *lengths;      /* (first[n_entries]) bytes */
    const int64_t *dst_offsets;  /* (first[n_entries]) byte offsets inside the entry's buffer */
    const int64_t *max_gap;      /* (n_entries) fl_reader_read's merge limit per entry */
    const int64_t *max_run;      /* (n_entries) fl_reader_read's read size limit per entry */
} fl_readahead_schedule;

int32_t fl_readahead_open(fl_reader **readers, int32_t n_readers,
                          const fl_readahead_schedule *schedule, uint8_t *buffers,
                          int64_t buf_bytes, int32_t n_buf, fl_readahead **out);

/* Wait for schedule position pos (entry pos % n_entries) and give its buffer index, the
 * reader's counters for its read and the seconds the thread had waited for a free buffer before
 * it (the device idles then: the consumer is behind). A pos other than the one after the last
 * take (or a stopped ring) restarts the thread at pos. A read error is returned by the take of
 * its position and stops the ring. */
int32_t fl_readahead_take(fl_readahead *ra, int64_t pos, int32_t *buffer,
                          fl_reader_stats_t *delta, double *idle);

/* Positions [from, to) (absolute, as take's pos) are not read: the thread hands their buffers
 * over as read, with zero counters and unchanged bytes, so the consumer takes and releases them
 * in order and the ring keeps its place (a position already read when this is called stays
 * read). One range at a time: a call replaces the last one. */
int32_t fl_readahead_skip(fl_readahead *ra, int64_t from, int64_t to);

/* The buffer of the oldest take not yet released may be read into again. */
int32_t fl_readahead_release(fl_readahead *ra);

/* Stop reading ahead (waits for the read in flight); what was read is dropped. */
int32_t fl_readahead_stop(fl_readahead *ra);
int32_t fl_readahead_running(const fl_readahead *ra, int32_t *running);

/* Stops the thread and frees ra; ra == NULL is fine. */
int32_t fl_readahead_close(fl_readahead *ra);

/* CDEF-END */

#endif /* FLASHLLM_H */
