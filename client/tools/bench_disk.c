/*
 * bench_disk.c - the disk's O_DIRECT ceiling for weightd-bench's cold phase:
 * the plan's file ranges read with O_DIRECT, as a sweep over ways of reading
 * them, so that the ceiling a cold load is judged against is the disk's best
 * and not one fixed way's.
 *
 * Ways: blocking preads of R bytes on T threads (T in 1, 4, 8, 16, 32; R in
 * 1, 4, 16 MiB), and, where liburing is built in, io_uring on one thread with
 * Q reads of R bytes in flight (Q in 8, 32, 128). Each way reads a different
 * slice of the ranges (a disk or a hypervisor that caches what was read just
 * now would flatter a way that rereads it); the two fastest ways then read
 * all of them once more, and the faster rate is the ceiling.
 *
 * DESIGN: a sweep point starts its threads and joins them before it returns;
 * they share one atomic task counter and read-only inputs, each its own
 * buffer and descriptors.
 */
#include "bench_disk.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef WEIGHTD_HAVE_LIBURING
#include <liburing.h>
#endif

#include "clock.h"

/* A list of reads: (shard, offset, length) of at most `size` bytes each, over [skip, skip + take) of the ranges. */
struct tasks {
  uint32_t *shard;
  uint64_t *off, *len;
  size_t n;
};

static void tasks_free(struct tasks *t) {
  free(t->shard);
  free(t->off);
  free(t->len);
}

static int tasks_make(const struct plan_range *r, size_t nr, uint64_t size, uint64_t skip, uint64_t take,
                      struct tasks *t) {
  memset(t, 0, sizeof *t);
  size_t cap = 0;
  uint64_t pos = 0;
  for (size_t k = 0; k < nr; k++)
    for (uint64_t off = r[k].off; off < r[k].off + r[k].len; off += size) {
      uint64_t n = r[k].off + r[k].len - off < size ? r[k].off + r[k].len - off : size;
      if (pos + n > skip && pos < skip + take) {
        if (t->n == cap) {
          cap = cap ? 2 * cap : 1024;
          uint32_t *s = realloc(t->shard, cap * sizeof *s);
          uint64_t *o = realloc(t->off, cap * sizeof *o), *l = realloc(t->len, cap * sizeof *l);
          if (s) t->shard = s;
          if (o) t->off = o;
          if (l) t->len = l;
          if (!s || !o || !l) return -1;
        }
        t->shard[t->n] = r[k].shard;
        t->off[t->n] = off;
        t->len[t->n++] = n;
      }
      pos += n;
    }
  return 0;
}

/* Opens every shard O_DIRECT (-1 for those that fail). */
static int *open_all(const struct ckpt *c) {
  int *fds = malloc((c->nshards ? c->nshards : 1) * sizeof *fds);
  for (size_t i = 0; fds != NULL && i < c->nshards; i++) fds[i] = open(c->shards[i].real, O_RDONLY | O_DIRECT);
  return fds;
}

static void close_all(const struct ckpt *c, int *fds) {
  for (size_t i = 0; fds != NULL && i < c->nshards; i++)
    if (fds[i] >= 0) close(fds[i]);
  free(fds);
}

/* ---- preads on threads ------------------------------------------------------------------- */

struct pread_run {
  const struct tasks *t;
  const int *fds;
  uint64_t size;
  atomic_size_t next;
  atomic_uint_fast64_t bytes;
  atomic_int failed;
};

static void *pread_thread(void *arg) {
  struct pread_run *p = arg;
  void *buf = NULL;
  if (posix_memalign(&buf, 4096, (size_t)p->size) != 0) {
    atomic_store(&p->failed, 1);
    return NULL;
  }
  for (;;) {
    size_t i = atomic_fetch_add(&p->next, 1);
    if (i >= p->t->n) break;
    int fd = p->fds[p->t->shard[i]];
    uint64_t n = p->t->len[i], want = (n + 4095) & ~4095ull; /* whole blocks: a short read at EOF is fine */
    ssize_t got = fd >= 0 ? pread(fd, buf, (size_t)want, (off_t)p->t->off[i]) : -1;
    if (got < 0) {
      atomic_store(&p->failed, 1);
      break;
    }
    atomic_fetch_add(&p->bytes, (uint64_t)got < n ? (uint64_t)got : n);
  }
  free(buf);
  return NULL;
}

static double run_preads(const struct ckpt *c, const struct tasks *t, unsigned threads, uint64_t size,
                         uint64_t *bytes) {
  struct pread_run p = {.t = t, .size = size};
  atomic_init(&p.next, 0);
  atomic_init(&p.bytes, 0);
  atomic_init(&p.failed, 0);
  int *fds = open_all(c);
  p.fds = fds;
  pthread_t th[64];
  if (threads > 64) threads = 64;
  double t0 = clock_s();
  for (unsigned i = 0; fds != NULL && i < threads; i++) pthread_create(&th[i], NULL, pread_thread, &p);
  for (unsigned i = 0; fds != NULL && i < threads; i++) pthread_join(th[i], NULL);
  double dt = clock_s() - t0;
  close_all(c, fds);
  *bytes = fds == NULL || atomic_load(&p.failed) ? 0 : atomic_load(&p.bytes);
  return dt;
}

/* ---- io_uring -------------------------------------------------------------------------------- */

#ifdef WEIGHTD_HAVE_LIBURING
/* One thread, depth reads of size in flight. Seconds; bytes in *bytes (0 when io_uring is refused or a read fails). */
static double run_uring(const struct ckpt *c, const struct tasks *t, unsigned depth, uint64_t size, uint64_t *bytes) {
  *bytes = 0;
  struct io_uring ring;
  if (io_uring_queue_init(depth, &ring, 0) != 0) return 0;
  unsigned char *bufs = NULL;
  int *fds = open_all(c);
  if (fds == NULL || posix_memalign((void **)&bufs, 4096, (size_t)(depth * size)) != 0) {
    close_all(c, fds);
    io_uring_queue_exit(&ring);
    return 0;
  }
  size_t next = 0, inflight = 0;
  uint64_t got = 0;
  bool failed = false;
  unsigned *free_slot = malloc(depth * sizeof *free_slot), nfree = depth;
  if (free_slot == NULL) {
    free(bufs);
    close_all(c, fds);
    io_uring_queue_exit(&ring);
    return 0;
  }
  for (unsigned i = 0; i < depth; i++) free_slot[i] = i;
  double t0 = clock_s();
  while ((next < t->n || inflight > 0) && !failed) {
    while (next < t->n && nfree > 0) {
      struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
      if (sqe == NULL) break;
      unsigned s = free_slot[--nfree];
      uint64_t want = (t->len[next] + 4095) & ~4095ull;
      io_uring_prep_read(sqe, fds[t->shard[next]], bufs + (uint64_t)s * size, (unsigned)want, t->off[next]);
      io_uring_sqe_set_data64(sqe, ((uint64_t)s << 32) | (uint64_t)next);
      next++;
      inflight++;
    }
    io_uring_submit(&ring);
    struct io_uring_cqe *cqe;
    if (io_uring_wait_cqe(&ring, &cqe) != 0) {
      failed = true;
      break;
    }
    uint64_t data = io_uring_cqe_get_data64(cqe);
    size_t i = (size_t)(data & 0xffffffffu);
    if (cqe->res < 0) failed = true;
    else got += (uint64_t)cqe->res < t->len[i] ? (uint64_t)cqe->res : t->len[i];
    free_slot[nfree++] = (unsigned)(data >> 32);
    inflight--;
    io_uring_cqe_seen(&ring, cqe);
  }
  double dt = clock_s() - t0;
  /* Reads still in flight after a failure write into bufs: reap them first (the ring's teardown is asynchronous). */
  while (inflight > 0) {
    struct io_uring_cqe *cqe;
    if (io_uring_wait_cqe(&ring, &cqe) != 0) break;
    io_uring_cqe_seen(&ring, cqe);
    inflight--;
  }
  io_uring_queue_exit(&ring);
  if (inflight > 0) bufs = NULL; /* could not reap them: the buffers are left to the process's end */
  free(free_slot);
  free(bufs);
  close_all(c, fds);
  *bytes = failed ? 0 : got;
  return dt;
}
#endif

/* ---- the sweep ------------------------------------------------------------------------------------ */

int bench_disk_sweep(const struct ckpt *c, const struct plan_range *r, size_t nr, void (*drop)(void *arg),
                     void *arg, struct bench_disk *out) {
  static const unsigned threads[] = {1, 4, 8, 16, 32};
  static const uint64_t sizes[] = {1u << 20, 4u << 20, 16u << 20};
#ifdef WEIGHTD_HAVE_LIBURING
  static const unsigned depths[] = {8, 32, 128};
  const size_t nuring = sizeof depths / sizeof depths[0] * (sizeof sizes / sizeof sizes[0]);
#else
  const size_t nuring = 0;
#endif
  const size_t npread = sizeof threads / sizeof threads[0] * (sizeof sizes / sizeof sizes[0]);
  memset(out, 0, sizeof *out);
  uint64_t total = 0;
  for (size_t k = 0; k < nr; k++) total += r[k].len;
  size_t npoints = npread + nuring;
  uint64_t slice = total / (npoints ? npoints : 1);
  if (slice < (64u << 20)) slice = total < (64u << 20) ? total : (64u << 20); /* small checkpoints: reread */
  size_t p = 0;
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++, p++) {
      struct tasks t;
      if (tasks_make(r, nr, sizes[s], (slice * p) % (total - slice + 1), slice, &t) != 0) return -1;
      if (drop) drop(arg);
      uint64_t b = 0;
      double sec = run_preads(c, &t, threads[ti], sizes[s], &b);
      tasks_free(&t);
      struct bench_disk_point *q = &out->points[out->npoints++];
      *q = (struct bench_disk_point){.uring = false, .threads = threads[ti], .size = sizes[s],
                                     .gbps = b && sec > 0 ? (double)b / 1e9 / sec : 0};
    }
#ifdef WEIGHTD_HAVE_LIBURING
    for (size_t di = 0; di < sizeof depths / sizeof depths[0]; di++, p++) {
      struct tasks t;
      if (tasks_make(r, nr, sizes[s], (slice * p) % (total - slice + 1), slice, &t) != 0) return -1;
      if (drop) drop(arg);
      uint64_t b = 0;
      double sec = run_uring(c, &t, depths[di], sizes[s], &b);
      tasks_free(&t);
      struct bench_disk_point *q = &out->points[out->npoints++];
      *q = (struct bench_disk_point){.uring = true, .threads = depths[di], .size = sizes[s],
                                     .gbps = b && sec > 0 ? (double)b / 1e9 / sec : 0};
    }
#endif
  }
  /* The two fastest ways on their slices read every range once more; the faster of them is the ceiling. */
  size_t first = 0, second = out->npoints > 1 ? 1 : 0;
  for (size_t i = 0; i < out->npoints; i++) {
    if (out->points[i].gbps > out->points[first].gbps) {
      second = first;
      first = i;
    } else if (i != first && (second == first || out->points[i].gbps > out->points[second].gbps)) {
      second = i;
    }
  }
  size_t cand[2] = {first, second};
  for (size_t k = 0; k < (first == second ? 1u : 2u); k++) {
    const struct bench_disk_point *q = &out->points[cand[k]];
    struct tasks t;
    if (tasks_make(r, nr, q->size, 0, total, &t) != 0) return -1;
    if (drop) drop(arg);
    uint64_t b = 0;
    double sec;
#ifdef WEIGHTD_HAVE_LIBURING
    if (q->uring) sec = run_uring(c, &t, q->threads, q->size, &b);
    else
#endif
      sec = run_preads(c, &t, q->threads, q->size, &b);
    tasks_free(&t);
    double gbps = b && sec > 0 ? (double)b / 1e9 / sec : 0;
    if (gbps > out->ceiling_gbps) {
      out->ceiling_gbps = gbps;
      out->ceiling_bytes = b;
      out->best = *q;
    }
  }
  out->have_uring = nuring > 0;
  return 0;
}
