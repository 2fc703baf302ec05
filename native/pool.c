/* pool.c — the compute kernel's worker threads (fli_parallel in pool.h).
 *
 * A decode token runs ~170 parallel sections (four matmuls, attention and the FFN per layer),
 * separated by a few microseconds of Python. OpenMP's team under OMP_WAIT_POLICY=passive put
 * its threads to sleep after every section, so each one paid a futex wake-up and a wait at its
 * end (~14 ms a token on Qwen2.5-1.5B, measured); under the active policy its threads spin for
 * milliseconds whatever else needs the core, the direct-I/O readers included.
 *
 * Here an idle worker spins for SPIN_NS (yielding the core between looks), long enough to bridge
 * the Python between two kernel calls, then sleeps until the next section. A section's work is
 * taken in chunks (fli_take from a shared counter, or fli_split's contiguous part per thread,
 * stolen from by the others when they are done), so it never waits for a worker that is not
 * running: the caller opens n_threads - 1 places, works, then closes the places; a worker that
 * did not take one by then stays out, and the caller waits only for those that did.
 *
 * One team per process, as OpenMP's: it grows to the largest thread count asked for and its
 * threads live until the process ends (a forked child starts with none). A section asked for
 * while another runs (a second Python thread calling the kernel) runs on the calling thread.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "pool.h"

#define MAX_WORKERS 255  /* threads besides the caller */
#define SPIN_NS 100000   /* how long an idle thread spins (yielding) before it sleeps */
#define SPIN_CHECK 32    /* pause instructions between two looks at the clock */
#define SEATS 0xFFFF     /* the low bits of `seats`: places left; the rest: the section's number */

typedef struct {
    pthread_mutex_t lock;      /* guards the sleepers and the condition variables */
    pthread_cond_t work;       /* a new section was published */
    pthread_cond_t done;       /* the last worker of a section finished */
    atomic_uint_fast64_t gen;  /* the number of the last section published */
    atomic_uint_fast64_t seats; /* section number << 16 | places still open to workers */
    atomic_int finished;       /* workers of the current section done with it */
    atomic_int sleepers;       /* workers waiting on `work` */
    atomic_int caller_asleep;  /* the caller waits on `done` */
    atomic_flag busy;          /* a section is being run */
    fli_task fn;               /* the current section */
    void *ctx;
    int32_t n_workers;         /* threads started */
} team;

static team pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                    PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, ATOMIC_FLAG_INIT, NULL, NULL, 0};
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* spin (giving the core to anything else runnable between looks) until *word differs from seen,
 * for up to SPIN_NS; 1 when it did */
static int spin_until_changed(atomic_uint_fast64_t *word, uint_fast64_t seen) {
    const int64_t until = now_ns() + SPIN_NS;
    for (;;) {
        for (int i = 0; i < SPIN_CHECK; i++) {
            if (atomic_load_explicit(word, memory_order_acquire) != seen) return 1;
            cpu_relax();
        }
        if (now_ns() > until) return 0;
        sched_yield();
    }
}

/* take a place in section `sec` while it is open; 0 when it is full or closed */
static int join(uint_fast64_t sec) {
    uint_fast64_t s = atomic_load(&pool.seats);
    while (s >> 16 == sec && (s & SEATS) > 0)
        if (atomic_compare_exchange_weak(&pool.seats, &s, s - 1)) return 1;
    return 0;
}

/* what a worker starts from: the last section published before it was made */
static void *worker_main(void *arg) {
    uint_fast64_t seen = *(uint_fast64_t *)arg;
    free(arg);
    for (;;) {
        if (!spin_until_changed(&pool.gen, seen)) {  // sleep (Dekker with fli_parallel's wake)
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.work, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.gen);
        if (!join(seen)) continue;  // open until its caller closes it: fn and ctx stay valid
        pool.fn(pool.ctx);
        atomic_fetch_add(&pool.finished, 1);
        if (atomic_load(&pool.caller_asleep)) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    return NULL;
}

/* a forked child has no workers (only the forking thread survives a fork) */
static void reset_in_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    atomic_store(&pool.seats, 0);
    atomic_store(&pool.finished, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_asleep, 0);
    atomic_flag_clear(&pool.busy);
    pool.n_workers = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

/* start workers up to n (the caller holds busy); fewer when the system refuses threads */
static void grow(int32_t n) {
    pthread_once(&atfork_once, register_atfork);
    while (pool.n_workers < n && pool.n_workers < MAX_WORKERS) {
        uint_fast64_t *start = malloc(sizeof *start);
        if (!start) break;
        *start = atomic_load(&pool.gen);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, start);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(start);
            break;
        }
        pool.n_workers++;
    }
}

/* wait until the `joined` workers that took a place finished: spin, then sleep on `done` */
static void wait_finished(int joined) {
    const int64_t until = now_ns() + SPIN_NS;
    while (atomic_load_explicit(&pool.finished, memory_order_acquire) < joined) {
        cpu_relax();
        if (now_ns() <= until) continue;
        pthread_mutex_lock(&pool.lock);
        atomic_store(&pool.caller_asleep, 1);
        while (atomic_load(&pool.finished) < joined) pthread_cond_wait(&pool.done, &pool.lock);
        atomic_store(&pool.caller_asleep, 0);
        pthread_mutex_unlock(&pool.lock);
    }
}

void fli_parallel(int32_t n_threads, fli_task fn, void *ctx) {
    if (n_threads <= 1 || atomic_flag_test_and_set(&pool.busy)) {
        fn(ctx);  // one thread asked for, or the team is busy: run here, alone
        return;
    }
    grow(n_threads - 1);
    const int32_t places = n_threads - 1 < pool.n_workers ? n_threads - 1 : pool.n_workers;
    const uint_fast64_t sec = atomic_load(&pool.gen) + 1;
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.finished, 0);
    atomic_store(&pool.seats, sec << 16 | (uint_fast64_t)places);
    atomic_store(&pool.gen, sec);  // seq_cst: published before sleepers is read
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.work);
        pthread_mutex_unlock(&pool.lock);
    }
    fn(ctx);
    // close the section: a worker that has not taken a place by now never will
    const int open = (int)(atomic_exchange(&pool.seats, sec << 16) & SEATS);
    wait_finished(places - open);
    atomic_flag_clear(&pool.busy);
}
