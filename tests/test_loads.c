/*
 * test_loads.c - how loads move bytes, driven on a real loop (no socket, no
 * server): the staged pipeline with strided pieces staged as gathered rows
 * or whole source rows (slots of a few KiB, so windows split pieces), and the
 * pinned-resident tier: the pin policy (after_load, on_open, off), pins per
 * plan, direct loads that never copy across two registrations, the budget
 * with least-recently-used unpinning that spares a checkpoint with a load
 * queued, requests parked behind a running pin, a failed registration, and
 * every registration undone on close; and the ready watermark of early
 * attach, staged on the schedule's windows and direct, on a backend whose
 * copies complete only when an event after them is waited for.
 *
 * The host backend cannot register memory, so the tier runs on a test
 * backend: the host backend's table with caps 0 and registration hooks that
 * record every registration and check what CUDA would refuse or mishandle
 * (a start off a page boundary, an overlap, an unregistration that is not
 * exactly a registration, a copy whose source starts in one registration and
 * runs past its end). Its copies are the host backend's memcpys, so every
 * slab is compared with the plan gathered from the file's bytes.
 */
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "testutil.h"

#include "fixture.h"
#include "base/hostmem.h"
#include "manifest.h"
#include "state_env.h"

/* ---- the checkpoint --------------------------------------------------------------------- */

/* Rows of 96, 128 and 512 bytes; "big" spans many pages. */
static const struct fx_tensor tensors[] = {
    {"w", "BF16", 2, 200, 48},
    {"v", "BF16", 2, 64, 64},
    {"n", "F32", 4, 100, 0},
    {"big", "U8", 1, 512, 512},
};
#define NTENSORS 4

static const char *const col_plan =
    "{\"outputs\":["
    "{\"name\":\"wc\",\"dtype\":\"BF16\",\"shape\":[200,24],\"pieces\":[{\"tensor\":\"w\",\"dim\":1,\"start\":24,\"end\":48}]},"
    "{\"name\":\"n\",\"dtype\":\"F32\",\"shape\":[100],\"pieces\":[{\"tensor\":\"n\"}]},"
    "{\"name\":\"bigc\",\"dtype\":\"U8\",\"shape\":[512,256],\"pieces\":[{\"tensor\":\"big\",\"dim\":1,\"start\":256,\"end\":512}]},"
    "{\"name\":\"vc\",\"dtype\":\"BF16\",\"shape\":[64,32],\"pieces\":[{\"tensor\":\"v\",\"dim\":1,\"start\":0,\"end\":32}]}]}";

static const char *const rows_plan =
    "{\"outputs\":[{\"name\":\"big0\",\"dtype\":\"U8\",\"shape\":[40,512],"
    "\"pieces\":[{\"tensor\":\"big\",\"dim\":0,\"start\":0,\"end\":40}]}]}";

/* ---- the registering test backend -------------------------------------------------------- */

static const struct wd_backend_ops *host_ops;
static struct wd_backend_ops fake_ops;

static struct {
  pthread_mutex_t mu;
  struct {
    const char *p;
    size_t len;
  } v[4096];
  size_t n;
  unsigned registers, unregisters, copies_checked;
  pthread_t loop;              /* the thread that runs the loop, once loop_known */
  bool loop_known;
  unsigned unregisters_on_loop; /* cudaHostUnregister stalls the loop: never there */
  int violations;
  int fail_next; /* the next registration fails */
  unsigned pinned, pinned_write_combined; /* staging buffers asked for, and of them write-combined */
} fk = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void violation(const char *fmt, const void *p, size_t len) {
  fk.violations++;
  fprintf(stderr, "test backend: ");
  fprintf(stderr, fmt, p, len);
  fprintf(stderr, "\n");
}

static int fake_register(void *ctx, void *p, size_t len, struct wd_error *err) {
  (void)ctx;
  pthread_mutex_lock(&fk.mu);
  int rc = 0;
  const char *a = p;
  if ((uintptr_t)a % (uintptr_t)sysconf(_SC_PAGESIZE) != 0) violation("registration of %p (+%zu) off a page boundary", p, len);
  for (size_t i = 0; i < fk.n; i++)
    if (a < fk.v[i].p + fk.v[i].len && fk.v[i].p < a + len) {
      violation("registration of %p (+%zu) overlaps another", p, len);
      rc = err_set(err, WEIGHTD_E_DEVICE, "already registered");
    }
  if (rc == 0 && fk.fail_next) {
    fk.fail_next = 0;
    rc = err_set(err, WEIGHTD_E_DEVICE, "cudaHostRegister: cudaErrorMemoryAllocation (test)");
  }
  if (rc == 0 && fk.n < sizeof fk.v / sizeof fk.v[0]) {
    fk.v[fk.n].p = a;
    fk.v[fk.n++].len = len;
    fk.registers++;
  }
  pthread_mutex_unlock(&fk.mu);
  return rc;
}

static void fake_unregister(void *ctx, void *p, size_t len) {
  (void)ctx;
  pthread_mutex_lock(&fk.mu);
  size_t i = 0;
  while (i < fk.n && !(fk.v[i].p == p && fk.v[i].len == len)) i++;
  if (i == fk.n) {
    violation("unregistration of %p (+%zu), which is no registration", p, len);
  } else {
    fk.v[i] = fk.v[--fk.n];
    fk.unregisters++;
    if (fk.loop_known && pthread_equal(pthread_self(), fk.loop)) fk.unregisters_on_loop++;
  }
  pthread_mutex_unlock(&fk.mu);
}

static int fake_copy(void *ctx, struct wd_slab *dst, uint64_t dst_offset, size_t dst_pitch, const void *src,
                     size_t src_pitch, size_t width, size_t height, struct wd_stream *s, struct wd_error *err) {
  const char *a = src;
  size_t span = height ? (height - 1) * src_pitch + width : 0;
  pthread_mutex_lock(&fk.mu);
  for (size_t i = 0; i < fk.n; i++)
    if (a >= fk.v[i].p && a < fk.v[i].p + fk.v[i].len) {
      fk.copies_checked++;
      if (a + span > fk.v[i].p + fk.v[i].len) violation("a copy from %p (+%zu) runs past its registration", a, span);
    }
  pthread_mutex_unlock(&fk.mu);
  return host_ops->copy_h2d(ctx, dst, dst_offset, dst_pitch, src, src_pitch, width, height, s, err);
}

static int fake_pinned_alloc(void *ctx, int device, size_t bytes, unsigned flags, void **out, struct wd_error *err) {
  pthread_mutex_lock(&fk.mu);
  fk.pinned++;
  if (flags & WD_PINNED_WRITE_COMBINED) fk.pinned_write_combined++;
  pthread_mutex_unlock(&fk.mu);
  return host_ops->pinned_alloc(ctx, device, bytes, flags, out, err);
}

static void fake_init(void) {
  struct wd_backend hb;
  struct wd_error err = {0};
  backend_host_create(&hb, &err);
  host_ops = hb.ops;
  fake_ops = *host_ops;
  fake_ops.name = "registering test backend";
  fake_ops.caps = 0; /* like a GPU: registration applies */
  fake_ops.host_register = fake_register;
  fake_ops.host_unregister = fake_unregister;
  fake_ops.copy_h2d = fake_copy;
  fake_ops.pinned_alloc = fake_pinned_alloc;
}

static void fake_reset(void) {
  fk.n = 0;
  fk.registers = fk.unregisters = fk.copies_checked = fk.unregisters_on_loop = 0;
  fk.loop_known = false;
  fk.violations = 0;
  fk.fail_next = 0;
  fk.pinned = fk.pinned_write_combined = 0;
}

/* ---- fixtures ----------------------------------------------------------------------------- */

struct fix {
  struct env e;
  char *scratch;
  bool up;
};

static bool fix_start(struct fix *f, const char *tag, struct env_opts *o) {
  memset(f, 0, sizeof *f);
  o->bulk_threads = o->bulk_threads ? o->bulk_threads : 1;
  o->residency = true;
  o->device_budget = 64ull << 20;
  f->scratch = fx_tmpdir(tag);
  f->up = f->scratch != NULL && env_start(&f->e, o) == 0;
  CHECK(f->up);
  return f->up;
}

static void fix_stop(struct fix *f) {
  if (f->up) env_stop(&f->e);
  if (f->scratch != NULL) fx_rmtree(f->scratch);
  free(f->scratch);
}

/* Writes checkpoint `name` under the scratch dir and opens it: the caller holds a reference (NULL on failure). */
static struct reg_ckpt *open_ckpt(struct fix *f, const char *name) {
  char dir[PATH_MAX], file[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/%s", f->scratch, name);
  CHECK_EQ_INT(mkdir(dir, 0755), 0);
  snprintf(file, sizeof file, "%s/model.safetensors", dir);
  CHECK_EQ_INT(fx_write_st(file, tensors, NTENSORS), 0);
  struct acq a = env_acquire(&f->e, dir);
  CHECK_EQ_INT(a.err.code, 0);
  CHECK(a.ck != NULL);
  return a.ck;
}

static struct plan *plan_of(struct reg_ckpt *ck, const char *spec_text) {
  cJSON *spec = spec_text ? cJSON_Parse(spec_text) : NULL;
  struct plan *p = NULL;
  struct wd_error err = {0};
  int rc = plan_build(ck->ck, spec, &p, &err);
  if (rc != 0) fprintf(stderr, "plan: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  cJSON_Delete(spec);
  return p;
}

/* ---- loading and checking ------------------------------------------------------------------- */

struct wt {
  struct res_waiter w; /* first: done() casts back */
  bool fired;
  struct res_set *s;
  struct wd_error err;
};

static void wt_done(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err) {
  struct wt *t = (struct wt *)w;
  (void)joined;
  t->fired = true;
  t->s = s;
  if (err != NULL) t->err = *err;
}

static bool wt_fired(void *arg) { return ((const struct wt *)arg)->fired; }

/* Queues a load of spec (NULL: whole) of ck on device 0; t's waiter fires when it is done. */
static void load_start(struct fix *f, struct reg_ckpt *ck, const char *spec, struct wt *t) {
  memset(t, 0, sizeof *t);
  t->w.done = wt_done;
  struct plan *p = plan_of(ck, spec);
  if (p == NULL) {
    t->fired = true;
    t->err.code = WEIGHTD_E_BAD_PLAN;
    return;
  }
  reg_ref(ck);
  res_load(f->e.res, ck, 0, p, LD_CHOOSE_MMAP, &t->w);
}

/*
 * Loads spec, checks the slab against the plan gathered from the file's
 * bytes, and evicts the set again. Returns the load's method ("" on failure).
 */
static const char *load_check_evict(struct fix *f, struct reg_ckpt *ck, const char *spec) {
  static char method[16];
  method[0] = '\0';
  struct wt t;
  load_start(f, ck, spec, &t);
  CHECK(env_run_until(&f->e, wt_fired, &t));
  CHECK_EQ_INT(t.err.code, 0);
  if (t.s == NULL) return method;
  snprintf(method, sizeof method, "%s", ld_method_name(t.s->load.method));
  const struct plan *p = t.s->plan;
  /* The expected slab: the file read with read(), gathered here. */
  const struct ckpt_shard *sh = &ck->ck->shards[0];
  unsigned char *file = malloc((size_t)sh->size), *want = calloc(1, p->slab_bytes ? p->slab_bytes : 1);
  int fd = open(sh->real, O_RDONLY);
  CHECK(fd >= 0 && pread(fd, file, (size_t)sh->size, 0) == (ssize_t)sh->size);
  if (fd >= 0) close(fd);
  const unsigned char *data[1] = {file + sh->hdr->data_start};
  plan_gather(p, data, 0, p->slab_bytes, want);
  struct wd_handle h;
  struct wd_error err = {0};
  const struct wd_backend *b = &f->e.backend;
  CHECK_EQ_INT(b->ops->slab_export(b->ctx, t.s->load.slab, &h, &err), 0);
  const unsigned char *slab = mmap(NULL, p->slab_bytes, PROT_READ, MAP_SHARED, h.fd, 0);
  close(h.fd);
  CHECK(slab != MAP_FAILED);
  if (slab != MAP_FAILED) {
    if (memcmp(slab, want, p->slab_bytes) != 0) {
      fprintf(stderr, "a %s load of %s: the slab differs from the plan gathered from the file\n", method,
              spec ? spec : "whole");
      CHECK(0);
    }
    munmap((void *)slab, p->slab_bytes);
  }
  free(file);
  free(want);
  CHECK_EQ_INT(res_evict(f->e.res, t.s->id, 0, NULL, NULL, NULL, NULL, &err), 0);
  CHECK(env_run_until(&f->e, env_pools_idle, &f->e));
  return method;
}

static bool pin_idle(void *arg) {
  const struct reg_ckpt *ck = arg;
  return !ck->pinning && !ck->unpinning;
}

/* Waits for the pin jobs of ck, and for every job. */
static void pins_settle(struct fix *f, struct reg_ckpt *ck) {
  CHECK(env_run_until(&f->e, pin_idle, ck));
  CHECK(env_run_until(&f->e, env_pools_idle, &f->e));
}

struct pf {
  bool fired;
  struct reg_prefetched res;
  struct wd_error err;
};

static void pf_cb(void *arg, struct reg_ckpt *ck, const struct reg_prefetched *res, const struct wd_error *err) {
  struct pf *p = arg;
  (void)ck;
  p->fired = true;
  p->res = *res;
  if (err != NULL) p->err = *err;
}

/* Pins spec's ranges of ck (spec NULL: the whole checkpoint) and waits; returns the prefetch's error code. */
static int pin_and_wait(struct fix *f, struct reg_ckpt *ck, const char *spec) {
  struct plan_range *r = NULL;
  size_t n = 0;
  struct wd_error err = {0};
  if (spec != NULL) {
    struct plan *p = plan_of(ck, spec);
    CHECK_EQ_INT(reg_plan_ranges(ck, p, &r, &n, &err), 0);
    plan_free(p);
  }
  struct pf pf = {0};
  int rc = reg_prefetch(f->e.reg, ck, r, n, true, pf_cb, &pf, &err);
  free(r);
  if (rc != 0) return rc;
  CHECK(env_run_until(&f->e, env_flag_set, &pf.fired));
  pins_settle(f, ck);
  return pf.err.code;
}

/* ---- the staged pipeline ------------------------------------------------------------------- */

/*
 * Staged loads of column slices in small slots, each way, on the host
 * backend and the GPU-like one, the slots written each staging_writes way.
 */
static void test_staged_strided(void) {
  static const enum plan_strided modes[] = {PLAN_STRIDED_GATHER, PLAN_STRIDED_ROWS, PLAN_STRIDED_AUTO};
  /* 512 KiB: two fill tasks of 256 KiB (the fixture's two fill threads) in the whole plan's window. */
  static const size_t slots[] = {4096, 5000, 512u << 10, 1u << 20};
  for (int backend = 0; backend < 2; backend++)
    for (size_t m = 0; m < 3; m++)
      for (size_t k = 0; k < sizeof slots / sizeof slots[0]; k++) {
        fake_reset();
        struct fix f;
        struct env_opts o = {.ops = backend ? &fake_ops : NULL,
                             .method = CFG_LOAD_STAGED,
                             .strided = modes[m],
                             .staging_slots = k == 1 ? 3 : 2,
                             .staging_slot_bytes = slots[k],
                             .writes = (enum ld_writes)((m + k) % 3),
                             .pin_mode = REG_PIN_OFF};
        if (!fix_start(&f, "ld-staged", &o)) {
          fix_stop(&f);
          continue;
        }
        if (backend) { /* every slot and the direct windows' zeros, the slots write-combined exactly when asked */
          CHECK_EQ_INT(fk.pinned, o.staging_slots + 1);
          CHECK_EQ_INT(fk.pinned_write_combined, o.writes == LD_WRITES_WRITE_COMBINED ? o.staging_slots : 0);
        }
        struct reg_ckpt *ck = open_ckpt(&f, "m");
        if (ck != NULL) {
          CHECK(strcmp(load_check_evict(&f, ck, col_plan), "staged") == 0);
          CHECK(strcmp(load_check_evict(&f, ck, NULL), "staged") == 0);
          CHECK(strcmp(load_check_evict(&f, ck, rows_plan), "staged") == 0);
        }
        reg_unref(ck);
        fix_stop(&f);
        CHECK_EQ_INT(fk.registers, 0);
      }
}

/* A staged load of a shard truncated under its mapping fails with FAULT, rows staged whole included. */
static void test_staged_rows_truncated(void) {
  struct fix f;
  struct env_opts o = {.method = CFG_LOAD_STAGED, .strided = PLAN_STRIDED_ROWS, .staging_slot_bytes = 8192};
  if (!fix_start(&f, "ld-trunc", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    CHECK_EQ_INT(truncate(ck->ck->shards[0].real, 8192), 0); /* "big" runs on far past it */
    struct wt t;
    load_start(&f, ck, col_plan, &t);
    CHECK(env_run_until(&f.e, wt_fired, &t));
    CHECK(t.s == NULL);
    CHECK_EQ_INT(t.err.code, WEIGHTD_E_FAULT);
    CHECK_STR_CONTAINS(t.err.msg, "truncated");
  }
  reg_unref(ck);
  fix_stop(&f);
}

/* ---- the ready watermark (early attach) ------------------------------------------------------ */

/*
 * A test backend whose copy engine runs late: the registering backend, but a
 * copy on a stream happens only when an event recorded after it is waited for
 * (reading its source then, as a DMA engine would); copies without a stream
 * happen at once. A watermark raised before the copies below it completed, or
 * a slot refilled while its copy still waits, shows as wrong slab bytes.
 */
struct acopy {
  struct wd_slab *dst;
  uint64_t off;
  size_t dpitch, spitch, width, height;
  const void *src;
};
struct astream {
  struct acopy *q;
  size_t n, cap, done;
};
struct aevent {
  struct astream *s;
  size_t upto;
};

static struct wd_backend_ops async_ops;
static pthread_mutex_t amu = PTHREAD_MUTEX_INITIALIZER;
static unsigned async_late;    /* copies that ran at an event wait */
static unsigned async_fail_at; /* when set, the copy that counts it down to 0 fails */

static int async_stream_create(void *ctx, int device, struct wd_stream **out, struct wd_error *err) {
  (void)ctx;
  (void)device;
  struct astream *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(err, WEIGHTD_E_NOMEM, "stream");
  *out = (struct wd_stream *)(void *)s;
  return 0;
}

static void async_stream_destroy(void *ctx, struct wd_stream *ws) {
  (void)ctx;
  struct astream *s = (struct astream *)(void *)ws;
  if (s == NULL) return;
  if (s->done != s->n) fprintf(stderr, "test backend: a stream destroyed with %zu copies pending\n", s->n - s->done);
  CHECK_EQ_INT(s->done, s->n);
  free(s->q);
  free(s);
}

static int async_event_create(void *ctx, int device, struct wd_event **out, struct wd_error *err) {
  (void)ctx;
  (void)device;
  struct aevent *e = calloc(1, sizeof *e);
  if (e == NULL) return err_set(err, WEIGHTD_E_NOMEM, "event");
  *out = (struct wd_event *)(void *)e;
  return 0;
}

static void async_event_destroy(void *ctx, struct wd_event *e) {
  (void)ctx;
  free(e);
}

static int async_event_record(void *ctx, struct wd_event *we, struct wd_stream *ws, struct wd_error *err) {
  (void)ctx;
  (void)err;
  struct aevent *e = (struct aevent *)(void *)we;
  pthread_mutex_lock(&amu);
  e->s = (struct astream *)(void *)ws;
  e->upto = e->s->n;
  pthread_mutex_unlock(&amu);
  return 0;
}

/* Runs the copies the event covers that have not run yet, in stream order. */
static int async_event_wait(void *ctx, struct wd_event *we, struct wd_error *err) {
  struct aevent *e = (struct aevent *)(void *)we;
  int rc = 0;
  pthread_mutex_lock(&amu);
  struct astream *s = e->s;
  while (s != NULL && s->done < e->upto && rc == 0) {
    const struct acopy *c = &s->q[s->done++];
    rc = fake_copy(ctx, c->dst, c->off, c->dpitch, c->src, c->spitch, c->width, c->height, NULL, err);
    async_late++;
  }
  pthread_mutex_unlock(&amu);
  return rc;
}

static int async_copy(void *ctx, struct wd_slab *dst, uint64_t dst_offset, size_t dst_pitch, const void *src,
                      size_t src_pitch, size_t width, size_t height, struct wd_stream *ws, struct wd_error *err) {
  if (ws == NULL) return fake_copy(ctx, dst, dst_offset, dst_pitch, src, src_pitch, width, height, NULL, err);
  struct astream *s = (struct astream *)(void *)ws;
  pthread_mutex_lock(&amu);
  if (async_fail_at > 0 && --async_fail_at == 0) {
    pthread_mutex_unlock(&amu);
    return err_set(err, WEIGHTD_E_INTERNAL, "test backend: copy failed");
  }
  if (s->n == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 64;
    struct acopy *q = realloc(s->q, cap * sizeof *q);
    if (q == NULL) {
      pthread_mutex_unlock(&amu);
      return err_set(err, WEIGHTD_E_NOMEM, "copy queue");
    }
    s->q = q;
    s->cap = cap;
  }
  s->q[s->n++] = (struct acopy){dst, dst_offset, dst_pitch, src_pitch, width, height, src};
  pthread_mutex_unlock(&amu);
  return 0;
}

static void async_init(void) {
  async_ops = fake_ops;
  async_ops.name = "late-copy test backend";
  async_ops.stream_create = async_stream_create;
  async_ops.stream_destroy = async_stream_destroy;
  async_ops.event_create = async_event_create;
  async_ops.event_destroy = async_event_destroy;
  async_ops.event_record = async_event_record;
  async_ops.event_wait = async_event_wait;
  async_ops.copy_h2d = async_copy;
}

/* A load driven by ld_fill directly, whose ready hook checks the slab below every watermark it is given. */
struct wm {
  struct ld_target t; /* first: the hooks cast back */
  const unsigned char *want; /* the plan gathered from the file's bytes */
  const uint64_t *ends;      /* the schedule's window ends (staged), or NULL: only the set's size */
  size_t nends;
  pthread_mutex_t mu;
  unsigned allocated, calls, bad, off_schedule;
  uint64_t max;
};

static void wm_allocated(struct ld_target *t) {
  struct wm *w = (struct wm *)t;
  w->allocated++;
  memset(t->slab->host_view, 0xEE, (size_t)t->slab->bytes); /* poison: a byte not yet copied shows */
}

static void wm_ready(struct ld_target *t, uint64_t v) {
  struct wm *w = (struct wm *)t;
  const struct plan *p = t->plan;
  const unsigned char *slab = t->slab->host_view;
  uint64_t first_bad = UINT64_MAX;
  for (size_t i = 0; i < p->noutputs && p->outputs[i].offset < v && first_bad == UINT64_MAX; i++) {
    const struct plan_output *o = &p->outputs[i];
    uint64_t e = o->offset + o->nbytes < v ? o->offset + o->nbytes : v;
    for (uint64_t b = o->offset; b < e; b++)
      if (slab[b] != w->want[b]) {
        first_bad = b;
        break;
      }
  }
  bool listed = w->ends == NULL ? v == p->slab_bytes : false;
  for (size_t i = 0; i < w->nends && !listed; i++) listed = w->ends[i] == v;
  pthread_mutex_lock(&w->mu);
  w->calls++;
  if (first_bad != UINT64_MAX) {
    if (w->bad++ == 0)
      fprintf(stderr, "watermark %llu: slab byte %llu is not in place yet\n", (unsigned long long)v,
              (unsigned long long)first_bad);
  }
  if (!listed) w->off_schedule++;
  if (v > w->max) w->max = v;
  pthread_mutex_unlock(&w->mu);
}

/* The plan gathered from the shard's bytes as read() gives them (free it). */
static unsigned char *want_image(const struct reg_ckpt *ck, const struct plan *p) {
  const struct ckpt_shard *sh = &ck->ck->shards[0];
  unsigned char *file = malloc((size_t)sh->size), *want = calloc(1, p->slab_bytes ? p->slab_bytes : 1);
  int fd = open(sh->real, O_RDONLY);
  CHECK(fd >= 0 && pread(fd, file, (size_t)sh->size, 0) == (ssize_t)sh->size);
  if (fd >= 0) close(fd);
  const unsigned char *data[1] = {file + sh->hdr->data_start};
  plan_gather(p, data, 0, p->slab_bytes, want);
  free(file);
  return want;
}

/*
 * Fills plan spec of ck with ld_fill, checking the slab below each watermark
 * as it is raised; with strided != -1 (staged) every watermark must be one
 * of the schedule's window ends. cancel_first: a first run is canceled
 * before it copies, and the run again refills the slab it allocated.
 * Returns the method.
 */
static const char *wm_load(struct fix *f, struct reg_ckpt *ck, const char *spec, int strided, size_t slot,
                           const struct plan_range *pins, size_t npins, bool cancel_first) {
  static char method[16];
  method[0] = '\0';
  struct plan *p = plan_of(ck, spec);
  if (p == NULL) return method;
  struct wm w;
  memset(&w, 0, sizeof w);
  pthread_mutex_init(&w.mu, NULL);
  w.t.plan = p;
  w.t.ck = ck->ck;
  w.t.name = ck->path;
  w.t.mmap = ck->src;
  w.t.choice = LD_CHOOSE_MMAP;
  w.t.pins = pins;
  w.t.npins = npins;
  w.t.allocated = wm_allocated;
  w.t.ready = wm_ready;
  atomic_init(&w.t.bytes_done, 0);
  atomic_init(&w.t.ready_bytes, 0);
  atomic_init(&w.t.cancel, cancel_first);
  w.want = want_image(ck, p);
  uint64_t *ends = NULL;
  struct plan_stage *sched = NULL;
  struct wd_error err = {0};
  if (strided >= 0) {
    CHECK_EQ_INT(plan_stage_build(p, ck->ck, slot, (enum plan_strided)strided, 1, &sched, &err), 0);
    ends = calloc(sched ? sched->nwindows + 1 : 1, sizeof *ends);
    for (size_t k = 0, sum = 0; sched != NULL && k < sched->nwindows; k++) ends[k] = sum += sched->windows[k].slab_bytes;
    w.ends = ends;
    w.nends = sched ? sched->nwindows : 0;
  }
  int rc = ld_fill(f->e.ld, &w.t, &err);
  if (cancel_first) {
    CHECK_EQ_INT(rc, WEIGHTD_E_CANCELED);
    CHECK(w.t.slab != NULL); /* kept for early attachers: a run again refills it */
    CHECK_EQ_INT(atomic_load(&w.t.ready_bytes), 0);
    atomic_store(&w.t.cancel, false);
    rc = ld_fill(f->e.ld, &w.t, &err);
  }
  if (rc != 0) fprintf(stderr, "ld_fill: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(w.allocated, 1);
  CHECK_EQ_INT(w.bad, 0);
  CHECK_EQ_INT(w.off_schedule, 0);
  CHECK_EQ_INT(w.max, p->slab_bytes);
  CHECK_EQ_INT(atomic_load(&w.t.ready_bytes), p->slab_bytes);
  if (strided >= 0 && sched != NULL && sched->nwindows > 4)
    CHECK(w.calls > sched->nwindows / 4); /* it moved window by window, not only at the end */
  snprintf(method, sizeof method, "%s", ld_method_name(w.t.method));
  if (w.t.slab != NULL) {
    /* Sealed now: read it through an export, as a client would. */
    struct wd_handle h;
    const struct wd_backend *b = &f->e.backend;
    CHECK_EQ_INT(b->ops->slab_export(b->ctx, w.t.slab, &h, &err), 0);
    const unsigned char *slab = mmap(NULL, p->slab_bytes, PROT_READ, MAP_SHARED, h.fd, 0);
    close(h.fd);
    CHECK(slab != MAP_FAILED);
    if (slab != MAP_FAILED) {
      for (size_t i = 0; i < p->noutputs; i++)
        CHECK(memcmp(slab + p->outputs[i].offset, w.want + p->outputs[i].offset, p->outputs[i].nbytes) == 0);
      /* The set's own digests (load/digest.c): the tensor digest of each output of the expected image, whatever the method. */
      CHECK(w.t.digests != NULL);
      for (size_t i = 0; w.t.digests != NULL && i < p->noutputs; i++) {
        unsigned char d[MF_DIGEST_BYTES];
        CHECK_EQ_INT(mf_tensor_digest(w.want + p->outputs[i].offset, (size_t)p->outputs[i].nbytes, d), 0);
        CHECK(memcmp(d, w.t.digests[i], MF_DIGEST_BYTES) == 0);
      }
      /* The gaps between outputs too (zero, over the allocation's poison): bytes never depend on the method. */
      if (memcmp(slab, w.want, p->slab_bytes) != 0) {
        fprintf(stderr, "%s: the slab differs from the image outside its outputs\n", ld_method_name(w.t.method));
        CHECK(memcmp(slab, w.want, p->slab_bytes) == 0);
      }
      munmap((void *)slab, p->slab_bytes);
    }
    b->ops->slab_free(b->ctx, w.t.slab);
  }
  free(w.t.digests);
  plan_stage_free(sched);
  free(ends);
  free((void *)w.want);
  pthread_mutex_destroy(&w.mu);
  plan_free(p);
  return method;
}

/*
 * A window's second transfer fails after its first was queued: the load fails
 * with the copy's error, and the queued copy has run before the load returned
 * (async_stream_destroy checks that no stream keeps a pending copy; a copy
 * left queued would read the slot for the next load, into a freed slab).
 */
static void test_staged_copy_fails_after_others_queued(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &async_ops,
                       .method = CFG_LOAD_STAGED,
                       .strided = PLAN_STRIDED_ROWS, /* several transfers per window: 2D runs and image runs */
                       .staging_slots = 2,
                       .staging_slot_bytes = 1u << 20,
                       .pin_mode = REG_PIN_OFF};
  if (!fix_start(&f, "ld-copyfail", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    async_fail_at = 2;
    struct wt t;
    load_start(&f, ck, col_plan, &t);
    CHECK(env_run_until(&f.e, wt_fired, &t));
    CHECK(t.s == NULL);
    CHECK_EQ_INT(t.err.code, WEIGHTD_E_INTERNAL);
    CHECK_STR_CONTAINS(t.err.msg, "copy failed");
    CHECK_EQ_INT(async_fail_at, 0);
    async_fail_at = 0;
  }
  reg_unref(ck);
  fix_stop(&f);
}

/*
 * The watermark promises that every byte below it is in place: staged loads
 * on the schedule's windows (image runs, and strided pieces as whole rows cut
 * by 2D copies), in slots of a few KiB, two or three of them, written each
 * staging_writes way; direct loads (plain and 2D copies from registered
 * mappings); each on a backend whose copies complete only when waited for.
 */
static void test_watermark(void) {
  static const enum plan_strided modes[] = {PLAN_STRIDED_GATHER, PLAN_STRIDED_ROWS, PLAN_STRIDED_AUTO};
  static const size_t slots[] = {4096, 5000, 512u << 10}; /* 512 KiB: windows of two fill tasks */
  static const char *const *specs[] = {&col_plan, &rows_plan, NULL};
  for (size_t m = 0; m < 3; m++)
    for (size_t k = 0; k < 3; k++) {
      fake_reset();
      async_late = 0;
      struct fix f;
      struct env_opts o = {.ops = &async_ops,
                           .method = CFG_LOAD_STAGED,
                           .strided = modes[m],
                           .staging_slots = k == 1 ? 3 : 2,
                           .staging_slot_bytes = slots[k],
                           .writes = (enum ld_writes)((m + k + 1) % 3),
                           .pin_mode = REG_PIN_OFF};
      if (!fix_start(&f, "ld-wm", &o)) {
        fix_stop(&f);
        continue;
      }
      struct reg_ckpt *ck = open_ckpt(&f, "m");
      for (size_t i = 0; ck != NULL && i < 3; i++)
        CHECK(strcmp(wm_load(&f, ck, specs[i] ? *specs[i] : NULL, (int)modes[m], slots[k], NULL, 0, i == 0),
                     "staged") == 0);
      CHECK(async_late > 0);
      reg_unref(ck);
      fix_stop(&f);
    }
  /* Direct: the watermark moves at sync points (here only the end: the set is far below LD_DIRECT_SYNC). */
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &async_ops, .pin_mode = REG_PIN_OFF, .pin_budget = 64ull << 20};
  if (!fix_start(&f, "ld-wm-direct", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    CHECK_EQ_INT(pin_and_wait(&f, ck, NULL), 0);
    struct plan_range *pins = NULL;
    size_t npins = 0;
    CHECK_EQ_INT(reg_pins_copy(ck, &pins, &npins), 0);
    CHECK(npins > 0);
    async_late = 0;
    for (size_t i = 0; i < 3; i++)
      CHECK(strcmp(wm_load(&f, ck, specs[i] ? *specs[i] : NULL, -1, 0, pins, npins, i == 2), "direct") == 0);
    CHECK(async_late > 0);
    free(pins);
  }
  CHECK_EQ_INT(fk.violations, 0);
  reg_unref(ck);
  fix_stop(&f);
}

/* ---- the pin policy ---------------------------------------------------------------------- */

static void test_after_load(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_AFTER_LOAD, .pin_budget = 64ull << 20};
  if (!fix_start(&f, "ld-after", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }
  CHECK(reg_pin_wants_ranges(f.e.reg));
  CHECK_EQ_INT(ck->npins, 0); /* nothing at open */
  /* First load: not registered, so it copies on the CPU; afterwards its ranges get pinned. */
  CHECK(strcmp(load_check_evict(&f, ck, rows_plan), "memcpy") == 0);
  pins_settle(&f, ck);
  struct plan *p = plan_of(ck, rows_plan);
  struct plan_range *r = NULL;
  size_t n = 0;
  struct wd_error err = {0};
  CHECK_EQ_INT(reg_plan_ranges(ck, p, &r, &n, &err), 0);
  plan_free(p);
  CHECK_EQ_INT(n, 1);
  CHECK_EQ_INT(ck->npins, n);
  CHECK_EQ_INT(reg_pins_bytes(ck), plan_ranges_bytes(r, n));
  CHECK_EQ_INT(reg_pinned_bytes(f.e.reg), plan_ranges_bytes(r, n));
  CHECK(plan_ranges_bytes(r, n) < ck->ck->shards[0].size / 4);
  CHECK_EQ_INT(fk.registers, n);
  CHECK(!reg_pinned_whole(ck));
  free(r);
  /* Later loads of it go direct; a plan reading more is not covered, so it copies and then pins the rest. */
  CHECK(strcmp(load_check_evict(&f, ck, rows_plan), "direct") == 0);
  CHECK(fk.copies_checked > 0);
  unsigned before = fk.registers;
  CHECK(strcmp(load_check_evict(&f, ck, col_plan), "memcpy") == 0);
  pins_settle(&f, ck);
  CHECK(fk.registers > before);
  CHECK(strcmp(load_check_evict(&f, ck, col_plan), "direct") == 0); /* 2D copies */
  CHECK(strcmp(load_check_evict(&f, ck, NULL), "direct") == 0);
  CHECK_EQ_INT(fk.violations, 0);
  reg_unref(ck);
  fix_stop(&f);
  /* Stopping freed the entry: every registration undone, exactly. */
  CHECK_EQ_INT(fk.n, 0);
  CHECK_EQ_INT(fk.unregisters, fk.registers);
  CHECK_EQ_INT(fk.violations, 0);
}

/* A strided piece and a whole tensor that straddle two registrations: copies stop at the boundary. */
static void test_direct_splits_at_registrations(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_OFF, .pin_budget = 64ull << 20};
  if (!fix_start(&f, "ld-split", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }
  CHECK(!reg_pin_wants_ranges(f.e.reg)); /* pin off */
  CHECK(strcmp(load_check_evict(&f, ck, NULL), "memcpy") == 0);
  CHECK_EQ_INT(fk.registers, 0);
  /* Rows [0, 40) of "big" first, then the rest of the file: two registrations meet inside "big". */
  CHECK_EQ_INT(pin_and_wait(&f, ck, rows_plan), 0);
  CHECK_EQ_INT(ck->npins, 1);
  uint64_t boundary = ck->pins[0].off + ck->pins[0].len;
  CHECK_EQ_INT(pin_and_wait(&f, ck, NULL), 0);
  CHECK(ck->npins >= 2);
  CHECK(reg_pinned_whole(ck));
  const struct ckpt_ref *big = ckpt_tensor_find(ck->ck, "big");
  uint64_t base = ck->ck->shards[0].hdr->data_start + big->t->begin, q = boundary - base;
  CHECK(boundary > base && q < 512 * 512);
  /* A column slice whose rows straddle the boundary: take the columns around it. */
  uint64_t col = q % 512, lo = col >= 60 ? col - 60 : 0, hi = lo + 120 <= 512 ? lo + 120 : 512;
  char spec[512];
  snprintf(spec, sizeof spec,
           "{\"outputs\":[{\"name\":\"x\",\"dtype\":\"U8\",\"shape\":[512,%llu],\"pieces\":[{\"tensor\":\"big\",\"dim\":1,"
           "\"start\":%llu,\"end\":%llu}]},{\"name\":\"big\",\"dtype\":\"U8\",\"shape\":[512,512],\"pieces\":[{\"tensor\":"
           "\"big\"}]}]}",
           (unsigned long long)(hi - lo), (unsigned long long)lo, (unsigned long long)hi);
  CHECK(strcmp(load_check_evict(&f, ck, spec), "direct") == 0);
  CHECK(strcmp(load_check_evict(&f, ck, col_plan), "direct") == 0);
  CHECK(strcmp(load_check_evict(&f, ck, NULL), "direct") == 0);
  CHECK_EQ_INT(fk.violations, 0);
  reg_unref(ck);
  fix_stop(&f);
  CHECK_EQ_INT(fk.n, 0);
}

static void test_on_open(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_ON_OPEN, .pin_budget = 64ull << 20};
  if (!fix_start(&f, "ld-open", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    pins_settle(&f, ck);
    CHECK(reg_pinned_whole(ck));
    CHECK_EQ_INT(fk.registers, 1);
    CHECK_EQ_INT(reg_pinned_bytes(f.e.reg), ck->ck->shards[0].size);
    CHECK(strcmp(load_check_evict(&f, ck, col_plan), "direct") == 0);
  }
  reg_unref(ck);
  /* A budget smaller than the checkpoint: nothing is pinned at open, and the failure is only logged. */
  reg_pin_budget_set(f.e.reg, 4096);
  struct reg_ckpt *c2 = open_ckpt(&f, "m2");
  if (c2 != NULL) {
    pins_settle(&f, c2);
    CHECK_EQ_INT(c2->npins, 0);
    CHECK(strcmp(load_check_evict(&f, c2, NULL), "memcpy") == 0);
  }
  reg_unref(c2);
  CHECK_EQ_INT(fk.violations, 0);
  fix_stop(&f);
  CHECK_EQ_INT(fk.n, 0);
}

static void test_budget_lru_and_loading(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_OFF, .bulk_threads = 1};
  if (!fix_start(&f, "ld-budget", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *a = open_ckpt(&f, "a"), *b = open_ckpt(&f, "b");
  if (a == NULL || b == NULL) {
    reg_unref(a);
    reg_unref(b);
    fix_stop(&f);
    return;
  }
  uint64_t size = a->ck->shards[0].size;
  reg_pin_budget_set(f.e.reg, size + size / 2); /* room for one */
  CHECK_EQ_INT(reg_pin_budget(f.e.reg), size + size / 2);
  CHECK(strcmp(reg_pin_budget_source(f.e.reg), "host_pin_budget") == 0);
  CHECK_EQ_INT(pin_and_wait(&f, a, NULL), 0);
  CHECK(reg_pinned_whole(a));
  /* b needs the room: a, the least recently used, is unpinned. */
  CHECK_EQ_INT(pin_and_wait(&f, b, NULL), 0);
  CHECK(reg_pinned_whole(b));
  CHECK_EQ_INT(a->npins, 0);
  CHECK_EQ_INT(reg_pinned_bytes(f.e.reg), size);
  CHECK_EQ_INT(fk.n, 1);
  /* b with a load queued (the only bulk thread held): it cannot be unpinned, so a does not fit. */
  struct gate g;
  gate_close(&g, f.e.bulk);
  struct wt t;
  load_start(&f, b, NULL, &t);
  CHECK_EQ_INT(b->loads, 1);
  struct wd_error err = {0};
  struct pf pf = {0};
  CHECK_EQ_INT(reg_prefetch(f.e.reg, a, NULL, 0, true, pf_cb, &pf, &err), WEIGHTD_E_LIMIT);
  CHECK_STR_CONTAINS(err.msg, "exceeds host_pin_budget");
  CHECK(!pf.fired);
  gate_open(&g);
  CHECK(env_run_until(&f.e, wt_fired, &t));
  CHECK(t.s != NULL && t.s->load.method == LD_METHOD_DIRECT);
  CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
  gate_destroy(&g);
  CHECK_EQ_INT(b->loads, 0);
  /* Now it can: b goes, a comes back. A shrunk budget unpins what no longer fits. */
  CHECK_EQ_INT(pin_and_wait(&f, a, NULL), 0);
  CHECK(reg_pinned_whole(a));
  CHECK_EQ_INT(b->npins, 0);
  CHECK_EQ_INT(reg_pin_budget_set(f.e.reg, size / 2), 1);
  pins_settle(&f, a);
  CHECK_EQ_INT(a->npins, 0);
  CHECK_EQ_INT(reg_pinned_bytes(f.e.reg), 0);
  CHECK_EQ_INT(fk.n, 0);
  /* The derived budget (0 configured) is half of what the daemon may use. */
  reg_pin_budget_set(f.e.reg, 0);
  struct hostmem hm;
  hostmem_read(&hm);
  CHECK_EQ_INT(reg_pin_budget(f.e.reg), hm.limit / 2);
  CHECK(strcmp(reg_pin_budget_source(f.e.reg), hm.source) == 0);
  CHECK_EQ_INT(fk.violations, 0);
  CHECK_EQ_INT(res_evict(f.e.res, NULL, 0, NULL, NULL, NULL, NULL, &err), 0);
  reg_unref(a);
  reg_unref(b);
  fix_stop(&f);
}

/* How many of this process's mappings are of the file at path. */
static int mappings_of(const char *path) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (f == NULL) return -1;
  char line[PATH_MAX + 128];
  int n = 0;
  size_t len = strlen(path);
  while (fgets(line, sizeof line, f) != NULL) {
    char *nl = strchr(line, '\n');
    if (nl != NULL) *nl = '\0';
    size_t l = strlen(line);
    n += l >= len && strcmp(line + l - len, path) == 0;
  }
  fclose(f);
  return n;
}

static bool no_pins(void *arg) {
  (void)arg;
  pthread_mutex_lock(&fk.mu);
  bool none = fk.n == 0;
  pthread_mutex_unlock(&fk.mu);
  return none;
}

/*
 * The last reference to a pinned checkpoint goes (a close): its pins are
 * unregistered and its shards unmapped on a bulk job, never on the loop,
 * and both are gone once the job is done.
 */
static void test_close_unpins_off_the_loop(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_OFF, .pin_budget = 64ull << 20, .bulk_threads = 1};
  if (!fix_start(&f, "ld-release", &o)) {
    fix_stop(&f);
    return;
  }
  fk.loop = pthread_self();
  fk.loop_known = true;
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    char shard[PATH_MAX];
    snprintf(shard, sizeof shard, "%s", ck->ck->shards[0].real);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s", ck->path);
    CHECK_EQ_INT(pin_and_wait(&f, ck, NULL), 0);
    CHECK(reg_pinned_whole(ck));
    CHECK(fk.n > 0);
    CHECK_EQ_INT(mappings_of(shard), 1);
    /* The only bulk thread held: the release waits for it, and the close has returned. */
    reg_unref(ck);
    ck = NULL;
    struct gate g;
    gate_close(&g, f.e.bulk);
    struct wd_error err = {0};
    CHECK_EQ_INT(reg_close(f.e.reg, path, &err), 0);
    CHECK_EQ_INT(reg_pinned_bytes(f.e.reg), 0);
    CHECK(fk.n > 0);
    gate_open(&g);
    CHECK(env_run_until(&f.e, no_pins, NULL));
    CHECK(env_run_until(&f.e, env_pools_idle, &f.e));
    gate_destroy(&g);
    CHECK_EQ_INT(fk.unregisters_on_loop, 0);
    CHECK(fk.unregisters > 0);
    CHECK_EQ_INT(mappings_of(shard), 0);
  }
  CHECK_EQ_INT(fk.violations, 0);
  fix_stop(&f);
  fk.loop_known = false;
}

/* Two pins of one checkpoint asked at once: the second waits for the first, then registers only what is new. */
static void test_parked_pins(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_OFF, .pin_budget = 64ull << 20};
  if (!fix_start(&f, "ld-parked", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    struct plan *p = plan_of(ck, rows_plan);
    struct plan_range *r = NULL;
    size_t n = 0;
    struct wd_error err = {0};
    CHECK_EQ_INT(reg_plan_ranges(ck, p, &r, &n, &err), 0);
    plan_free(p);
    struct pf a = {0}, b = {0};
    CHECK_EQ_INT(reg_prefetch(f.e.reg, ck, r, n, true, pf_cb, &a, &err), 0);
    CHECK(ck->pinning);
    CHECK_EQ_INT(reg_prefetch(f.e.reg, ck, NULL, 0, true, pf_cb, &b, &err), 0);
    CHECK(ck->parked != NULL);
    CHECK(env_run_until(&f.e, env_flag_set, &a.fired));
    CHECK(env_run_until(&f.e, env_flag_set, &b.fired));
    pins_settle(&f, ck);
    CHECK_EQ_INT(a.err.code, 0);
    CHECK_EQ_INT(b.err.code, 0);
    CHECK_EQ_INT(a.res.registered, plan_ranges_bytes(r, n));
    CHECK_EQ_INT(b.res.registered, ck->ck->shards[0].size - plan_ranges_bytes(r, n));
    CHECK(reg_pinned_whole(ck));
    CHECK(ck->parked == NULL);
    /* Asked again: nothing new to register. */
    struct pf c = {0};
    CHECK_EQ_INT(reg_prefetch(f.e.reg, ck, NULL, 0, true, pf_cb, &c, &err), 0);
    CHECK(env_run_until(&f.e, env_flag_set, &c.fired));
    CHECK_EQ_INT(c.res.registered, 0);
    free(r);
    /* Closed: every registration undone. */
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s", ck->path);
    reg_unref(ck);
    CHECK(env_run_until(&f.e, env_pools_idle, &f.e));
    CHECK_EQ_INT(reg_close(f.e.reg, path, &err), 0);
    CHECK(env_run_until(&f.e, no_pins, NULL)); /* on a bulk job */
    ck = NULL;
  }
  CHECK_EQ_INT(fk.violations, 0);
  fix_stop(&f);
}

/* A registration that fails: the request says why, the budget and the pins are as before. */
static void test_failed_registration(void) {
  fake_reset();
  struct fix f;
  struct env_opts o = {.ops = &fake_ops, .pin_mode = REG_PIN_OFF, .pin_budget = 64ull << 20};
  if (!fix_start(&f, "ld-fail", &o)) {
    fix_stop(&f);
    return;
  }
  struct reg_ckpt *ck = open_ckpt(&f, "m");
  if (ck != NULL) {
    fk.fail_next = 1;
    CHECK_EQ_INT(pin_and_wait(&f, ck, NULL), WEIGHTD_E_DEVICE);
    CHECK_EQ_INT(ck->npins, 0);
    CHECK_EQ_INT(ck->pinned_bytes, 0);
    CHECK_EQ_INT(reg_pinned_bytes(f.e.reg), 0);
    CHECK_EQ_INT(fk.n, 0);
    CHECK(strcmp(load_check_evict(&f, ck, NULL), "memcpy") == 0);
  }
  reg_unref(ck);
  CHECK_EQ_INT(fk.violations, 0);
  fix_stop(&f);
}

int main(void) {
  log_set_level(LOG_ERROR);
  if (fault_install() != 0) {
    fprintf(stderr, "fault_install failed\n");
    return 1;
  }
  fake_init();
  async_init();
  RUN(test_staged_strided);
  RUN(test_staged_rows_truncated);
  RUN(test_staged_copy_fails_after_others_queued);
  RUN(test_watermark);
  RUN(test_after_load);
  RUN(test_direct_splits_at_registrations);
  RUN(test_on_open);
  RUN(test_budget_lru_and_loading);
  RUN(test_parked_pins);
  RUN(test_close_unpins_off_the_loop);
  RUN(test_failed_registration);
  return tu_finish();
}
