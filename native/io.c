/* io.c — the direct-I/O reader: a batch of (offset, length) requests → caller memory.
 *
 * io_plan.c turns a batch into "runs" (sorted, page-aligned, merged reads). Each run is one
 * pread (repeated on EINTR / short reads) by one thread of the pool (the caller is one of
 * them); threads take runs in file order from a shared counter until none is left, and a batch
 * of k runs wakes only min(k, n_threads) - 1 workers. A run lands straight in the destination
 * when it is a single page-aligned piece of one request, else in that thread's aligned staging
 * buffer, from which each request's bytes are copied to dst + dst_offsets[i]. So the caller
 * always finds request i at a known place, whatever the merging did.
 */
#include "flashllm.h"
#include "io_plan.h"
#include "io_uring.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FL_IO_MAX_THREADS 256
#define FL_IO_HUGE (2 << 20)       /* staging arena alignment: one transparent huge page */

typedef struct {
    struct fl_reader *r;
    int32_t index;
    sem_t go;                 /* posted once per batch this worker joins (or to quit) */
} io_worker;

struct fl_reader {
    int fd;
    int32_t flags;            /* FL_READ_DIRECT / FL_READ_RING in effect */
    int32_t n_threads;        /* pool threads, or reads in flight with the ring */
    uring_engine *ring;            /* the io_uring engine, NULL for the thread pool */
    int64_t file_size;
    int64_t stage_bytes;
    uint8_t *arena;           /* (n_threads * stage_bytes) aligned staging memory */
    uint8_t **stage;          /* (n_threads) pool thread i's staging: arena + i * stage_bytes */
    pthread_t *threads;       /* (n_threads - 1) pool only; the caller is the last reader */
    io_worker *workers;       /* (n_threads - 1) */
    int32_t n_started;
    sem_t done;               /* posted by a worker when it has finished its batch */
    int32_t has_done;         /* done is initialised */
    io_job *job;              /* the batch in flight, set before the workers are posted */
    atomic_int quit;
    fl_reader_stats_t stats;
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sem_wait_all(sem_t *s) {
    while (sem_wait(s) != 0 && errno == EINTR) continue;
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

static void work(struct fl_reader *r, io_job *job, uint8_t *stage) {
    for (;;) {
        int64_t k = atomic_fetch_add(&job->next, 1);
        if (k >= job->n_runs || atomic_load(&job->status) != FL_OK) return;
        const io_run *run = &job->runs[k];
        uint8_t *target = io_direct_target(job, run);
        int32_t st = read_full(r, target ? target : stage, run->a, run->b - run->a);
        if (st != FL_OK) {
            int expected = FL_OK;
            atomic_compare_exchange_strong(&job->status, &expected, st);
            return;
        }
        if (!target) io_scatter(job, run, stage);
    }
}

static void *worker_main(void *p) {
    io_worker *w = p;
    struct fl_reader *r = w->r;
    for (;;) {
        sem_wait_all(&w->go);
        if (atomic_load(&r->quit)) return NULL;
        work(r, r->job, r->stage[w->index]);
        sem_post(&r->done);
    }
}

static void stop_workers(struct fl_reader *r) {
    atomic_store(&r->quit, 1);
    for (int32_t i = 0; i < r->n_started; i++) sem_post(&r->workers[i].go);
    for (int32_t i = 0; i < r->n_started; i++) {
        pthread_join(r->threads[i], NULL);
        sem_destroy(&r->workers[i].go);
    }
    r->n_started = 0;
}

static int32_t start_workers(struct fl_reader *r) {
    for (int32_t i = 0; i < r->n_threads - 1; i++) {
        io_worker *w = &r->workers[i];
        w->r = r;
        w->index = i;
        if (sem_init(&w->go, 0, 0) != 0) return FL_ENOMEM;
        if (pthread_create(&r->threads[i], NULL, worker_main, w) != 0) {
            sem_destroy(&w->go);
            return FL_ENOMEM;
        }
        r->n_started++;
    }
    return FL_OK;
}

static int32_t alloc_reader(struct fl_reader *r) {
    r->stage = calloc((size_t)r->n_threads, sizeof *r->stage);
    r->threads = calloc((size_t)r->n_threads, sizeof *r->threads);
    r->workers = calloc((size_t)r->n_threads, sizeof *r->workers);
    if (!r->stage || !r->threads || !r->workers || sem_init(&r->done, 0, 0) != 0) return FL_ENOMEM;
    r->has_done = 1;
    /* huge pages where the kernel gives them (THP "madvise" mode): a direct read into 4 KiB
     * pages is one DMA segment per page; on a virtio disk 256 KiB reads into huge pages ran
     * 1.3-1.5x faster (BENCHMARKS.md "## I/O") */
    size_t bytes = ((size_t)(r->n_threads * r->stage_bytes) + FL_IO_HUGE - 1) & ~(size_t)(FL_IO_HUGE - 1);
    if (posix_memalign((void **)&r->arena, FL_IO_HUGE, bytes) != 0) {
        r->arena = NULL;
        return FL_ENOMEM;
    }
    madvise(r->arena, bytes, MADV_HUGEPAGE);  /* advice only: failure leaves 4 KiB pages */
    for (int32_t i = 0; i < r->n_threads; i++) r->stage[i] = r->arena + i * r->stage_bytes;
    return FL_OK;
}

/* Stops the workers that started, frees everything; safe on a partly built reader. */
static void free_reader(struct fl_reader *r) {
    stop_workers(r);
    uring_close(r->ring);
    free(r->arena);
    if (r->has_done) sem_destroy(&r->done);
    free(r->stage);
    free(r->threads);
    free(r->workers);
    if (r->fd >= 0) close(r->fd);
    free(r);
}

static int open_file(const char *path, int32_t want_direct, int32_t *flags) {
    if (want_direct) {
        int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (fd >= 0) { *flags |= FL_READ_DIRECT; return fd; }
        if (errno != EINVAL) return -1;  /* EINVAL: this filesystem refuses O_DIRECT */
    }
    return open(path, O_RDONLY | O_CLOEXEC);
}

/* The io_uring engine when asked for and the kernel has it, else the thread pool. */
static int32_t start_engine(struct fl_reader *r, int32_t want_ring) {
    int32_t status = alloc_reader(r);
    if (status != FL_OK) return status;
    if (want_ring) {
        status = uring_open(r->fd, r->n_threads, &r->ring);
        if (status == FL_OK) r->flags |= FL_READ_RING;
        if (status != FL_EUNSUPPORTED) return status;
    }
    return start_workers(r);
}

int32_t fl_reader_open(const char *path, int32_t n_threads, int32_t flags,
                       int64_t stage_bytes, fl_reader **out) {
    if (!path || !out || n_threads < 1 || n_threads > FL_IO_MAX_THREADS ||
        stage_bytes < FL_IO_ALIGN || stage_bytes % FL_IO_ALIGN != 0 ||
        (flags & ~(FL_READ_DIRECT | FL_READ_RING)) != 0)
        return FL_EINVAL;
    *out = NULL;
    struct fl_reader *r = calloc(1, sizeof *r);
    if (!r) return FL_ENOMEM;
    r->n_threads = n_threads;
    r->stage_bytes = stage_bytes;
    atomic_init(&r->quit, 0);
    r->fd = open_file(path, flags & FL_READ_DIRECT, &r->flags);
    struct stat st;
    if (r->fd < 0 || fstat(r->fd, &st) != 0) { free_reader(r); return FL_EIO; }
    r->file_size = (int64_t)st.st_size;
    int32_t status = start_engine(r, flags & FL_READ_RING);
    if (status != FL_OK) { free_reader(r); return status; }
    *out = r;
    return FL_OK;
}

int32_t fl_reader_info(const fl_reader *r, int32_t *flags, int64_t *file_size, int32_t *n_threads) {
    if (!r || !flags || !file_size || !n_threads) return FL_EINVAL;
    *flags = r->flags;
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
    if (r) free_reader(r);
    return FL_OK;
}

/* ---- reading a batch --------------------------------------------------------------------- */

static int32_t run_job(struct fl_reader *r, io_job *job) {
    if (r->ring) return uring_read(r->ring, job, r->arena, r->n_threads * r->stage_bytes,
                                     r->file_size);
    int64_t helpers = job->n_runs < r->n_threads ? job->n_runs - 1 : r->n_threads - 1;
    r->job = job;
    for (int64_t i = 0; i < helpers; i++) sem_post(&r->workers[i].go);
    work(r, job, r->stage[r->n_threads - 1]);
    for (int64_t i = 0; i < helpers; i++) sem_wait_all(&r->done);
    r->job = NULL;
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
    int32_t status = io_check_requests(offsets, lengths, n, r->file_size);
    if (status != FL_OK) return status;
    if (max_run <= 0 || max_run > r->stage_bytes) max_run = r->stage_bytes;
    max_run = io_align_down(max_run) > 0 ? io_align_down(max_run) : FL_IO_ALIGN;
    double t0 = now_seconds();
    int64_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!order) return FL_ENOMEM;
    io_plan p;
    status = io_plan_requests(offsets, lengths, n, max_gap, max_run, order, &p);
    if (status == FL_OK) {
        io_job job = {.offsets = offsets, .lengths = lengths, .dst_offsets = dst_offsets,
                      .order = order, .dst = dst, .runs = p.runs, .n_runs = p.n};
        atomic_init(&job.next, 0);
        atomic_init(&job.status, FL_OK);
        status = run_job(r, &job);
        if (status == FL_OK) count_batch(r, &p, lengths, n, now_seconds() - t0);
        free(p.runs);
    }
    free(order);
    return status;
}
