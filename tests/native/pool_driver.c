/* pool_driver.c — native/pool.c under AddressSanitizer / ThreadSanitizer (make test-asan):
 * many short sections back to back (workers spinning), sections after the team fell asleep,
 * and sections asked for from several threads at once; work shared by fli_take and by
 * fli_split (each item taken exactly once, however many threads claim parts or steal; a lone
 * taker reads a part it stole mostly forwards).
 * Exit 0 when every sum is right. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "pool.h"

typedef struct {
    atomic_llong sum, next;
    int64_t n;
} count_job;

static void count_part(void *p) {  // sum of 0 .. n-1, 7 at a time, over the threads
    count_job *j = p;
    for (int64_t lo, hi; fli_take(&j->next, j->n, 7, &lo, &hi);) {
        int64_t s = 0;
        for (int64_t i = lo; i < hi; i++) s += i;
        atomic_fetch_add(&j->sum, s);
    }
}

#define SPLIT_MAX 3000
typedef struct {
    fli_split split;
    atomic_int hits[SPLIT_MAX];  // how often each item was taken
    int64_t chunk;
} split_job;

static void split_part(void *p) {  // every item taken once, 1..chunk at a time
    split_job *j = p;
    int mine = -1;
    for (int64_t lo, hi; fli_split_take(&j->split, &mine, j->chunk, &lo, &hi);)
        for (int64_t i = lo; i < hi; i++) atomic_fetch_add(&j->hits[i], 1);
}

static split_job shared_split;  // too large for a caller thread's stack

static int split_sections(split_job *j, int32_t threads, int reps) {
    for (int r = 0; r < reps; r++) {
        const int64_t n = (r * 37) % SPLIT_MAX;  // 0 .. SPLIT_MAX-1 items, fewer than parts too
        for (int64_t i = 0; i < n; i++) atomic_store(&j->hits[i], 0);
        j->chunk = 1 + r % 9;
        fli_split_init(&j->split, n, threads);
        fli_parallel(threads, split_part, j);
        for (int64_t i = 0; i < n; i++)
            if (atomic_load(&j->hits[i]) != 1) return 1;
    }
    return 0;
}

/* the one taker left when the other part's thread never runs reads that part mostly forwards:
 * halves stolen from its back, each taken from its front (one backwards jump a half, ~log2 of
 * its chunks; a chunk at a time from the back made 125 here) */
static int lone_taker_reads_forwards(void) {
    fli_split s;
    fli_split_init(&s, 1000, 2);
    int mine = -1, jumps = 0;
    int64_t end = 0, taken = 0;
    for (int64_t lo, hi; fli_split_take(&s, &mine, 4, &lo, &hi); end = hi, taken += hi - lo)
        jumps += lo < end;
    return taken != 1000 || jumps > 10;
}

static int sections(int32_t threads, int reps) {
    for (int r = 0; r < reps; r++) {
        count_job j = {0, 0, 1000 + r};
        fli_parallel(threads, count_part, &j);
        if (atomic_load(&j.sum) != j.n * (j.n - 1) / 2) return 1;
    }
    return 0;
}

static void *caller(void *arg) {
    return (void *)(intptr_t)sections((int32_t)(intptr_t)arg, 2000);
}

int main(void) {
    int bad = sections(2, 20000) + sections(4, 2000) + sections(3, 2000) +
              lone_taker_reads_forwards();
    for (int32_t threads = 1; threads <= FLI_PARTS + 3; threads++)  // more threads than parts too
        bad += split_sections(&shared_split, threads, 300);
    const struct timespec nap = {0, 5 * 1000 * 1000};  // past the spin: the workers sleep
    for (int k = 0; k < 20; k++) {
        nanosleep(&nap, NULL);
        bad += sections(4, 3);
    }
    pthread_t t[4];
    for (int k = 0; k < 4; k++) pthread_create(&t[k], NULL, caller, (void *)(intptr_t)(k + 2));
    for (int k = 0; k < 4; k++) {
        void *r;
        pthread_join(t[k], &r);
        bad += (int)(intptr_t)r;
    }
    printf("pool_driver: %s\n", bad ? "WRONG SUMS OR ITEMS" : "ok");
    return bad != 0;
}
