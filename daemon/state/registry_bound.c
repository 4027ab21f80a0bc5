/*
 * registry_bound.c - the bounds on open checkpoints (see registry.h, struct
 * reg_limits): what an entry is charged, who it is charged to, making room
 * by closing idle entries, the idle timer; and the plan memo of an entry.
 *
 * DESIGN: loop-owned, like the registry's list, with one exception:
 * reg_entry_charge runs on the job that opened the entry, and reads only that
 * entry, which nobody else reads while it is OPENING. Walks are over the
 * list of entries, which the bounds keep to max_open_checkpoints, so each
 * acquire costs a walk or two of it; making room closes an entry per walk.
 */
#include "registry_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "clock.h"
#include "plan.h"

/* ---- what an entry is charged ------------------------------------------------------- */

/* malloc's bookkeeping per allocation, about; and the kernel's per mapping (its VMA and page-table share), about. */
#define ALLOC_OVERHEAD 16u
#define MAP_OVERHEAD 512u

static uint64_t text_bytes(const char *s) { return s != NULL ? strlen(s) + 1 + ALLOC_OVERHEAD : 0; }

static uint64_t header_bytes(const struct st_header *h) {
  if (h == NULL) return 0;
  uint64_t b = sizeof *h + ALLOC_OVERHEAD;
  b += (uint64_t)h->ntensors * (sizeof h->tensors[0] + sizeof h->by_name[0]) + 2 * ALLOC_OVERHEAD;
  for (size_t i = 0; i < h->ntensors; i++)
    b += h->tensors[i].name_len + 1 + (uint64_t)h->tensors[i].ndim * sizeof(uint64_t) + 2 * ALLOC_OVERHEAD;
  b += (uint64_t)h->nmeta * sizeof h->meta[0] + ALLOC_OVERHEAD;
  for (size_t i = 0; i < h->nmeta; i++) b += h->meta[i].key_len + h->meta[i].value_len + 2 + 2 * ALLOC_OVERHEAD;
  return b;
}

uint64_t reg_entry_charge(const struct reg_ckpt *ck) {
  const struct ckpt *c = ck->ck;
  uint64_t b = sizeof *ck + text_bytes(ck->path);
  b += REG_PLAN_MEMO * (sizeof(struct reg_plan_memo) + PLAN_KEY_MAX + 1 + ALLOC_OVERHEAD);
  if (c == NULL) return b;
  b += sizeof *c + text_bytes(c->path) + text_bytes(c->dir);
  b += (uint64_t)c->ntensors * sizeof c->by_name[0] + ALLOC_OVERHEAD;
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    b += sizeof *s + text_bytes(s->rel) + text_bytes(s->path) + text_bytes(s->real) + header_bytes(s->hdr);
    if (s->size > 0) b += MAP_OVERHEAD + sizeof(void *);
  }
  if (c->config != NULL)
    b += sizeof *c->config + text_bytes(c->config->label) + text_bytes(c->config->model_type) +
         text_bytes(c->config->architecture) + text_bytes(c->config->quant_method);
  return b;
}

/* ---- who it is charged to ------------------------------------------------------------ */

/* The name of the mapping bound in messages. */
#define MAP_BOUND "the mapping bound (a quarter of vm.max_map_count)"

static bool charged_to(const struct reg_ckpt *ck, uid_t uid) {
  for (size_t i = 0; i < ck->nuids; i++)
    if (ck->uids[i] == uid) return true;
  return false;
}

/* True when uid waits for ck to open. */
static bool awaited_by(const struct reg_ckpt *ck, uid_t uid) {
  for (const struct reg_waiter *w = ck->waiters; w != NULL; w = w->next)
    if (w->uid == uid) return true;
  return false;
}

/*
 * The entries other than skip charged to uid, or being opened for it, and
 * their bytes (an entry being opened counts 0 bytes until its headers are read).
 */
static void uid_usage(const struct registry *r, uid_t uid, const struct reg_ckpt *skip, size_t *n, uint64_t *bytes) {
  *n = 0;
  *bytes = 0;
  for (const struct reg_ckpt *e = r->ckpts; e != NULL; e = e->next)
    if (e != skip && (charged_to(e, uid) || (e->state == REG_OPENING && awaited_by(e, uid)))) {
      (*n)++;
      *bytes += e->counted ? e->charge : 0;
    }
}

bool reg_idle(const struct reg_ckpt *ck) {
  return ck->state == REG_OPEN && !ck->detached && ck->refs - ck->observers == 1 && ck->waiters == NULL &&
         !ck->prefetching && !ck->digesting && !ck->pinning && !ck->unpinning && ck->parked == NULL && ck->npins == 0 && ck->loads == 0;
}

/*
 * Closes the least recently used idle entry other than keep (charged to uid,
 * unless uid is REG_UID_DAEMON: any), saying which bound it made room under.
 * False when none is idle.
 */
static bool close_lru(struct registry *r, uid_t uid, const struct reg_ckpt *keep, const char *bound) {
  struct reg_ckpt *lru = NULL;
  for (struct reg_ckpt *e = r->ckpts; e != NULL; e = e->next)
    if (e != keep && reg_idle(e) && (uid == REG_UID_DAEMON || charged_to(e, uid)) &&
        (lru == NULL || e->use_seq < lru->use_seq))
      lru = e;
  if (lru == NULL) return false;
  log_msg(LOG_INFO, "closed %s: idle for %.1f s, the least recently used, to make room under %s", lru->path,
          (double)(clock_ms() - lru->last_used_ms) / 1000.0, bound);
  r->closed_room++;
  reg_detach(lru);
  return true;
}

/* Counts a refusal and says what was refused, by which bound, and what would help. */
static int refuse(struct registry *r, struct wd_error *err, const char *path, const char *bound, const char *whose,
                  uint64_t used, uint64_t limit, const char *unit) {
  r->refused++;
  bool maps = strcmp(bound, MAP_BOUND) == 0;
  err_set(err, WEIGHTD_E_LIMIT,
          "%s: not opened: %s holds %" PRIu64 " %s of %s (%" PRIu64 ") and none of them is idle (each has a "
          "resident set, a load, a prefetch or a pin); close or evict one, or raise %s",
          path, whose, used, unit, bound, limit, maps ? "vm.max_map_count (read when the daemon starts)" : bound);
  log_msg(LOG_DEBUG, "%s", err->msg); /* counted in weightd_checkpoint_opens_refused_total */
  return err->code;
}

int reg_bound_admit(struct registry *r, uid_t uid, const char *path, struct wd_error *err) {
  if (uid == REG_UID_DAEMON) return 0;
  const struct reg_limits *l = &r->limits;
  while (l->max_open > 0 && r->nlisted >= l->max_open)
    if (!close_lru(r, REG_UID_DAEMON, NULL, "max_open_checkpoints"))
      return refuse(r, err, path, "max_open_checkpoints", "the daemon", r->nlisted, l->max_open, "checkpoints");
  size_t n;
  uint64_t bytes;
  uid_usage(r, uid, NULL, &n, &bytes);
  while (l->max_open_per_uid > 0 && n >= l->max_open_per_uid) {
    if (!close_lru(r, uid, NULL, "max_open_checkpoints_per_uid")) {
      char whose[48];
      snprintf(whose, sizeof whose, "uid %u", (unsigned)uid);
      return refuse(r, err, path, "max_open_checkpoints_per_uid", whose, n, l->max_open_per_uid, "checkpoints");
    }
    uid_usage(r, uid, NULL, &n, &bytes);
  }
  return 0;
}

/* True when only the daemon's own work waits for ck (re-adoption at start, which no bound refuses). */
static bool for_daemon_only(const struct reg_ckpt *ck) {
  for (const struct reg_waiter *w = ck->waiters; w != NULL; w = w->next)
    if (w->uid != REG_UID_DAEMON) return false;
  return true;
}

int reg_bound_open(struct registry *r, struct reg_ckpt *ck, struct wd_error *err) {
  const struct reg_limits *l = &r->limits;
  bool daemon = for_daemon_only(ck);
  while (!daemon && l->memory > 0 && r->charged + ck->charge > l->memory)
    if (!close_lru(r, REG_UID_DAEMON, ck, "checkpoint_memory"))
      return refuse(r, err, ck->path, "checkpoint_memory", "the daemon", r->charged + ck->charge, l->memory,
                    "bytes (this one included)");
  while (!daemon && l->max_maps > 0 && r->nmaps + ck->nmaps > l->max_maps)
    if (!close_lru(r, REG_UID_DAEMON, ck, MAP_BOUND))
      return refuse(r, err, ck->path, MAP_BOUND, "the daemon",
                    (uint64_t)(r->nmaps + ck->nmaps), (uint64_t)l->max_maps, "shard mappings (this one's included)");
  r->charged += ck->charge;
  r->nmaps += ck->nmaps;
  ck->counted = true;
  return 0;
}

int reg_bound_charge(struct registry *r, struct reg_ckpt *ck, uid_t uid, struct wd_error *err) {
  if (uid == REG_UID_DAEMON || charged_to(ck, uid)) return 0; /* a uid already charged costs nothing more */
  const struct reg_limits *l = &r->limits;
  char whose[48];
  snprintf(whose, sizeof whose, "uid %u", (unsigned)uid);
  size_t n;
  uint64_t bytes;
  uid_usage(r, uid, ck, &n, &bytes);
  while (l->max_open_per_uid > 0 && n >= l->max_open_per_uid) {
    if (!close_lru(r, uid, ck, "max_open_checkpoints_per_uid"))
      return refuse(r, err, ck->path, "max_open_checkpoints_per_uid", whose, n, l->max_open_per_uid,
                    "checkpoints");
    uid_usage(r, uid, ck, &n, &bytes);
  }
  uint64_t mine = ck->counted ? ck->charge : 0;
  while (l->memory_per_uid > 0 && bytes + mine > l->memory_per_uid) {
    if (!close_lru(r, uid, ck, "checkpoint_memory_per_uid"))
      return refuse(r, err, ck->path, "checkpoint_memory_per_uid", whose, bytes + mine, l->memory_per_uid,
                    "bytes (this one included)");
    uid_usage(r, uid, ck, &n, &bytes);
  }
  uid_t *v = realloc(ck->uids, (ck->nuids + 1) * sizeof *v);
  if (v == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  v[ck->nuids++] = uid;
  ck->uids = v;
  return 0;
}

/* ---- limits, counts, the idle timer -------------------------------------------------- */

void reg_limits_set(struct registry *r, const struct reg_limits *l) {
  r->limits = *l;
  reg_bound_timer(r);
}

const struct reg_limits *reg_limits(const struct registry *r) { return &r->limits; }

void reg_counts(const struct registry *r, struct reg_counts *out) {
  *out = (struct reg_counts){.open = r->nlisted,
                             .charged = r->charged,
                             .maps = r->nmaps,
                             .closed_idle = r->closed_idle,
                             .closed_room = r->closed_room,
                             .refused = r->refused,
                             .plans_reused = r->plans_reused};
}

/* Closes every idle entry unused for the idle time. */
static void on_idle_timer(uv_timer_t *t) {
  struct registry *r = t->data;
  uint64_t idle = r->limits.idle_ms, now = clock_ms();
  struct reg_ckpt *e = r->ckpts;
  while (e != NULL) {
    struct reg_ckpt *next = e->next;
    if (reg_idle(e) && now - e->last_used_ms >= idle) {
      log_msg(LOG_INFO, "closed %s: unused for %.1f s (checkpoint_idle_ms %" PRIu64 ")", e->path,
              (double)(now - e->last_used_ms) / 1000.0, idle);
      r->closed_idle++;
      reg_detach(e);
    }
    e = next;
  }
}

/* The timer looks at the entries twice per idle time, between every 100 ms and every 30 s. */
void reg_bound_timer(struct registry *r) {
  if (!r->timer_open || r->destroyed) return;
  uint64_t idle = r->limits.idle_ms;
  if (idle == 0) {
    uv_timer_stop(&r->idle_timer);
    return;
  }
  uint64_t every = idle / 2 < 100 ? 100 : idle / 2 > 30000 ? 30000 : idle / 2;
  uv_timer_start(&r->idle_timer, on_idle_timer, every, every);
}

/* ---- plans remembered ------------------------------------------------------------------ */

const char *reg_plan_key_find(struct reg_ckpt *ck, const unsigned char spec[REG_SPEC_DIGEST]) {
  for (size_t i = 0; ck->memo != NULL && i < REG_PLAN_MEMO; i++) {
    struct reg_plan_memo *m = &ck->memo[i];
    if (m->key != NULL && memcmp(m->spec, spec, REG_SPEC_DIGEST) == 0) {
      m->used = ++ck->reg->memo_clock;
      return m->key;
    }
  }
  return NULL;
}

void reg_plan_reused(struct reg_ckpt *ck) { ck->reg->plans_reused++; }

void reg_plan_key_remember(struct reg_ckpt *ck, const unsigned char spec[REG_SPEC_DIGEST], const char *key) {
  if (ck->memo == NULL && (ck->memo = calloc(REG_PLAN_MEMO, sizeof *ck->memo)) == NULL) return;
  struct reg_plan_memo *slot = &ck->memo[0];
  for (size_t i = 0; i < REG_PLAN_MEMO; i++) {
    struct reg_plan_memo *m = &ck->memo[i];
    if (m->key != NULL && memcmp(m->spec, spec, REG_SPEC_DIGEST) == 0) return; /* remembered already */
    if (m->key == NULL || (slot->key != NULL && m->used < slot->used)) slot = m;
  }
  char *copy = strdup(key);
  if (copy == NULL) return;
  free(slot->key);
  memcpy(slot->spec, spec, REG_SPEC_DIGEST);
  slot->key = copy;
  slot->used = ++ck->reg->memo_clock;
}

void reg_plan_memo_free(struct reg_ckpt *ck) {
  for (size_t i = 0; ck->memo != NULL && i < REG_PLAN_MEMO; i++) free(ck->memo[i].key);
  free(ck->memo);
  ck->memo = NULL;
}
