/*
 * registry.c - the registry's table of open checkpoints: creation, the model
 * roots, entries and their references, release and destruction (see
 * registry.h). Opening is registry_open.c; the page cache, prefetch and the
 * pinned tier are registry_pin.c.
 *
 * DESIGN: the registry's list and entries are loop-owned. Resolving a path,
 * validating shards, mapping, checking that shards are unchanged, prefetching
 * and pinning all run on job threads (prefetch chunks on the fill threads);
 * each job reads only its own struct: the entry it was handed (immutable once
 * open, but for its loop-owned pin list, which jobs never read: a pin job is
 * handed the ranges to register, an unpin job the ranges to unregister; an
 * entry nothing uses any more is handed whole to a release job, which
 * unregisters its pins and unmaps its shards), a
 * reference to the model roots it started with, the backend's const table,
 * the registry's atomic stop flag, its memory of failed index checks and
 * its memory of access ACLs (each has its own lock). Their done() callbacks update the registry on the
 * loop thread and run the caller's continuation.
 */
#include "registry_internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"

/*
 * Failed index checks remembered (ckpt_verdicts): 64 verdicts of about 1 KiB,
 * the oldest forgotten first, so a client that repeats the open of one bad
 * checkpoint costs reading its index and a stat per shard, not a header parse.
 */
#define REG_VERDICTS 64

/* ---- roots ------------------------------------------------------------------------ */

void reg_roots_unref(struct reg_roots *rt) {
  if (rt == NULL || --rt->refs > 0) return;
  for (size_t i = 0; i < rt->n; i++) free(rt->dirs[i]);
  free(rt->dirs);
  free(rt);
}

struct reg_roots *reg_roots_ref(struct reg_roots *rt) {
  rt->refs++;
  return rt;
}

void reg_remote_set(struct registry *r, const struct rroots *remote, struct jobs *pool) {
  r->remote = remote;
  r->remote_jobs = pool;
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
      reg_roots_unref(rt);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
  reg_roots_unref(r->roots);
  r->roots = rt;
  return 0;
}

static void sources_free(struct registry *r) {
  for (size_t i = 0; i < r->nsources; i++) free(r->source_dirs[i]);
  free(r->source_dirs);
  free(r->source_choices);
  r->source_dirs = NULL;
  r->source_choices = NULL;
  r->nsources = 0;
}

int reg_sources_set(struct registry *r, const char *const *dirs, const enum ld_source_choice *choices, size_t n,
                    struct wd_error *err) {
  char **d = calloc(n ? n : 1, sizeof *d);
  enum ld_source_choice *c = calloc(n ? n : 1, sizeof *c);
  bool ok = d != NULL && c != NULL;
  for (size_t i = 0; ok && i < n; i++) {
    ok = (d[i] = strdup(dirs[i])) != NULL;
    c[i] = choices[i];
  }
  if (!ok) {
    for (size_t i = 0; d != NULL && i < n; i++) free(d[i]);
    free(d);
    free(c);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  sources_free(r);
  r->source_dirs = d;
  r->source_choices = c;
  r->nsources = n;
  return 0;
}

bool reg_source_for(const struct registry *r, const char *path, enum ld_source_choice *out) {
  size_t best = 0;
  bool found = false;
  for (size_t i = 0; i < r->nsources; i++) {
    size_t n = strlen(r->source_dirs[i]);
    bool under = strncmp(path, r->source_dirs[i], n) == 0 && (path[n] == '/' || path[n] == '\0' ||
                                                               (n > 0 && r->source_dirs[i][n - 1] == '/'));
    if (under && (!found || n > best)) {
      best = n;
      *out = r->source_choices[i];
      found = true;
    }
  }
  return found;
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
  r->pin_mode = p->pin_mode;
  r->limits = p->limits;
  r->loop = p->loop;
  atomic_init(&r->stopping, false);
  if ((r->verdicts = ckpt_verdicts_create(REG_VERDICTS)) == NULL || (r->acls = acc_cache_create()) == NULL) {
    ckpt_verdicts_free(r->verdicts);
    free(r);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  if (reg_roots_set(r, NULL, 0, err) != 0) {
    ckpt_verdicts_free(r->verdicts);
    acc_cache_free(r->acls);
    free(r);
    return err->code;
  }
  if (r->loop != NULL) {
    uv_timer_init(r->loop, &r->idle_timer);
    r->idle_timer.data = r;
    r->timer_open = true;
    reg_bound_timer(r);
  }
  *out = r;
  return 0;
}

/* ---- registrations ------------------------------------------------------------------------ */

/* Whether the backend registers host memory (pins) at all. */
bool reg_registers(const struct registry *r) {
  return r->backend->ops->host_register != NULL && !(r->backend->ops->caps & WD_CAP_HOST_SLABS);
}

/* Unregisters n ranges of ck's mappings (a job, or entry_free). */
void reg_unregister_ranges(const struct wd_backend *b, const struct reg_ckpt *ck, const struct plan_range *v,
                           size_t n) {
  for (size_t i = 0; i < n; i++)
    b->ops->host_unregister(b->ctx, (char *)ld_source_map(ck->src, v[i].shard) + v[i].off, (size_t)v[i].len);
}

bool reg_pin_wants_ranges(const struct registry *r) { return r->pin_mode != REG_PIN_OFF && reg_registers(r); }
struct reg_ckpt *reg_first(const struct registry *r) { return r->ckpts; }
void reg_stop(struct registry *r) { atomic_store(&r->stopping, true); }

/* ---- references ------------------------------------------------------------------- */

void reg_ref(struct reg_ckpt *ck) { ck->refs++; }

static void registry_free(struct registry *r) {
  reg_roots_unref(r->roots);
  sources_free(r);
  ckpt_verdicts_free(r->verdicts);
  acc_cache_free(r->acls);
  free(r);
}

void reg_free_if_done(struct registry *r) {
  if (r->destroyed && r->nentries == 0 && !r->timer_open) registry_free(r);
}

static void timer_closed(uv_handle_t *h) {
  struct registry *r = h->data;
  r->timer_open = false;
  reg_free_if_done(r);
}

/* Unregisters an unused entry's pins and unmaps its shards: slow (tens of ms per GiB pinned), so on a job. */
static void entry_release(struct reg_ckpt *ck) {
  const struct wd_backend *b = ck->reg->backend;
  if (ck->npins > 0 && b->ops->host_unregister != NULL) reg_unregister_ranges(b, ck, ck->pins, ck->npins);
  ld_source_close(ck->src);
  ck->src = NULL;
}

/* Frees what is left of an entry once released. The registry itself goes with its last entry once destroyed. */
static void entry_finish(struct reg_ckpt *ck) {
  struct registry *r = ck->reg;
  free(ck->pins);
  reg_digests_free(ck->digests);
  reg_plan_memo_free(ck);
  free(ck->uids);
  ckpt_free(ck->ck);
  free(ck->path);
  free(ck);
  r->nentries--;
  reg_free_if_done(r);
}

struct release_job {
  struct job job;
  struct reg_ckpt *ck; /* unused: only this job reads it */
};

static void release_work(struct job *j) { entry_release(((struct release_job *)j)->ck); }

static void release_done(struct job *j) {
  entry_finish(((struct release_job *)j)->ck);
  free(j);
}

/*
 * Frees an entry nothing uses. Its pins and mappings are released on a bulk
 * job (the loop never waits for cudaHostUnregister or munmap), which the
 * daemon's stop drains; once the registry is destroyed, or without memory for
 * the job, here.
 */
static void entry_free(struct reg_ckpt *ck) {
  struct registry *r = ck->reg;
  r->pinned_bytes -= ck->pinned_bytes;
  ck->pinned_bytes = 0;
  struct release_job *rj = r->bulk != NULL && !r->destroyed && ck->src != NULL ? calloc(1, sizeof *rj) : NULL;
  if (rj != NULL) {
    rj->job.work = release_work;
    rj->job.done = release_done;
    rj->ck = ck;
    jobs_submit(r->bulk, &rj->job);
    return;
  }
  entry_release(ck);
  entry_finish(ck);
}

void reg_unref(struct reg_ckpt *ck) {
  if (ck == NULL) return;
  if (--ck->refs == 0) entry_free(ck);
}

void reg_observe(struct reg_ckpt *ck) {
  reg_ref(ck);
  ck->observers++;
}

void reg_unobserve(struct reg_ckpt *ck) {
  ck->observers--;
  reg_unref(ck);
}

void reg_touch(struct reg_ckpt *ck) {
  ck->last_used_ms = clock_ms();
  ck->use_seq = ++ck->reg->use_clock;
}

void reg_detach(struct reg_ckpt *ck) {
  if (ck->detached) return;
  struct registry *r = ck->reg;
  struct reg_ckpt **pp = &r->ckpts;
  while (*pp != NULL && *pp != ck) pp = &(*pp)->next;
  if (*pp == ck) {
    *pp = ck->next;
    r->nlisted--;
  }
  if (ck->counted) {
    r->charged -= ck->charge;
    r->nmaps -= ck->nmaps;
    ck->counted = false;
  }
  ck->detached = true;
  reg_unref(ck); /* the registry's reference */
}

void reg_destroy(struct registry *r) {
  if (r == NULL) return;
  while (r->ckpts != NULL) reg_detach(r->ckpts);
  r->destroyed = true; /* the last entry to go, or the timer's close, frees it */
  if (r->timer_open) {
    uv_timer_stop(&r->idle_timer);
    uv_close((uv_handle_t *)&r->idle_timer, timer_closed);
  }
  reg_free_if_done(r);
}

struct reg_ckpt *reg_find(struct registry *r, const char *resolved) {
  for (struct reg_ckpt *ck = r->ckpts; ck != NULL; ck = ck->next)
    if (ck->state == REG_OPEN && strcmp(ck->path, resolved) == 0) return ck;
  return NULL;
}

void reg_load_begin(struct reg_ckpt *ck) { ck->loads++; }
void reg_load_end(struct reg_ckpt *ck) {
  ck->loads--;
  reg_touch(ck);
}

int reg_pins_copy(const struct reg_ckpt *ck, struct plan_range **out, size_t *n) {
  *out = NULL;
  *n = 0;
  if (ck->npins == 0) return 0;
  struct plan_range *v = malloc(ck->npins * sizeof *v);
  if (v == NULL) return WEIGHTD_E_NOMEM;
  memcpy(v, ck->pins, ck->npins * sizeof *v);
  *out = v;
  *n = ck->npins;
  return 0;
}

bool reg_pinned_whole(const struct reg_ckpt *ck) {
  if (ck->ck == NULL || ck->npins == 0) return false;
  size_t k = 0;
  for (size_t s = 0; s < ck->ck->nshards; s++) {
    if (ld_source_map(ck->src, (uint32_t)s) == NULL) continue;
    uint64_t pos = 0;
    while (k < ck->npins && ck->pins[k].shard < s) k++;
    while (k < ck->npins && ck->pins[k].shard == s && ck->pins[k].off == pos) pos += ck->pins[k++].len;
    if (pos < ck->ck->shards[s].size) return false;
  }
  return true;
}

uint64_t reg_pins_bytes(const struct reg_ckpt *ck) { return plan_ranges_bytes(ck->pins, ck->npins); }

int reg_plan_ranges(const struct reg_ckpt *ck, const struct plan *p, struct plan_range **out, size_t *n,
                    struct wd_error *err) {
  return plan_ranges(p, ck->ck, (uint64_t)sysconf(_SC_PAGESIZE), REG_PIN_MERGE_GAP, out, n, err);
}
