/*
 * registry_open.c - acquiring a checkpoint: resolving a path against the
 * model roots, checking an open entry is unchanged, or opening and mapping
 * it; and closing (see registry.h).
 *
 * DESIGN: each stage runs on a control job that reads only its struct acquire
 * (the path, a reference to the roots it started with, the client's access
 * check, the registry's thread-safe verdicts and ACL memory, and an entry
 * nobody else reads while OPENING or that is immutable once OPEN); the
 * done() callbacks update the registry on the loop thread (registry.c says
 * what the jobs share).
 */
#include "registry_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/log.h"
#include "clock.h"
#include "pathutil.h"
#include "remote/rckpt.h"
#include "remote/rroots.h"
#include "wire.h"

/* A remote checkpoint found unchanged this recently is not asked about again (a HEAD per shard) for a request. */
#define REG_REMOTE_RECHECK_MS 10000

struct acquire;

/* Remote opens and checks wait on the network: on their own pool, so that local ones never wait behind them. */
static struct jobs *pool_for(struct registry *r, const char *resolved) {
  return r->remote_jobs != NULL && wire_path_is_url(resolved) ? r->remote_jobs : r->control;
}

/* ---- acquiring: resolve, then verify or open ---------------------------------------- */

/* ACQ_CHECK: reg_check's one stage, the access check of an open checkpoint. */
enum acq_stage { ACQ_RESOLVE, ACQ_VERIFY, ACQ_OPEN, ACQ_CHECK };

struct acquire {
  struct job job;
  struct registry *reg;
  struct reg_roots *roots; /* referenced: what the job checks against */
  struct ckpt_verdicts *verdicts; /* the registry's (thread-safe; it outlives every open job) */
  enum acq_stage stage;
  reg_ready_fn ready;      /* acquire */
  reg_resolved_fn resolved_cb; /* resolve only */
  void *arg;
  uid_t uid; /* whom the entry is charged to */
  char *path;
  char *resolved;
  struct reg_ckpt *entry; /* ACQ_VERIFY / ACQ_OPEN / ACQ_CHECK: referenced */
  enum reg_check_mode mode; /* ACQ_CHECK */
  bool checked;            /* for a client whose own access is checked (access) */
  struct acc_check access;
  int rc;
  struct wd_error err;
};

static void acquire_free(struct acquire *a) {
  acc_check_fini(&a->access);
  reg_roots_unref(a->roots);
  free(a->path);
  free(a->resolved);
  free(a);
}

/*
 * The client's walk to the path it gave, decided before any answer of the
 * daemon's own resolution (which uses the daemon's rights): a directory on
 * the way it may not search refuses the request, whether the path resolved,
 * was missing, led outside the model roots or failed otherwise, so that
 * nothing behind that directory shows (not even whether a name exists).
 * Where it resolved, the client must also be able to search the directory
 * (or read the file) it ends on, as any use of the checkpoint needs. Only
 * what the walk reaches through directories the client may search shows,
 * which the client could learn itself.
 */
static void walk_check(struct acquire *a, const struct stat *st) {
  if (a->rc != 0) {
    a->rc = acc_check_failure(&a->access, a->path, a->rc, &a->err);
    return;
  }
  struct wd_error e;
  if (acc_check_path(&a->access, a->path, S_ISDIR(st->st_mode) ? ACC_EXEC : ACC_READ, NULL, &e) !=
      WEIGHTD_E_PERMISSION)
    return;
  free(a->resolved);
  a->resolved = NULL;
  a->err = e;
  a->rc = e.code;
}

/*
 * reg_check's verdict on files that are not the ones opened (gone, or
 * replaced): for a caller who could use what was read anyway, a pass; else
 * PERMISSION, since its access to what was read cannot be shown.
 */
static void check_same(struct acquire *a) {
  if (a->mode == REG_CHECK_PATHS || (a->rc != WEIGHTD_E_STALE && a->rc != WEIGHTD_E_NOT_FOUND)) return;
  if (a->mode == REG_CHECK_SAME_OR_GONE) {
    a->rc = 0;
    return;
  }
  a->rc = err_set(&a->err, WEIGHTD_E_PERMISSION,
                  "%s: the files it was read from are gone from their paths or replaced, so uid %u's access to "
                  "them cannot be shown (weightd reads for a client only what the client may read itself)",
                  a->access.label, (unsigned)a->access.cred.uid);
}

/* ACQ_RESOLVE of a URL: within a remote root, or PATH_DENIED; resolved is its canonical text. */
static void resolve_url(struct acquire *a) {
  struct rurl u;
  char label[320];
  err_quote(a->path, strlen(a->path), label, sizeof label);
  a->rc = rurl_parse(a->path, &u, &a->err);
  if (a->rc == 0) { /* a checkpoint's directory with or without a trailing '/' is one checkpoint */
    size_t k = strlen(u.key);
    while (k > 0 && u.key[k - 1] == '/') u.key[--k] = '\0';
  }
  if (a->rc == 0 && !rroots_allows(a->reg->remote, &u))
    a->rc = err_set(&a->err, WEIGHTD_E_PATH_DENIED, "%s: not within the remote roots%s", label,
                    a->reg->remote == NULL ? " (none is configured: remote_roots, --remote-root)" : "");
  if (a->rc == 0 && (a->resolved = rurl_format(&u)) == NULL) a->rc = err_set(&a->err, WEIGHTD_E_NOMEM, "out of memory");
  rurl_free(&u);
}

/* ACQ_OPEN of a URL: the checkpoint read with range GETs, its remote source the entry's own. */
static void open_url(struct acquire *a) {
  struct rck *k = NULL;
  a->rc = rck_open(rroots_target(a->reg->remote), a->resolved, &k, &a->err);
  if (a->rc == 0) a->rc = ld_source_remote_open(k, &a->entry->src, &a->err);
  if (a->rc != 0) {
    rck_close(k);
    return;
  }
  a->entry->ck = k->ck; /* the entry is OPENING: nobody else reads it yet. Freed after the source, as a file's */
  a->entry->remote = true;
  atomic_store(&a->entry->remote_checked_ms, clock_ms());
  a->entry->charge = reg_entry_charge(a->entry);
}

static void acquire_work(struct job *j) {
  struct acquire *a = (struct acquire *)j;
  const struct reg_roots *rt = a->roots;
  /* A stage may run long after the one before (a waiter retries once another open ends): what an earlier
   * stage found searchable is checked afresh, the ACL memory keeping that cheap. */
  acc_check_reset(&a->access);
  switch (a->stage) {
  case ACQ_RESOLVE: {
    if (wire_path_is_url(a->path)) {
      resolve_url(a);
      return;
    }
    /* Resolved with lstat and readlink only, and judged against the roots without
     * saying whether anything outside them exists (path_resolve). */
    const struct path_roots roots = {(const char *const *)rt->dirs, rt->n};
    char label[320];
    struct path_resolved res;
    a->rc = path_resolve(a->path, &roots, err_quote(a->path, strlen(a->path), label, sizeof label), &res, &a->err);
    if (a->rc == 0) a->resolved = res.real;
    if (a->checked) walk_check(a, &res.st);
    return;
  }
  case ACQ_VERIFY:
    if (a->entry->remote) { /* its objects are still the ones opened (HEAD): nobody's rights to check */
      uint64_t now = clock_ms(), last = atomic_load(&a->entry->remote_checked_ms);
      if (last != 0 && now - last < REG_REMOTE_RECHECK_MS) return; /* checked a moment ago */
      a->rc = ld_source_unchanged(a->entry->src, &a->err);
      if (a->rc == 0) atomic_store(&a->entry->remote_checked_ms, now);
      else if (a->rc != WEIGHTD_E_STALE && a->rc != WEIGHTD_E_NOMEM) {
        /* The store cannot say now (down, slow, refusing): what is open stays served. Every range read carries
         * If-Match and every load checks its objects again after, so no changed bytes get through. */
        log_msg(LOG_WARN, "%s: cannot check its objects now (%s): serving it as opened", a->entry->path, a->err.msg);
        a->rc = 0;
      }
      return;
    }
    a->rc = ckpt_check_unchanged(a->entry->ck, &a->err);
    if (a->rc == 0 && a->checked) a->rc = ckpt_access_check(a->entry->ck, &a->access, true, &a->err);
    return;
  case ACQ_CHECK:
    if (a->entry->remote) {
      a->rc = 0;
      return;
    }
    a->rc = ckpt_access_check(a->entry->ck, &a->access, a->mode != REG_CHECK_PATHS, &a->err);
    check_same(a);
    return;
  case ACQ_OPEN: {
    if (wire_path_is_url(a->resolved)) {
      open_url(a);
      return;
    }
    bool remembered = false;
    struct ckpt_opts opts = {.model_roots = (const char *const *)rt->dirs,
                             .nroots = rt->n,
                             .verdicts = a->verdicts,
                             .remembered = &remembered,
                             .access = a->checked ? &a->access : NULL,
                             .manifest = true};
    struct ckpt *c = NULL;
    a->rc = ckpt_open(a->resolved, &opts, &c, &a->err);
    if (a->rc != 0) {
      if (remembered) log_msg(LOG_DEBUG, "%s: refused from the remembered verdict (the files are unchanged)", a->resolved);
      return;
    }
    a->entry->ck = c; /* the entry is OPENING: nobody else reads it yet */
    a->rc = ld_source_mmap_open(c, &a->entry->src, &a->err);
    a->entry->charge = reg_entry_charge(a->entry);
    for (size_t i = 0; i < c->nshards; i++) a->entry->nmaps += c->shards[i].size > 0;
    return;
  }
  }
}

static void acquire_resolved(struct acquire *a);

/*
 * Tells every waiter; on success each is charged for first, and one its
 * uid's shares cannot hold gets LIMIT. A waiter with other credentials
 * acquires again. Returns how many got the entry.
 */
static size_t notify_waiters(struct reg_ckpt *e, const struct wd_error *err) {
  struct reg_waiter *w = e->waiters;
  e->waiters = NULL;
  size_t given = 0;
  while (w != NULL) {
    struct reg_waiter *next = w->next;
    struct wd_error cerr = {0};
    if (w->retry != NULL) {
      acquire_resolved(w->retry);
    } else if (err == NULL && reg_bound_charge(e->reg, e, w->uid, &cerr) != 0) {
      w->cb(w->arg, NULL, &cerr);
    } else {
      if (err == NULL) reg_ref(e);
      given += err == NULL;
      w->cb(w->arg, err == NULL ? e : NULL, err);
    }
    free(w);
    w = next;
  }
  return given;
}

static int add_waiter(struct reg_ckpt *e, reg_ready_fn cb, void *arg, uid_t uid, struct acquire *retry) {
  struct reg_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) return -1;
  w->cb = cb;
  w->arg = arg;
  w->uid = uid;
  w->retry = retry;
  w->next = e->waiters;
  e->waiters = w;
  return 0;
}

/* Whether a may take the verdict of e's open as its own: the open checks the same access, or none for both. */
static bool shares_open(const struct acquire *a, const struct reg_ckpt *e) {
  if (!a->checked || e->open_for == NULL) return !a->checked && e->open_for == NULL;
  return acc_cred_equal(&a->access.cred, e->open_for);
}

static void fail_nomem(reg_ready_fn cb, void *arg) {
  struct wd_error err;
  err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
  cb(arg, NULL, &err);
}

/*
 * Starts opening a->resolved, if the bounds leave room for it, or joins an
 * open already under way: as a waiter for its verdict when it checks the
 * same access, else to acquire again once it ends.
 */
static void start_open(struct acquire *a) {
  struct registry *r = a->reg;
  if (r->destroyed) {
    struct wd_error err;
    err_set(&err, WEIGHTD_E_SHUTDOWN, "the daemon is shutting down");
    a->ready(a->arg, NULL, &err);
    acquire_free(a);
    return;
  }
  for (struct reg_ckpt *e = r->ckpts; e != NULL; e = e->next) {
    if (e->state == REG_OPENING && strcmp(e->path, a->resolved) == 0) {
      bool shared = shares_open(a, e);
      if (add_waiter(e, shared ? a->ready : NULL, shared ? a->arg : NULL, a->uid, shared ? NULL : a) != 0) {
        fail_nomem(a->ready, a->arg);
        acquire_free(a);
      } else if (shared) {
        acquire_free(a);
      }
      return;
    }
  }
  struct wd_error berr = {0};
  if (reg_bound_admit(r, a->uid, a->resolved, &berr) != 0) {
    a->ready(a->arg, NULL, &berr);
    acquire_free(a);
    return;
  }
  struct reg_ckpt *e = calloc(1, sizeof *e);
  if (e == NULL || (e->path = strdup(a->resolved)) == NULL || add_waiter(e, a->ready, a->arg, a->uid, NULL) != 0) {
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
  e->open_for = a->checked ? &a->access.cred : NULL;
  e->next = r->ckpts;
  r->ckpts = e;
  r->nlisted++;
  a->stage = ACQ_OPEN;
  a->entry = e;
  a->rc = 0;
  jobs_submit(pool_for(r, a->resolved), &a->job);
}

/* The path is resolved: verifies the open checkpoint of that path, or opens it. */
static void acquire_resolved(struct acquire *a) {
  struct reg_ckpt *e = reg_find(a->reg, a->resolved);
  if (e == NULL) {
    start_open(a);
    return;
  }
  reg_ref(e);
  a->entry = e;
  a->stage = ACQ_VERIFY;
  a->rc = 0;
  jobs_submit(pool_for(a->reg, a->resolved), &a->job);
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
    acquire_resolved(a);
    return;
  }
  case ACQ_CHECK: {
    struct reg_ckpt *e = a->entry;
    a->entry = NULL;
    if (a->rc == 0) {
      a->ready(a->arg, e, NULL); /* passes our reference on */
    } else {
      reg_unref(e);
      a->ready(a->arg, NULL, &a->err);
    }
    acquire_free(a);
    return;
  }
  case ACQ_VERIFY: {
    struct reg_ckpt *e = a->entry;
    a->entry = NULL;
    struct wd_error cerr = {0};
    if (a->rc == 0 && !e->detached && reg_bound_charge(a->reg, e, a->uid, &cerr) != 0) {
      reg_unref(e);
      a->ready(a->arg, NULL, &cerr);
      acquire_free(a);
      return;
    }
    if (a->rc == 0 && !e->detached) {
      reg_touch(e);
      a->ready(a->arg, e, NULL); /* passes our reference on */
      acquire_free(a);
      return;
    }
    if (a->rc != 0 && a->rc != WEIGHTD_E_STALE) { /* not the client's to read (the entry stays for others) */
      reg_unref(e);
      a->ready(a->arg, NULL, &a->err);
      acquire_free(a);
      return;
    }
    if (a->rc == WEIGHTD_E_STALE && !e->detached) {
      log_msg(LOG_INFO, "%s; reopening", a->err.msg);
      reg_detach(e);
    }
    reg_unref(e);
    a->rc = 0;
    start_open(a);
    return;
  }
  case ACQ_OPEN: {
    struct reg_ckpt *e = a->entry;
    e->open_for = NULL; /* it points into a, freed below */
    bool bounded = a->rc == 0 && (a->rc = reg_bound_open(a->reg, e, &a->err)) != 0;
    if (a->rc == 0) {
      e->state = REG_OPEN;
      reg_touch(e);
      log_msg(LOG_INFO, "opened %s: %zu shards, %zu tensors, %llu bytes (%llu charged)", e->path, e->ck->nshards,
              e->ck->ntensors, (unsigned long long)e->ck->total_bytes, (unsigned long long)e->charge);
      if (notify_waiters(e, NULL) == 0 && !e->detached) {
        log_msg(LOG_INFO, "closed %s: every request for it was refused by a bound", e->path);
        reg_detach(e);
      } else if (!e->detached) {
        reg_pin_on_open(a->reg, e);
      }
    } else {
      e->state = REG_FAILED;
      ckpt_err_name(&a->err, e->path); /* the mmap source's errors name the checkpoint too */
      if (!bounded) log_msg(LOG_WARN, "cannot open %s", a->err.msg); /* a refusal logs itself */
      reg_detach(e);
      notify_waiters(e, &a->err);
    }
    reg_unref(e); /* the job's reference */
    acquire_free(a);
    return;
  }
  }
}

static struct acquire *acquire_new(struct registry *r, const char *path, const struct acc_cred *who,
                                   const char *label) {
  struct acquire *a = calloc(1, sizeof *a);
  if (a == NULL || (a->path = strdup(path)) == NULL) {
    free(a);
    return NULL;
  }
  if (who != NULL) {
    char q[320];
    acc_check_init(&a->access, who, r->acls, label ? label : err_quote(path, strlen(path), q, sizeof q));
    a->checked = true;
  }
  a->job.work = acquire_work;
  a->job.done = acquire_done;
  a->reg = r;
  a->roots = reg_roots_ref(r->roots);
  a->verdicts = r->verdicts;
  a->stage = ACQ_RESOLVE;
  a->uid = REG_UID_DAEMON; /* reg_acquire_as says whom else */
  return a;
}

void reg_acquire_as(struct registry *r, const char *path, uid_t uid, const struct acc_cred *who, reg_ready_fn cb,
                    void *arg) {
  struct acquire *a = acquire_new(r, path, who, NULL);
  if (a == NULL) {
    fail_nomem(cb, arg);
    return;
  }
  a->ready = cb;
  a->arg = arg;
  a->uid = uid;
  jobs_submit(r->control, &a->job);
}

void reg_acquire(struct registry *r, const char *path, const struct acc_cred *who, reg_ready_fn cb, void *arg) {
  reg_acquire_as(r, path, REG_UID_DAEMON, who, cb, arg);
}

void reg_resolve(struct registry *r, const char *path, const struct acc_cred *who, reg_resolved_fn cb, void *arg) {
  struct acquire *a = acquire_new(r, path, who, NULL);
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

void reg_check(struct registry *r, struct reg_ckpt *ck, const struct acc_cred *who, const char *label,
               enum reg_check_mode mode, reg_ready_fn cb, void *arg) {
  if (who == NULL) {
    reg_ref(ck);
    cb(arg, ck, NULL);
    return;
  }
  struct acquire *a = acquire_new(r, ck->path, who, label);
  if (a == NULL) {
    fail_nomem(cb, arg);
    return;
  }
  reg_ref(ck);
  a->entry = ck;
  a->mode = mode;
  a->stage = ACQ_CHECK;
  a->ready = cb;
  a->arg = arg;
  jobs_submit(r->control, &a->job);
}

/* ---- readable: which of many open checkpoints a client may read ------------------------------ */

struct readable {
  struct job job;
  struct reg_ckpt **cks; /* the caller's (alive until cb) */
  size_t n;
  bool *readable;
  struct acc_check access;
  reg_readable_fn cb;
  void *arg;
};

static void readable_work(struct job *j) {
  struct readable *q = (struct readable *)j;
  for (size_t i = 0; i < q->n; i++) {
    struct wd_error err;
    acc_check_reset(&q->access); /* a checkpoint's directories are shared by its files, not by every checkpoint */
    q->readable[i] = q->cks[i]->remote || ckpt_access_check(q->cks[i]->ck, &q->access, true, &err) == 0;
  }
}

static void readable_done(struct job *j) {
  struct readable *q = (struct readable *)j;
  q->cb(q->arg, q->readable);
  acc_check_fini(&q->access);
  free(q->readable);
  free(q->cks);
  free(q);
}

void reg_readable(struct registry *r, struct reg_ckpt *const *cks, size_t n, const struct acc_cred *who,
                  reg_readable_fn cb, void *arg) {
  struct readable *q = calloc(1, sizeof *q);
  if (q == NULL || (q->readable = calloc(n ? n : 1, sizeof *q->readable)) == NULL ||
      (q->cks = malloc((n ? n : 1) * sizeof *q->cks)) == NULL) {
    if (q != NULL) free(q->readable);
    free(q);
    cb(arg, NULL);
    return;
  }
  memcpy(q->cks, cks, n * sizeof *cks);
  q->n = n;
  acc_check_init(&q->access, who, r->acls, "status");
  q->cb = cb;
  q->arg = arg;
  q->job.work = readable_work;
  q->job.done = readable_done;
  jobs_submit(r->control, &q->job);
}

int reg_close(struct registry *r, const char *resolved, struct wd_error *err) {
  struct reg_ckpt *e = reg_find(r, resolved);
  if (e == NULL) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s is not open", resolved);
  int users = e->refs - 1 - e->observers; /* a measurement under way holds it alive, not open */
  if (users > 0)
    return err_set(err, WEIGHTD_E_BUSY, "%s is in use by %d resident set(s) or running operation(s)", resolved,
                   users);
  log_msg(LOG_INFO, "closed %s", e->path);
  reg_detach(e);
  return 0;
}
