/* io_internal.h — what io.c (the reader pool) and io_plan.c (batch planning) share.
 * Not part of the C API (that is flashllm.h only): no fl_ names are declared here. */
#ifndef FLASHLLM_IO_INTERNAL_H
#define FLASHLLM_IO_INTERNAL_H

#include <stdint.h>

#define FL_IO_ALIGN 4096

static inline int64_t io_align_down(int64_t x) { return x & ~(int64_t)(FL_IO_ALIGN - 1); }
static inline int64_t io_align_up(int64_t x) { return io_align_down(x + FL_IO_ALIGN - 1); }

/* One pread: file range [a, b), page aligned (b may pass EOF), covering (parts of) the
 * requests order[first .. last]. */
typedef struct {
    int64_t a, b;
    int64_t first, last;
} io_run;

/* The runs of a batch, in ascending file order, and what they cost. */
typedef struct {
    io_run *runs;            /* (n) owned: free(runs) */
    int64_t n, cap;
    int64_t bytes;           /* sum of b - a */
    int64_t gap_bytes;       /* holes between requests read through */
    int64_t merged;          /* requests that joined an earlier request's run */
} io_plan;

/* FL_ERANGE unless every request lies in [0, limit). */
int32_t io_check_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                          int64_t limit);

/* order (n) := requests by ascending offset; p := the runs: pages joined across holes of at
 * most max_gap bytes (max_gap < 0: never joined), each at most max_run bytes (a multiple of
 * FL_IO_ALIGN). On FL_OK the caller frees p->runs. */
int32_t io_plan_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                         int64_t max_gap, int64_t max_run, int64_t *order, io_plan *p);

#endif /* FLASHLLM_IO_INTERNAL_H */
