/* io_plan.c — planning a reader batch: (offset, length) requests → page-aligned runs.
 *
 * Requests are sorted by offset, widened to FL_IO_ALIGN pages, and neighbours joined when the
 * hole between them is at most max_gap bytes and the run stays at most max_run bytes (a long
 * request is cut into max_run pieces). io.c reads the runs; fl_io_plan only counts them (the
 * cost model's view of a batch). Where a read run's bytes go (in place, or copied out of staging)
 * is here too: both engines (io.c's threads, io_uring.c) land runs the same way.
 */
#include "flashllm.h"
#include "io_plan.h"

#include <stdlib.h>
#include <string.h>

typedef struct { int64_t off, idx; } io_key;

static int cmp_key(const void *x, const void *y) {
    const io_key *p = x, *q = y;
    if (p->off != q->off) return p->off < q->off ? -1 : 1;
    return (p->idx > q->idx) - (p->idx < q->idx);
}

/* order (n) = request indices by ascending offset (stable). */
static int32_t sort_order(const int64_t *offsets, int64_t n, int64_t *order) {
    int sorted = 1;
    for (int64_t i = 0; i < n; i++) {
        order[i] = i;
        if (i > 0 && offsets[i] < offsets[i - 1]) sorted = 0;
    }
    if (sorted) return FL_OK;
    io_key *keys = malloc((size_t)n * sizeof *keys);
    if (!keys) return FL_ENOMEM;
    for (int64_t i = 0; i < n; i++) keys[i] = (io_key){offsets[i], i};
    qsort(keys, (size_t)n, sizeof *keys, cmp_key);
    for (int64_t i = 0; i < n; i++) order[i] = keys[i].idx;
    free(keys);
    return FL_OK;
}

static int32_t push_run(io_plan *p, int64_t a, int64_t b, int64_t first, int64_t last) {
    if (p->n == p->cap) {
        int64_t cap = p->cap ? 2 * p->cap : 64;
        io_run *runs = realloc(p->runs, (size_t)cap * sizeof *runs);
        if (!runs) return FL_ENOMEM;
        p->runs = runs;
        p->cap = cap;
    }
    p->runs[p->n++] = (io_run){a, b, first, last};
    p->bytes += b - a;
    return FL_OK;
}

/* Runs of the requests taken in `order`: pages joined across holes of at most max_gap bytes
 * (max_gap < 0: never joined, not even when touching), at most max_run bytes each. */
static int32_t build_plan(const int64_t *offsets, const int64_t *lengths, const int64_t *order,
                          int64_t n, int64_t max_gap, int64_t max_run, io_plan *p) {
    int64_t a = 0, b = 0, first = 0, last = 0;
    int have = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t i = order[k];
        if (lengths[i] == 0) continue;
        int64_t fa = io_align_down(offsets[i]), fb = io_align_up(offsets[i] + lengths[i]);
        if (have && max_gap >= 0 && fa >= a && fa <= b + max_gap && fb - a <= max_run) {
            if (fa > b) p->gap_bytes += fa - b;
            p->merged++;
            b = fb > b ? fb : b;
            last = k;
            continue;
        }
        /* a request straddling the end of a full run continues in the next one: no page twice */
        int straddle = have && max_gap >= 0 && fa >= a && fa < b;
        if (have && push_run(p, a, b, first, straddle ? k : last) != FL_OK) return FL_ENOMEM;
        a = straddle ? b : fa;
        b = fb; first = last = k; have = 1;
        for (; b - a > max_run; a += max_run)
            if (push_run(p, a, a + max_run, k, k) != FL_OK) return FL_ENOMEM;
    }
    return have ? push_run(p, a, b, first, last) : FL_OK;
}

int32_t io_plan_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                         int64_t max_gap, int64_t max_run, int64_t *order, io_plan *p) {
    memset(p, 0, sizeof *p);
    int32_t status = sort_order(offsets, n, order);
    if (status == FL_OK) status = build_plan(offsets, lengths, order, n, max_gap, max_run, p);
    if (status != FL_OK) {
        free(p->runs);
        memset(p, 0, sizeof *p);
    }
    return status;
}

int32_t io_check_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                          int64_t limit) {
    for (int64_t i = 0; i < n; i++)
        if (offsets[i] < 0 || lengths[i] < 0 || offsets[i] > limit - lengths[i]) return FL_ERANGE;
    return FL_OK;
}

int32_t fl_io_plan(const int64_t *offsets, const int64_t *lengths, int64_t n, int64_t max_gap,
                   int64_t max_run, int64_t *n_reads, int64_t *bytes_read, int64_t *gap_bytes) {
    if (n < 0 || (n > 0 && (!offsets || !lengths)) || !n_reads || !bytes_read || !gap_bytes ||
        max_run < FL_IO_ALIGN || max_run % FL_IO_ALIGN != 0)
        return FL_EINVAL;
    int32_t status = io_check_requests(offsets, lengths, n, INT64_MAX - FL_IO_ALIGN);
    if (status != FL_OK) return status;
    int64_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!order) return FL_ENOMEM;
    io_plan p;
    status = io_plan_requests(offsets, lengths, n, max_gap, max_run, order, &p);
    *n_reads = p.n;
    *bytes_read = p.bytes;
    *gap_bytes = p.gap_bytes;
    free(p.runs);
    free(order);
    return status;
}

void io_scatter(const io_job *job, const io_run *run, const uint8_t *buf) {
    for (int64_t k = run->first; k <= run->last; k++) {
        int64_t i = job->order[k];
        int64_t lo = job->offsets[i] > run->a ? job->offsets[i] : run->a;
        int64_t end = job->offsets[i] + job->lengths[i];
        int64_t hi = end < run->b ? end : run->b;
        if (hi <= lo) continue;
        memcpy(job->dst + job->dst_offsets[i] + (lo - job->offsets[i]), buf + (lo - run->a),
               (size_t)(hi - lo));
    }
}

uint8_t *io_direct_target(const io_job *job, const io_run *run) {
    if (run->first != run->last) return NULL;
    int64_t i = job->order[run->first];
    int64_t off = job->offsets[i];
    if (run->a < off || run->b > off + job->lengths[i]) return NULL;
    uint8_t *p = job->dst + job->dst_offsets[i] + (run->a - off);
    return ((uintptr_t)p % FL_IO_ALIGN) == 0 ? p : NULL;
}
