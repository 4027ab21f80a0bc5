/*
 * survive.c - restart survival (see survive.h): storing the sets and their
 * description as they change, and re-adopting them at start.
 *
 * DESIGN: everything runs on the loop thread. A change (residency's
 * res_on_change) stores a new description at once, before the reply that
 * reports it (an attach's lease) is sent: whatever a client was told is in
 * the store when it hears it. Re-adoption stores nothing until it is done,
 * then one description of what it kept. Re-adoption holds one
 * `struct readopt` per described set while its checkpoint is acquired on
 * the registry's control jobs; the last callback finishes the start.
 */
#include "survive.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "fdstore.h"
#include "base/log.h"
#include "base/sealed_memfd.h"
#include "service.h"
#include "setdesc.h"
#include "tensor_table.h"

#define SLAB_PREFIX "wd-slab-"
#define TABLE_PREFIX "wd-table-"
#define DESC_PREFIX "wd-sets-"

struct survive {
  struct daemon *d;
  struct fdstore *fs;
  uint64_t generation;
  bool frozen;
  bool adopting; /* re-adoption runs: publish once it is done */
  bool pending;  /* a change that ends something waits for flush_timer (or the next change that publishes) */
  uv_timer_t grace_timer;
  uv_timer_t flush_timer;
  int open_timers; /* while closing */
  size_t max_fds;  /* what the store holds (fd_store_max, $FDSTORE, or the shipped unit's 512) */
  /* Re-adoption at start. */
  struct setdesc desc;
  const void *map;
  size_t map_len;
  char desc_name[64];
  size_t waiting;
  unsigned adopted, dropped, leases;
  uint64_t adopted_bytes;
  uint64_t started_ns;
  void (*done)(void *arg);
  void *done_arg;
};

struct readopt {
  struct survive *sv;
  size_t idx;
};

static bool has_prefix(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

/* Whether a store name is one this daemon stores (and so removes when unused). */
static bool ours(const char *name) {
  return has_prefix(name, SLAB_PREFIX) || has_prefix(name, TABLE_PREFIX) || has_prefix(name, DESC_PREFIX);
}

/* ---- storing ------------------------------------------------------------------------------ */

/* Whether s goes into the store: READY, and memory that outlives the process. */
static bool storable(const struct res_set *s) {
  return s->state == SET_READY && s->ncorrupt == 0 && s->load.slab != NULL && /* a corrupt one: never adopted */
         (s->load.slab->kind == WD_HANDLE_FD || s->load.slab->kind == WD_HANDLE_CUDA_VMM);
}

/*
 * Fills one set's entry: its slab and its tensor table are stored under
 * their names the first time (they never change), so that describing a set
 * again costs only its names and identities.
 */
static int describe_set(struct survive *sv, struct res_set *s, struct setdesc_set *o, struct wd_error *err) {
  struct daemon *d = sv->d;
  char name[64], tname[64];
  snprintf(name, sizeof name, SLAB_PREFIX "%s", s->id);
  snprintf(tname, sizeof tname, TABLE_PREFIX "%s", s->id);
  bool stored = fdstore_has(sv->fs, name);
  size_t need = !stored + !fdstore_has(sv->fs, tname);
  /* One place stays free for the next description, stored before the one it replaces goes. */
  if (need > 0 && fdstore_count(sv->fs) + need + 1 > sv->max_fds)
    return err_set(err, WEIGHTD_E_LIMIT,
                   "the fd store is full (%zu of %zu descriptors; a set takes two: fd_store_max, "
                   "FileDescriptorStoreMax= in the unit)",
                   fdstore_count(sv->fs), sv->max_fds);
  int rc = 0;
  if (!stored || s->store_alloc_bytes == 0) { /* once per set (a re-adopted one has them from its description) */
    struct wd_handle h = {.fd = -1};
    rc = d->backend.ops->slab_export(d->backend.ctx, s->load.slab, &h, err);
    if (rc == 0 && !stored) rc = fdstore_put(sv->fs, name, h.fd, err);
    if (h.fd >= 0) close(h.fd);
    if (rc != 0) return rc;
    s->store_alloc_bytes = h.bytes;
    memcpy(s->store_alloc_id, h.alloc_id, sizeof s->store_alloc_id);
  }
  if ((rc = res_set_table_fd(s, err)) != 0) return rc;
  if (!fdstore_has(sv->fs, tname) && (rc = fdstore_put(sv->fs, tname, s->table_fd, err)) != 0) return rc;
  const struct ckpt *c = s->ck->ck;
  o->id = s->id;
  o->path = s->ck->path;
  o->uuid = res_device(d->res, s->device)->info.uuid;
  o->handle_kind = (uint32_t)s->load.slab->kind;
  o->slab_bytes = s->plan->slab_bytes;
  o->alloc_bytes = s->store_alloc_bytes > o->slab_bytes ? s->store_alloc_bytes : o->slab_bytes;
  memcpy(o->alloc_id, s->store_alloc_id, sizeof o->alloc_id);
  o->fdname = strdup(name);
  o->table_fdname = strdup(tname);
  o->plan_key = s->plan->key;
  o->has_ids = true;
  memcpy(o->layout_id, c->layout_id, sizeof o->layout_id);
  o->content_known = s->ck->content_known;
  if (o->content_known) memcpy(o->content_id, s->ck->content_id, sizeof o->content_id);
  o->nshards = c->nshards;
  o->shards = calloc(c->nshards, sizeof *o->shards);
  if (o->fdname == NULL || o->table_fdname == NULL || o->shards == NULL)
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (size_t i = 0; i < c->nshards; i++)
    o->shards[i] = (struct setdesc_shard){.name = c->shards[i].rel, .dev = (uint64_t)c->shards[i].dev,
                                          .ino = (uint64_t)c->shards[i].ino, .size = c->shards[i].size,
                                          .mtime_ns = c->shards[i].mtime_ns};
  o->table_len = (size_t)s->table_bytes;
  o->table_sum = s->table_sum;
  return 0;
}

/* What describe_set allocated in o. */
static void entry_free(struct setdesc_set *o) {
  free(o->fdname);
  free(o->table_fdname);
  free(o->shards);
  memset(o, 0, sizeof *o);
}

/* Removes every name of ours that the description `keep` (and its slabs) no longer uses. */
static void remove_stale(struct survive *sv, const char *keep, const struct setdesc *desc) {
  size_t n = fdstore_count(sv->fs);
  char **gone = calloc(n ? n : 1, sizeof *gone);
  size_t ngone = 0;
  for (size_t i = 0; gone != NULL && i < n; i++) {
    const char *name = fdstore_name(sv->fs, i);
    bool used = strcmp(name, keep) == 0;
    for (size_t k = 0; !used && k < desc->nsets; k++)
      used = strcmp(name, desc->sets[k].fdname) == 0 || strcmp(name, desc->sets[k].table_fdname) == 0;
    if (!used && ours(name)) gone[ngone++] = strdup(name);
  }
  for (size_t i = 0; i < ngone; i++) {
    if (gone[i] != NULL) fdstore_remove(sv->fs, gone[i]);
    free(gone[i]);
  }
  free(gone);
}

/* Stores a new generation of the description of every storable set, then removes stale names. */
static void publish(struct survive *sv) {
  sv->pending = false;
  uv_timer_stop(&sv->flush_timer);
  if (!fdstore_enabled(sv->fs) || sv->frozen) return;
  if (sv->generation >= SETDESC_COUNTER_MAX) { /* only a description that said so brings it here */
    log_msg(LOG_WARN, "cannot store the set description: generation %llu is the last (restarts keep the previous "
            "one)", SETDESC_COUNTER_MAX);
    return;
  }
  struct daemon *d = sv->d;
  size_t nsets = 0, nleases = 0;
  for (struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) nsets += storable(s);
  for (struct lease *l = res_first_lease(d->res); l != NULL; l = l->next) nleases++;
  struct setdesc desc = {.generation = sv->generation + 1};
  desc.sets = calloc(nsets ? nsets : 1, sizeof *desc.sets);
  desc.leases = calloc(nleases ? nleases : 1, sizeof *desc.leases);
  struct wd_error err = {0};
  int rc = desc.sets && desc.leases ? 0 : err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
  for (struct res_set *s = res_first_set(d->res); rc == 0 && s != NULL; s = s->next) {
    if (!storable(s)) continue;
    struct wd_error serr = {0};
    struct setdesc_set *o = &desc.sets[desc.nsets++];
    if (describe_set(sv, s, o, &serr) != 0) {
      if (!s->store_refused) /* once per set: this runs at every change */
        log_msg(LOG_WARN, "set %s will not survive a restart: %s", s->id, serr.msg);
      s->store_refused = true;
      entry_free(o);
      desc.nsets--;
    }
  }
  for (struct lease *l = res_first_lease(d->res); rc == 0 && l != NULL; l = l->next)
    for (size_t k = 0; k < desc.nsets; k++)
      if (strcmp(desc.sets[k].id, l->set->id) == 0) {
        desc.leases[desc.nleases++] = (struct setdesc_lease){.id = l->id, .set_id = l->set->id,
                                                              .uid = (uint32_t)l->holder.uid,
                                                              .pid = (int32_t)l->holder.pid, .client = l->holder.client};
        break;
      }
  unsigned char *buf = NULL;
  size_t len = 0;
  int fd = -1;
  char name[64];
  snprintf(name, sizeof name, DESC_PREFIX "%" PRIu64, desc.generation);
  if (rc == 0) rc = setdesc_write(&desc, &buf, &len, &err);
  if (rc == 0) rc = sealed_memfd_create("weightd-sets", buf, len, &fd, &err);
  if (rc == 0) rc = fdstore_put(sv->fs, name, fd, &err);
  if (fd >= 0) close(fd);
  free(buf);
  if (rc == 0) {
    sv->generation = desc.generation;
    remove_stale(sv, name, &desc);
    log_msg(LOG_DEBUG, "stored %s: %zu set(s), %zu lease(s), %zu bytes", name, desc.nsets, desc.nleases, len);
  } else {
    log_msg(LOG_WARN, "cannot store the set description (restarts keep the previous one): %s", err.msg);
  }
  for (size_t k = 0; k < desc.nsets; k++) entry_free(&desc.sets[k]);
  free(desc.sets);
  free(desc.leases);
}

static void on_flush(uv_timer_t *t) {
  struct survive *sv = t->data;
  if (sv->pending && !sv->adopting) publish(sv);
}

/*
 * What a reply reports (a lease, a ready set) is stored before the reply is
 * sent; what ends (a release, a set gone) is stored with the next change
 * or at the loop's next turn, so that a connection closing with a thousand
 * leases stores one description, not a thousand.
 */
static void on_changed(void *arg, bool now) {
  struct survive *sv = arg;
  if (sv->adopting) return;
  if (now) {
    publish(sv);
  } else if (!sv->pending) {
    sv->pending = true;
    uv_timer_start(&sv->flush_timer, on_flush, 0, 0);
  }
}

/* ---- re-adopting ---------------------------------------------------------------------------- */

static void on_grace(uv_timer_t *t) {
  struct survive *sv = t->data;
  size_t n = 0;
  for (struct lease *l = res_first_lease(sv->d->res); l != NULL; l = l->next) n += l->holder.owner == NULL;
  if (n > 0)
    log_msg(LOG_INFO, "restart_grace_ms (%" PRIu64 " ms) is over: %zu re-adopted lease(s) nobody reclaimed ended",
            sv->d->cfg.restart_grace_ms, n);
  res_leases_drop_owner(sv->d->res, NULL);
}

static void finish(struct survive *sv) {
  log_msg(LOG_INFO,
          "restart survival: re-adopted %u set(s) (%.2f GiB) and %u lease(s) from %s in %.1f ms, dropped %u; no "
          "weights were read",
          sv->adopted, (double)sv->adopted_bytes / (double)(1ull << 30), sv->leases, sv->desc_name,
          (double)(clock_ns() - sv->started_ns) / 1e6, sv->dropped);
  setdesc_free(&sv->desc);
  if (sv->map != NULL) munmap((void *)sv->map, sv->map_len);
  sv->map = NULL;
  sv->adopting = false;
  publish(sv);
  if (sv->leases > 0) uv_timer_start(&sv->grace_timer, on_grace, sv->d->cfg.restart_grace_ms, 0);
  if (sv->done != NULL) sv->done(sv->done_arg);
}

static void drop(struct survive *sv, const struct setdesc_set *s, const char *what, const char *why) {
  log_msg(LOG_WARN, "set %s of %s is not re-adopted: %s%s", s->id, s->path, what, why);
  sv->dropped++;
}

/*
 * "" when ck's shards are the described ones, else what changed: the files'
 * identities (device, inode, size, mtime), and for a description with ids
 * the layout id. A description written before ids existed (version 1) is
 * judged by the files' identities alone.
 */
static void identity_diff(const struct setdesc_set *s, const struct ckpt *c, char *why, size_t len) {
  why[0] = '\0';
  if (s->has_ids && memcmp(s->layout_id, c->layout_id, sizeof s->layout_id) != 0) {
    snprintf(why, len, "its layout id differs from the described one");
    return;
  }
  if (c->nshards != s->nshards) {
    snprintf(why, len, "%zu shard(s) now, %zu then", c->nshards, s->nshards);
    return;
  }
  for (size_t i = 0; i < s->nshards; i++) {
    const struct setdesc_shard *a = &s->shards[i];
    const struct ckpt_shard *b = &c->shards[i];
    if (strcmp(a->name, b->rel) != 0)
      snprintf(why, len, "shard %zu is %s now, %s then", i, b->rel, a->name);
    else if (a->size != b->size)
      snprintf(why, len, "%s: size %" PRIu64 " then, %" PRIu64 " now", a->name, a->size, b->size);
    else if (a->dev != (uint64_t)b->dev || a->ino != (uint64_t)b->ino)
      snprintf(why, len, "%s: replaced by another file (inode %" PRIu64 " then, %" PRIu64 " now)", a->name, a->ino,
               (uint64_t)b->ino);
    else if (a->mtime_ns != b->mtime_ns)
      snprintf(why, len, "%s: modified (mtime %" PRId64 " ns then, %" PRId64 " ns now)", a->name, a->mtime_ns,
               b->mtime_ns);
    if (why[0] != '\0') return;
  }
}

/* A version 3 set's stored tensor table, mapped while its plan is read. */
struct table_map {
  int fd; /* the table's memfd, taken from the passed descriptors; -1 for an inline table */
  const void *map;
  size_t len;
};

/* Maps set s's stored table (version 3) and checks it against the description; an inline one needs nothing. */
static int stored_table(struct setdesc_set *s, struct table_map *tm, struct wd_error *err) {
  if (s->table_fdname == NULL) return 0;
  struct service_fd *f = service_fd_find(s->table_fdname);
  if (f == NULL || f->taken)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "its tensor table %s was not passed back", s->table_fdname);
  int rc = sealed_memfd_map(f->fd, &tm->map, &tm->len, err);
  if (rc == 0) rc = setdesc_table_check(s, tm->map, tm->len, err);
  if (rc != 0) return err_prefix(err, "%s", s->table_fdname);
  f->taken = true;
  tm->fd = f->fd;
  return 0;
}

static void table_unmap(struct setdesc_set *s, struct table_map *tm) {
  if (tm->map != NULL) munmap((void *)tm->map, tm->len);
  tm->map = NULL;
  if (s->table_fdname != NULL) s->table = NULL;
}

/* Adopts set s of checkpoint ck (whose reference it takes): 0, or an error saying why not. */
static int adopt(struct survive *sv, struct setdesc_set *s, struct reg_ckpt *ck, struct wd_error *err) {
  struct daemon *d = sv->d;
  int device = -1;
  for (int i = 0; i < res_device_count(d->res); i++)
    if (strcmp(res_device(d->res, i)->info.uuid, s->uuid) == 0) device = i;
  if (device < 0) return err_set(err, WEIGHTD_E_NOT_FOUND, "its device %s is not present", s->uuid);
  struct service_fd *f = service_fd_find(s->fdname);
  if (f == NULL) return err_set(err, WEIGHTD_E_NOT_FOUND, "its slab descriptor %s was not passed back", s->fdname);
  if (d->backend.ops->slab_adopt == NULL)
    return err_set(err, WEIGHTD_E_UNSUPPORTED, "the %s backend cannot adopt slabs", d->backend_name);
  struct table_map tm = {.fd = -1};
  struct ttab t;
  struct plan *plan = NULL;
  int rc = stored_table(s, &tm, err);
  if (rc == 0) rc = ttab_open(s->table, s->table_len, &t, err);
  if (rc == 0) rc = plan_from_ttab(&t, s->plan_key, &plan, err);
  table_unmap(s, &tm);
  if (rc != 0) {
    if (tm.fd >= 0) close(tm.fd);
    return rc;
  }
  struct wd_slab *slab = NULL;
  rc = d->backend.ops->slab_adopt(d->backend.ctx, device, (enum wd_handle_kind)s->handle_kind, f->fd, s->slab_bytes,
                                  s->alloc_bytes, s->alloc_id, &slab, err);
  if (rc != 0) {
    if (tm.fd >= 0) close(tm.fd);
    plan_free(plan);
    return rc;
  }
  f->taken = true; /* the slab owns the descriptor now */
  struct res_set *set = NULL;
  rc = res_set_adopt(d->res, ck, device, plan, slab, s->id, &set, err);
  if (rc != 0) {
    if (tm.fd >= 0) close(tm.fd);
    d->backend.ops->slab_free(d->backend.ctx, slab);
    plan_free(plan);
    return rc;
  }
  set->store_alloc_bytes = s->alloc_bytes;
  memcpy(set->store_alloc_id, s->alloc_id, sizeof set->store_alloc_id);
  if (tm.fd >= 0) { /* the stored table is the set's: attaches send it, the next description names it again */
    set->table_fd = tm.fd;
    set->table_bytes = s->table_len;
    set->table_sum = s->table_sum;
  } else { /* an inline table (version 1 or 2): a stored one of that name is not known to be this set's */
    char tname[64];
    snprintf(tname, sizeof tname, TABLE_PREFIX "%s", s->id);
    if (fdstore_has(sv->fs, tname)) fdstore_remove(sv->fs, tname);
  }
  sv->adopted++;
  sv->adopted_bytes += s->slab_bytes;
  for (size_t i = 0; i < sv->desc.nleases; i++) {
    const struct setdesc_lease *l = &sv->desc.leases[i];
    if (strcmp(l->set_id, s->id) != 0) continue;
    struct lease_holder h = {.pid = (pid_t)l->pid, .uid = (uid_t)l->uid};
    snprintf(h.client, sizeof h.client, "%s", l->client);
    struct wd_error lerr = {0};
    if (res_lease_restore(d->res, set, l->id, &h, &lerr) == 0) sv->leases++;
    else log_msg(LOG_WARN, "lease %s of set %s is not restored: %s", l->id, s->id, lerr.msg);
  }
  if (s->content_known) reg_content_adopt(ck, s->content_id); /* the same files: the same bytes */
  log_msg(LOG_INFO, "re-adopted set %s: %s on %s, %zu tensors, %" PRIu64 " bytes, without loading%s", s->id, s->path,
          s->uuid, plan->noutputs, s->slab_bytes,
          s->has_ids ? "" : " (described by an earlier weightd without content ids: judged by its files' identities)");
  return 0;
}

static void on_acquired(void *arg, struct reg_ckpt *ck, const struct wd_error *aerr) {
  struct readopt *ro = arg;
  struct survive *sv = ro->sv;
  struct setdesc_set *s = &sv->desc.sets[ro->idx];
  free(ro);
  char why[512];
  if (ck == NULL) {
    drop(sv, s, "its checkpoint cannot be opened: ", aerr->msg);
  } else if (identity_diff(s, ck->ck, why, sizeof why), why[0] != '\0') {
    drop(sv, s, "the checkpoint changed while the daemon was down: ", why);
    reg_unref(ck);
  } else {
    struct wd_error err = {0};
    if (adopt(sv, s, ck, &err) != 0) {
      drop(sv, s, "", err.msg);
      reg_unref(ck);
    }
  }
  if (--sv->waiting == 0) finish(sv);
}

/* The newest description passed at start, or NULL; every name of ours is noted as stored. */
static struct service_fd *newest_description(struct survive *sv) {
  struct service_fd *best = NULL;
  uint64_t best_gen = 0;
  for (size_t i = 0; i < service_fd_count(); i++) {
    struct service_fd *f = service_fd(i);
    if (f->taken) continue;
    if (ours(f->name)) fdstore_note(sv->fs, f->name);
    if (!has_prefix(f->name, DESC_PREFIX)) continue;
    uint64_t gen;
    if (!setdesc_counter_parse(f->name + strlen(DESC_PREFIX), &gen)) {
      /* Never a candidate (an overflowing number would outrank every real generation); removed at the next store. */
      log_msg(LOG_WARN, "descriptor '%s' passed at start: not a generation from 1 to %llu; ignored", f->name,
              SETDESC_COUNTER_MAX);
      continue;
    }
    if (gen > sv->generation) sv->generation = gen; /* a new generation comes after every one passed */
    if (best == NULL || gen > best_gen) {
      best = f;
      best_gen = gen;
    }
  }
  return best;
}

bool survive_start(struct survive *sv, void (*done)(void *arg), void *arg) {
  if (sv == NULL || !fdstore_enabled(sv->fs)) return false;
  sv->started_ns = clock_ns();
  sv->adopting = true;
  struct service_fd *f = newest_description(sv);
  if (f == NULL) {
    sv->adopting = false;
    publish(sv); /* the first generation: stale names of ours (if any) go */
    return false;
  }
  snprintf(sv->desc_name, sizeof sv->desc_name, "%s", f->name);
  f->taken = true;
  struct wd_error err = {0};
  int rc = sealed_memfd_map(f->fd, &sv->map, &sv->map_len, &err);
  close(f->fd);
  if (rc == 0) rc = setdesc_read(sv->map, sv->map_len, &sv->desc, &err);
  if (rc != 0) {
    log_msg(LOG_ERROR, "set description %s rejected, starting with no sets: %s", sv->desc_name, err.msg);
    if (sv->map != NULL) munmap((void *)sv->map, sv->map_len);
    sv->map = NULL;
    sv->adopting = false;
    publish(sv);
    return false;
  }
  if (sv->desc.generation > sv->generation) sv->generation = sv->desc.generation;
  sv->done = done;
  sv->done_arg = arg;
  if (sv->desc.nsets == 0) {
    sv->done = NULL;
    finish(sv);
    return false;
  }
  sv->waiting = sv->desc.nsets;
  for (size_t i = 0; i < sv->desc.nsets; i++) {
    struct readopt *ro = malloc(sizeof *ro);
    if (ro == NULL) {
      drop(sv, &sv->desc.sets[i], "", "out of memory");
      if (--sv->waiting == 0) {
        sv->done = NULL;
        finish(sv);
        return false;
      }
      continue;
    }
    ro->sv = sv;
    ro->idx = i;
    reg_acquire(sv->d->reg, sv->desc.sets[i].path, NULL, on_acquired, ro); /* the daemon's own */
  }
  return true;
}

/* ---- the rest ------------------------------------------------------------------------------ */

struct survive *survive_create(struct daemon *d) {
  const char *verdict;
  bool on = false;
  bool passed = false;
  for (size_t i = 0; i < service_fd_count(); i++) passed |= has_prefix(service_fd(i)->name, DESC_PREFIX);
  long long max = service_fdstore_max();
  char why[200];
  if (d->cfg.fd_store == CFG_FD_STORE_OFF) {
    verdict = "fd_store is off";
  } else if (!service_notify_enabled()) {
    verdict = "no NOTIFY_SOCKET, so no service manager keeps descriptors";
  } else if (d->cfg.fd_store == CFG_FD_STORE_ON) {
    on = true;
    verdict = "fd_store is on";
  } else if (max > 0) {
    on = true;
    snprintf(why, sizeof why, "the service manager keeps up to %lld descriptors (FDSTORE)", max);
    verdict = why;
  } else if (passed) {
    on = true;
    verdict = "a set description was passed back at start";
  } else {
    verdict = "fd_store is auto and the service manager announced no store (systemd 252 announces none: set "
              "fd_store on with FileDescriptorStoreMax= in the unit)";
  }
  log_msg(on ? LOG_INFO : (d->cfg.fd_store == CFG_FD_STORE_ON ? LOG_WARN : LOG_INFO),
          "restart survival: %s (%s)", on ? "on" : "off", verdict);
  struct survive *sv = calloc(1, sizeof *sv);
  if (sv == NULL || (sv->fs = fdstore_create(on)) == NULL) {
    free(sv);
    log_msg(LOG_WARN, "restart survival: off (out of memory)");
    return NULL;
  }
  sv->d = d;
  sv->max_fds = d->cfg.fd_store_max ? (size_t)d->cfg.fd_store_max : max > 0 ? (size_t)max : 512;
  if (on)
    log_msg(LOG_INFO, "restart survival: the store holds %zu descriptors (%s): %zu sets, two each, beside the "
            "description", sv->max_fds, d->cfg.fd_store_max ? "fd_store_max" : max > 0 ? "$FDSTORE" : "the shipped "
            "unit's FileDescriptorStoreMax=", sv->max_fds > 2 ? (sv->max_fds - 2) / 2 : 0);
  uv_timer_init(d->loop, &sv->grace_timer);
  uv_timer_init(d->loop, &sv->flush_timer);
  sv->grace_timer.data = sv->flush_timer.data = sv;
  if (on) res_on_change(d->res, on_changed, sv);
  return sv;
}

void survive_freeze(struct survive *sv) {
  if (sv == NULL) return;
  sv->frozen = true;
  uv_timer_stop(&sv->grace_timer);
  uv_timer_stop(&sv->flush_timer);
}

unsigned survive_adopted(const struct survive *sv) { return sv != NULL ? sv->adopted : 0; }

static void timer_closed(uv_handle_t *h) {
  struct survive *sv = h->data;
  if (--sv->open_timers > 0) return;
  fdstore_destroy(sv->fs);
  free(sv);
}

void survive_destroy(struct survive *sv) {
  if (sv == NULL) return;
  survive_freeze(sv);
  if (sv->d->res != NULL) res_on_change(sv->d->res, NULL, NULL);
  setdesc_free(&sv->desc);
  if (sv->map != NULL) munmap((void *)sv->map, sv->map_len);
  sv->open_timers = 2;
  uv_close((uv_handle_t *)&sv->grace_timer, timer_closed);
  uv_close((uv_handle_t *)&sv->flush_timer, timer_closed);
}
