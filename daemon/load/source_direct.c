/*
 * source_direct.c - the direct source: O_DIRECT reads, no page cache (see
 * source.h).
 *
 * O_DIRECT wants the file offset, the length and the memory address aligned
 * to the filesystem's direct-I/O alignment (statx STATX_DIOALIGN; 4096 when
 * the kernel does not say, and never less). A read whose destination is
 * congruent to its file offset modulo that alignment goes straight into the
 * destination: whole blocks when the caller reserved the slack around it
 * (the staging pipeline lays out its slots so), else only the aligned middle,
 * with the unaligned head and tail through a bounce buffer. Any other read,
 * and every strided read, goes through bounce buffers: one aligned read of a
 * run of rows, then the rows copied out.
 *
 * Reads run on the fill threads, each a blocking pread of a fill task's part
 * (at least DIRECT_READ_MIN: read_min, a whole window), so a load has as
 * many reads in flight as it has staging slots (docs/benchmarks.md,
 * "Sources", says why a thread pool and not io_uring).
 *
 * DESIGN (threads): the descriptors never change after open and pread has no
 * shared offset, so readers share them without locks. Bounce buffers are a
 * free list under `lock`, taken by a read that needs one and returned at
 * its end; at most two per concurrent reader are ever made (a strided read
 * holds one and takes another for a row longer than a buffer).
 */
#include "source.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Each bounce buffer's size: the largest aligned read that does not go straight into its destination. */
#define DIRECT_BOUNCE (2u << 20)
/*
 * The length reads go fastest at (struct ld_source.read_min): fill tasks are
 * at least this long, a whole 16 MiB staging window each, so that a load has
 * as many 16 MiB reads in flight as it has slots. On the H100 host's disk a
 * sweep measured 16 MiB reads from 4 threads at 2.10 GB/s against 1.76 GB/s
 * for 4 MiB reads from 16 threads (docs/benchmarks.md, "Sources").
 */
#define DIRECT_READ_MIN (16u << 20)
/* The alignment used when the kernel does not report one, and the least used. */
#define DIRECT_ALIGN_MIN 4096u

struct direct_src {
  const struct ckpt *ck;
  int *fds; /* per shard, O_DIRECT; -1 for an empty file */
  uint64_t align;
  pthread_mutex_t lock; /* guards the free list */
  void **free_bounce;
  size_t nfree, cap;
};

static inline uint64_t down(uint64_t v, uint64_t a) { return v / a * a; }
static inline uint64_t up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static void *bounce_take(struct direct_src *d) {
  void *p = NULL;
  pthread_mutex_lock(&d->lock);
  if (d->nfree > 0) p = d->free_bounce[--d->nfree];
  pthread_mutex_unlock(&d->lock);
  if (p == NULL && posix_memalign(&p, (size_t)d->align, DIRECT_BOUNCE) != 0) p = NULL;
  return p;
}

static void bounce_give(struct direct_src *d, void *p) {
  if (p == NULL) return;
  pthread_mutex_lock(&d->lock);
  if (d->nfree == d->cap) {
    size_t cap = d->cap ? 2 * d->cap : 16;
    void **v = realloc(d->free_bounce, cap * sizeof *v);
    if (v == NULL) {
      pthread_mutex_unlock(&d->lock);
      free(p);
      return;
    }
    d->free_bounce = v;
    d->cap = cap;
  }
  d->free_bounce[d->nfree++] = p;
  pthread_mutex_unlock(&d->lock);
}

/*
 * Reads n bytes at `at` into buf (every argument a multiple of align); the
 * bytes read (fewer at the end of the file), or -errno.
 */
static int64_t pread_all(int fd, unsigned char *buf, uint64_t n, uint64_t at, uint64_t align) {
  uint64_t got = 0;
  while (got < n) {
    ssize_t r = pread(fd, buf + got, (size_t)(n - got), (off_t)(at + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r == 0) break;
    got += (uint64_t)r;
    if (got % align != 0) break; /* a short read ends at the end of the file */
  }
  return (int64_t)got;
}

/*
 * Reads the aligned blocks [a, b) of shard i into buf and checks that they
 * reach `need` (the end of the bytes wanted; the rest of the last block may
 * lie past the end of the file).
 */
static int read_blocks(const struct direct_src *d, uint32_t i, unsigned char *buf, uint64_t a, uint64_t b,
                       uint64_t need, struct wd_error *err) {
  int64_t got = pread_all(d->fds[i], buf, b - a, a, d->align);
  const char *rel = d->ck->shards[i].rel;
  if (got < 0)
    return err_set(err, WEIGHTD_E_IO, "%s: O_DIRECT read of %llu bytes at %llu: %s", rel, (unsigned long long)(b - a),
                   (unsigned long long)a, strerror((int)-got));
  if ((uint64_t)got < need - a)
    return err_set(err, WEIGHTD_E_FAULT, "%s: the shard was truncated or became unreadable while it was read", rel);
  return 0;
}

/* Contiguous bytes [off, off + len) through bounce buffers, in pieces: any destination. */
static int read_bounced(struct direct_src *d, const struct ld_read *rq, uint64_t off, uint64_t len, unsigned char *dst,
                        struct wd_error *err) {
  unsigned char *b = bounce_take(d);
  if (b == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory for a direct read's bounce buffer");
  int rc = 0;
  for (uint64_t done = 0; done < len && rc == 0;) {
    uint64_t at = off + done, a = down(at, d->align);
    uint64_t n = len - done < DIRECT_BOUNCE - (at - a) ? len - done : DIRECT_BOUNCE - (at - a);
    rc = read_blocks(d, rq->shard, b, a, up(at + n, d->align), at + n, err);
    if (rc == 0) rq->copy(dst + done, b + (at - a), (size_t)n);
    done += n;
  }
  bounce_give(d, b);
  return rc;
}

/* Strided rows: each run of rows that fits a bounce buffer read as one aligned span, then the rows copied out. */
static int read_rows(struct direct_src *d, const struct ld_read *rq, struct wd_error *err) {
  unsigned char *b = bounce_take(d);
  if (b == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory for a direct read's bounce buffer");
  int rc = 0;
  for (uint64_t r = 0; r < rq->height && rc == 0;) {
    uint64_t at = rq->off + r * rq->pitch, a = down(at, d->align), lead = at - a;
    if (lead + rq->width > DIRECT_BOUNCE) { /* a row longer than a bounce buffer: on its own */
      rc = read_bounced(d, rq, at, rq->width, rq->dst + r * rq->width, err);
      r++;
      continue;
    }
    uint64_t k = (DIRECT_BOUNCE - lead - rq->width) / rq->pitch + 1;
    if (k > rq->height - r) k = rq->height - r;
    uint64_t end = at + (k - 1) * rq->pitch + rq->width;
    rc = read_blocks(d, rq->shard, b, a, up(end, d->align), end, err);
    for (uint64_t j = 0; rc == 0 && j < k; j++)
      rq->copy(rq->dst + (r + j) * rq->width, b + lead + j * rq->pitch, (size_t)rq->width);
    r += k;
  }
  bounce_give(d, b);
  return rc;
}

static int direct_read(void *ctx, const struct ld_read *rq_in, struct wd_error *err) {
  struct direct_src *d = ctx;
  struct ld_read rq = *rq_in;
  if (rq.copy == NULL) rq.copy = memcpy;
  if (rq.height == 0 || rq.width == 0) return 0;
  const struct ckpt *ck = d->ck;
  int rc = ld_read_check(ck, &rq, err);
  if (rc != 0) return rc;
  if (d->fds[rq.shard] < 0) /* only empty files have none, and nothing lies in them */
    return err_set(err, WEIGHTD_E_INTERNAL, "%s: a read of an empty file", ck->shards[rq.shard].rel);
  uint64_t A = d->align, len = rq.width * rq.height;
  bool congruent = ((uintptr_t)rq.dst - rq.off) % A == 0;
  if (rq.height > 1 && rq.pitch != rq.width) {
    rc = read_rows(d, &rq, err);
  } else if (congruent && rq.slack) {
    /* Whole blocks straight into the destination: its slack takes the bytes around the range. */
    uint64_t a = down(rq.off, A);
    rc = read_blocks(d, rq.shard, rq.dst - (rq.off - a), a, up(rq.off + len, A), rq.off + len, err);
  } else if (congruent) {
    /* The aligned middle straight in; the head and tail through a bounce buffer. */
    uint64_t mid_lo = up(rq.off, A), mid_hi = down(rq.off + len, A);
    if (mid_lo >= mid_hi) {
      rc = read_bounced(d, &rq, rq.off, len, rq.dst, err);
    } else {
      rc = mid_lo > rq.off ? read_bounced(d, &rq, rq.off, mid_lo - rq.off, rq.dst, err) : 0;
      if (rc == 0) rc = read_blocks(d, rq.shard, rq.dst + (mid_lo - rq.off), mid_lo, mid_hi, mid_hi, err);
      if (rc == 0 && mid_hi < rq.off + len)
        rc = read_bounced(d, &rq, mid_hi, rq.off + len - mid_hi, rq.dst + (mid_hi - rq.off), err);
    }
  } else {
    rc = read_bounced(d, &rq, rq.off, len, rq.dst, err);
  }
  if (rc == 0 && rq.counts != NULL) rq.counts[LD_SOURCE_DIRECT] += len;
  return rc;
}

static int direct_unchanged(void *ctx, struct wd_error *err) {
  const struct direct_src *d = ctx;
  return ckpt_check_unchanged(d->ck, err);
}

static void direct_destroy(void *ctx) {
  struct direct_src *d = ctx;
  if (d == NULL) return;
  for (size_t i = 0; d->fds != NULL && i < d->ck->nshards; i++)
    if (d->fds[i] >= 0) close(d->fds[i]);
  for (size_t i = 0; i < d->nfree; i++) free(d->free_bounce[i]);
  free(d->free_bounce);
  free(d->fds);
  pthread_mutex_destroy(&d->lock);
  free(d);
}

static const struct ld_source_ops direct_ops = {
    .kind = LD_SOURCE_DIRECT,
    .read = direct_read,
    .readv = NULL, /* fill tasks are read_min long already: one by one */
    .holds = NULL,    /* every byte: the files are local */
    .map = NULL,      /* reads only */
    .prefetch = NULL, /* nothing is kept warm: that is the point */
    .advise = NULL,
    .unchanged = direct_unchanged,
    .destroy = direct_destroy,
};

/*
 * The filesystem's direct-I/O alignment for fd (statx STATX_DIOALIGN), a
 * power of two of at least DIRECT_ALIGN_MIN; 0 when the filesystem says it
 * does not do direct I/O on this file (ext4 with data=journal, encrypted or
 * inline-data files: the open succeeds, the reads would go through the page
 * cache). A filesystem that does not report the alignment gets the minimum.
 */
static uint64_t dio_align(int fd) {
  uint64_t a = DIRECT_ALIGN_MIN;
#ifdef STATX_DIOALIGN
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    if (sx.stx_dio_offset_align == 0 || sx.stx_dio_mem_align == 0) return 0;
    if (sx.stx_dio_offset_align > a) a = sx.stx_dio_offset_align;
    if (sx.stx_dio_mem_align > a) a = sx.stx_dio_mem_align;
  }
#endif
  uint64_t p = DIRECT_ALIGN_MIN;
  while (p < a) p *= 2;
  return p;
}

int ld_source_direct_open(const struct ckpt *ck, bool refuse_test, struct ld_source **out, struct wd_error *err) {
  *out = NULL;
  struct ld_source *s = calloc(1, sizeof *s);
  struct direct_src *d = calloc(1, sizeof *d);
  if (s == NULL || d == NULL || (d->fds = malloc((ck->nshards ? ck->nshards : 1) * sizeof *d->fds)) == NULL) {
    free(s);
    if (d != NULL) free(d->fds);
    free(d);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  pthread_mutex_init(&d->lock, NULL);
  d->ck = ck;
  d->align = DIRECT_ALIGN_MIN;
  for (size_t i = 0; i < ck->nshards; i++) d->fds[i] = -1;
  int rc = 0;
  for (size_t i = 0; i < ck->nshards && rc == 0; i++) {
    const struct ckpt_shard *sh = &ck->shards[i];
    if (sh->size == 0) continue;
    int fd = refuse_test ? -1 : open(sh->real, O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    int e = refuse_test ? EINVAL : errno;
    struct stat st;
    if (fd < 0 && e == EINVAL) {
      rc = err_set(err, WEIGHTD_E_UNSUPPORTED, "%s: the filesystem refuses O_DIRECT%s", sh->rel,
                   refuse_test ? " (test_refuse_odirect)" : "");
    } else if (fd < 0) {
      rc = err_set(err, e == ENOENT ? WEIGHTD_E_STALE : WEIGHTD_E_IO, "%s: opening for O_DIRECT: %s", sh->rel,
                   strerror(e));
    } else if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_dev != sh->dev || st.st_ino != sh->ino ||
               (uint64_t)st.st_size != sh->size) {
      close(fd);
      rc = err_set(err, WEIGHTD_E_STALE, "%s: replaced since the checkpoint was opened", sh->rel);
    } else {
      d->fds[i] = fd;
      uint64_t a = dio_align(fd);
      if (a == 0)
        rc = err_set(err, WEIGHTD_E_UNSUPPORTED, "%s: the filesystem does no direct I/O on this file (statx)", sh->rel);
      else if (a > d->align)
        d->align = a;
    }
  }
  if (rc != 0) {
    direct_destroy(d);
    free(s);
    return rc;
  }
  *s = (struct ld_source){.ops = &direct_ops, .ctx = d, .ck = ck, .align = d->align, .read_min = DIRECT_READ_MIN};
  snprintf(s->label, sizeof s->label, "%s", ld_source_kind_name(LD_SOURCE_DIRECT));
  *out = s;
  return 0;
}
