/* progress_page.c - the shared page that says how far a load has come (see progress_page.h). */
#include "progress_page.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1 */
#endif

_Static_assert(ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_LLONG_LOCK_FREE == 2,
               "the page's atomics must be lock-free to work across processes");
_Static_assert(sizeof(struct wd_progress_page) <= WD_PAGE_BYTES, "the page's fields fit in it");
_Static_assert(offsetof(struct wd_progress_page, seq) == 8 && offsetof(struct wd_progress_page, state) == 12 &&
                   offsetof(struct wd_progress_page, ready_bytes) == 16 &&
                   offsetof(struct wd_progress_page, total_bytes) == 24 &&
                   offsetof(struct wd_progress_page, error) == 32 && offsetof(struct wd_progress_page, flags) == 36 &&
                   offsetof(struct wd_progress_page, message) == 64,
               "the layout docs/protocol.md gives");

static void wake_all(struct wd_progress_page *p) {
  atomic_fetch_add_explicit(&p->seq, 1, memory_order_release);
  /* A shared (not FUTEX_PRIVATE) wake: waiters are other processes mapping the same page. */
  syscall(SYS_futex, &p->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* ---- the daemon's side ------------------------------------------------------------ */

int ppage_create(uint64_t total_bytes, struct wd_progress_page **out, int *fd_out, struct wd_error *err) {
  *out = NULL;
  *fd_out = -1;
  int fd = memfd_create("weightd-progress", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return err_set(err, WEIGHTD_E_NOMEM, "memfd_create for a progress page: %s", strerror(errno));
  void *m = MAP_FAILED;
  int rc;
  if (ftruncate(fd, WD_PAGE_BYTES) != 0) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "sizing a progress page: %s", strerror(errno));
    goto fail;
  }
  m = mmap(NULL, WD_PAGE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "mapping a progress page: %s", strerror(errno));
    goto fail;
  }
  struct wd_progress_page *p = m;
  p->magic = WD_PAGE_MAGIC;
  p->version = WD_PAGE_VERSION;
  p->total_bytes = total_bytes;
  atomic_init(&p->seq, 0);
  atomic_init(&p->state, WD_PAGE_LOADING);
  atomic_init(&p->ready_bytes, 0);
  atomic_init(&p->error, 0);
  atomic_init(&p->flags, 0);
  /* From here on only this mapping writes: the seals bind every other one, and cannot be undone. */
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    rc = err_set(err, errno == EINVAL ? WEIGHTD_E_UNSUPPORTED : WEIGHTD_E_INTERNAL,
                 "sealing a progress page against writes (needs Linux 5.1): %s", strerror(errno));
    goto fail;
  }
  *out = p;
  *fd_out = fd;
  return 0;
fail:
  if (m != MAP_FAILED) munmap(m, WD_PAGE_BYTES);
  close(fd);
  return rc;
}

void ppage_destroy(struct wd_progress_page *p, int fd) {
  if (p != NULL) munmap(p, WD_PAGE_BYTES);
  if (fd >= 0) close(fd);
}

void ppage_advance(struct wd_progress_page *p, uint64_t ready) {
  uint64_t cur = atomic_load_explicit(&p->ready_bytes, memory_order_relaxed);
  while (cur < ready)
    if (atomic_compare_exchange_weak_explicit(&p->ready_bytes, &cur, ready, memory_order_release,
                                              memory_order_relaxed)) {
      wake_all(p);
      return;
    }
}

void ppage_finish(struct wd_progress_page *p, enum wd_page_state state, int code, const char *message) {
  snprintf(p->message, sizeof p->message, "%s", message ? message : "");
  atomic_store_explicit(&p->error, code, memory_order_release);
  if (state == WD_PAGE_READY) ppage_advance(p, p->total_bytes);
  atomic_store_explicit(&p->state, (uint32_t)state, memory_order_release);
  wake_all(p);
}

void ppage_flag_set(struct wd_progress_page *p, uint32_t flag) {
  if ((atomic_fetch_or_explicit(&p->flags, flag, memory_order_release) & flag) == 0) wake_all(p);
}

/* ---- a client's side ------------------------------------------------------------------ */

int ppage_map(int fd, const struct wd_progress_page **out, struct wd_error *err) {
  *out = NULL;
  struct stat st;
  if (fstat(fd, &st) != 0) return err_set(err, WEIGHTD_E_IO, "fstat of the progress page: %s", strerror(errno));
  int seals = fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || st.st_size < (off_t)WD_PAGE_BYTES || seals < 0 || !(seals & F_SEAL_SHRINK) ||
      !(seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)))
    return err_set(err, WEIGHTD_E_PROTOCOL, "the progress page is not a sealed memfd of %u bytes", WD_PAGE_BYTES);
  void *m = mmap(NULL, WD_PAGE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return err_set(err, WEIGHTD_E_IO, "mapping the progress page: %s", strerror(errno));
  const struct wd_progress_page *p = m;
  if (p->magic != WD_PAGE_MAGIC || p->version != WD_PAGE_VERSION) {
    munmap(m, WD_PAGE_BYTES);
    return err_set(err, WEIGHTD_E_PROTOCOL, "the progress page has magic 0x%08x version %u", p->magic,
                   p->version);
  }
  *out = p;
  return 0;
}

void ppage_unmap(const struct wd_progress_page *p) {
  if (p != NULL) munmap((void *)(uintptr_t)p, WD_PAGE_BYTES);
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* What the page says about a wait for end: 0, an error code, or 1 while it is still loading. */
static int page_verdict(const struct wd_progress_page *p, uint64_t end) {
  if (atomic_load_explicit(&p->ready_bytes, memory_order_acquire) >= end) return 0;
  uint32_t state = atomic_load_explicit(&p->state, memory_order_acquire);
  if (state == WD_PAGE_READY) return 0;
  if (state == WD_PAGE_CANCELED) return WEIGHTD_E_CANCELED;
  if (state != WD_PAGE_LOADING) {
    int code = atomic_load_explicit(&p->error, memory_order_acquire);
    return code < 0 ? code : WEIGHTD_E_INTERNAL;
  }
  return 1;
}

int ppage_wait(const struct wd_progress_page *p, uint64_t end, int timeout_ms, ppage_alive_fn alive,
               const void *arg) {
  /* The page is mapped read-only: FUTEX_WAIT only reads the word, which such a mapping allows. */
  _Atomic uint32_t *seqp = (_Atomic uint32_t *)(uintptr_t)&p->seq;
  int64_t deadline = timeout_ms > 0 ? now_ms() + timeout_ms : 0;
  for (;;) {
    uint32_t seq = atomic_load_explicit(seqp, memory_order_acquire);
    int v = page_verdict(p, end);
    if (v <= 0) return v;
    if (alive != NULL && !alive(arg)) {
      /* Whatever the writer stored before it died is on the page: look once more. */
      v = page_verdict(p, end);
      return v <= 0 ? v : WEIGHTD_E_CLOSED;
    }
    if (timeout_ms == 0) return WEIGHTD_E_TIMEOUT;
    int64_t left = alive != NULL ? PPAGE_SLICE_MS : -1;
    if (timeout_ms > 0) {
      int64_t until = deadline - now_ms();
      if (until <= 0) return WEIGHTD_E_TIMEOUT;
      if (left < 0 || until < left) left = until;
    }
    struct timespec ts = {(time_t)(left / 1000), (long)(left % 1000) * 1000000};
    syscall(SYS_futex, seqp, FUTEX_WAIT, seq, left >= 0 ? &ts : NULL, NULL, 0);
  }
}
