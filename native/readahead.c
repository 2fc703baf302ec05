/* readahead.c — the read-ahead ring: one C thread reads a fixed schedule of batches, over and
 * over, into a ring of buffers; the consumer takes them in schedule order.
 *
 * Entry e of the schedule is one fl_reader_read of requests [first[e], first[e+1]) through
 * readers[reader_of[e]] into a buffer; schedule position pos (growing without bound, entry
 * pos % n_entries) lands in buffer (pos - start) % n_buf. The thread waits only for a free
 * buffer, never for the consumer's code: the reads of the next entries are issued while the
 * consumer computes, and no interpreter lock or Python frame sits between two reads.
 *
 * One mutex and one condition variable (broadcast: the two sides are one thread each) guard
 * n_free / n_full / halt and the done records. A read error ends the thread after its record,
 * so the take() of that position returns the error.
 */
#include "flashllm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double ra_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    int64_t pos;                /* schedule position read into this buffer */
    int32_t status;             /* of its fl_reader_read */
    fl_reader_stats_t delta;    /* the reader's counters for that read */
    double idle;                /* seconds the thread waited for a free buffer before it */
} ra_done;

struct fl_readahead {
    fl_reader **readers;        /* (n_readers) not owned */
    int32_t n_readers;
    int32_t *reader_of;         /* (n_entries) */
    int64_t *first;             /* (n_entries + 1) request ranges */
    int64_t *offsets, *lengths, *dst_offsets;   /* (n_requests) */
    int64_t *max_gap, *max_run; /* (n_entries) */
    int64_t n_entries;
    uint8_t *buffers;           /* (n_buf, buf_bytes) not owned */
    int64_t buf_bytes;
    int32_t n_buf;
    pthread_t thread;
    int32_t running;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t n_free, n_full, halt;
    int64_t start_pos;          /* where the thread starts */
    int64_t expect;             /* the position the next take() should ask for */
    int32_t k_take;             /* ring index of the next take() */
    ra_done *done;              /* (n_buf) by ring index */
    int64_t skip_from, skip_to; /* positions [from, to) the thread marks done without a read */
};

static void *dup_array(const void *src, size_t n, size_t size) {
    void *p = malloc(n ? n * size : 1);
    if (p && n) memcpy(p, src, n * size);
    return p;
}

static void stats_delta(const fl_reader_stats_t *a, const fl_reader_stats_t *b,
                        fl_reader_stats_t *out) {
    out->batches = b->batches - a->batches;
    out->requests = b->requests - a->requests;
    out->reads = b->reads - a->reads;
    out->bytes_requested = b->bytes_requested - a->bytes_requested;
    out->bytes_read = b->bytes_read - a->bytes_read;
    out->gap_bytes = b->gap_bytes - a->gap_bytes;
    out->merged_requests = b->merged_requests - a->merged_requests;
    out->seconds = b->seconds - a->seconds;
}

static int32_t read_entry(fl_readahead *ra, int64_t e, uint8_t *dst, fl_reader_stats_t *delta) {
    fl_reader *r = ra->readers[ra->reader_of[e]];
    int64_t a = ra->first[e], n = ra->first[e + 1] - a;
    fl_reader_stats_t before, after;
    fl_reader_stats(r, &before);
    int32_t status = fl_reader_read(r, ra->offsets + a, ra->lengths + a, dst, ra->dst_offsets + a,
                                    n, ra->max_gap[e], ra->max_run[e]);
    fl_reader_stats(r, &after);
    stats_delta(&before, &after, delta);
    return status;
}

static void *ra_main(void *arg) {
    fl_readahead *ra = arg;
    int64_t pos = ra->start_pos;
    for (int32_t k = 0;; k = (k + 1) % ra->n_buf, pos++) {
        double t0 = ra_now();
        pthread_mutex_lock(&ra->mu);
        while (ra->n_free == 0 && !ra->halt) pthread_cond_wait(&ra->cv, &ra->mu);
        int32_t halt = ra->halt;
        int32_t skip = pos >= ra->skip_from && pos < ra->skip_to;
        if (!halt) ra->n_free--;
        pthread_mutex_unlock(&ra->mu);
        if (halt) return NULL;
        ra_done d = {.pos = pos, .idle = ra_now() - t0};
        d.status = skip ? FL_OK : read_entry(ra, pos % ra->n_entries,
                                             ra->buffers + k * ra->buf_bytes, &d.delta);
        pthread_mutex_lock(&ra->mu);
        ra->done[k] = d;
        ra->n_full++;
        pthread_cond_broadcast(&ra->cv);
        pthread_mutex_unlock(&ra->mu);
        if (d.status != FL_OK) return NULL;
    }
}

/* Every request lands inside one buffer; every entry names a reader. */
static int32_t check_schedule(const int32_t *reader_of, const int64_t *first,
                              const int64_t *lengths, const int64_t *dst_offsets,
                              int64_t n_entries, int32_t n_readers, int64_t buf_bytes) {
    if (first[0] != 0) return FL_EINVAL;
    for (int64_t e = 0; e < n_entries; e++) {
        if (reader_of[e] < 0 || reader_of[e] >= n_readers || first[e + 1] < first[e])
            return FL_EINVAL;
        for (int64_t i = first[e]; i < first[e + 1]; i++)
            if (lengths[i] < 0 || dst_offsets[i] < 0 || dst_offsets[i] + lengths[i] > buf_bytes)
                return FL_EINVAL;
    }
    return FL_OK;
}

int32_t fl_readahead_open(fl_reader **readers, int32_t n_readers,
                          const fl_readahead_schedule *schedule, uint8_t *buffers,
                          int64_t buf_bytes, int32_t n_buf, fl_readahead **out) {
    if (!out) return FL_EINVAL;
    *out = NULL;
    if (!schedule) return FL_EINVAL;
    const fl_readahead_schedule s = *schedule;
    const int64_t n_entries = s.n_entries;
    if (!readers || n_readers < 1 || !s.reader_of || !s.first || n_entries < 1 || !buffers ||
        buf_bytes < 1 || n_buf < 2 || !s.max_gap || !s.max_run)
        return FL_EINVAL;
    for (int32_t i = 0; i < n_readers; i++)
        if (!readers[i]) return FL_EINVAL;
    int64_t n_req = s.first[n_entries];
    if (n_req > 0 && (!s.offsets || !s.lengths || !s.dst_offsets)) return FL_EINVAL;
    int32_t status = check_schedule(s.reader_of, s.first, s.lengths, s.dst_offsets, n_entries,
                                    n_readers, buf_bytes);
    if (status != FL_OK) return status;
    fl_readahead *ra = calloc(1, sizeof *ra);
    if (!ra) return FL_ENOMEM;
    ra->readers = dup_array(readers, (size_t)n_readers, sizeof *readers);
    ra->reader_of = dup_array(s.reader_of, (size_t)n_entries, sizeof *s.reader_of);
    ra->first = dup_array(s.first, (size_t)n_entries + 1, sizeof *s.first);
    ra->offsets = dup_array(s.offsets, (size_t)n_req, sizeof *s.offsets);
    ra->lengths = dup_array(s.lengths, (size_t)n_req, sizeof *s.lengths);
    ra->dst_offsets = dup_array(s.dst_offsets, (size_t)n_req, sizeof *s.dst_offsets);
    ra->max_gap = dup_array(s.max_gap, (size_t)n_entries, sizeof *s.max_gap);
    ra->max_run = dup_array(s.max_run, (size_t)n_entries, sizeof *s.max_run);
    ra->done = calloc((size_t)n_buf, sizeof *ra->done);
    ra->n_readers = n_readers;
    ra->n_entries = n_entries;
    ra->buffers = buffers;
    ra->buf_bytes = buf_bytes;
    ra->n_buf = n_buf;
    ra->expect = -1;
    pthread_mutex_init(&ra->mu, NULL);
    pthread_cond_init(&ra->cv, NULL);
    if (!ra->readers || !ra->reader_of || !ra->first || !ra->offsets || !ra->lengths ||
        !ra->dst_offsets || !ra->max_gap || !ra->max_run || !ra->done) {
        fl_readahead_close(ra);
        return FL_ENOMEM;
    }
    *out = ra;
    return FL_OK;
}

int32_t fl_readahead_stop(fl_readahead *ra) {
    if (!ra) return FL_EINVAL;
    if (!ra->running) return FL_OK;
    pthread_mutex_lock(&ra->mu);
    ra->halt = 1;
    pthread_cond_broadcast(&ra->cv);
    pthread_mutex_unlock(&ra->mu);
    pthread_join(ra->thread, NULL);
    ra->running = 0;
    ra->expect = -1;
    return FL_OK;
}

static int32_t ra_start(fl_readahead *ra, int64_t pos) {
    ra->n_free = ra->n_buf;
    ra->n_full = 0;
    ra->halt = 0;
    ra->k_take = 0;
    ra->start_pos = ra->expect = pos;
    if (pthread_create(&ra->thread, NULL, ra_main, ra) != 0) return FL_ENOMEM;
    ra->running = 1;
    return FL_OK;
}

int32_t fl_readahead_take(fl_readahead *ra, int64_t pos, int32_t *buffer,
                          fl_reader_stats_t *delta, double *idle) {
    if (!ra || !buffer || !delta || !idle || pos < 0) return FL_EINVAL;
    if (!ra->running || pos != ra->expect) {
        fl_readahead_stop(ra);
        int32_t status = ra_start(ra, pos);
        if (status != FL_OK) return status;
    }
    pthread_mutex_lock(&ra->mu);
    while (ra->n_full == 0) pthread_cond_wait(&ra->cv, &ra->mu);
    ra_done d = ra->done[ra->k_take];
    ra->n_full--;
    pthread_mutex_unlock(&ra->mu);
    if (d.status != FL_OK || d.pos != pos) {
        fl_readahead_stop(ra);
        return d.status != FL_OK ? d.status : FL_EINVAL;
    }
    *buffer = ra->k_take;
    *delta = d.delta;
    *idle = d.idle;
    ra->k_take = (ra->k_take + 1) % ra->n_buf;
    ra->expect = pos + 1;
    return FL_OK;
}

int32_t fl_readahead_skip(fl_readahead *ra, int64_t from, int64_t to) {
    if (!ra || from < 0 || to < from) return FL_EINVAL;
    pthread_mutex_lock(&ra->mu);
    ra->skip_from = from;
    ra->skip_to = to;
    pthread_mutex_unlock(&ra->mu);
    return FL_OK;
}

int32_t fl_readahead_release(fl_readahead *ra) {
    if (!ra) return FL_EINVAL;
    pthread_mutex_lock(&ra->mu);
    if (ra->n_free < ra->n_buf) ra->n_free++;
    pthread_cond_broadcast(&ra->cv);
    pthread_mutex_unlock(&ra->mu);
    return FL_OK;
}

int32_t fl_readahead_running(const fl_readahead *ra, int32_t *running) {
    if (!ra || !running) return FL_EINVAL;
    *running = ra->running;
    return FL_OK;
}

int32_t fl_readahead_close(fl_readahead *ra) {
    if (!ra) return FL_OK;
    fl_readahead_stop(ra);
    pthread_cond_destroy(&ra->cv);
    pthread_mutex_destroy(&ra->mu);
    free(ra->readers);
    free(ra->reader_of);
    free(ra->first);
    free(ra->offsets);
    free(ra->lengths);
    free(ra->dst_offsets);
    free(ra->max_gap);
    free(ra->max_run);
    free(ra->done);
    free(ra);
    return FL_OK;
}
