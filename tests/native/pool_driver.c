/* pool_driver.c — native/pool.c under AddressSanitizer / ThreadSanitizer (make test-asan):
 * many short sections back to back (workers spinning), sections after the team fell asleep,
 * and sections asked for from several threads at once. Exit 0 when every sum is right. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "compute_internal.h"

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
    int bad = sections(2, 20000) + sections(4, 2000) + sections(3, 2000);
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
    printf("pool_driver: %s\n", bad ? "WRONG SUMS" : "ok");
    return bad != 0;
}
