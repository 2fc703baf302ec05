/* io_uring.c — the reader's io_uring engine: one thread keeps up to `depth` reads in flight.
 *
 * The calling thread queues the batch's runs (in file order) into a raw io_uring (no liburing:
 * the three syscalls and the shared rings), each into a free staging slot or straight into the
 * destination (io_direct_target). The staging arena is cut into slots of the batch's largest
 * run — up to SLOTS_PER_DEPTH times as many slots as reads in flight — so a completed run can
 * wait for its copy (io_scatter) while a new read already uses another slot: the loop tops the
 * queue up and submits before every COPY_BETWEEN_SUBMITS bytes of copying (one syscall per
 * large run, one per several small ones), and waits in the kernel only when nothing is left to
 * copy. Short reads and -EINTR/-EAGAIN are resubmitted for the remaining bytes; an error stops
 * new reads, but every read in flight is reaped before returning, so no read lands in caller
 * memory after fl_reader_read returns.
 */
#include "flashllm.h"
#include "io_uring.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SLOTS_PER_DEPTH 4
#define COPY_BETWEEN_SUBMITS (128 << 10)  /* run bytes copied out before topping the queue up */

typedef struct {
    int64_t run;          /* index into job->runs */
    int64_t done;         /* bytes of the run read so far */
    uint8_t *buf;         /* where the run lands */
    int32_t staged;       /* buf is a staging slot: scatter when complete */
} io_slot;

struct uring_engine {
    int ring_fd, file_fd;
    uint32_t depth;
    uint32_t *sq_head, *sq_tail, *sq_mask, *sq_array;
    uint32_t *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;       /* (sq entries) */
    struct io_uring_cqe *cqes;       /* (cq entries) */
    void *sq_map, *cq_map, *sqe_map;
    size_t sq_len, cq_len, sqe_len;
    int32_t cap;                     /* SLOTS_PER_DEPTH * depth */
    io_slot *slots;                  /* (cap) */
    int32_t *free_slots;             /* (cap) stack of free slot indices */
    int32_t *ready;                  /* (cap) stack of read runs waiting for their copy */
};

static int ring_enter(int fd, uint32_t to_submit, uint32_t min_complete) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete,
                        IORING_ENTER_GETEVENTS, NULL, 0);
}

static int32_t map_rings(uring_engine *q, const struct io_uring_params *p) {
    q->sq_len = p->sq_off.array + p->sq_entries * sizeof(uint32_t);
    q->cq_len = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    if (p->features & IORING_FEAT_SINGLE_MMAP)
        q->sq_len = q->cq_len = q->sq_len > q->cq_len ? q->sq_len : q->cq_len;
    int prot = PROT_READ | PROT_WRITE, flags = MAP_SHARED | MAP_POPULATE;
    q->sq_map = mmap(NULL, q->sq_len, prot, flags, q->ring_fd, IORING_OFF_SQ_RING);
    if (q->sq_map == MAP_FAILED) { q->sq_map = NULL; return FL_ENOMEM; }
    q->cq_map = (p->features & IORING_FEAT_SINGLE_MMAP) ? q->sq_map
              : mmap(NULL, q->cq_len, prot, flags, q->ring_fd, IORING_OFF_CQ_RING);
    if (q->cq_map == MAP_FAILED) { q->cq_map = NULL; return FL_ENOMEM; }
    q->sqe_len = p->sq_entries * sizeof(struct io_uring_sqe);
    q->sqe_map = mmap(NULL, q->sqe_len, prot, flags, q->ring_fd, IORING_OFF_SQES);
    if (q->sqe_map == MAP_FAILED) { q->sqe_map = NULL; return FL_ENOMEM; }
    uint8_t *sq = q->sq_map, *cq = q->cq_map;
    q->sq_head = (uint32_t *)(sq + p->sq_off.head);
    q->sq_tail = (uint32_t *)(sq + p->sq_off.tail);
    q->sq_mask = (uint32_t *)(sq + p->sq_off.ring_mask);
    q->sq_array = (uint32_t *)(sq + p->sq_off.array);
    q->cq_head = (uint32_t *)(cq + p->cq_off.head);
    q->cq_tail = (uint32_t *)(cq + p->cq_off.tail);
    q->cq_mask = (uint32_t *)(cq + p->cq_off.ring_mask);
    q->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    q->sqes = q->sqe_map;
    return FL_OK;
}

void uring_close(uring_engine *q) {
    if (!q) return;
    if (q->sqe_map) munmap(q->sqe_map, q->sqe_len);
    if (q->cq_map && q->cq_map != q->sq_map) munmap(q->cq_map, q->cq_len);
    if (q->sq_map) munmap(q->sq_map, q->sq_len);
    if (q->ring_fd >= 0) close(q->ring_fd);
    free(q->slots);
    free(q->free_slots);
    free(q->ready);
    free(q);
}

int32_t uring_open(int file_fd, int32_t depth, uring_engine **out) {
    *out = NULL;
    uring_engine *q = calloc(1, sizeof *q);
    if (!q) return FL_ENOMEM;
    q->file_fd = file_fd;
    q->depth = (uint32_t)depth;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    q->ring_fd = (int)syscall(__NR_io_uring_setup, (unsigned)depth, &p);
    if (q->ring_fd < 0) { uring_close(q); return FL_EUNSUPPORTED; }
    q->cap = SLOTS_PER_DEPTH * depth;
    q->slots = calloc((size_t)q->cap, sizeof *q->slots);
    q->free_slots = calloc((size_t)q->cap, sizeof *q->free_slots);
    q->ready = calloc((size_t)q->cap, sizeof *q->ready);
    int32_t status = q->slots && q->free_slots && q->ready ? map_rings(q, &p) : FL_ENOMEM;
    if (status != FL_OK) { uring_close(q); return status; }
    *out = q;
    return FL_OK;
}

/* Queue the rest of slot s's run (not yet submitted). */
static void queue_read(uring_engine *q, const io_job *job, int32_t s) {
    const io_slot *slot = &q->slots[s];
    const io_run *run = &job->runs[slot->run];
    uint32_t tail = *q->sq_tail, idx = tail & *q->sq_mask;
    struct io_uring_sqe *sqe = &q->sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = IORING_OP_READ;
    sqe->fd = q->file_fd;
    sqe->off = (uint64_t)(run->a + slot->done);
    sqe->addr = (uint64_t)(uintptr_t)(slot->buf + slot->done);
    sqe->len = (uint32_t)(run->b - run->a - slot->done);
    sqe->user_data = (uint64_t)s;
    q->sq_array[idx] = idx;
    __atomic_store_n(q->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* A completion of slot s with result res: 1 when its run is finished (read or failed), 0 when
 * the rest was resubmitted. */
static int complete(uring_engine *q, io_job *job, int32_t s, int32_t res, int64_t file_size) {
    io_slot *slot = &q->slots[s];
    const io_run *run = &job->runs[slot->run];
    if (res == -EINTR || res == -EAGAIN) { queue_read(q, job, s); return 0; }
    int32_t st = FL_OK;
    if (res < 0) st = FL_EIO;
    else if (res == 0 && run->a + slot->done < file_size) st = FL_EIO;  /* EOF inside the file */
    slot->done += res > 0 ? res : 0;
    if (st == FL_OK && res > 0 && slot->done < run->b - run->a && run->a + slot->done < file_size) {
        queue_read(q, job, s);
        return 0;
    }
    if (st != FL_OK) atomic_store(&job->status, st);
    return 1;
}

/* The batch's read state: slots of slot_bytes in the arena, free and ready stacks. */
typedef struct {
    uint8_t *arena;
    int64_t slot_bytes, next, live;
    int32_t n_free, n_ready;
} io_batch;

/* Queue the next runs while fewer than depth reads are in flight and a slot is free. */
static void fill(uring_engine *q, io_job *job, io_batch *b) {
    while (b->live < q->depth && b->n_free > 0 && b->next < job->n_runs &&
           atomic_load(&job->status) == FL_OK) {
        int32_t s = q->free_slots[--b->n_free];
        uint8_t *target = io_direct_target(job, &job->runs[b->next]);
        uint8_t *stage = b->arena + s * b->slot_bytes;
        q->slots[s] = (io_slot){b->next, 0, target ? target : stage, target == NULL};
        queue_read(q, job, s);
        b->next++;
        b->live++;
    }
}

/* Take every completion off the CQ ring: finished staged runs go to the ready stack. */
static void reap(uring_engine *q, io_job *job, io_batch *b, int64_t file_size) {
    uint32_t head = *q->cq_head, tail = __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        const struct io_uring_cqe *cqe = &q->cqes[head & *q->cq_mask];
        int32_t s = (int32_t)cqe->user_data;
        if (!complete(q, job, s, cqe->res, file_size)) continue;
        b->live--;
        if (q->slots[s].staged && atomic_load(&job->status) == FL_OK) q->ready[b->n_ready++] = s;
        else q->free_slots[b->n_free++] = s;
    }
    __atomic_store_n(q->cq_head, head, __ATOMIC_RELEASE);
}

static int64_t largest_run(const io_job *job) {
    int64_t most = FL_IO_ALIGN;
    for (int64_t k = 0; k < job->n_runs; k++)
        if (job->runs[k].b - job->runs[k].a > most) most = job->runs[k].b - job->runs[k].a;
    return most;
}

int32_t uring_read(uring_engine *q, io_job *job, uint8_t *arena, int64_t arena_bytes,
                     int64_t file_size) {
    io_batch b = {.arena = arena, .slot_bytes = largest_run(job)};
    int64_t n_slots = arena_bytes / b.slot_bytes;
    b.n_free = (int32_t)(n_slots < q->cap ? n_slots : q->cap);
    for (int32_t i = 0; i < b.n_free; i++) q->free_slots[i] = b.n_free - 1 - i;
    int32_t failures = 0;
    for (;;) {
        fill(q, job, &b);
        uint32_t pending = *q->sq_tail - __atomic_load_n(q->sq_head, __ATOMIC_ACQUIRE);
        if (b.live == 0 && b.n_ready == 0) break;
        if (pending > 0 || b.n_ready == 0) {  /* wait in the kernel only with nothing to copy */
            if (ring_enter(q->ring_fd, pending, b.n_ready == 0 ? 1 : 0) < 0 && errno != EINTR &&
                errno != EAGAIN && errno != EBUSY) {
                atomic_store(&job->status, FL_EIO);  /* no new reads; those in flight are reaped */
                if (++failures == 3) return FL_EIO;  /* the ring itself is broken */
            } else {
                failures = 0;
            }
        }
        reap(q, job, &b, file_size);
        for (int64_t copied = 0; b.n_ready > 0 && copied < COPY_BETWEEN_SUBMITS;) {
            int32_t s = q->ready[--b.n_ready];
            const io_run *run = &job->runs[q->slots[s].run];
            if (atomic_load(&job->status) == FL_OK) io_scatter(job, run, q->slots[s].buf);
            copied += run->b - run->a;
            q->free_slots[b.n_free++] = s;
        }
    }
    return atomic_load(&job->status);
}
