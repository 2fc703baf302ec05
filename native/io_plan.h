/* io_plan.h — the I/O module below the engines (io_plan.c): a reader batch planned into runs
 * (sorted, page-aligned, merged reads) and where a read run's bytes land. Offered to io.c (the
 * thread-pool reader) and io_uring.c (the io_uring engine). Internal: no fl_ names here. */
#ifndef FLASHLLM_IO_PLAN_H
#define FLASHLLM_IO_PLAN_H

#include <stdatomic.h>
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

/* One batch being read: the requests, where they go, the planned runs. Threads take runs by
 * next (atomically); the first error wins status. */
typedef struct {
    const int64_t *offsets, *lengths, *dst_offsets, *order;
    uint8_t *dst;
    const io_run *runs;       /* (n_runs) */
    int64_t n_runs;
    atomic_int_fast64_t next;
    atomic_int status;
} io_job;

/* FL_ERANGE unless every request lies in [0, limit). */
int32_t io_check_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                          int64_t limit);

/* order (n) := requests by ascending offset; p := the runs: pages joined across holes of at
 * most max_gap bytes (max_gap < 0: never joined), each at most max_run bytes (a multiple of
 * FL_IO_ALIGN). On FL_OK the caller frees p->runs. */
int32_t io_plan_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                         int64_t max_gap, int64_t max_run, int64_t *order, io_plan *p);

/* Copy the part of each request of run that lies in [run->a, run->b) out of buf (the run). */
void io_scatter(const io_job *job, const io_run *run, const uint8_t *buf);

/* Where run can land in place (one page-aligned piece of one request with a page-aligned
 * destination), else NULL (it goes through staging). */
uint8_t *io_direct_target(const io_job *job, const io_run *run);

#endif /* FLASHLLM_IO_PLAN_H */
