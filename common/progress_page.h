/*
 * progress_page.h - how far a resident set's load has come, on one small
 * shared page the daemon writes and clients map read-only and wait on.
 *
 * Loads fill a slab in offset order, so one number says which tensors are in
 * place: the ready watermark. Every slab byte below it holds its final value
 * (on a GPU: the copy that wrote it has completed, so a kernel another process
 * starts afterwards reads it), and it only grows; tensor i is ready once its
 * offset + nbytes <= ready_bytes. The state says how the load ended. The page
 * is a memfd of WD_PAGE_BYTES that the daemon maps read-write and seals with
 * F_SEAL_FUTURE_WRITE (Linux 5.1 and later), F_SEAL_SHRINK, F_SEAL_GROW and
 * F_SEAL_SEAL before anyone else sees it: the daemon keeps writing through
 * its own mapping, every other mapping of it can only be read, and no
 * process can unseal or resize it. docs/protocol.md ("The progress page")
 * gives the layout, which struct wd_progress_page is.
 *
 * Updates: the daemon stores ready_bytes (or the error code, the message
 * and then state), then increments seq, then wakes every FUTEX_WAIT on seq.
 * Waiters read seq, then the fields, and sleep on seq while nothing they
 * wait for happened. Plain 32/64-bit atomics are lock-free on every target
 * weightd builds for (checked at compile time), so they work across
 * processes on shared memory.
 *
 * Threads: the daemon's load threads call ppage_advance concurrently (each
 * raises the watermark to at least its value); the loop thread calls
 * ppage_finish once. Clients read from any thread.
 */
#ifndef WD_PROGRESS_PAGE_H
#define WD_PROGRESS_PAGE_H

#include <stdatomic.h>
#include <stdint.h>

#include "error.h"

#define WD_PAGE_MAGIC 0x50504457u /* "WDPP" little-endian */
#define WD_PAGE_VERSION 1u
#define WD_PAGE_BYTES 4096u
#define WD_PAGE_MESSAGE_BYTES 256u

/*
 * Flags the daemon sets on a set's page after its load, each once and for
 * good (the values are part of the protocol). CORRUPT: a scrub found the
 * set's bytes changed since they were loaded (state/scrub.h); its holders
 * should release it and attach the set loaded in its place.
 */
#define WD_PAGE_FLAG_CORRUPT 0x1u

/* A load's state on the page; the values are part of the protocol. */
enum wd_page_state {
  WD_PAGE_LOADING = 0,
  WD_PAGE_READY = 1,
  WD_PAGE_FAILED = 2,
  WD_PAGE_CANCELED = 3,
};

struct wd_progress_page {
  uint32_t magic;               /* 0: WD_PAGE_MAGIC */
  uint32_t version;             /* 4: WD_PAGE_VERSION */
  _Atomic uint32_t seq;         /* 8: futex word, +1 after every change */
  _Atomic uint32_t state;       /* 12: enum wd_page_state */
  _Atomic uint64_t ready_bytes; /* 16: the watermark, in slab bytes */
  uint64_t total_bytes;         /* 24: the slab's bytes: ready_bytes reaches it before state READY */
  _Atomic int32_t error;        /* 32: the load's WEIGHTD_E_* code once FAILED or CANCELED, else 0 */
  _Atomic uint32_t flags;       /* 36: WD_PAGE_FLAG_* bits, set after the load (never cleared) */
  uint64_t reserved[3];         /* 40 */
  char message[WD_PAGE_MESSAGE_BYTES]; /* 64: the load's error message, NUL-terminated */
};

/* ---- the daemon's side ------------------------------------------------------------ */

/*
 * Creates a page for a slab of total_bytes: a sealed memfd (*fd) mapped
 * read-write (*out). WEIGHTD_E_UNSUPPORTED when the kernel cannot seal
 * future writes (before Linux 5.1): sets then get no page.
 */
int ppage_create(uint64_t total_bytes, struct wd_progress_page **out, int *fd, struct wd_error *err);
/* Unmaps and closes a page made by ppage_create (NULL-safe). */
void ppage_destroy(struct wd_progress_page *p, int fd);
/* Raises the watermark to ready (never lowers it) and wakes waiters when it moved. */
void ppage_advance(struct wd_progress_page *p, uint64_t ready);
/* Sets the final state (READY, FAILED or CANCELED), the error code and message, and wakes waiters. */
void ppage_finish(struct wd_progress_page *p, enum wd_page_state state, int code, const char *message);

/* Sets flag (WD_PAGE_FLAG_*) on the page and wakes waiters (loop thread). */
void ppage_flag_set(struct wd_progress_page *p, uint32_t flag);

/* ---- a client's side ----------------------------------------------------------------- */

/*
 * Maps a page received as fd (which the caller keeps) read-only, after
 * checking that it is what it says: a sealed memfd (no writes but the
 * daemon's, no shrinking) of at least WD_PAGE_BYTES with the magic and
 * version. WEIGHTD_E_PROTOCOL otherwise.
 */
int ppage_map(int fd, const struct wd_progress_page **out, struct wd_error *err);
void ppage_unmap(const struct wd_progress_page *p);

/* Whether the page's writer (the daemon) still runs: nonzero yes, 0 no. */
typedef int (*ppage_alive_fn)(const void *arg);

/*
 * Waits until the watermark reaches end (0), or the load failed or was
 * canceled (its code: the page's error, WEIGHTD_E_CANCELED), at most
 * timeout_ms (< 0: forever; 0: only looks): WEIGHTD_E_TIMEOUT. Bytes below
 * the watermark stay in place whatever happens later, so a wait for them
 * succeeds after a failure too; end UINT64_MAX waits for the final state
 * and succeeds only when it is READY.
 *
 * A page whose writer died says LOADING for good. With alive not NULL the
 * wait sleeps in slices of PPAGE_SLICE_MS and asks alive(arg) between them:
 * once it says the writer is gone (and the page, read again, still lacks
 * what was waited for), WEIGHTD_E_CLOSED.
 */
#define PPAGE_SLICE_MS 100
int ppage_wait(const struct wd_progress_page *p, uint64_t end, int timeout_ms, ppage_alive_fn alive,
               const void *arg);

#endif
