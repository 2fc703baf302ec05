/* io.c — the direct-I/O reader: a batch of (offset, length) requests → caller memory.
 *
 * A batch is planned into "runs": requests sorted by offset, widened to FL_IO_ALIGN pages,
 * neighbours joined when the hole between them is at most max_gap bytes and the run stays at
 * most max_run bytes (a long request is cut into max_run pieces). Each run is one pread
 * (repeated on EINTR / short reads) by one thread of the pool (the caller is one of them):
 * straight into the destination when the run is a single page-aligned piece of one request,
 * else into that thread's aligned staging buffer, from which each request's bytes are copied
 * to dst + dst_offsets[i]. So the caller always finds request i at a known place, whatever the
 * merging did.
 */
#include "flashllm.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FL_IO_ALIGN 4096
#define FL_IO_MAX_THREADS 256

typedef struct {
    int64_t a, b;         /* file range [a, b), page aligned (b may pass EOF) */
    int64_t first, last;  /* requests touching it: order[first .. last] */
} io_run;

typedef struct {
    const int64_t *offsets, *lengths, *dst_offsets, *order;
    uint8_t *dst;
    const io_run *runs;
    int64_t n_runs;
    atomic_int_fast64_t next;
    atomic_int status;
} io_job;

struct fl_reader {
    int fd;
    int32_t direct;
    int32_t n_threads;
    int64_t file_size;
    int64_t stage_bytes;
    uint8_t **stage;          /* (n_threads) aligned buffers of stage_bytes */
    pthread_t *workers;       /* (n_threads - 1); the caller is the last reader */
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
    int64_t generation;
    int32_t n_busy;
    int32_t quit;
    io_job *job;
    fl_reader_stats_t stats;
};

static int64_t align_down(int64_t x) { return x & ~(int64_t)(FL_IO_ALIGN - 1); }
static int64_t align_up(int64_t x) { return align_down(x + FL_IO_ALIGN - 1); }

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Read file range [off, off + len) into buf; a short count is fine only at end of file. */
static int32_t read_full(const struct fl_reader *r, uint8_t *buf, int64_t off, int64_t len) {
    int64_t done = 0;
    while (done < len) {
        ssize_t got = pread(r->fd, buf + done, (size_t)(len - done), (off_t)(off + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return FL_EIO;
        if (got == 0) return off + done >= r->file_size ? FL_OK : FL_EIO;
        done += got;
    }
    return FL_OK;
}

/* Copy the part of each request of the run that lies in [run->a, run->b) out of buf. */
static void scatter(const io_job *job, const io_run *run, const uint8_t *buf) {
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

/* A run that is one page-aligned piece of one request can land in place: its address. */
static uint8_t *direct_target(const io_job *job, const io_run *run) {
    if (run->first != run->last) return NULL;
    int64_t i = job->order[run->first];
    int64_t off = job->offsets[i];
    if (run->a < off || run->b > off + job->lengths[i]) return NULL;
    uint8_t *p = job->dst + job->dst_offsets[i] + (run->a - off);
    return ((uintptr_t)p % FL_IO_ALIGN) == 0 ? p : NULL;
}

static void work(struct fl_reader *r, io_job *job, uint8_t *stage) {
    for (;;) {
        int64_t k = atomic_fetch_add(&job->next, 1);
        if (k >= job->n_runs || atomic_load(&job->status) != FL_OK) return;
        const io_run *run = &job->runs[k];
        uint8_t *target = direct_target(job, run);
        int32_t st = read_full(r, target ? target : stage, run->a, run->b - run->a);
        if (st != FL_OK) {
            int expected = FL_OK;
            atomic_compare_exchange_strong(&job->status, &expected, st);
            return;
        }
        if (!target) scatter(job, run, stage);
    }
}

typedef struct { struct fl_reader *r; int32_t index; } worker_arg;

static void *worker_main(void *p) {
    worker_arg arg = *(worker_arg *)p;
    free(p);
    struct fl_reader *r = arg.r;
    int64_t seen = 0;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->quit && r->generation == seen) pthread_cond_wait(&r->cv_start, &r->mu);
        if (r->quit) break;
        seen = r->generation;
        io_job *job = r->job;
        pthread_mutex_unlock(&r->mu);
        work(r, job, r->stage[arg.index]);
        pthread_mutex_lock(&r->mu);
        if (--r->n_busy == 0) pthread_cond_signal(&r->cv_done);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void stop_workers(struct fl_reader *r, int32_t n_started) {
    pthread_mutex_lock(&r->mu);
    r->quit = 1;
    pthread_cond_broadcast(&r->cv_start);
    pthread_mutex_unlock(&r->mu);
    for (int32_t i = 0; i < n_started; i++) pthread_join(r->workers[i], NULL);
}

static int32_t start_workers(struct fl_reader *r) {
    for (int32_t i = 0; i < r->n_threads - 1; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (!arg) { stop_workers(r, i); return FL_ENOMEM; }
        arg->r = r;
        arg->index = i;
        if (pthread_create(&r->workers[i], NULL, worker_main, arg) != 0) {
            free(arg);
            stop_workers(r, i);
            return FL_ENOMEM;
        }
    }
    return FL_OK;
}

static int32_t alloc_reader(struct fl_reader *r) {
    r->stage = calloc((size_t)r->n_threads, sizeof *r->stage);
    r->workers = calloc((size_t)r->n_threads, sizeof *r->workers);
    if (!r->stage || !r->workers) return FL_ENOMEM;
    for (int32_t i = 0; i < r->n_threads; i++) {
        if (posix_memalign((void **)&r->stage[i], FL_IO_ALIGN, (size_t)r->stage_bytes) != 0) {
            r->stage[i] = NULL;
            return FL_ENOMEM;
        }
    }
    return FL_OK;
}

static void free_reader(struct fl_reader *r) {
    if (r->stage)
        for (int32_t i = 0; i < r->n_threads; i++) free(r->stage[i]);
    free(r->stage);
    free(r->workers);
    if (r->fd >= 0) close(r->fd);
    free(r);
}

static int open_file(const char *path, int32_t want_direct, int32_t *direct) {
    *direct = 0;
    if (want_direct) {
        int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (fd >= 0) { *direct = 1; return fd; }
        if (errno != EINVAL) return -1;  /* EINVAL: this filesystem refuses O_DIRECT */
    }
    return open(path, O_RDONLY | O_CLOEXEC);
}

int32_t fl_reader_open(const char *path, int32_t n_threads, int32_t want_direct,
                       int64_t stage_bytes, fl_reader **out) {
    if (!path || !out || n_threads < 1 || n_threads > FL_IO_MAX_THREADS ||
        stage_bytes < FL_IO_ALIGN || stage_bytes % FL_IO_ALIGN != 0)
        return FL_EINVAL;
    *out = NULL;
    struct fl_reader *r = calloc(1, sizeof *r);
    if (!r) return FL_ENOMEM;
    r->n_threads = n_threads;
    r->stage_bytes = stage_bytes;
    r->fd = open_file(path, want_direct, &r->direct);
    struct stat st;
    if (r->fd < 0 || fstat(r->fd, &st) != 0) { free_reader(r); return FL_EIO; }
    r->file_size = (int64_t)st.st_size;
    int32_t status = alloc_reader(r);
    if (status != FL_OK) { free_reader(r); return status; }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv_start, NULL);
    pthread_cond_init(&r->cv_done, NULL);
    status = start_workers(r);
    if (status != FL_OK) {
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv_start);
        pthread_cond_destroy(&r->cv_done);
        free_reader(r);
        return status;
    }
    *out = r;
    return FL_OK;
}

int32_t fl_reader_info(const fl_reader *r, int32_t *direct, int64_t *file_size, int32_t *n_threads) {
    if (!r || !direct || !file_size || !n_threads) return FL_EINVAL;
    *direct = r->direct;
    *file_size = r->file_size;
    *n_threads = r->n_threads;
    return FL_OK;
}

int32_t fl_reader_stats(const fl_reader *r, fl_reader_stats_t *out) {
    if (!r || !out) return FL_EINVAL;
    *out = r->stats;
    return FL_OK;
}

int32_t fl_reader_reset_stats(fl_reader *r) {
    if (!r) return FL_EINVAL;
    memset(&r->stats, 0, sizeof r->stats);
    return FL_OK;
}

int32_t fl_reader_close(fl_reader *r) {
    if (!r) return FL_OK;
    stop_workers(r, r->n_threads - 1);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv_start);
    pthread_cond_destroy(&r->cv_done);
    free_reader(r);
    return FL_OK;
}


/* ---- planning ---------------------------------------------------------------------------- */

typedef struct {
    io_run *runs;
    int64_t n, cap;
    int64_t bytes, gap_bytes, merged;
} io_plan;

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
        int64_t fa = align_down(offsets[i]), fb = align_up(offsets[i] + lengths[i]);
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

static int32_t plan_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
                             int64_t max_gap, int64_t max_run, int64_t *order, io_plan *p) {
    memset(p, 0, sizeof *p);
    int32_t status = sort_order(offsets, n, order);
    if (status != FL_OK) return status;
    return build_plan(offsets, lengths, order, n, max_gap, max_run, p);
}

static int32_t check_requests(const int64_t *offsets, const int64_t *lengths, int64_t n,
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
    int32_t status = check_requests(offsets, lengths, n, INT64_MAX - FL_IO_ALIGN);
    if (status != FL_OK) return status;
    int64_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!order) return FL_ENOMEM;
    io_plan p;
    status = plan_requests(offsets, lengths, n, max_gap, max_run, order, &p);
    *n_reads = p.n;
    *bytes_read = p.bytes;
    *gap_bytes = p.gap_bytes;
    free(p.runs);
    free(order);
    return status;
}

/* ---- reading a batch --------------------------------------------------------------------- */

static int32_t run_job(struct fl_reader *r, io_job *job) {
    uint8_t *own_stage = r->stage[r->n_threads - 1];
    if (r->n_threads == 1 || job->n_runs < 2) {
        work(r, job, own_stage);
        return atomic_load(&job->status);
    }
    pthread_mutex_lock(&r->mu);
    r->job = job;
    r->n_busy = r->n_threads - 1;
    r->generation++;
    pthread_cond_broadcast(&r->cv_start);
    pthread_mutex_unlock(&r->mu);
    work(r, job, own_stage);
    pthread_mutex_lock(&r->mu);
    while (r->n_busy > 0) pthread_cond_wait(&r->cv_done, &r->mu);
    r->job = NULL;
    pthread_mutex_unlock(&r->mu);
    return atomic_load(&job->status);
}

static void count_batch(struct fl_reader *r, const io_plan *p, const int64_t *lengths, int64_t n,
                        double seconds) {
    fl_reader_stats_t *s = &r->stats;
    s->batches += 1;
    s->requests += n;
    for (int64_t i = 0; i < n; i++) s->bytes_requested += lengths[i];
    s->reads += p->n;
    int64_t past_eof = 0;
    for (int64_t k = 0; k < p->n; k++)
        if (p->runs[k].b > r->file_size)
            past_eof += p->runs[k].b - (p->runs[k].a > r->file_size ? p->runs[k].a : r->file_size);
    s->bytes_read += p->bytes - past_eof;
    s->gap_bytes += p->gap_bytes;
    s->merged_requests += p->merged;
    s->seconds += seconds;
}

int32_t fl_reader_read(fl_reader *r, const int64_t *offsets, const int64_t *lengths,
                       uint8_t *dst, const int64_t *dst_offsets, int64_t n, int64_t max_gap,
                       int64_t max_run) {
    if (!r || n < 0 || (n > 0 && (!offsets || !lengths || !dst || !dst_offsets))) return FL_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (dst_offsets[i] < 0) return FL_EINVAL;
    int32_t status = check_requests(offsets, lengths, n, r->file_size);
    if (status != FL_OK) return status;
    if (max_run <= 0 || max_run > r->stage_bytes) max_run = r->stage_bytes;
    max_run = align_down(max_run) > 0 ? align_down(max_run) : FL_IO_ALIGN;
    double t0 = now_seconds();
    int64_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!order) return FL_ENOMEM;
    io_plan p;
    status = plan_requests(offsets, lengths, n, max_gap, max_run, order, &p);
    if (status == FL_OK) {
        io_job job = {.offsets = offsets, .lengths = lengths, .dst_offsets = dst_offsets,
                      .order = order, .dst = dst, .runs = p.runs, .n_runs = p.n};
        atomic_init(&job.next, 0);
        atomic_init(&job.status, FL_OK);
        status = run_job(r, &job);
    }
    if (status == FL_OK) count_batch(r, &p, lengths, n, now_seconds() - t0);
    free(p.runs);
    free(order);
    return status;
}
