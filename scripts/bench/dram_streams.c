/* dram_streams.c — how two threads read one large array from DRAM: each a contiguous half (one
 * forward stream per core), or alternate chunks taken from a shared counter. The kernel's
 * parallel sections read weights the second way until fli_split (native/pool.h).
 *
 *   cc -O3 -fopenmp scripts/bench/dram_streams.c -o dram_streams && ./dram_streams
 *
 * Prints GB/s (best of 5 passes over 1 GiB) per thread count and schedule. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BYTES ((size_t)1 << 30)

static double pass(const uint64_t *p, int threads, long chunk) {
    const long n = (long)(BYTES / 8);
    uint64_t s = 0;
    const double t0 = omp_get_wtime();
    if (chunk == 0) {
#pragma omp parallel for num_threads(threads) reduction(+ : s) schedule(static)
        for (long i = 0; i < n; i++) s += p[i];
    } else {
#pragma omp parallel for num_threads(threads) reduction(+ : s) schedule(dynamic, chunk)
        for (long i = 0; i < n; i++) s += p[i];
    }
    const double dt = omp_get_wtime() - t0;
    if (s == 42) puts("");  // keeps the sum
    return (double)BYTES / dt / 1e9;
}

int main(void) {
    uint64_t *p = malloc(BYTES);
    if (!p) return 1;
    for (size_t i = 0; i < BYTES / 8; i++) p[i] = i;
    const long chunks[] = {0, 8192, 65536};  // contiguous parts; 64 KiB and 512 KiB chunks
    for (int threads = 1; threads <= 2; threads++)
        for (int c = 0; c < 3; c++) {
            double best = 0;
            for (int r = 0; r < 5; r++) {
                const double g = pass(p, threads, chunks[c]);
                best = g > best ? g : best;
            }
            if (chunks[c] == 0)
                printf("%d thread(s), contiguous parts:  %5.1f GB/s\n", threads, best);
            else
                printf("%d thread(s), %4ld KiB chunks:     %5.1f GB/s\n", threads,
                       chunks[c] * 8 / 1024, best);
        }
    free(p);
    return 0;
}
