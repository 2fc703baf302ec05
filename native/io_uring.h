/* io_uring.h — the reader's io_uring engine (io_uring.c): depth reads in flight from one thread,
 * over a batch planned by io_plan.h. Offered to io.c. Internal: no fl_ names here. */
#ifndef FLASHLLM_IO_URING_H
#define FLASHLLM_IO_URING_H

#include <stdint.h>

#include "io_plan.h"

typedef struct uring_engine uring_engine;

/* FL_EUNSUPPORTED when the kernel refuses io_uring (old kernel, seccomp, sysctl). */
int32_t uring_open(int file_fd, int32_t depth, uring_engine **out);
void uring_close(uring_engine *ring);

/* Read every run of job, staging through arena (arena_bytes, page aligned, at least depth times
 * the largest run). */
int32_t uring_read(uring_engine *ring, io_job *job, uint8_t *arena, int64_t arena_bytes,
                   int64_t file_size);

#endif /* FLASHLLM_IO_URING_H */
