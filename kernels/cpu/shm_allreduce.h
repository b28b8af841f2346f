/* Collectives of the ranks of one host through a shared-memory segment (/dev/shm): all-reduce (sum),
 * all-gather of equal-size byte buffers, barrier. Plain C (no AVX-512): built into both native libraries
 * (kernels/cpu and kernels/cpu/avx2, which includes shm_allreduce.c).
 *
 * Segment (created by rank 0, opened by the others by name): a header, one 64-byte control line per rank
 * (its arrival counter `seq` and its pid), then two sets (generation parity) of one buffer per rank.
 * A collective of generation g (every rank counts its collectives; all ranks call the same collectives in
 * the same order): a rank copies its data into its parity-(g & 1) buffer, stores seq = g (release), waits
 * until every rank's seq >= g (acquire), then reads every rank's buffer. The two sets make a second phase
 * unnecessary: a rank writes generation g + 1 only after all ranks arrived at g, hence finished reading
 * g - 1, the set it overwrites. One synchronisation per collective (per chunk: data larger than a buffer
 * goes in chunks of the buffer's size, one generation each).
 *
 * All-reduce: every rank sums every rank's buffer itself, in rank order, in fp32, and writes the sum back
 * in the data's dtype (bf16: rounded to nearest even once), so every rank holds bit-identical results.
 * Summing everything on every rank reads size x n elements but needs one synchronisation; the
 * reduce-scatter alternative (each rank sums a slice, then all read the slices) needs a second, which
 * costs more than it saves for the tensors of a decode/prefill step ([rows, hidden], <= a few MiB).
 *
 * Waits spin (pause) for tens of microseconds, then sleep on a futex of the awaited rank's counter (its post
 * wakes the sleepers it finds registered), so a rank far ahead (e.g. ranks > 0 while rank 0 samples) frees its
 * core. Every call returns within the context's timeout: XSHM_TIMEOUT when a rank did not arrive,
 * XSHM_PEER_DEAD when a rank's process is gone (checked every 20 ms while asleep). After a failure the
 * context is broken (generations no longer agree): every later call returns XSHM_BROKEN.
 */
#ifndef XLLM_SHM_ALLREDUCE_H
#define XLLM_SHM_ALLREDUCE_H

#include <stdint.h>

#define XSHM_OK 0
#define XSHM_TIMEOUT (-1)   /* a rank did not arrive within the timeout (xllm_shm_missing names it) */
#define XSHM_PEER_DEAD (-2) /* a rank's process exited */
#define XSHM_BROKEN (-3)    /* an earlier collective failed: the group is unusable */
#define XSHM_BAD_ARG (-4)   /* unknown dtype, negative size */

#define XSHM_F32 0
#define XSHM_BF16 1
#define XSHM_MAX_RANKS 64

typedef struct XllmShm XllmShm; /* one rank's handle: process-local, opaque */

/* rank 0: create segment `name` ("/xllm-..."; O_EXCL) for `size` ranks with `buf_bytes` per rank buffer;
 * NULL (errno set) on failure */
XllmShm *xllm_shm_create(const char *name, int64_t size, int64_t buf_bytes, double timeout_s);
/* rank > 0: open segment `name` (waiting up to timeout_s for rank 0 to finish creating it); NULL on failure */
XllmShm *xllm_shm_attach(const char *name, int64_t rank, int64_t size, double timeout_s);
/* unmap and free; rank 0 also unlinks the segment name */
void xllm_shm_close(XllmShm *ctx);
/* bytes per rank buffer (the largest chunk of one generation) */
int64_t xllm_shm_capacity(const XllmShm *ctx);
/* bit r set: rank r had not arrived when the last failed collective gave up */
uint64_t xllm_shm_missing(const XllmShm *ctx);

/* in place sum over the ranks of n elements of dtype XSHM_F32 / XSHM_BF16; one thread (no OpenMP team) */
int xllm_shm_all_reduce(XllmShm *ctx, void *data, int64_t n, int dtype);
/* out[r * nbytes .. (r + 1) * nbytes) = rank r's src */
int xllm_shm_all_gather(XllmShm *ctx, const void *src, int64_t nbytes, void *out);
int xllm_shm_barrier(XllmShm *ctx);

/* xllm_shm_all_reduce called by every thread of an OpenMP team (an orphaned worksharing construct: every
 * thread of the team must call it, with the same arguments): the team copies in and sums slices, one thread
 * synchronises with the other ranks. Returns the same code on every thread; ends with a barrier. */
int xllm_shm_all_reduce_team(XllmShm *ctx, void *data, int64_t n, int dtype);

#endif
