/*
 * registry.c - open checkpoints: resolution, validation, mappings, prefetch
 * and the pinned tier (see registry.h).
 *
 * DESIGN: the registry's list and entries are loop-owned. Resolving a path,
 * validating shards, mapping, checking that shards are unchanged, prefetching
 * and pinning all run on job threads (prefetch chunks on the fill threads);
 * each job reads only its own struct: the entry it was handed (immutable once
 * open), a reference to the model roots it started with, the backend's const
 * table, the registry's atomic stop flag and its memory of failed index checks
 * (which has its own lock). Their done() callbacks update the registry on the
 * loop thread and run the caller's continuation.
 */
#include "registry.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"
#include "fault.h"
#include "log.h"
#include "pathutil.h"

/*
 * Failed index checks remembered (ckpt_verdicts): 64 verdicts of about 1 KiB,
 * the oldest forgotten first, so a client that repeats the open of one bad
 * checkpoint costs reading its index and a stat per shard, not a header parse.
 */
#define REG_VERDICTS 64

/* The model roots, shared by reference with the jobs that started under them (loop thread counts). */
struct reg_roots {
  int refs;
  size_t n;
  char **dirs;
};

struct registry {
  const struct wd_backend *backend;
  struct jobs *control, *bulk;
  struct fillpool *fill;
  struct reg_roots *roots;
  struct ckpt_verdicts *verdicts; /* failed index checks, remembered by file identity */
  uint64_t pin_budget;
  uint64_t pinned_bytes; /* the pinned-resident tier's total */
  uint64_t next_generation;
  atomic_bool stopping; /* read by prefetch chunks on fill threads */
  bool destroyed;
  size_t nentries; /* entries not yet freed, listed or detached */
  struct reg_ckpt *ckpts;
};

struct reg_waiter {
  reg_ready_fn cb;
  void *arg;
  struct reg_waiter *next;
};

/* ---- roots ------------------------------------------------------------------------ */

static void roots_unref(struct reg_roots *rt) {
  if (rt == NULL || --rt->refs > 0) return;
  for (size_t i = 0; i < rt->n; i++) free(rt->dirs[i]);
  free(rt->dirs);
  free(rt);
}

static struct reg_roots *roots_ref(struct reg_roots *rt) {
  rt->refs++;
  return rt;
}

int reg_roots_set(struct registry *r, const char *const *dirs, size_t n, struct wd_error *err) {
  struct reg_roots *rt = calloc(1, sizeof *rt);
  if (rt == NULL || (rt->dirs = calloc(n ? n : 1, sizeof *rt->dirs)) == NULL) {
    free(rt);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  rt->refs = 1;
  for (; rt->n < n; rt->n++)
    if ((rt->dirs[rt->n] = strdup(dirs[rt->n])) == NULL) {
      roots_unref(rt);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
  roots_unref(r->roots);
  r->roots = rt;
  return 0;
}

size_t reg_roots_count(const struct registry *r) { return r->roots->n; }
const char *reg_root(const struct registry *r, size_t i) { return i < r->roots->n ? r->roots->dirs[i] : NULL; }

/* ---- the registry ----------------------------------------------------------------- */

int reg_create(const struct reg_params *p, struct registry **out, struct wd_error *err) {
  struct registry *r = calloc(1, sizeof *r);
  if (r == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  r->backend = p->backend;
  r->control = p->control;
  r->bulk = p->bulk;
  r->fill = p->fill;
  r->pin_budget = p->pin_budget;
  atomic_init(&r->stopping, false);
  if ((r->verdicts = ckpt_verdicts_create(REG_VERDICTS)) == NULL) {
    free(r);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  if (reg_roots_set(r, NULL, 0, err) != 0) {
    ckpt_verdicts_free(r->verdicts);
    free(r);
    return err->code;
  }
  *out = r;
  return 0;
}

/* Unregisters checkpoints a shrunk pin budget no longer holds, on a job. */
struct unpin_job {
  struct job job;
  const struct wd_backend *backend;
  struct reg_ckpt **v;
  size_t n;
};

static void unregister_all(const struct wd_backend *b, struct reg_ckpt *ck);

static void unpin_work(struct job *j) {
  struct unpin_job *u = (struct unpin_job *)j;
  for (size_t i = 0; i < u->n; i++) unregister_all(u->backend, u->v[i]);
}

static void unpin_done(struct job *j) {
  struct unpin_job *u = (struct unpin_job *)j;
  for (size_t i = 0; i < u->n; i++) {
    log_msg(LOG_INFO, "%s: unpinned: host_pin_budget shrank", u->v[i]->path);
    u->v[i]->unpinning = false;
    reg_unref(u->v[i]);
  }
  free(u->v);
  free(u);
}

size_t reg_pin_budget_set(struct registry *r, uint64_t budget) {
  r->pin_budget = budget;
  if (r->pinned_bytes <= budget) return 0;
  struct unpin_job *u = calloc(1, sizeof *u);
  size_t cap = 0;
  for (struct reg_ckpt *c = r->ckpts; c != NULL; c = c->next) cap++;
  if (u == NULL || (u->v = calloc(cap ? cap : 1, sizeof *u->v)) == NULL) {
    free(u);
    log_msg(LOG_WARN, "out of memory unpinning checkpoints over host_pin_budget; they stay pinned");
    return 0;
  }
  while (r->pinned_bytes > budget) {
    struct reg_ckpt *victim = NULL;
    for (struct reg_ckpt *c = r->ckpts; c != NULL; c = c->next)
      if (atomic_load(&c->pinned) && !c->unpinning && c->loads == 0 &&
          (victim == NULL || c->last_used_ms < victim->last_used_ms))
        victim = c;
    if (victim == NULL) break; /* the rest are loading: unpinned when a later pin needs the room */
    atomic_store(&victim->pinned, false); /* new loads of it stage from now on */
    victim->unpinning = true;
    r->pinned_bytes -= victim->pinned_bytes;
    victim->pinned_bytes = 0;
    reg_ref(victim);
    u->v[u->n++] = victim;
  }
  if (u->n == 0) {
    free(u->v);
    free(u);
    return 0;
  }
  size_t n = u->n;
  u->job.work = unpin_work;
  u->job.done = unpin_done;
  u->backend = r->backend;
  jobs_submit(r->bulk, &u->job);
  return n;
}
uint64_t reg_pin_budget(const struct registry *r) { return r->pin_budget; }
uint64_t reg_pinned_bytes(const struct registry *r) { return r->pinned_bytes; }
struct reg_ckpt *reg_first(const struct registry *r) { return r->ckpts; }
void reg_stop(struct registry *r) { atomic_store(&r->stopping, true); }

/* ---- references ------------------------------------------------------------------- */

void reg_ref(struct reg_ckpt *ck) { ck->refs++; }

static void registry_free(struct registry *r) {
  roots_unref(r->roots);
  ckpt_verdicts_free(r->verdicts);
  free(r);
}

/* Frees an entry nothing uses. The registry itself goes with its last entry once destroyed. */
static void entry_free(struct reg_ckpt *ck) {
  struct registry *r = ck->reg;
  const struct wd_backend *b = r->backend;
  if (ck->ck != NULL) {
    for (size_t i = 0; i < ck->ck->nshards; i++) {
      if (ck->maps != NULL && ck->maps[i] != NULL) {
        if (atomic_load(&ck->pinned) && b->ops->host_unregister)
          b->ops->host_unregister(b->ctx, ck->maps[i], ck->ck->shards[i].size);
        munmap(ck->maps[i], ck->ck->shards[i].size);
      }
    }
  }
  r->pinned_bytes -= ck->pinned_bytes;
  free(ck->maps);
  ckpt_free(ck->ck);
  free(ck->path);
  free(ck);
  if (--r->nentries == 0 && r->destroyed) registry_free(r);
}

void reg_unref(struct reg_ckpt *ck) {
  if (ck == NULL) return;
  if (--ck->refs == 0) entry_free(ck);
}

static void detach(struct reg_ckpt *ck) {
  if (ck->detached) return;
  struct reg_ckpt **pp = &ck->reg->ckpts;
  while (*pp != NULL && *pp != ck) pp = &(*pp)->next;
  if (*pp == ck) *pp = ck->next;
  ck->detached = true;
  reg_unref(ck); /* the registry's reference */
}

void reg_destroy(struct registry *r) {
  if (r == NULL) return;
  while (r->ckpts != NULL) detach(r->ckpts);
  if (r->nentries == 0) registry_free(r);
  else r->destroyed = true; /* the last entry to go frees it */
}

struct reg_ckpt *reg_find(struct registry *r, const char *resolved) {
  for (struct reg_ckpt *ck = r->ckpts; ck != NULL; ck = ck->next)
    if (ck->state == REG_OPEN && strcmp(ck->path, resolved) == 0) return ck;
  return NULL;
}

void reg_load_begin(struct reg_ckpt *ck) { ck->loads++; }
void reg_load_end(struct reg_ckpt *ck) { ck->loads--; }

/* ---- acquiring: resolve, then verify or open ---------------------------------------- */

enum acq_stage { ACQ_RESOLVE, ACQ_VERIFY, ACQ_OPEN };

struct acquire {
  struct job job;
  struct registry *reg;
  struct reg_roots *roots; /* referenced: what the job checks against */
  struct ckpt_verdicts *verdicts; /* the registry's (thread-safe; it outlives every open job) */
  enum acq_stage stage;
  reg_ready_fn ready;      /* acquire */
  reg_resolved_fn resolved_cb; /* resolve only */
  void *arg;
  char *path;
  char *resolved;
  struct reg_ckpt *entry; /* ACQ_VERIFY / ACQ_OPEN: referenced */
  int rc;
  struct wd_error err;
};

static void acquire_free(struct acquire *a) {
  roots_unref(a->roots);
  free(a->path);
  free(a->resolved);
  free(a);
}

static int map_shards(struct reg_ckpt *e, struct wd_error *err) {
  const struct ckpt *c = e->ck;
  e->maps = calloc(c->nshards ? c->nshards : 1, sizeof *e->maps);
  if (e->maps == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (size_t i = 0; i < c->nshards; i++) {
    if (c->shards[i].size == 0) continue;
    void *p = mmap(NULL, c->shards[i].size, PROT_READ, MAP_SHARED, c->shards[i].fd, 0);
    if (p == MAP_FAILED) return err_set(err, WEIGHTD_E_IO, "%s: mmap: %s", c->shards[i].rel, strerror(errno));
    e->maps[i] = p;
  }
  /* The mappings keep the files; the descriptors are no longer needed. */
  for (size_t i = 0; i < c->nshards; i++) {
    close(c->shards[i].fd);
    c->shards[i].fd = -1;
  }
  return 0;
}

static void acquire_work(struct job *j) {
  struct acquire *a = (struct acquire *)j;
  const struct reg_roots *rt = a->roots;
  switch (a->stage) {
  case ACQ_RESOLVE: {
    /* Resolved with lstat and readlink only, and judged against the roots without
     * saying whether anything outside them exists (path_resolve). */
    const struct path_roots roots = {(const char *const *)rt->dirs, rt->n};
    char label[320];
    struct path_resolved res;
    a->rc = path_resolve(a->path, &roots, err_quote(a->path, strlen(a->path), label, sizeof label), &res, &a->err);
    if (a->rc == 0) a->resolved = res.real;
    return;
  }
  case ACQ_VERIFY:
    a->rc = ckpt_check_unchanged(a->entry->ck, &a->err);
    return;
  case ACQ_OPEN: {
    struct ckpt_opts opts = {(const char *const *)rt->dirs, rt->n, a->verdicts};
    struct ckpt *c = NULL;
    a->rc = ckpt_open(a->resolved, &opts, &c, &a->err);
    if (a->rc != 0) return;
    a->entry->ck = c; /* the entry is OPENING: nobody else reads it yet */
    a->rc = map_shards(a->entry, &a->err);
    return;
  }
  }
}

static void notify_waiters(struct reg_ckpt *e, const struct wd_error *err) {
  struct reg_waiter *w = e->waiters;
  e->waiters = NULL;
  while (w != NULL) {
    struct reg_waiter *next = w->next;
    if (err == NULL) reg_ref(e);
    w->cb(w->arg, err == NULL ? e : NULL, err);
    free(w);
    w = next;
  }
}

static int add_waiter(struct reg_ckpt *e, reg_ready_fn cb, void *arg) {
  struct reg_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) return -1;
  w->cb = cb;
  w->arg = arg;
  w->next = e->waiters;
  e->waiters = w;
  return 0;
}

static void fail_nomem(reg_ready_fn cb, void *arg) {
  struct wd_error err;
  err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
  cb(arg, NULL, &err);
}

/* Starts opening a->resolved (or joins an open already under way). */
static void start_open(struct acquire *a) {
  struct registry *r = a->reg;
  for (struct reg_ckpt *e = r->ckpts; e != NULL; e = e->next) {
    if (e->state == REG_OPENING && strcmp(e->path, a->resolved) == 0) {
      if (add_waiter(e, a->ready, a->arg) != 0) fail_nomem(a->ready, a->arg);
      acquire_free(a);
      return;
    }
  }
  struct reg_ckpt *e = calloc(1, sizeof *e);
  if (e == NULL || (e->path = strdup(a->resolved)) == NULL || add_waiter(e, a->ready, a->arg) != 0) {
    if (e) free(e->path);
    free(e);
    fail_nomem(a->ready, a->arg);
    acquire_free(a);
    return;
  }
  e->reg = r;
  r->nentries++;
  e->state = REG_OPENING;
  e->generation = ++r->next_generation;
  e->refs = 2; /* the registry's, and the open job's */
  atomic_init(&e->pinned, false);
  e->next = r->ckpts;
  r->ckpts = e;
  a->stage = ACQ_OPEN;
  a->entry = e;
  a->rc = 0;
  jobs_submit(r->control, &a->job);
}

static void acquire_done(struct job *j) {
  struct acquire *a = (struct acquire *)j;
  switch (a->stage) {
  case ACQ_RESOLVE: {
    if (a->resolved_cb != NULL) { /* reg_resolve: that was all */
      a->resolved_cb(a->arg, a->rc == 0 ? a->resolved : NULL, a->rc == 0 ? NULL : &a->err);
      acquire_free(a);
      return;
    }
    if (a->rc != 0) {
      a->ready(a->arg, NULL, &a->err);
      acquire_free(a);
      return;
    }
    struct reg_ckpt *e = reg_find(a->reg, a->resolved);
    if (e == NULL) {
      start_open(a);
      return;
    }
    reg_ref(e);
    a->entry = e;
    a->stage = ACQ_VERIFY;
    jobs_submit(a->reg->control, &a->job);
    return;
  }
  case ACQ_VERIFY: {
    struct reg_ckpt *e = a->entry;
    a->entry = NULL;
    if (a->rc == 0 && !e->detached) {
      e->last_used_ms = clock_ms();
      a->ready(a->arg, e, NULL); /* passes our reference on */
      acquire_free(a);
      return;
    }
    if (a->rc == WEIGHTD_E_STALE && !e->detached) {
      log_msg(LOG_INFO, "%s: %s; reopening", e->path, a->err.msg);
      detach(e);
    }
    reg_unref(e);
    a->rc = 0;
    start_open(a);
    return;
  }
  case ACQ_OPEN: {
    struct reg_ckpt *e = a->entry;
    if (a->rc == 0) {
      e->state = REG_OPEN;
      e->last_used_ms = clock_ms();
      log_msg(LOG_INFO, "opened %s: %zu shards, %zu tensors, %llu bytes", e->path, e->ck->nshards,
              e->ck->ntensors, (unsigned long long)e->ck->total_bytes);
      notify_waiters(e, NULL);
    } else {
      e->state = REG_FAILED;
      log_msg(LOG_WARN, "cannot open %s: %s", e->path, a->err.msg);
      detach(e);
      notify_waiters(e, &a->err);
    }
    reg_unref(e); /* the job's reference */
    acquire_free(a);
    return;
  }
  }
}

static struct acquire *acquire_new(struct registry *r, const char *path) {
  struct acquire *a = calloc(1, sizeof *a);
  if (a == NULL || (a->path = strdup(path)) == NULL) {
    free(a);
    return NULL;
  }
  a->job.work = acquire_work;
  a->job.done = acquire_done;
  a->reg = r;
  a->roots = roots_ref(r->roots);
  a->verdicts = r->verdicts;
  a->stage = ACQ_RESOLVE;
  return a;
}

void reg_acquire(struct registry *r, const char *path, reg_ready_fn cb, void *arg) {
  struct acquire *a = acquire_new(r, path);
  if (a == NULL) {
    fail_nomem(cb, arg);
    return;
  }
  a->ready = cb;
  a->arg = arg;
  jobs_submit(r->control, &a->job);
}

void reg_resolve(struct registry *r, const char *path, reg_resolved_fn cb, void *arg) {
  struct acquire *a = acquire_new(r, path);
  if (a == NULL) {
    struct wd_error err;
    err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
    cb(arg, NULL, &err);
    return;
  }
  a->resolved_cb = cb;
  a->arg = arg;
  jobs_submit(r->control, &a->job);
}

int reg_close(struct registry *r, const char *resolved, struct wd_error *err) {
  struct reg_ckpt *e = reg_find(r, resolved);
  if (e == NULL) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s is not open", resolved);
  if (e->refs > 1)
    return err_set(err, WEIGHTD_E_BUSY, "%s is in use by %d resident set(s) or running operation(s)", resolved,
                   e->refs - 1);
  log_msg(LOG_INFO, "closed %s", e->path);
  detach(e);
  return 0;
}

/* ---- page cache: residency and prefetch -------------------------------------------- */

uint64_t reg_resident_bytes(const struct reg_ckpt *ck) {
  long page = sysconf(_SC_PAGESIZE);
  enum { CHUNK_PAGES = 1 << 16 };
  unsigned char vec[CHUNK_PAGES];
  uint64_t resident = 0;
  for (size_t i = 0; i < ck->ck->nshards; i++) {
    const unsigned char *base = ck->maps[i];
    uint64_t size = ck->ck->shards[i].size;
    for (uint64_t off = 0; base != NULL && off < size; off += (uint64_t)CHUNK_PAGES * (uint64_t)page) {
      size_t len = size - off < (uint64_t)CHUNK_PAGES * (uint64_t)page ? (size_t)(size - off)
                                                                       : (size_t)CHUNK_PAGES * (size_t)page;
      if (mincore((void *)(base + off), len, vec) != 0) break;
      size_t pages = (len + (size_t)page - 1) / (size_t)page;
      for (size_t k = 0; k < pages; k++)
        if (vec[k] & 1) resident += (uint64_t)page;
    }
  }
  return resident;
}

struct prefetch {
  struct job job;
  struct registry *reg;
  struct reg_ckpt *ck;
  reg_prefetched_fn cb;
  void *arg;
  bool pin;
  struct reg_ckpt **unpin; /* pinned checkpoints to unregister first, referenced */
  size_t nunpin;
  atomic_int failed;
  atomic_bool canceled;        /* reg_prefetch_cancel: stop between chunks, do not pin */
  atomic_uint_fast64_t done;   /* shard bytes read so far */
  uint64_t total;              /* shard bytes to read */
  bool stopped;                /* the work saw the cancel before pinning (read by done) */
  int pin_rc;
  struct wd_error pin_err;
  uint64_t resident; /* measured at the end, on the job thread */
};

#define PREFETCH_CHUNK (32ull << 20)

/* Touches one chunk of one shard through the mapping: the pages loads will read. */
static void prefetch_chunk(void *arg, size_t i) {
  struct prefetch *p = arg;
  const struct ckpt *c = p->ck->ck;
  uint64_t k = i;
  size_t s = 0;
  for (; s < c->nshards; s++) {
    uint64_t n = (c->shards[s].size + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK;
    if (k < n) break;
    k -= n;
  }
  if (s == c->nshards || atomic_load(&p->reg->stopping) || atomic_load(&p->canceled)) return;
  uint64_t off = k * PREFETCH_CHUNK, end = off + PREFETCH_CHUNK;
  if (end > c->shards[s].size) end = c->shards[s].size;
  if (fault_touch((const char *)p->ck->maps[s] + off, (size_t)(end - off)) != 0) atomic_store(&p->failed, 1);
  atomic_fetch_add(&p->done, end - off);
}

static void unregister_all(const struct wd_backend *b, struct reg_ckpt *ck) {
  for (size_t i = 0; i < ck->ck->nshards; i++)
    if (ck->maps[i] != NULL) b->ops->host_unregister(b->ctx, ck->maps[i], ck->ck->shards[i].size);
}

static void prefetch_work(struct job *j) {
  struct prefetch *p = (struct prefetch *)j;
  const struct wd_backend *b = p->reg->backend;
  const struct ckpt *c = p->ck->ck;
  for (size_t i = 0; i < p->nunpin; i++) unregister_all(b, p->unpin[i]);
  size_t n = 0;
  for (size_t s = 0; s < c->nshards; s++) {
    if (p->ck->maps[s] == NULL) continue;
    madvise(p->ck->maps[s], c->shards[s].size, MADV_WILLNEED);
    n += (size_t)((c->shards[s].size + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK);
  }
  fill_run(p->reg->fill, n, prefetch_chunk, p);
  p->stopped = atomic_load(&p->canceled);
  if (p->pin && !atomic_load(&p->failed) && !p->stopped) {
    double t0 = clock_s();
    size_t s = 0;
    for (; s < c->nshards; s++) {
      if (p->ck->maps[s] == NULL) continue;
      p->pin_rc = b->ops->host_register(b->ctx, p->ck->maps[s], c->shards[s].size, &p->pin_err);
      if (p->pin_rc != 0) break;
    }
    if (p->pin_rc != 0) {
      err_prefix(&p->pin_err, "%s: pinning %s", p->ck->path, c->shards[s].rel);
      for (size_t u = 0; u < s; u++)
        if (p->ck->maps[u] != NULL) b->ops->host_unregister(b->ctx, p->ck->maps[u], c->shards[u].size);
    } else {
      log_msg(LOG_INFO, "%s: registered %llu bytes for direct DMA in %.0f ms", p->ck->path,
              (unsigned long long)p->ck->pinned_bytes, (clock_s() - t0) * 1000);
    }
  }
  p->resident = reg_resident_bytes(p->ck);
}

static void prefetch_done(struct job *j) {
  struct prefetch *p = (struct prefetch *)j;
  struct registry *r = p->reg;
  p->ck->prefetching = false;
  for (size_t i = 0; i < p->nunpin; i++) {
    log_msg(LOG_INFO, "%s: unpinned to make room in host_pin_budget", p->unpin[i]->path);
    p->unpin[i]->unpinning = false;
    reg_unref(p->unpin[i]);
  }
  free(p->unpin);
  int failed = atomic_load(&p->failed);
  bool canceled = p->stopped;
  if (p->pin) {
    if (failed || canceled || p->pin_rc != 0) {
      r->pinned_bytes -= p->ck->pinned_bytes;
      p->ck->pinned_bytes = 0;
    } else {
      atomic_store(&p->ck->pinned, true);
    }
  }
  struct wd_error err = {0};
  if (failed) {
    log_msg(LOG_WARN, "%s: prefetch hit a truncated shard", p->ck->path);
    err_set(&err, WEIGHTD_E_FAULT, "%s: a shard was truncated while it was read", p->ck->path);
  } else if (canceled) {
    log_msg(LOG_INFO, "prefetch of %s canceled", p->ck->path);
    err_set(&err, WEIGHTD_E_CANCELED, "prefetch of %s canceled", p->ck->path);
  } else if (p->pin_rc != 0) {
    log_msg(LOG_WARN, "%s", p->pin_err.msg);
    err = p->pin_err;
  } else {
    log_msg(LOG_INFO, "prefetched %s", p->ck->path);
  }
  if (p->cb != NULL) p->cb(p->arg, p->ck, p->resident, err.code != 0 ? &err : NULL);
  reg_unref(p->ck);
  free(p);
}

static uint64_t shard_bytes(const struct reg_ckpt *ck) {
  uint64_t n = 0;
  for (size_t i = 0; i < ck->ck->nshards; i++) n += ck->ck->shards[i].size;
  return n;
}

/* Chooses pinned checkpoints to unpin, least recently used first, so that need fits. */
static int choose_unpin(struct prefetch *p, uint64_t need, struct wd_error *err) {
  struct registry *r = p->reg;
  uint64_t freed = 0;
  while (r->pinned_bytes - freed + need > r->pin_budget) {
    struct reg_ckpt *victim = NULL;
    for (struct reg_ckpt *c = r->ckpts; c != NULL; c = c->next) {
      bool chosen = false;
      for (size_t i = 0; i < p->nunpin; i++) chosen |= p->unpin[i] == c;
      if (c != p->ck && !chosen && atomic_load(&c->pinned) && c->loads == 0 &&
          (victim == NULL || c->last_used_ms < victim->last_used_ms))
        victim = c;
    }
    if (victim == NULL)
      return err_set(err, WEIGHTD_E_LIMIT,
                     "%s: pinning %llu bytes exceeds host_pin_budget (%llu bytes, %llu in use by "
                     "checkpoints that are loading)",
                     p->ck->path, (unsigned long long)need, (unsigned long long)r->pin_budget,
                     (unsigned long long)r->pinned_bytes);
    struct reg_ckpt **nu = realloc(p->unpin, (p->nunpin + 1) * sizeof *nu);
    if (nu == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    p->unpin = nu;
    p->unpin[p->nunpin++] = victim;
    freed += victim->pinned_bytes;
  }
  return 0;
}

int reg_prefetch(struct registry *r, struct reg_ckpt *ck, bool pin, reg_prefetched_fn cb, void *arg,
                 struct wd_error *err) {
  return reg_prefetch_start(r, ck, pin, cb, arg, NULL, err);
}

/* A handle is the prefetch itself, seen through an incomplete type. */
void reg_prefetch_progress(const struct reg_prefetch *h, uint64_t *done, uint64_t *total) {
  const struct prefetch *p = (const struct prefetch *)h;
  *done = atomic_load(&((struct prefetch *)p)->done);
  *total = p->total;
}

void reg_prefetch_cancel(struct reg_prefetch *h) { atomic_store(&((struct prefetch *)h)->canceled, true); }

int reg_prefetch_start(struct registry *r, struct reg_ckpt *ck, bool pin, reg_prefetched_fn cb, void *arg,
                       struct reg_prefetch **handle, struct wd_error *err) {
  struct prefetch *p = calloc(1, sizeof *p);
  if (p == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  p->job.work = prefetch_work;
  p->job.done = prefetch_done;
  p->reg = r;
  p->ck = ck;
  p->cb = cb;
  p->arg = arg;
  atomic_init(&p->failed, 0);
  atomic_init(&p->canceled, false);
  atomic_init(&p->done, 0);
  for (size_t s = 0; s < ck->ck->nshards; s++)
    if (ck->maps[s] != NULL) p->total += ck->ck->shards[s].size;
  p->pin = pin && !(r->backend->ops->caps & WD_CAP_HOST_SLABS) && !atomic_load(&ck->pinned) &&
           ck->pinned_bytes == 0;
  if (p->pin && ck->unpinning) {
    free(p);
    return err_set(err, WEIGHTD_E_BUSY, "%s is being unpinned to make room; ask again", ck->path);
  }
  if (p->pin) {
    uint64_t need = shard_bytes(ck);
    int rc = choose_unpin(p, need, err);
    if (rc != 0) {
      free(p->unpin);
      free(p);
      return rc;
    }
    for (size_t i = 0; i < p->nunpin; i++) {
      struct reg_ckpt *v = p->unpin[i];
      atomic_store(&v->pinned, false); /* new loads of it stage from now on */
      v->unpinning = true;
      r->pinned_bytes -= v->pinned_bytes;
      v->pinned_bytes = 0;
      reg_ref(v);
    }
    ck->pinned_bytes = need;
    r->pinned_bytes += need;
  }
  reg_ref(ck);
  ck->prefetching = true;
  if (handle != NULL) *handle = (struct reg_prefetch *)p;
  jobs_submit(r->bulk, &p->job);
  return 0;
}
