/*
 * registry.c - open checkpoints: resolution, validation, mappings, prefetch.
 *
 * DESIGN: the registry (a list in struct daemon) is loop-owned. Resolving a
 * path, validating shards, mapping, checking that shards are unchanged and
 * prefetching all run on job threads; their done() callbacks update the
 * registry. An entry is reference counted: the registry holds one reference
 * while the entry is listed, each resident set and each running job another.
 * A replaced shard detaches the old entry (sets built from it keep it alive)
 * and a fresh one is opened. Jobs read an entry's ckpt and maps, which never
 * change once the entry is open.
 */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon.h"
#include "fault.h"
#include "log.h"
#include "msg.h"
#include "pathutil.h"

/* ---- references -------------------------------------------------------------- */

void reg_ref(struct reg_ckpt *ck) { ck->refs++; }

static void entry_free(struct reg_ckpt *ck) {
  if (ck->ck != NULL) {
    for (size_t i = 0; i < ck->ck->nshards; i++) {
      if (ck->maps != NULL && ck->maps[i] != NULL) {
        if (atomic_load(&ck->pinned) && wd->backend.ops->host_unregister)
          wd->backend.ops->host_unregister(wd->backend.ctx, ck->maps[i], ck->ck->shards[i].size);
        munmap(ck->maps[i], ck->ck->shards[i].size);
      }
    }
  }
  wd->pinned_bytes -= ck->pinned_bytes;
  free(ck->maps);
  ckpt_free(ck->ck);
  free(ck->path);
  free(ck);
}

void reg_unref(struct reg_ckpt *ck) {
  if (ck == NULL) return;
  if (--ck->refs == 0) entry_free(ck);
}

static void detach(struct reg_ckpt *ck) {
  if (ck->detached) return;
  struct reg_ckpt **pp = &wd->ckpts;
  while (*pp != NULL && *pp != ck) pp = &(*pp)->next;
  if (*pp == ck) *pp = ck->next;
  ck->detached = true;
  reg_unref(ck); /* the registry's reference */
}

struct reg_ckpt *reg_find(const char *resolved) {
  for (struct reg_ckpt *ck = wd->ckpts; ck != NULL; ck = ck->next)
    if (ck->state == REG_OPEN && strcmp(ck->path, resolved) == 0) return ck;
  return NULL;
}

/* ---- acquiring: resolve, then verify or open ---------------------------------- */

enum acq_stage { ACQ_RESOLVE, ACQ_VERIFY, ACQ_OPEN };

struct acquire {
  struct job job;
  enum acq_stage stage;
  struct request *req;
  reg_ready_fn cb;
  char *path;
  char *resolved;
  struct reg_ckpt *entry; /* ACQ_VERIFY / ACQ_OPEN: referenced */
  int rc;
  struct wd_error err;
};

static void acquire_done(struct job *j);

static void acquire_free(struct acquire *a) {
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
    if (p == MAP_FAILED)
      return err_set(err, WEIGHTD_E_IO, "%s: mmap: %s", c->shards[i].rel, strerror(errno));
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
  switch (a->stage) {
  case ACQ_RESOLVE: {
    a->resolved = realpath(a->path, NULL);
    if (a->resolved == NULL) {
      a->rc = err_set(&a->err, errno == ENOENT || errno == ENOTDIR ? WEIGHTD_E_NOT_FOUND : WEIGHTD_E_IO,
                      "%s: %s", a->path, strerror(errno));
      return;
    }
    if (wd->nroots > 0 && !path_under_roots(a->resolved, (const char *const *)wd->roots, wd->nroots))
      a->rc = err_set(&a->err, WEIGHTD_E_PATH_DENIED, "%s: resolves to %s, outside the model roots",
                      a->path, a->resolved);
    return;
  }
  case ACQ_VERIFY:
    a->rc = ckpt_check_unchanged(a->entry->ck, &a->err);
    return;
  case ACQ_OPEN: {
    struct ckpt_opts opts = {(const char *const *)wd->roots, wd->nroots};
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
    w->cb(w->req, err == NULL ? e : NULL, err);
    free(w);
    w = next;
  }
}

static int add_waiter(struct reg_ckpt *e, struct request *req, reg_ready_fn cb) {
  struct reg_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) return -1;
  w->req = req;
  w->cb = cb;
  w->next = e->waiters;
  e->waiters = w;
  return 0;
}

/* Starts opening `resolved` (or joins an open already under way). */
static void start_open(struct acquire *a) {
  for (struct reg_ckpt *e = wd->ckpts; e != NULL; e = e->next) {
    if (e->state == REG_OPENING && strcmp(e->path, a->resolved) == 0) {
      if (add_waiter(e, a->req, a->cb) != 0) {
        struct wd_error err;
        err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
        a->cb(a->req, NULL, &err);
      }
      acquire_free(a);
      return;
    }
  }
  struct reg_ckpt *e = calloc(1, sizeof *e);
  if (e == NULL || (e->path = strdup(a->resolved)) == NULL || add_waiter(e, a->req, a->cb) != 0) {
    if (e) free(e->path);
    free(e);
    struct wd_error err;
    err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
    a->cb(a->req, NULL, &err);
    acquire_free(a);
    return;
  }
  e->state = REG_OPENING;
  e->generation = ++wd->next_id;
  e->refs = 2; /* the registry's, and the open job's */
  e->next = wd->ckpts;
  wd->ckpts = e;
  a->stage = ACQ_OPEN;
  a->entry = e;
  a->rc = 0;
  jobs_submit(wd->control_pool, &a->job);
}

static void acquire_done(struct job *j) {
  struct acquire *a = (struct acquire *)j;
  switch (a->stage) {
  case ACQ_RESOLVE: {
    if (a->rc != 0) {
      a->cb(a->req, NULL, &a->err);
      acquire_free(a);
      return;
    }
    struct reg_ckpt *e = reg_find(a->resolved);
    if (e == NULL) {
      start_open(a);
      return;
    }
    reg_ref(e);
    a->entry = e;
    a->stage = ACQ_VERIFY;
    jobs_submit(wd->control_pool, &a->job);
    return;
  }
  case ACQ_VERIFY: {
    struct reg_ckpt *e = a->entry;
    a->entry = NULL;
    if (a->rc == 0 && !e->detached) {
      e->last_used_ms = clock_ms();
      a->cb(a->req, e, NULL); /* passes our reference on */
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

void reg_acquire(struct request *req, const char *path, reg_ready_fn cb) {
  struct acquire *a = calloc(1, sizeof *a);
  if (a == NULL || (a->path = strdup(path)) == NULL) {
    free(a);
    struct wd_error err;
    err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
    cb(req, NULL, &err);
    return;
  }
  a->job.work = acquire_work;
  a->job.done = acquire_done;
  a->req = req;
  a->cb = cb;
  a->stage = ACQ_RESOLVE;
  jobs_submit(wd->control_pool, &a->job);
}

int reg_close(const char *resolved, struct wd_error *err) {
  struct reg_ckpt *e = reg_find(resolved);
  if (e == NULL) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s is not open", resolved);
  if (e->refs > 1)
    return err_set(err, WEIGHTD_E_BUSY, "%s is in use by %d resident set(s) or running operation(s)",
                   resolved, e->refs - 1);
  log_msg(LOG_INFO, "closed %s", e->path);
  detach(e);
  return 0;
}

void reg_shutdown(void) {
  while (wd->ckpts != NULL) detach(wd->ckpts);
}

/* ---- page cache: residency and prefetch ---------------------------------------- */

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
  struct reg_ckpt *ck;
  struct request *req; /* replied to when done, if set */
  bool pin;
  struct reg_ckpt **unpin; /* pinned checkpoints to unregister first, referenced */
  size_t nunpin;
  atomic_int failed;
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
  if (s == c->nshards || atomic_load(&wd->stop_requested)) return;
  uint64_t off = k * PREFETCH_CHUNK, end = off + PREFETCH_CHUNK;
  if (end > c->shards[s].size) end = c->shards[s].size;
  if (fault_touch((const char *)p->ck->maps[s] + off, (size_t)(end - off)) != 0)
    atomic_store(&p->failed, 1);
}

static void unregister_all(struct reg_ckpt *ck) {
  for (size_t i = 0; i < ck->ck->nshards; i++)
    if (ck->maps[i] != NULL) wd->backend.ops->host_unregister(wd->backend.ctx, ck->maps[i], ck->ck->shards[i].size);
}

static void prefetch_work(struct job *j) {
  struct prefetch *p = (struct prefetch *)j;
  const struct ckpt *c = p->ck->ck;
  for (size_t i = 0; i < p->nunpin; i++) unregister_all(p->unpin[i]);
  size_t n = 0;
  for (size_t s = 0; s < c->nshards; s++) {
    if (p->ck->maps[s] == NULL) continue;
    madvise(p->ck->maps[s], c->shards[s].size, MADV_WILLNEED);
    n += (size_t)((c->shards[s].size + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK);
  }
  fill_run(wd->fill, n, prefetch_chunk, p);
  if (p->pin && !atomic_load(&p->failed)) {
    double t0 = clock_s();
    size_t s = 0;
    for (; s < c->nshards; s++) {
      if (p->ck->maps[s] == NULL) continue;
      p->pin_rc = wd->backend.ops->host_register(wd->backend.ctx, p->ck->maps[s], c->shards[s].size, &p->pin_err);
      if (p->pin_rc != 0) break;
    }
    if (p->pin_rc != 0) {
      err_prefix(&p->pin_err, "%s: pinning %s", p->ck->path, c->shards[s].rel);
      for (size_t u = 0; u < s; u++)
        if (p->ck->maps[u] != NULL) wd->backend.ops->host_unregister(wd->backend.ctx, p->ck->maps[u], c->shards[u].size);
    } else {
      log_msg(LOG_INFO, "%s: registered %llu bytes for direct DMA in %.0f ms", p->ck->path,
              (unsigned long long)p->ck->pinned_bytes, (clock_s() - t0) * 1000);
    }
  }
  p->resident = reg_resident_bytes(p->ck);
}

static void prefetch_done(struct job *j) {
  struct prefetch *p = (struct prefetch *)j;
  p->ck->prefetching = false;
  for (size_t i = 0; i < p->nunpin; i++) {
    log_msg(LOG_INFO, "%s: unpinned to make room in host_pin_budget", p->unpin[i]->path);
    p->unpin[i]->unpinning = false;
    reg_unref(p->unpin[i]);
  }
  free(p->unpin);
  int failed = atomic_load(&p->failed);
  if (p->pin) {
    if (failed || p->pin_rc != 0) {
      wd->pinned_bytes -= p->ck->pinned_bytes;
      p->ck->pinned_bytes = 0;
    } else {
      atomic_store(&p->ck->pinned, true);
    }
  }
  if (failed) log_msg(LOG_WARN, "%s: prefetch hit a truncated shard", p->ck->path);
  else if (p->pin_rc != 0) log_msg(LOG_WARN, "%s", p->pin_err.msg);
  else log_msg(LOG_INFO, "prefetched %s", p->ck->path);
  if (p->req != NULL) {
    if (failed) {
      req_fail(p->req, WEIGHTD_E_FAULT, "%s: a shard was truncated while it was read", p->ck->path);
    } else if (p->pin_rc != 0) {
      req_fail_err(p->req, &p->pin_err);
    } else {
      cJSON *reply = msg_reply_ok(p->req->id);
      cJSON_AddItemToObject(reply, "checkpoint", ops_checkpoint_json(p->ck, p->resident));
      req_reply(p->req, reply, NULL, 0);
    }
  }
  reg_unref(p->ck);
  free(p);
}

static bool has_running_load(const struct reg_ckpt *ck) {
  for (struct res_set *s = wd->sets; s != NULL; s = s->next)
    if (s->ck == ck && s->state == SET_LOADING) return true;
  return false;
}

static uint64_t shard_bytes(const struct reg_ckpt *ck) {
  uint64_t n = 0;
  for (size_t i = 0; i < ck->ck->nshards; i++) n += ck->ck->shards[i].size;
  return n;
}

/* Chooses pinned checkpoints to unpin, least recently used first, so that need fits. */
static int choose_unpin(struct prefetch *p, uint64_t need, struct wd_error *err) {
  uint64_t freed = 0;
  while (wd->pinned_bytes - freed + need > wd->pin_budget) {
    struct reg_ckpt *victim = NULL;
    for (struct reg_ckpt *c = wd->ckpts; c != NULL; c = c->next) {
      bool chosen = false;
      for (size_t i = 0; i < p->nunpin; i++) chosen |= p->unpin[i] == c;
      if (c != p->ck && !chosen && atomic_load(&c->pinned) && !has_running_load(c) &&
          (victim == NULL || c->last_used_ms < victim->last_used_ms))
        victim = c;
    }
    if (victim == NULL)
      return err_set(err, WEIGHTD_E_LIMIT,
                     "%s: pinning %llu bytes exceeds host_pin_budget (%llu bytes, %llu in use by "
                     "checkpoints that are loading)",
                     p->ck->path, (unsigned long long)need, (unsigned long long)wd->pin_budget,
                     (unsigned long long)wd->pinned_bytes);
    struct reg_ckpt **nu = realloc(p->unpin, (p->nunpin + 1) * sizeof *nu);
    if (nu == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    p->unpin = nu;
    p->unpin[p->nunpin++] = victim;
    freed += victim->pinned_bytes;
  }
  return 0;
}

int reg_prefetch(struct reg_ckpt *ck, bool pin, struct request *wait_req, struct wd_error *err) {
  struct prefetch *p = calloc(1, sizeof *p);
  if (p == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  p->job.work = prefetch_work;
  p->job.done = prefetch_done;
  p->ck = ck;
  p->req = wait_req;
  p->pin = pin && !(wd->backend.ops->caps & WD_CAP_HOST_SLABS) && !atomic_load(&ck->pinned) && ck->pinned_bytes == 0;
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
      wd->pinned_bytes -= v->pinned_bytes;
      v->pinned_bytes = 0;
      reg_ref(v);
    }
    ck->pinned_bytes = need;
    wd->pinned_bytes += need;
  }
  reg_ref(ck);
  ck->prefetching = true;
  jobs_submit(wd->job_pool, &p->job);
  return 0;
}
