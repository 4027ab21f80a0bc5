/*
 * registry_pin.c - the page cache and the pinned-resident tier: residency,
 * prefetch, pin admission against the budget, unpinning least recently used
 * checkpoints, and the pin policy (see registry.h).
 *
 * DESIGN: prefetch and pin jobs run on the bulk pool, prefetch chunks on the
 * fill threads; they read only their struct prefetch or struct unpin_job
 * (registry.c says what the jobs share), and their done() callbacks update
 * the entries and the budget on the loop thread.
 *
 * Pin admission (loop thread): the ranges asked for minus those registered
 * are what a pin job registers; their bytes are reserved in the budget at
 * once, and victims (other checkpoints with pins, no load, no pin or unpin
 * under way; least recently used first) hand their pin lists to the job,
 * which unregisters them before it registers. One pin job per checkpoint at
 * a time: a request that arrives meanwhile is parked and admitted again when
 * the job is done.
 */
#include "registry_internal.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <xxhash.h>

#include "clock.h"
#include "sha256.h"
#include "base/fault.h"
#include "base/hostmem.h"
#include "base/log.h"

/* ---- victims: checkpoints unpinned to make room ------------------------------------------- */

/* A checkpoint being unpinned: its registrations, taken from it on the loop, unregistered on a job. */
struct victim {
  struct reg_ckpt *ck; /* referenced */
  struct plan_range *pins;
  size_t n;
};

/* Takes ck's registrations for unregistering (loop thread): new loads of it stage from now on. */
static void victim_take(struct registry *r, struct reg_ckpt *ck, struct victim *v) {
  v->ck = ck;
  v->pins = ck->pins;
  v->n = ck->npins;
  ck->pins = NULL;
  ck->npins = 0;
  ck->unpinning = true;
  r->pinned_bytes -= ck->pinned_bytes;
  ck->pinned_bytes = 0;
  reg_ref(ck);
}

static void victims_unregister(const struct wd_backend *b, const struct victim *v, size_t n) {
  for (size_t i = 0; i < n; i++) reg_unregister_ranges(b, v[i].ck, v[i].pins, v[i].n);
}

static void victims_release(struct victim *v, size_t n, const char *why) {
  for (size_t i = 0; i < n; i++) {
    log_msg(LOG_INFO, "%s: unpinned %zu range(s): %s", v[i].ck->path, v[i].n, why);
    v[i].ck->unpinning = false;
    free(v[i].pins);
    reg_unref(v[i].ck);
  }
  free(v);
}

/* Whether c may be unpinned now: pinned, and nothing loading from, pinning or unpinning it. */
static bool unpinnable(const struct reg_ckpt *c) {
  return c->npins > 0 && !c->unpinning && !c->pinning && c->loads == 0;
}

/* The least recently used checkpoint that may be unpinned, other than except and those in v, or NULL. */
static struct reg_ckpt *lru_victim(struct registry *r, const struct reg_ckpt *except, const struct victim *v,
                                   size_t nv) {
  struct reg_ckpt *best = NULL;
  for (struct reg_ckpt *c = r->ckpts; c != NULL; c = c->next) {
    bool chosen = false;
    for (size_t i = 0; i < nv; i++) chosen |= v[i].ck == c;
    if (c != except && !chosen && unpinnable(c) && (best == NULL || c->last_used_ms < best->last_used_ms)) best = c;
  }
  return best;
}

/* Unregisters checkpoints a shrunk pin budget no longer holds, on a job. */
struct unpin_job {
  struct job job;
  const struct wd_backend *backend;
  struct victim *v;
  size_t n;
};

static void unpin_work(struct job *j) {
  struct unpin_job *u = (struct unpin_job *)j;
  victims_unregister(u->backend, u->v, u->n);
}

static void unpin_done(struct job *j) {
  struct unpin_job *u = (struct unpin_job *)j;
  victims_release(u->v, u->n, "host_pin_budget shrank");
  free(u);
}

/* ---- the pin budget ------------------------------------------------------------------------ */

uint64_t reg_pin_budget(const struct registry *r) {
  if (r->pin_budget > 0) return r->pin_budget;
  struct hostmem hm;
  hostmem_read(&hm);
  return hm.limit == UINT64_MAX ? 0 : hm.limit / 2;
}

const char *reg_pin_budget_source(const struct registry *r) {
  if (r->pin_budget > 0) return "host_pin_budget";
  struct hostmem hm;
  hostmem_read(&hm);
  return hm.source;
}

size_t reg_pin_budget_set(struct registry *r, uint64_t budget) {
  r->pin_budget = budget;
  uint64_t now = reg_pin_budget(r);
  if (r->pinned_bytes <= now) return 0;
  struct unpin_job *u = calloc(1, sizeof *u);
  size_t cap = 0;
  for (struct reg_ckpt *c = r->ckpts; c != NULL; c = c->next) cap++;
  if (u == NULL || (u->v = calloc(cap ? cap : 1, sizeof *u->v)) == NULL) {
    free(u);
    log_msg(LOG_WARN, "out of memory unpinning checkpoints over host_pin_budget; they stay pinned");
    return 0;
  }
  while (r->pinned_bytes > now) {
    struct reg_ckpt *victim = lru_victim(r, NULL, u->v, u->n);
    if (victim == NULL) break; /* the rest are busy: unpinned when a later pin needs the room */
    victim_take(r, victim, &u->v[u->n++]);
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
uint64_t reg_pinned_bytes(const struct registry *r) { return r->pinned_bytes; }
void reg_pin_mode_set(struct registry *r, enum reg_pin_mode mode) { r->pin_mode = mode; }
enum reg_pin_mode reg_pin_mode(const struct registry *r) { return r->pin_mode; }
/* ---- page cache: residency and prefetch -------------------------------------------- */

/*
 * cachestat(2) (Linux 6.5): a file's page-cache pages in one call. mincore
 * over a mapping looks each page up in the page cache, which for DeepSeek-V3's
 * 673 GB of shards takes seconds.
 */
#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif
struct cs_range {
  uint64_t off, len;
};
struct cs_stat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

/* Page-cache bytes of shard i by mincore over its mapping. */
static uint64_t resident_mincore(const struct reg_ckpt *ck, size_t i, uint64_t page) {
  enum { CHUNK_PAGES = 1 << 16 };
  unsigned char vec[CHUNK_PAGES];
  uint64_t resident = 0;
  const unsigned char *base = ld_source_map(ck->src, (uint32_t)i);
  uint64_t size = ck->ck->shards[i].size;
  for (uint64_t off = 0; base != NULL && off < size; off += (uint64_t)CHUNK_PAGES * page) {
    size_t len = size - off < (uint64_t)CHUNK_PAGES * page ? (size_t)(size - off) : (size_t)CHUNK_PAGES * (size_t)page;
    if (mincore((void *)(base + off), len, vec) != 0) break;
    size_t pages = (len + (size_t)page - 1) / (size_t)page;
    for (size_t k = 0; k < pages; k++)
      if (vec[k] & 1) resident += page;
  }
  return resident;
}

/*
 * Page-cache bytes of shard i by cachestat, on the file opened again by its
 * resolved path (the descriptors are closed once mapped) and checked to be
 * the file that was mapped; -1 when that cannot be done.
 */
static int64_t resident_cachestat(const struct reg_ckpt *ck, size_t i, uint64_t page) {
  const struct ckpt_shard *sh = &ck->ck->shards[i];
  int fd = open(sh->real, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat sb;
  struct cs_range r = {0, 0}; /* len 0: to the end of the file */
  struct cs_stat cs;
  int64_t n = -1;
  if (fstat(fd, &sb) == 0 && sb.st_dev == sh->dev && sb.st_ino == sh->ino &&
      syscall(SYS_cachestat, fd, &r, &cs, 0) == 0)
    n = (int64_t)(cs.nr_cache * page);
  close(fd);
  return n;
}

uint64_t reg_resident_bytes(const struct reg_ckpt *ck) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), resident = 0;
  for (size_t i = 0; i < ck->ck->nshards; i++) {
    if (ld_source_map(ck->src, (uint32_t)i) == NULL) continue;
    int64_t n = resident_cachestat(ck, i, page);
    resident += n >= 0 ? (uint64_t)n : resident_mincore(ck, i, page);
  }
  return resident;
}

struct prefetch {
  struct job job;
  struct registry *reg;
  struct reg_ckpt *ck; /* referenced */
  reg_prefetched_fn cb;
  void *arg;
  bool read;      /* read the ranges into the page cache first */
  bool pin;       /* register the ranges (what `add` lists once admitted) */
  bool automatic; /* the pin policy's, not a request's: failures are only logged */
  struct plan_range *ranges; /* what to read and pin, sorted and merged */
  size_t nranges;
  struct plan_range *add; /* admitted: the ranges to register (ranges minus ck's pins) */
  size_t nadd;
  uint64_t reserved;      /* bytes of add, counted in the budget */
  struct victim *unpin;   /* admitted: checkpoints to unregister first */
  size_t nunpin;
  atomic_int failed;
  atomic_int skipped;          /* a chunk was not read (shutdown or cancel): the digests are not whole */
  atomic_bool canceled;        /* reg_prefetch_cancel: stop between chunks, do not pin */
  atomic_uint_fast64_t done;   /* shard bytes read so far */
  uint64_t total;              /* shard bytes to read */
  bool stopped;                /* the work saw the cancel before pinning (read by done) */
  int pin_rc;
  struct wd_error pin_err;
  struct reg_prefetched res; /* measured on the job thread */
  struct reg_digests *digests; /* a whole read of a checkpoint without a content id: filled by the chunks */
  struct prefetch *next_parked;
};

#define PREFETCH_CHUNK (32ull << 20)

static void prefetch_free(struct prefetch *p) {
  free(p->ranges);
  free(p->add);
  reg_digests_free(p->digests);
  free(p);
}

/* ---- payload digests and the content id ------------------------------------------------- */

void reg_digests_free(struct reg_digests *d) {
  if (d == NULL) return;
  for (size_t i = 0; i < d->nshards; i++) free(d->files[i].chunks);
  free(d->files);
  free(d);
}

/* Room for every chunk digest of c's shards, or NULL. */
static struct reg_digests *digests_new(const struct ckpt *c) {
  struct reg_digests *d = calloc(1, sizeof *d);
  if (d == NULL || (d->files = calloc(c->nshards ? c->nshards : 1, sizeof *d->files)) == NULL) {
    free(d);
    return NULL;
  }
  d->nshards = c->nshards;
  for (size_t i = 0; i < c->nshards; i++) {
    uint64_t n = (c->shards[i].size + MF_CHUNK_BYTES - 1) / MF_CHUNK_BYTES;
    d->files[i].size = c->shards[i].size;
    d->files[i].nchunks = n;
    if ((d->files[i].chunks = calloc(n ? n : 1, sizeof *d->files[i].chunks)) == NULL) {
      reg_digests_free(d);
      return NULL;
    }
  }
  return d;
}

/* The prefetch's seen callback: the bytes of one chunk, in order. */
static void digest_seen(void *arg, const unsigned char *p, size_t n) { XXH3_128bits_update(arg, p, n); }

void reg_content_adopt(struct reg_ckpt *ck, const unsigned char id[CKPT_ID_BYTES]) {
  if (ck->content_known) return;
  memcpy(ck->content_id, id, CKPT_ID_BYTES);
  ck->content_known = true;
}

/* Every shard whole, as ranges. */
static int whole_ranges(const struct reg_ckpt *ck, struct plan_range **out, size_t *n) {
  const struct ckpt *c = ck->ck;
  struct plan_range *v = malloc((c->nshards ? c->nshards : 1) * sizeof *v);
  if (v == NULL) return WEIGHTD_E_NOMEM;
  size_t k = 0;
  for (size_t i = 0; i < c->nshards; i++)
    if (ld_source_map(ck->src, (uint32_t)i) != NULL) v[k++] = (struct plan_range){(uint32_t)i, 0, c->shards[i].size};
  *out = v;
  *n = k;
  return 0;
}

/*
 * want minus have (both sorted by shard and offset, each disjoint): the parts
 * of want not registered yet. They start on page boundaries, since every
 * range of both does and ends on one or at the end of its file.
 */
static int ranges_subtract(const struct plan_range *want, size_t nw, const struct plan_range *have, size_t nh,
                           struct plan_range **out, size_t *n) {
  *out = NULL;
  *n = 0;
  if (nw == 0) return 0;
  size_t cap = nw + nh, k = 0, h = 0;
  struct plan_range *v = malloc(cap * sizeof *v);
  if (v == NULL) return WEIGHTD_E_NOMEM;
  for (size_t i = 0; i < nw; i++) {
    uint32_t s = want[i].shard;
    uint64_t a = want[i].off, b = want[i].off + want[i].len;
    while (h < nh && (have[h].shard < s || (have[h].shard == s && have[h].off + have[h].len <= a))) h++;
    for (size_t j = h; a < b && j < nh && have[j].shard == s && have[j].off < b; j++) {
      if (have[j].off > a) v[k++] = (struct plan_range){s, a, have[j].off - a};
      if (have[j].off + have[j].len > a) a = have[j].off + have[j].len;
    }
    if (a < b) v[k++] = (struct plan_range){s, a, b - a};
  }
  if (k == 0) {
    free(v);
    return 0;
  }
  *out = v;
  *n = k;
  return 0;
}

/* Merges the sorted, disjoint ranges add into ck's pins. */
static int pins_merge(struct reg_ckpt *ck, const struct plan_range *add, size_t nadd) {
  struct plan_range *v = malloc((ck->npins + nadd) * sizeof *v);
  if (v == NULL) return WEIGHTD_E_NOMEM;
  size_t i = 0, j = 0, k = 0;
  while (i < ck->npins || j < nadd) {
    bool take_old = j == nadd || (i < ck->npins && (ck->pins[i].shard < add[j].shard ||
                                                    (ck->pins[i].shard == add[j].shard && ck->pins[i].off < add[j].off)));
    v[k++] = take_old ? ck->pins[i++] : add[j++];
  }
  free(ck->pins);
  ck->pins = v;
  ck->npins = k;
  return 0;
}

/* Touches one chunk of the ranges through the mapping: the pages loads will read. */
static void prefetch_chunk(void *arg, size_t i) {
  struct prefetch *p = arg;
  uint64_t k = i;
  size_t r = 0;
  for (; r < p->nranges; r++) {
    uint64_t n = (p->ranges[r].len + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK;
    if (k < n) break;
    k -= n;
  }
  if (r == p->nranges) return;
  if (atomic_load(&p->reg->stopping) || atomic_load(&p->canceled)) {
    atomic_store(&p->skipped, 1);
    return;
  }
  const struct plan_range *g = &p->ranges[r];
  uint64_t off = g->off + k * PREFETCH_CHUNK, end = off + PREFETCH_CHUNK;
  if (end > g->off + g->len) end = g->off + g->len;
  struct wd_error err = {0};
  if (p->digests == NULL) {
    if (ld_source_prefetch(p->ck->src, g->shard, off, end - off, NULL, NULL, &err) != 0) atomic_store(&p->failed, 1);
  } else { /* whole files from offset 0: every MF_CHUNK_BYTES digested as it is read */
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) atomic_store(&p->failed, 1);
    for (uint64_t a = off; st != NULL && a < end; a += MF_CHUNK_BYTES) {
      uint64_t n = end - a < MF_CHUNK_BYTES ? end - a : MF_CHUNK_BYTES;
      XXH3_128bits_reset(st);
      if (ld_source_prefetch(p->ck->src, g->shard, a, n, digest_seen, st, &err) != 0) {
        atomic_store(&p->failed, 1);
        break;
      }
      XXH128_canonical_t c;
      XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
      memcpy(p->digests->files[g->shard].chunks[a / MF_CHUNK_BYTES], c.digest, MF_DIGEST_BYTES);
    }
    XXH3_freeState(st);
  }
  atomic_fetch_add(&p->done, end - off);
}

static void prefetch_work(struct job *j) {
  struct prefetch *p = (struct prefetch *)j;
  const struct wd_backend *b = p->reg->backend;
  double t0 = clock_s();
  if (p->read) {
    size_t n = 0;
    ld_source_advise(p->ck->src, p->ranges, p->nranges);
    for (size_t r = 0; r < p->nranges; r++) n += (size_t)((p->ranges[r].len + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK);
    ld_pool_run(p->reg->fill, n, prefetch_chunk, p);
  }
  double t1 = clock_s();
  p->res.read_seconds = t1 - t0;
  p->stopped = atomic_load(&p->canceled);
  struct wd_error e2 = {0};
  if (p->digests != NULL && !atomic_load(&p->skipped) && ld_source_unchanged(p->ck->src, &e2) != 0) {
    /* Digests over bytes that changed while they were read name no content: none is recorded. */
    log_msg(LOG_WARN, "%s: no content id from this prefetch: %s", p->ck->path, e2.msg);
    atomic_store(&p->skipped, 1);
  }
  victims_unregister(b, p->unpin, p->nunpin);
  if (p->pin && p->nadd > 0 && !atomic_load(&p->failed) && !p->stopped) {
    size_t i = 0;
    for (; i < p->nadd; i++) {
      const struct plan_range *g = &p->add[i];
      p->pin_rc = b->ops->host_register(b->ctx, (char *)ld_source_map(p->ck->src, g->shard) + g->off, (size_t)g->len,
                                          &p->pin_err);
      if (p->pin_rc != 0) break;
    }
    if (p->pin_rc != 0) {
      err_prefix(&p->pin_err, "%s: pinning %s bytes [%llu, %llu)", p->ck->path, p->ck->ck->shards[p->add[i].shard].rel,
                 (unsigned long long)p->add[i].off, (unsigned long long)(p->add[i].off + p->add[i].len));
      reg_unregister_ranges(b, p->ck, p->add, i);
    } else {
      p->res.registered = p->reserved;
    }
  }
  p->res.pin_seconds = clock_s() - t1;
  if (p->cb != NULL) p->res.resident = reg_resident_bytes(p->ck);
}

static void prefetch_submit(struct prefetch *p);
static int prefetch_admit(struct prefetch *p, struct wd_error *err);

/* Admits the requests parked on ck while its pin job ran, in arrival order. */
static void unpark(struct reg_ckpt *ck) {
  struct prefetch *list = NULL;
  while (ck->parked != NULL) { /* reverse the LIFO list */
    struct prefetch *p = ck->parked;
    ck->parked = p->next_parked;
    p->next_parked = list;
    list = p;
  }
  while (list != NULL) {
    struct prefetch *p = list;
    list = p->next_parked;
    p->next_parked = NULL;
    struct wd_error err = {0};
    if (ck->pinning) { /* an earlier one of these started a pin job: wait for that */
      p->next_parked = ck->parked;
      ck->parked = p;
      continue;
    }
    if (prefetch_admit(p, &err) != 0) {
      if (p->cb != NULL) p->cb(p->arg, p->ck, &p->res, &err);
      reg_unref(p->ck);
      prefetch_free(p);
      continue;
    }
    prefetch_submit(p);
  }
}

static void prefetch_done(struct job *j) {
  struct prefetch *p = (struct prefetch *)j;
  struct registry *r = p->reg;
  struct reg_ckpt *ck = p->ck;
  if (p->read) ck->prefetching = false;
  reg_touch(ck);
  if (p->digests != NULL) {
    ck->digesting = false;
    if (!atomic_load(&p->failed) && !atomic_load(&p->skipped) && !p->stopped && !ck->content_known) {
      for (size_t i = 0; i < p->digests->nshards; i++) mf_file_finish(&p->digests->files[i]);
      mf_content_id(ck->ck->layout_id, p->digests->files, p->digests->nshards, ck->content_id);
      ck->content_known = true;
      reg_digests_free(ck->digests);
      ck->digests = p->digests;
      p->digests = NULL;
      char hex[SHA256_HEX_LEN + 1];
      sha256_hex(ck->content_id, hex);
      log_msg(LOG_INFO, "%s: content id %s (payload digests of %zu shard(s) taken while prefetching)", ck->path, hex,
              ck->digests->nshards);
    }
  }
  victims_release(p->unpin, p->nunpin, "making room in host_pin_budget");
  p->unpin = NULL;
  int failed = atomic_load(&p->failed);
  bool canceled = p->stopped;
  struct wd_error err = {0};
  if (p->pin && p->nadd > 0) {
    ck->pinning = false;
    if (failed || canceled || p->pin_rc != 0 || pins_merge(ck, p->add, p->nadd) != 0) {
      if (!failed && !canceled && p->pin_rc == 0) { /* registered, but no memory to remember it: undo on a job is not worth it */
        reg_unregister_ranges(r->backend, ck, p->add, p->nadd);
        p->pin_rc = err_set(&p->pin_err, WEIGHTD_E_NOMEM, "%s: out of memory recording pins", ck->path);
      }
      r->pinned_bytes -= p->reserved;
      ck->pinned_bytes -= p->reserved;
      p->res.registered = 0;
    } else {
      log_msg(LOG_INFO, "%s: registered %zu range(s), %llu bytes, for direct DMA in %.0f ms%s (%llu of %llu bytes now)",
              ck->path, p->nadd, (unsigned long long)p->reserved, p->res.pin_seconds * 1000,
              p->automatic ? " (pin policy)" : "", (unsigned long long)reg_pins_bytes(ck),
              (unsigned long long)ck->ck->total_bytes);
    }
  }
  if (failed) {
    log_msg(LOG_WARN, "%s: prefetch hit a truncated shard", ck->path);
    err_set(&err, WEIGHTD_E_FAULT, "%s: a shard was truncated while it was read", ck->path);
  } else if (canceled) {
    log_msg(LOG_INFO, "prefetch of %s canceled", ck->path);
    err_set(&err, WEIGHTD_E_CANCELED, "prefetch of %s canceled", ck->path);
  } else if (p->pin_rc != 0) {
    log_msg(LOG_WARN, "%s", p->pin_err.msg);
    err = p->pin_err;
  } else if (p->read) {
    log_msg(LOG_INFO, "prefetched %s (%zu range(s)) in %.0f ms", ck->path, p->nranges, p->res.read_seconds * 1000);
  }
  if (p->cb != NULL) p->cb(p->arg, ck, &p->res, err.code != 0 ? &err : NULL);
  if (!ck->pinning) unpark(ck);
  reg_unref(ck);
  prefetch_free(p);
}

/*
 * Decides p's pin on the loop thread: what to register (p->ranges minus ck's
 * pins), the room in the budget, the victims. 0 (p->pin false when nothing
 * is new), or LIMIT / BUSY / NOMEM without changing anything.
 */
static int prefetch_admit(struct prefetch *p, struct wd_error *err) {
  struct registry *r = p->reg;
  struct reg_ckpt *ck = p->ck;
  if (!p->pin) return 0;
  if (ck->unpinning)
    return err_set(err, WEIGHTD_E_BUSY, "%s is being unpinned to make room; ask again", ck->path);
  free(p->add);
  p->add = NULL;
  p->nadd = 0;
  if (ranges_subtract(p->ranges, p->nranges, ck->pins, ck->npins, &p->add, &p->nadd) != 0)
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  uint64_t need = plan_ranges_bytes(p->add, p->nadd), budget = reg_pin_budget(r), freed = 0;
  if (need == 0) return 0;
  struct victim *v = NULL;
  size_t nv = 0;
  while (r->pinned_bytes - freed + need > budget) {
    struct reg_ckpt *c = lru_victim(r, ck, v, nv);
    if (c == NULL) {
      free(v);
      return err_set(err, WEIGHTD_E_LIMIT,
                     "%s: pinning %llu bytes exceeds host_pin_budget (%llu bytes from %s, %llu pinned, of which "
                     "%llu cannot be unpinned now: loading, pinning or unpinning)",
                     ck->path, (unsigned long long)need, (unsigned long long)budget, reg_pin_budget_source(r),
                     (unsigned long long)r->pinned_bytes, (unsigned long long)(r->pinned_bytes - freed));
    }
    struct victim *nvv = realloc(v, (nv + 1) * sizeof *nvv);
    if (nvv == NULL) {
      free(v);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
    v = nvv;
    v[nv++].ck = c;
    freed += c->pinned_bytes;
  }
  for (size_t i = 0; i < nv; i++) victim_take(r, v[i].ck, &v[i]);
  p->unpin = v;
  p->nunpin = nv;
  p->reserved = need;
  ck->pinned_bytes += need;
  r->pinned_bytes += need;
  ck->pinning = true;
  return 0;
}

static void prefetch_submit(struct prefetch *p) {
  if (p->read) p->ck->prefetching = true;
  if (p->digests != NULL && (p->ck->content_known || p->ck->digesting)) { /* another whole read got there first */
    reg_digests_free(p->digests);
    p->digests = NULL;
  }
  if (p->digests != NULL) p->ck->digesting = true;
  jobs_submit(p->reg->bulk, &p->job);
}

/* A new prefetch of ck (referenced here): ranges copied, or ck's whole shards. NULL when out of memory. */
static struct prefetch *prefetch_new(struct registry *r, struct reg_ckpt *ck, const struct plan_range *ranges,
                                     size_t nranges, bool read, bool pin) {
  struct prefetch *p = calloc(1, sizeof *p);
  if (p == NULL) return NULL;
  p->job.work = prefetch_work;
  p->job.done = prefetch_done;
  p->reg = r;
  p->ck = ck;
  p->read = read;
  p->pin = pin && reg_registers(r);
  atomic_init(&p->failed, 0);
  atomic_init(&p->skipped, 0);
  atomic_init(&p->canceled, false);
  atomic_init(&p->done, 0);
  int rc = 0;
  if (ranges == NULL) {
    rc = whole_ranges(ck, &p->ranges, &p->nranges);
    /* The first whole read of a checkpoint without a content id digests it (no memory: it reads without). */
    if (rc == 0 && read && !ck->content_known && !ck->digesting) p->digests = digests_new(ck->ck);
  } else if (nranges > 0) {
    p->ranges = malloc(nranges * sizeof *p->ranges);
    if (p->ranges == NULL) rc = WEIGHTD_E_NOMEM;
    else memcpy(p->ranges, ranges, nranges * sizeof *p->ranges);
    p->nranges = nranges;
  }
  if (rc != 0) {
    free(p);
    return NULL;
  }
  for (size_t i = 0; i < p->nranges; i++) p->total += p->ranges[i].len;
  reg_ref(ck);
  return p;
}

int reg_prefetch_start(struct registry *r, struct reg_ckpt *ck, const struct plan_range *ranges, size_t nranges,
                       bool pin, reg_prefetched_fn cb, void *arg, struct reg_prefetch **handle, struct wd_error *err) {
  if (ck->remote)
    return err_set(err, WEIGHTD_E_UNSUPPORTED,
                   "%s: a remote checkpoint has no local files to keep warm or pin (loads fetch what they need)",
                   ck->path);
  struct prefetch *p = prefetch_new(r, ck, ranges, nranges, true, pin);
  if (p == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  p->cb = cb;
  p->arg = arg;
  if (handle != NULL) *handle = (struct reg_prefetch *)p;
  if (p->pin && ck->pinning) { /* admitted when the running pin job is done */
    p->next_parked = ck->parked;
    ck->parked = p;
    return 0;
  }
  int rc = prefetch_admit(p, err);
  if (rc != 0) {
    if (handle != NULL) *handle = NULL;
    reg_unref(ck);
    prefetch_free(p);
    return rc;
  }
  prefetch_submit(p);
  return 0;
}

int reg_prefetch(struct registry *r, struct reg_ckpt *ck, const struct plan_range *ranges, size_t nranges, bool pin,
                 reg_prefetched_fn cb, void *arg, struct wd_error *err) {
  return reg_prefetch_start(r, ck, ranges, nranges, pin, cb, arg, NULL, err);
}

/* A handle is the prefetch itself, seen through an incomplete type. */
void reg_prefetch_progress(const struct reg_prefetch *h, uint64_t *done, uint64_t *total) {
  struct prefetch *p = (struct prefetch *)h;
  *done = atomic_load(&p->done);
  *total = p->total;
}

void reg_prefetch_cancel(struct reg_prefetch *h) { atomic_store(&((struct prefetch *)h)->canceled, true); }

/* The pin policy's own pins: logged, never reported. */
static void pin_auto(struct registry *r, struct reg_ckpt *ck, struct plan_range *ranges, size_t n, bool read,
                     const char *why) {
  if (ck->remote || ck->pinning || ck->unpinning || ck->detached || ck->state != REG_OPEN) { /* remote: nothing mapped */
    free(ranges);
    return;
  }
  struct prefetch *p = prefetch_new(r, ck, ranges == NULL ? NULL : ranges, n, read, true);
  free(ranges);
  if (p == NULL) return;
  p->automatic = true;
  struct wd_error err = {0};
  if (prefetch_admit(p, &err) != 0) {
    log_msg(LOG_INFO, "%s: not pinned %s: %s", ck->path, why, err.msg);
    reg_unref(ck);
    prefetch_free(p);
    return;
  }
  if (!p->pin || p->nadd == 0) { /* already registered */
    reg_unref(ck);
    prefetch_free(p);
    return;
  }
  log_msg(LOG_INFO, "%s: pinning %llu bytes in %zu range(s) %s (host_pin_budget %llu bytes from %s)", ck->path,
          (unsigned long long)p->reserved, p->nadd, why, (unsigned long long)reg_pin_budget(r),
          reg_pin_budget_source(r));
  prefetch_submit(p);
}

void reg_pin_after_load(struct reg_ckpt *ck, struct plan_range *ranges, size_t n) {
  struct registry *r = ck->reg;
  if (!reg_pin_wants_ranges(r) || n == 0) {
    free(ranges);
    return;
  }
  pin_auto(r, ck, ranges, n, false, "after a load (pin after_load)");
}

/* pin on_open: a checkpoint just opened is read and registered whole, when it fits. */
void reg_pin_on_open(struct registry *r, struct reg_ckpt *ck) {
  if (r->pin_mode != REG_PIN_ON_OPEN || !reg_registers(r)) return;
  pin_auto(r, ck, NULL, 0, true, "on open (pin on_open)");
}
