/* io_driver.c — exercises native/io.c + io_plan.c + readahead.c under AddressSanitizer (make
 * test-asan).
 *
 * Writes a file of random bytes (unaligned size), then reads seeded random batches through
 * fl_reader_read with several thread counts, gaps and run sizes and compares every request
 * with the same bytes taken from the in-memory copy. Also checks the error paths, and runs a
 * read-ahead ring over two readers (laps, a jump, a read error, close while running).
 * Usage: io_driver DIR   (DIR on a real disk so O_DIRECT is exercised). Exit 0 when all pass.
 */
#include "flashllm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FILE_BYTES (3 * 1024 * 1024 + 1234)
#define MAX_REQ 256

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int fail(const char *what, long long detail) {
    fprintf(stderr, "FAIL: %s (%lld)\n", what, detail);
    return 1;
}

static int write_file(const char *path, uint8_t *data) {
    for (int64_t i = 0; i < FILE_BYTES; i++) data[i] = (uint8_t)rng();
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, FILE_BYTES, f) != FILE_BYTES) return 1;
    return fclose(f) != 0;
}

/* One random batch: fixed-stride bundles of random ids, or arbitrary ranges. */
static int one_batch(fl_reader *r, const uint8_t *data, int trial) {
    int64_t off[MAX_REQ], len[MAX_REQ], dst_off[MAX_REQ];
    int64_t n = 1 + (int64_t)(rng() % MAX_REQ), stride = 512 + (int64_t)(rng() % 4000), pos = 0;
    for (int64_t i = 0; i < n; i++) {
        if (trial % 2) {
            len[i] = stride;
            off[i] = (int64_t)(rng() % (FILE_BYTES / stride)) * stride;
        } else {
            len[i] = (int64_t)(rng() % 300000);
            off[i] = (int64_t)(rng() % (uint64_t)(FILE_BYTES - len[i] + 1));
        }
        if (i == n - 1) off[i] = FILE_BYTES - len[i];  /* the unaligned tail */
        dst_off[i] = pos;
        pos += len[i] + (int64_t)(rng() % 3) * 7;  /* packed, or a few guard bytes */
    }
    uint8_t *dst = NULL;
    if (posix_memalign((void **)&dst, 4096, (size_t)(pos > 0 ? pos : 1)) != 0) return fail("alloc", pos);
    memset(dst, 0xAB, (size_t)pos);
    int64_t gap = (int64_t)(rng() % 4) * 8192 - 4096, run = 4096 * (int64_t)(1 + rng() % 64);
    int32_t st = fl_reader_read(r, off, len, dst, dst_off, n, gap, run);
    int bad = st != FL_OK ? fail("read status", st) : 0;
    for (int64_t i = 0; i < n && !bad; i++)
        if (memcmp(dst + dst_off[i], data + off[i], (size_t)len[i]) != 0) {
            fprintf(stderr, "request %lld: offset %lld length %lld, gap %lld run %lld\n",
                    (long long)i, (long long)off[i], (long long)len[i], (long long)gap,
                    (long long)run);
            bad = fail("bytes differ", i);
        }
    for (int64_t i = 0; i + 1 < n && !bad; i++)  /* the guard bytes between slots are untouched */
        for (int64_t g = dst_off[i] + len[i]; g < dst_off[i + 1]; g++)
            if (dst[g] != 0xAB) bad = fail("write outside a request's slot", i);
    free(dst);
    return bad;
}

static int error_paths(fl_reader *r) {
    uint8_t buf[8192];
    int64_t off = FILE_BYTES - 100, len = 101, zero = 0;
    if (fl_reader_read(r, &off, &len, buf, &zero, 1, 0, 0) != FL_ERANGE) return fail("past EOF", 0);
    off = -1; len = 1;
    if (fl_reader_read(r, &off, &len, buf, &zero, 1, 0, 0) != FL_ERANGE) return fail("negative", 0);
    if (fl_reader_read(NULL, &off, &len, buf, &zero, 1, 0, 0) != FL_EINVAL) return fail("null", 0);
    fl_reader *none = NULL;
    if (fl_reader_open("/nonexistent/flashllm", 2, 1, 65536, &none) != FL_EIO) return fail("open", 0);
    if (fl_reader_open("/", 0, 1, 65536, &none) != FL_EINVAL) return fail("threads", 0);
    return 0;
}

#define RA_ENTRIES 5
#define RA_BUF (64 * 1024)

/* A ring of 3 buffers over a 5-entry schedule alternating two readers; entry e reads two
 * pieces of the file. Every take must hold the file's bytes. */
static int readahead(fl_reader *a, fl_reader *b, const uint8_t *data) {
    fl_reader *readers[2] = {a, b};
    int32_t reader_of[RA_ENTRIES];
    int64_t first[RA_ENTRIES + 1], off[2 * RA_ENTRIES], len[2 * RA_ENTRIES], dst[2 * RA_ENTRIES];
    int64_t gap[RA_ENTRIES] = {0}, run[RA_ENTRIES] = {0};
    for (int e = 0; e < RA_ENTRIES; e++) {
        reader_of[e] = e % 2;
        first[e] = 2 * e;
        for (int j = 0; j < 2; j++) {
            off[2 * e + j] = (int64_t)(rng() % (FILE_BYTES - RA_BUF / 2));
            len[2 * e + j] = 1 + (int64_t)(rng() % (RA_BUF / 2 - 1));
            dst[2 * e + j] = j * (RA_BUF / 2);
        }
    }
    first[RA_ENTRIES] = 2 * RA_ENTRIES;
    uint8_t *buffers = aligned_alloc(4096, 3 * RA_BUF);
    const fl_readahead_schedule sched = {RA_ENTRIES, reader_of, first, off, len, dst, gap, run};
    fl_readahead *ra = NULL;
    if (!buffers || fl_readahead_open(readers, 2, &sched, buffers, RA_BUF, 3, &ra) != FL_OK)
        return fail("readahead open", 0);
    int bad = 0;
    int64_t order[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 17, 18};   /* laps and jumps */
    for (int i = 0; i < 16 && !bad; i++) {
        int32_t k = -1;
        fl_reader_stats_t d;
        double idle = -1;
        if (fl_readahead_take(ra, order[i], &k, &d, &idle) != FL_OK || k < 0 || k >= 3 || idle < 0)
            { bad = fail("readahead take", order[i]); break; }
        int64_t e = order[i] % RA_ENTRIES;
        for (int j = 0; j < 2 && !bad; j++)
            if (memcmp(buffers + k * RA_BUF + dst[2 * e + j], data + off[2 * e + j],
                       (size_t)len[2 * e + j]) != 0)
                bad = fail("readahead bytes", order[i]);
        if (d.bytes_requested != len[2 * e] + len[2 * e + 1]) bad = fail("readahead counters", e);
        fl_readahead_release(ra);
    }
    fl_readahead_close(ra);                            /* a running ring: stops, then frees */
    off[3] = FILE_BYTES;                               /* entry 1 now reads past the end */
    if (!bad && fl_readahead_open(readers, 2, &sched, buffers, RA_BUF, 3, &ra) == FL_OK) {
        int32_t k;
        fl_reader_stats_t d;
        double idle;
        if (fl_readahead_take(ra, 0, &k, &d, &idle) != FL_OK) bad = fail("readahead entry 0", 0);
        fl_readahead_release(ra);
        if (!bad && fl_readahead_take(ra, 1, &k, &d, &idle) != FL_ERANGE) bad = fail("readahead error", 1);
        fl_readahead_close(ra);
    }
    dst[0] = RA_BUF - 1;                               /* a request that leaves its buffer */
    if (!bad && fl_readahead_open(readers, 2, &sched, buffers, RA_BUF, 3, &ra) != FL_EINVAL)
        bad = fail("readahead check", 0);
    free(buffers);
    return bad;
}

int main(int argc, char **argv) {
    if (argc != 2) return fail("usage: io_driver DIR", argc);
    char path[4096];
    snprintf(path, sizeof path, "%s/io_driver.%d.bin", argv[1], (int)getpid());
    uint8_t *data = malloc(FILE_BYTES);
    if (!data || write_file(path, data)) return fail("write scratch file", 0);
    int bad = 0;
    int32_t threads[] = {1, 3, 16, 1, 3, 16}, flags[] = {FL_READ_DIRECT, FL_READ_DIRECT | FL_READ_RING};
    for (int t = 0; t < 6 && !bad; t++) {
        fl_reader *r = NULL;
        if (fl_reader_open(path, threads[t], flags[t / 3], 256 * 1024, &r) != FL_OK) { bad = fail("open", t); break; }
        for (int trial = 0; trial < 60 && !bad; trial++) bad = one_batch(r, data, trial);
        if (!bad) bad = error_paths(r);
        fl_reader_stats_t s;
        int32_t fl = 0, nt = 0;
        int64_t size = 0;
        fl_reader_stats(r, &s);
        fl_reader_info(r, &fl, &size, &nt);
        printf("direct %d ring %d threads %d: %lld batches, %lld requests, %lld reads, %lld MiB read\n",
               fl & FL_READ_DIRECT, (fl & FL_READ_RING) != 0, nt, (long long)s.batches, (long long)s.requests, (long long)s.reads,
               (long long)(s.bytes_read >> 20));
        (void)size;
        fl_reader_close(r);
    }
    fl_reader *ra_a = NULL, *ra_b = NULL;
    if (!bad && (fl_reader_open(path, 4, FL_READ_DIRECT | FL_READ_RING, 256 * 1024, &ra_a) != FL_OK ||
                 fl_reader_open(path, 2, FL_READ_DIRECT, 256 * 1024, &ra_b) != FL_OK))
        bad = fail("open readahead readers", 0);
    for (int lap = 0; lap < 20 && !bad; lap++) bad = readahead(ra_a, ra_b, data);
    if (!bad) puts("readahead: 20 schedules over two readers");
    fl_reader_close(ra_a);
    fl_reader_close(ra_b);
    unlink(path);
    free(data);
    puts(bad ? "io_driver: FAILED" : "io_driver: all passed");
    return bad;
}
