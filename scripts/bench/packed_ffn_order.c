/* packed_ffn_order.c — the packed matmuls of a dense decode FFN in the order a token runs them
 * (gate+up, the activation, down; layer after layer), each kind timed apart: how fast each
 * streams from DRAM when it follows the others, as in `run`, not in a loop of its own. 28 layers
 * of the 1.5B's shapes (d 1536, n_ff 8960), random blocks of the given dtypes packed by fl_pack;
 * even layers take down dtype D1, odd ones D2 (a Q4_K_M file's Q4_K / Q6_K down rows).
 *
 *   cc -O3 -march=native -std=c11 -D_GNU_SOURCE -Inative scripts/bench/packed_ffn_order.c \
 *      $(ls native/[a-z]*.c | grep -v -e io -e readahead) -o packed_ffn_order -lpthread -lm
 *   ./packed_ffn_order THREADS SWEEPS GATE_DTYPE D1 D2     # dtype codes: flashllm.h (q4_k 5,
 *                                                          # q5_k 8, q6_k 9, q2_k 10, q3_k 11)
 *
 * Prints GB/s of weight bytes and ms a matrix per kind, the median of SWEEPS sweeps. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "flashllm.h"

#define LAYERS 28
#define D_MODEL 1536
#define N_FF 8960

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t next(uint64_t *s) {  // xorshift64
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

/* a packed (rows, cols) matrix of random blocks whose f16 scales are small (finite sums) */
static uint8_t *random_packed(int32_t dt, int64_t rows, int64_t cols, uint64_t *seed) {
    size_t block = 0, at = 0, n_scales = 1;  // block bytes, offset of its f16 d (and dmin)
    switch (dt) {
    case FL_Q2_K: block = 84, at = 80, n_scales = 2; break;
    case FL_Q3_K: block = 110, at = 108; break;
    case FL_Q4_K: block = 144, n_scales = 2; break;
    case FL_Q5_K: block = 176, n_scales = 2; break;
    case FL_Q6_K: block = 210, at = 208; break;
    default: return NULL;
    }
    const size_t n = (size_t)rows * fl_row_bytes(dt, cols), pn = fl_packed_bytes(dt, rows, cols);
    uint8_t *w = malloc(n), *p = aligned_alloc(64, (pn + 63) / 64 * 64);
    if (!w || !p || pn == 0) return NULL;
    for (size_t i = 0; i < n; i++) w[i] = (uint8_t)next(seed);
    const uint16_t d = 0x1800;
    for (size_t b = 0; b < n; b += block)
        for (size_t k = 0; k < n_scales; k++) memcpy(w + b + at + 2 * k, &d, 2);
    const int32_t st = fl_pack(dt, w, rows, cols, p);
    free(w);
    return st == FL_OK ? p : NULL;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s THREADS SWEEPS GATE_DTYPE D1 D2\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[1]), sweeps = atoi(argv[2]);
    const int32_t gd = atoi(argv[3]), dd[2] = {atoi(argv[4]), atoi(argv[5])};
    if (threads < 1 || sweeps < 1 || sweeps > 64) {
        fprintf(stderr, "THREADS >= 1 and 1 <= SWEEPS <= 64\n");
        return 2;
    }
    uint64_t seed = 88172645463325252ull;
    uint8_t *gu[LAYERS], *down[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        gu[l] = random_packed(gd, 2 * N_FF, D_MODEL, &seed);          // (2 n_ff, d) packed
        down[l] = random_packed(dd[l % 2], D_MODEL, N_FF, &seed);      // (d, n_ff) packed
        if (!gu[l] || !down[l]) {
            fprintf(stderr, "no packed layout for these dtypes in this build\n");
            return 1;
        }
    }
    float *x = malloc(D_MODEL * sizeof *x), *gate = malloc(2 * N_FF * sizeof *gate);  // (d), (2 n_ff)
    float *a = malloc(N_FF * sizeof *a), *y = malloc(D_MODEL * sizeof *y);           // (n_ff), (d)
    for (int i = 0; i < D_MODEL; i++) x[i] = (float)((int)(next(&seed) % 2001) - 1000) / 700.0f;
    double t[3][64];  // kind (gate+up, even down, odd down), sweep: seconds
    for (int r = 0; r < sweeps; r++) {
        t[0][r] = t[1][r] = t[2][r] = 0;
        for (int l = 0; l < LAYERS; l++) {
            const double t0 = now();
            fl_matmul_packed(gu[l], gd, 2 * N_FF, D_MODEL, NULL, x, 1, gate, threads);
            const double t1 = now();
            fl_act_mul(FL_ACT_SILU, gate, gate + N_FF, a, N_FF);
            const double t2 = now();
            fl_matmul_packed(down[l], dd[l % 2], D_MODEL, N_FF, NULL, a, 1, y, threads);
            t[0][r] += t1 - t0;
            t[1 + l % 2][r] += now() - t2;
        }
    }
    const char *name[3] = {"gate+up", "down D1", "down D2"};
    const double bytes[3] = {LAYERS * (double)fl_packed_bytes(gd, 2 * N_FF, D_MODEL),
                             LAYERS / 2 * (double)fl_packed_bytes(dd[0], D_MODEL, N_FF),
                             LAYERS / 2 * (double)fl_packed_bytes(dd[1], D_MODEL, N_FF)};
    const int count[3] = {LAYERS, LAYERS / 2, LAYERS / 2};
    for (int k = 0; k < 3; k++) {
        qsort(t[k], (size_t)sweeps, sizeof t[k][0], by_value);
        const double med = t[k][sweeps / 2];
        printf("%s %.1f GB/s (%.3f ms)%s", name[k], bytes[k] / med / 1e9, med / count[k] * 1e3,
               k < 2 ? "  " : "  medians\n");
    }
    return 0;
}
