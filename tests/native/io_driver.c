/* io_driver.c — exercises native/io.c + io_plan.c under AddressSanitizer (make test-asan).
 *
 * Writes a file of random bytes (unaligned size), then reads seeded random batches through
 * fl_reader_read with several thread counts, gaps and run sizes and compares every request
 * with the same bytes taken from the in-memory copy. Also checks the error paths.
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
    unlink(path);
    free(data);
    puts(bad ? "io_driver: FAILED" : "io_driver: all passed");
    return bad;
}
