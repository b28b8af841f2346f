/* Shared-memory collectives of the ranks of one host: see shm_allreduce.h for the protocol and contract. */
#define _GNU_SOURCE
#include "shm_allreduce.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the futex word is the low half of a rank's 64-bit seq: little-endian only"
#endif

#define XSHM_MAGIC 0x786c6c6d73686d31ull /* "xllmshm1" */
#define XSHM_LINE 64
#define XSHM_SPINS 2048        /* pause-spins (tens of microseconds) before a wait sleeps on the futex */
#define XSHM_CHECK_NS 20000000ll /* a sleeping wait checks the peer's process and the timeout this often */
#define XSHM_BLOCK 2048        /* elements per work item of a team's copy / sum (a multiple of 32) */

typedef struct {
    uint64_t magic, size, buf_bytes, data_off;
    uint8_t pad[XSHM_LINE - 32];
} XshmHeader;

typedef struct {
    uint64_t seq;     /* the last generation this rank posted */
    int64_t pid;
    uint32_t waiters; /* ranks asleep on this rank's seq futex (the poster wakes them) */
    uint8_t pad[XSHM_LINE - 20];
} XshmCtl;

struct XllmShm {
    uint8_t *base;
    size_t map_bytes;
    int64_t rank, size, buf_bytes;
    uint64_t gen;
    int64_t timeout_ns;
    int status;      /* XSHM_OK until a collective fails */
    int last;        /* the code of the team's last synchronisation (read by the team after a barrier) */
    uint64_t missing;
    int owner;       /* rank 0: unlinks on close */
    char name[256];
};

static inline XshmHeader *hdr(const XllmShm *c) { return (XshmHeader *)c->base; }
static inline XshmCtl *ctl(const XllmShm *c, int64_t r) { return (XshmCtl *)(c->base + XSHM_LINE * (1 + r)); }
static inline uint8_t *buf(const XllmShm *c, uint64_t gen, int64_t r) {
    return c->base + hdr(c)->data_off + (size_t)((gen & 1) * c->size + r) * (size_t)c->buf_bytes;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static inline float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* nearest even, NaN kept quiet (torch's cast); branch-free: vectorizes */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static XllmShm *alloc_ctx(const char *name, int64_t rank, int64_t size, double timeout_s) {
    if (size < 1 || size > XSHM_MAX_RANKS || rank < 0 || rank >= size || strlen(name) >= 255) {
        errno = EINVAL;
        return NULL;
    }
    XllmShm *c = (XllmShm *)calloc(1, sizeof(XllmShm));
    if (c == NULL) return NULL;
    c->rank = rank;
    c->size = size;
    c->timeout_ns = (int64_t)(timeout_s * 1e9);
    strcpy(c->name, name);
    return c;
}

XllmShm *xllm_shm_create(const char *name, int64_t size, int64_t buf_bytes, double timeout_s) {
    if (buf_bytes < XSHM_LINE) buf_bytes = XSHM_LINE;
    buf_bytes = (buf_bytes + XSHM_LINE - 1) / XSHM_LINE * XSHM_LINE;
    XllmShm *c = alloc_ctx(name, 0, size, timeout_s);
    if (c == NULL) return NULL;
    const uint64_t data_off = (uint64_t)XSHM_LINE * (1 + size + 1) / 4096 * 4096 + 4096;
    c->map_bytes = data_off + (size_t)2 * size * buf_bytes;
    c->buf_bytes = buf_bytes;
    const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) goto fail;
    /* reserve the pages now: a /dev/shm too small for the segment fails here (ENOSPC), not with a SIGBUS at a
     * later write */
    int rc = posix_fallocate(fd, 0, (off_t)c->map_bytes);
    if (rc == EINVAL || rc == EOPNOTSUPP) rc = ftruncate(fd, (off_t)c->map_bytes) != 0 ? errno : 0;
    if (rc != 0) {
        close(fd);
        shm_unlink(name);
        errno = rc;
        goto fail;
    }
    c->base = (uint8_t *)mmap(NULL, c->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (c->base == MAP_FAILED) {
        const int e = errno;
        shm_unlink(name);
        errno = e;
        goto fail;
    }
    c->owner = 1;
    XshmHeader *h = hdr(c);
    h->size = (uint64_t)size;
    h->buf_bytes = (uint64_t)buf_bytes;
    h->data_off = data_off;
    for (int64_t r = 0; r < size; r++) ctl(c, r)->seq = 0;
    ctl(c, 0)->pid = getpid();
    __atomic_store_n(&h->magic, XSHM_MAGIC, __ATOMIC_RELEASE); /* the header is complete */
    return c;
fail:
    free(c);
    return NULL;
}

XllmShm *xllm_shm_attach(const char *name, int64_t rank, int64_t size, double timeout_s) {
    XllmShm *c = alloc_ctx(name, rank, size, timeout_s);
    if (c == NULL) return NULL;
    const int64_t deadline = now_ns() + c->timeout_ns;
    int fd = -1;
    struct stat st;
    for (;;) { /* rank 0 may still be creating it: wait for the name, its size, then the magic */
        if (fd < 0) fd = shm_open(name, O_RDWR, 0600);
        if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size >= 4096) break;
        if (now_ns() > deadline) {
            if (fd >= 0) close(fd);
            errno = ETIMEDOUT;
            free(c);
            return NULL;
        }
        usleep(1000);
    }
    c->map_bytes = (size_t)st.st_size;
    c->base = (uint8_t *)mmap(NULL, c->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (c->base == MAP_FAILED) {
        free(c);
        return NULL;
    }
    XshmHeader *h = hdr(c);
    while (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != XSHM_MAGIC) {
        if (now_ns() > deadline) {
            munmap(c->base, c->map_bytes);
            free(c);
            errno = ETIMEDOUT;
            return NULL;
        }
        usleep(1000);
    }
    if (h->size != (uint64_t)size) {
        munmap(c->base, c->map_bytes);
        free(c);
        errno = EINVAL;
        return NULL;
    }
    c->buf_bytes = (int64_t)h->buf_bytes;
    ctl(c, rank)->pid = getpid();
    return c;
}

void xllm_shm_close(XllmShm *c) {
    if (c == NULL) return;
    if (c->base != NULL && c->base != MAP_FAILED) munmap(c->base, c->map_bytes);
    if (c->owner) shm_unlink(c->name);
    free(c);
}

int64_t xllm_shm_capacity(const XllmShm *c) { return c->buf_bytes; }

uint64_t xllm_shm_missing(const XllmShm *c) { return c->missing; }

/* post generation ++gen (the data already in this rank's buffer) and wait for every rank to post it */
static int futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
#ifdef SYS_futex
    return (int)syscall(SYS_futex, addr, op, val, ts, NULL, 0); /* shared (no PRIVATE flag): across processes */
#else
    (void)addr, (void)op, (void)val;
    if (ts != NULL) nanosleep(ts, NULL);
    return 0;
#endif
}

/* the low 32 bits of rank r's seq: the futex word (little-endian: the first half); the generations of the ranks
 * never differ by 2^32, so it changes whenever seq does */
static inline uint32_t *seq_word(const XllmShm *c, int64_t r) { return (uint32_t *)&ctl(c, r)->seq; }

/* the slow wait for rank r to post generation g: registered as a waiter, asleep on the futex of r's seq
 * (woken by its post), checking every XSHM_CHECK_NS whether r's process still exists and the timeout */
static int sleep_wait(XllmShm *c, int64_t r, uint64_t g, int64_t start) {
    XshmCtl *peer = ctl(c, r);
    int rc = XSHM_OK;
    __atomic_fetch_add(&peer->waiters, 1, __ATOMIC_SEQ_CST); /* ordered before the seq load (post's mirror) */
    for (;;) {
        const uint64_t seen = __atomic_load_n(&peer->seq, __ATOMIC_SEQ_CST);
        if (seen >= g) break;
        const int64_t t = now_ns() - start;
        const int64_t pid = __atomic_load_n(&peer->pid, __ATOMIC_RELAXED);
        if (pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
            rc = XSHM_PEER_DEAD;
            break;
        }
        if (t > c->timeout_ns) {
            rc = XSHM_TIMEOUT;
            break;
        }
        const int64_t left = c->timeout_ns - t, nap = left < XSHM_CHECK_NS ? left + 1 : XSHM_CHECK_NS;
        const struct timespec ts = {nap / 1000000000ll, nap % 1000000000ll};
        futex(seq_word(c, r), FUTEX_WAIT, (uint32_t)seen, &ts); /* returns at once if seq moved since the load */
    }
    __atomic_fetch_sub(&peer->waiters, 1, __ATOMIC_RELAXED);
    if (rc != XSHM_OK) {
        c->missing = 0;
        for (int64_t q = 0; q < c->size; q++)
            if (__atomic_load_n(&ctl(c, q)->seq, __ATOMIC_ACQUIRE) < g) c->missing |= 1ull << q;
        c->status = rc;
    }
    return rc;
}

/* post generation c->gen (the data already in this rank's buffer) and wait for every rank to post it: spin
 * (pause) a few microseconds per rank, then sleep on the rank's futex */
static int post_wait(XllmShm *c) {
    if (c->status != XSHM_OK) return XSHM_BROKEN;
    const uint64_t g = c->gen;
    XshmCtl *me = ctl(c, c->rank);
    __atomic_store_n(&me->seq, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&me->waiters, __ATOMIC_SEQ_CST) != 0) /* a rank sleeps on our seq: wake it */
        futex(seq_word(c, c->rank), FUTEX_WAKE, INT32_MAX, NULL);
    const int64_t start = now_ns();
    for (int64_t r = 0; r < c->size; r++) {
        int spins = 0;
        while (__atomic_load_n(&ctl(c, r)->seq, __ATOMIC_ACQUIRE) < g) {
            if (++spins < XSHM_SPINS) {
                cpu_relax();
                continue;
            }
            const int rc = sleep_wait(c, r, g, start);
            if (rc != XSHM_OK) return rc;
            break;
        }
    }
    return XSHM_OK;
}

/* data[i0, i1) = sum over ranks of their generation-g buffers (rank order, fp32) */
static void sum_range(const XllmShm *c, void *data, int64_t i0, int64_t i1, int dtype) {
    const uint64_t g = c->gen;
    const int64_t R = c->size;
    if (dtype == XSHM_F32) {
        float *out = (float *)data;
        const float *b0 = (const float *)buf(c, g, 0);
        for (int64_t i = i0; i < i1; i++) out[i] = b0[i];
        for (int64_t r = 1; r < R; r++) {
            const float *br = (const float *)buf(c, g, r);
            for (int64_t i = i0; i < i1; i++) out[i] += br[i];
        }
        return;
    }
    uint16_t *out = (uint16_t *)data;
    float acc[XSHM_BLOCK];
    for (int64_t j0 = i0; j0 < i1; j0 += XSHM_BLOCK) {
        const int64_t n = i1 - j0 < XSHM_BLOCK ? i1 - j0 : XSHM_BLOCK;
        const uint16_t *b0 = (const uint16_t *)buf(c, g, 0) + j0;
        for (int64_t i = 0; i < n; i++) acc[i] = bf2f(b0[i]);
        for (int64_t r = 1; r < R; r++) {
            const uint16_t *br = (const uint16_t *)buf(c, g, r) + j0;
            for (int64_t i = 0; i < n; i++) acc[i] += bf2f(br[i]);
        }
        for (int64_t i = 0; i < n; i++) out[j0 + i] = f2bf(acc[i]);
    }
}

static int elem_size(int dtype) { return dtype == XSHM_F32 ? 4 : dtype == XSHM_BF16 ? 2 : 0; }

int xllm_shm_all_reduce(XllmShm *c, void *data, int64_t n, int dtype) {
    const int es = elem_size(dtype);
    if (es == 0 || n < 0) return XSHM_BAD_ARG;
    const int64_t cap = c->buf_bytes / es;
    for (int64_t off = 0; off < n; off += cap) {
        const int64_t m = n - off < cap ? n - off : cap;
        c->gen++;
        memcpy(buf(c, c->gen, c->rank), (uint8_t *)data + off * es, (size_t)(m * es));
        const int rc = post_wait(c);
        if (rc != XSHM_OK) return rc;
        sum_range(c, (uint8_t *)data + off * es, 0, m, dtype);
    }
    return XSHM_OK;
}

int xllm_shm_all_reduce_team(XllmShm *c, void *data, int64_t n, int dtype) {
    const int es = elem_size(dtype);
    if (es == 0 || n < 0) return XSHM_BAD_ARG;
    const int64_t cap = c->buf_bytes / es;
    for (int64_t off = 0; off < n; off += cap) {
        const int64_t m = n - off < cap ? n - off : cap, blocks = (m + XSHM_BLOCK - 1) / XSHM_BLOCK;
        uint8_t *chunk = (uint8_t *)data + off * es;
        uint8_t *mine = buf(c, c->gen + 1, c->rank);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i0 = b * XSHM_BLOCK, k = m - i0 < XSHM_BLOCK ? m - i0 : XSHM_BLOCK;
            memcpy(mine + i0 * es, chunk + i0 * es, (size_t)(k * es));
        }
#pragma omp single
        {
            c->gen++;
            c->last = post_wait(c);
        } /* (its barrier publishes gen and the code to the team) */
        if (c->last != XSHM_OK) return c->last;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i0 = b * XSHM_BLOCK, i1 = i0 + XSHM_BLOCK < m ? i0 + XSHM_BLOCK : m;
            sum_range(c, chunk, i0, i1, dtype);
        }
    }
    return XSHM_OK;
}

int xllm_shm_all_gather(XllmShm *c, const void *src, int64_t nbytes, void *out) {
    if (nbytes < 0) return XSHM_BAD_ARG;
    const int64_t cap = c->buf_bytes;
    for (int64_t off = 0; off < nbytes; off += cap) {
        const int64_t m = nbytes - off < cap ? nbytes - off : cap;
        c->gen++;
        memcpy(buf(c, c->gen, c->rank), (const uint8_t *)src + off, (size_t)m);
        const int rc = post_wait(c);
        if (rc != XSHM_OK) return rc;
        for (int64_t r = 0; r < c->size; r++) memcpy((uint8_t *)out + r * nbytes + off, buf(c, c->gen, r), (size_t)m);
    }
    return XSHM_OK;
}

int xllm_shm_barrier(XllmShm *c) {
    c->gen++;
    return post_wait(c);
}
