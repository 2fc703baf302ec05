/* pool.h — the compute kernel's worker threads (pool.c) and how a parallel section
 * shares its work among them: fli_take (chunks as threads come free) and fli_split (a contiguous
 * part per thread). Internal to the extension. */
#ifndef FLASHLLM_POOL_H
#define FLASHLLM_POOL_H

#include <stdatomic.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* a parallel section's work, run by every thread taking part; it takes its work in chunks
 * (fli_take or fli_split, state in ctx), so the result cannot depend on how many threads ran it */
typedef void (*fli_task)(void *ctx);

/* fn(ctx) on up to n_threads threads at once (the calling thread one of them), returning when
 * every one that took part has finished; per-thread state lives on a task's stack or heap */
void fli_parallel(int32_t n_threads, fli_task fn, void *ctx);

#pragma GCC visibility pop

/* the next chunk [*lo, *hi) of n items, chunk at a time from *next; 0 when none is left */
static inline int fli_take(atomic_llong *next, int64_t n, int64_t chunk, int64_t *lo,
                           int64_t *hi) {
    const int64_t i = atomic_fetch_add(next, chunk);
    if (i >= n) return 0;
    *lo = i;
    *hi = i + chunk < n ? i + chunk : n;
    return 1;
}

/* A section's n items (< 2^32) cut into contiguous parts, one per thread asked for (at most
 * FLI_PARTS): a taker claims a part and takes its chunks from the front; with its part done (or
 * no part left to claim) it takes chunks from the back of the others' parts. So each core reads
 * one forward stream of the weights instead of alternate chunks of them: on a Zen 4 VM this
 * took the 1.5B's decode from 21-22 to 25-30 tok/s (docs/KERNELS.md, "Threads"). A thread that
 * is not running leaves its part to the others, as fli_take's chunks would. Which thread takes
 * an item never changes the item's result. */
#define FLI_PARTS 8
typedef struct {
    struct {
        _Alignas(64) _Atomic uint64_t span;  // lo << 32 | hi: the items still in the part
    } part[FLI_PARTS];
    atomic_int claimed;  // parts claimed so far
    int n_parts;
} fli_split;

static inline void fli_split_init(fli_split *s, int64_t n, int32_t n_threads) {
    const int p = n_threads < 1 ? 1 : n_threads > FLI_PARTS ? FLI_PARTS : (int)n_threads;
    s->n_parts = p;
    atomic_init(&s->claimed, 0);
    for (int i = 0; i < p; i++)
        atomic_init(&s->part[i].span, (uint64_t)(n * i / p) << 32 | (uint64_t)(n * (i + 1) / p));
}

/* up to chunk items [*lo, *hi) off part i's front (front != 0) or back (half: half of what is
 * left when that is more); 0 when it is empty */
static inline int fli_split_cut(fli_split *s, int i, int front, int half, int64_t chunk,
                                int64_t *lo, int64_t *hi) {
    uint64_t v = atomic_load_explicit(&s->part[i].span, memory_order_relaxed);
    for (;;) {
        const int64_t a = (int64_t)(v >> 32), b = (int64_t)(v & 0xFFFFFFFFu);
        if (a >= b) return 0;
        const int64_t c = half && (b - a) / 2 > chunk ? (b - a) / 2 : b - a < chunk ? b - a : chunk;
        const uint64_t nv = front ? (uint64_t)(a + c) << 32 | (uint64_t)b
                                  : (uint64_t)a << 32 | (uint64_t)(b - c);
        if (atomic_compare_exchange_weak(&s->part[i].span, &v, nv)) {
            *lo = front ? a : b - c;
            *hi = front ? a + c : b;
            return 1;
        }
    }
}

/* a taker whose part m is empty steals the back half of part i (a chunk when less is left):
 * its first chunk [*lo, *hi), the rest of that half made part m, taken from its front. Taken a
 * chunk at a time from the back instead, a part whose thread did not run (its core held by
 * another process) was read backwards, and the one thread left ran 1.3-1.6x its one-thread
 * time (docs/KERNELS.md, "Threads"). Safe: nothing changes an empty part but its taker. */
static inline int fli_split_steal(fli_split *s, int i, int m, int64_t chunk, int64_t *lo,
                                  int64_t *hi) {
    int64_t end;
    if (!fli_split_cut(s, i, 0, 1, chunk, lo, &end)) return 0;
    *hi = end - *lo > chunk ? *lo + chunk : end;
    if (*hi < end) atomic_store(&s->part[m].span, (uint64_t)*hi << 32 | (uint64_t)end);
    return 1;
}

/* the next chunk [*lo, *hi) for a taker whose part is *mine (-1 before its first take, kept on
 * the taker's stack); 0 when no item is left */
static inline int fli_split_take(fli_split *s, int *mine, int64_t chunk, int64_t *lo,
                                 int64_t *hi) {
    if (*mine < 0) *mine = atomic_fetch_add(&s->claimed, 1);
    *lo = *hi = 0;  // (an empty chunk when none is left; gcc -O1 cannot see every path sets them)
    const int own = *mine < s->n_parts;
    if (own && fli_split_cut(s, *mine, 1, 0, chunk, lo, hi)) return 1;
    for (int k = 1; k <= s->n_parts; k++) {
        const int i = (*mine + k) % s->n_parts;
        if (own ? fli_split_steal(s, i, *mine, chunk, lo, hi)
                : fli_split_cut(s, i, 0, 0, chunk, lo, hi))
            return 1;
    }
    return 0;
}

#endif /* FLASHLLM_POOL_H */
