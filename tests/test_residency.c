/*
 * test_residency.c - resident sets driven directly on a real loop (no socket,
 * no server), on the host backend: a loaded slab holds the files' bytes, an
 * identical load joins the one under way, leases, least-recently-used
 * eviction that spares leased sets, a budget full of leased sets, explicit
 * eviction, canceling the only waiter, and loads of a shard that was
 * truncated or replaced after opening.
 *
 * The bulk pool has one thread, and a gate (state_env.h) holds it where a
 * test must act while a load is still queued: what the load job sees is
 * decided by the test, never by timing.
 */
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#include "fixture.h"
#include "state_env.h"

/* Over three pages, so that a shard cut to one page faults while it is read. */
static const struct fx_tensor tensors[] = {
    {"a", "U8", 1, 1000, 0},
    {"b", "F32", 4, 33, 7},
    {"c", "BF16", 2, 5000, 0},
};
#define NTENSORS 3
#define PAYLOAD (1000u + 33u * 7u * 4u + 5000u * 2u)

#define BUDGET (64ull << 20)

/* ---- fixtures -------------------------------------------------------------------- */

struct fix {
  struct env e;
  char *scratch;
  bool up;
};

/* An env whose loads read a byte from the FIFO gate (when given) before each window they fill. */
static bool fix_start_gated(struct fix *f, const char *tag, const char *gate) {
  memset(f, 0, sizeof *f);
  struct env_opts o = {.bulk_threads = 1, .residency = true, .device_budget = BUDGET, .load_gate = gate};
  f->scratch = fx_tmpdir(tag);
  f->up = f->scratch != NULL && env_start(&f->e, &o) == 0;
  CHECK(f->up);
  return f->up;
}

static bool fix_start(struct fix *f, const char *tag) { return fix_start_gated(f, tag, NULL); }

static void fix_stop(struct fix *f) {
  if (f->up) env_stop(&f->e);
  if (f->scratch != NULL) fx_rmtree(f->scratch);
  free(f->scratch);
}

/* Writes checkpoint `name` (one model.safetensors) under the scratch dir; its file path goes to file. */
static void write_ckpt(struct fix *f, const char *name, char dir[PATH_MAX], char file[PATH_MAX]) {
  snprintf(dir, PATH_MAX, "%s/%s", f->scratch, name);
  CHECK_EQ_INT(mkdir(dir, 0755), 0);
  snprintf(file, PATH_MAX, "%s/model.safetensors", dir);
  CHECK_EQ_INT(fx_write_st(file, tensors, NTENSORS), 0);
}

/* Writes and opens checkpoint `name`: the caller holds a reference. */
static struct reg_ckpt *open_ckpt(struct fix *f, const char *name, char file[PATH_MAX]) {
  char dir[PATH_MAX];
  write_ckpt(f, name, dir, file);
  struct acq a = env_acquire(&f->e, dir);
  CHECK_EQ_INT(a.err.code, 0);
  CHECK(a.ck != NULL);
  return a.ck;
}

/* ---- waiting for sets -------------------------------------------------------------- */

struct wt {
  struct res_waiter w; /* first: done() casts back */
  int done_calls;
  struct res_set *s;
  bool joined;
  struct wd_error err;
  int progress_calls;
  uint64_t first_done, first_total;
};

static void wt_done(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err) {
  struct wt *t = (struct wt *)w;
  t->done_calls++;
  t->s = s;
  t->joined = joined;
  if (err != NULL) t->err = *err;
}

static void wt_progress(struct res_waiter *w, uint64_t done, uint64_t total) {
  struct wt *t = (struct wt *)w;
  if (t->progress_calls++ == 0) {
    t->first_done = done;
    t->first_total = total;
  }
}

static void wt_init(struct wt *t) {
  memset(t, 0, sizeof *t);
  t->w.done = wt_done;
  t->w.progress = wt_progress;
}

static bool wt_fired(void *arg) { return ((const struct wt *)arg)->done_calls > 0; }

/* Asks for the whole-checkpoint set of ck on device 0 (res_load takes a reference and the plan). */
static void load(struct fix *f, struct reg_ckpt *ck, struct wt *t) {
  wt_init(t);
  struct plan *p = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(plan_build(ck->ck, NULL, &p, &err), 0);
  reg_ref(ck);
  res_load(f->e.res, ck, 0, p, LD_CHOOSE_MMAP, &t->w);
}

/* Loads and waits: the ready set, or NULL. */
static struct res_set *load_ready(struct fix *f, struct reg_ckpt *ck) {
  struct wt t;
  load(f, ck, &t);
  CHECK(env_run_until(&f->e, wt_fired, &t));
  CHECK_EQ_INT(t.done_calls, 1);
  CHECK_EQ_INT(t.err.code, 0);
  CHECK(t.s != NULL && t.s->state == SET_READY);
  return t.s;
}

static size_t count_sets(const struct residency *r) {
  size_t n = 0;
  for (const struct res_set *s = res_first_set(r); s != NULL; s = s->next) n++;
  return n;
}

static size_t count_leases(const struct residency *r) {
  size_t n = 0;
  for (const struct lease *l = res_first_lease(r); l != NULL; l = l->next) n++;
  return n;
}

static uint64_t used(struct fix *f) { return res_device(f->e.res, 0)->used; }

/* Returns once clock_ms() has moved on, so that the next use of a set is strictly later. */
static void next_ms(void) {
  uint64_t t = clock_ms();
  while (clock_ms() == t) sched_yield();
}

/* Marks s used now, as an identical request for a ready set does. */
static void touch(struct fix *f, struct res_set *s) {
  struct wt t;
  wt_init(&t);
  next_ms();
  res_wait(f->e.res, s, &t.w);
  CHECK_EQ_INT(t.done_calls, 1);
  CHECK(t.s == s);
}

/* ---- the bytes ------------------------------------------------------------------- */

static unsigned char *read_file(const char *path, size_t *len) {
  FILE *fp = fopen(path, "rb");
  if (fp == NULL) return NULL;
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  unsigned char *b = n > 0 ? malloc((size_t)n) : NULL;
  if (b != NULL && fread(b, 1, (size_t)n, fp) != (size_t)n) {
    free(b);
    b = NULL;
  }
  fclose(fp);
  *len = b != NULL ? (size_t)n : 0;
  return b;
}

/*
 * Checks the exported slab against the file: each tensor's bytes where the
 * plan put its output, zeros everywhere else, and the memfd sealed.
 */
static void check_slab_matches_file(struct fix *f, struct res_set *s, const char *file) {
  const struct wd_backend *b = &f->e.backend;
  const struct plan *p = s->plan;
  size_t flen = 0;
  unsigned char *fb = read_file(file, &flen);
  CHECK(fb != NULL && flen > 8);
  if (fb == NULL || flen <= 8) return;
  uint64_t hlen = 0;
  for (int i = 0; i < 8; i++) hlen |= (uint64_t)fb[i] << (8 * i);
  const unsigned char *data = fb + 8 + hlen;
  CHECK_EQ_INT(flen, 8 + hlen + PAYLOAD);

  struct wd_handle h;
  struct wd_error err = {0};
  CHECK_EQ_INT(b->ops->slab_export(b->ctx, s->load.slab, &h, &err), 0);
  CHECK_EQ_INT(h.kind, WD_HANDLE_FD);
  CHECK_EQ_INT(h.bytes, p->slab_bytes);
  struct stat sb;
  CHECK_EQ_INT(fstat(h.fd, &sb), 0);
  CHECK_EQ_INT(sb.st_size, p->slab_bytes);
  int seals = fcntl(h.fd, F_GET_SEALS);
  CHECK_EQ_INT(seals & (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW);
  CHECK(s->load.slab->host_view == NULL);
  const unsigned char *slab = mmap(NULL, p->slab_bytes, PROT_READ, MAP_SHARED, h.fd, 0);
  CHECK(slab != MAP_FAILED);
  close(h.fd);
  if (slab == MAP_FAILED) {
    free(fb);
    return;
  }

  CHECK_EQ_INT(p->noutputs, NTENSORS);
  CHECK_EQ_INT(p->payload_bytes, PAYLOAD);
  unsigned char *covered = calloc(p->slab_bytes, 1);
  uint64_t off = 0;
  for (size_t i = 0; i < NTENSORS; i++) {
    uint64_t n = (tensors[i].cols ? tensors[i].rows * tensors[i].cols : tensors[i].rows) * tensors[i].elem_bytes;
    const struct plan_output *o = NULL;
    for (size_t k = 0; k < p->noutputs; k++)
      if (strcmp(p->outputs[k].name, tensors[i].name) == 0) o = &p->outputs[k];
    CHECK(o != NULL);
    if (o != NULL) {
      CHECK_EQ_INT(o->nbytes, n);
      CHECK_EQ_INT(o->offset % PLAN_ALIGN, 0);
      CHECK(o->offset + n <= p->slab_bytes);
      if (o->offset + n <= p->slab_bytes) {
        CHECK_EQ_INT(memcmp(slab + o->offset, data + off, n), 0);
        memset(covered + o->offset, 1, n);
      }
    }
    off += n;
  }
  uint64_t stray = 0;
  for (uint64_t i = 0; i < p->slab_bytes; i++) stray += !covered[i] && slab[i] != 0;
  CHECK_EQ_INT(stray, 0);
  free(covered);
  munmap((void *)slab, p->slab_bytes);
  free(fb);
}

/* ---- loading ------------------------------------------------------------------------ */

static void test_load_fills_slab_with_file_bytes(void) {
  struct fix f;
  if (!fix_start(&f, "res-load")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }

  struct wt t;
  load(&f, ck, &t);
  CHECK_EQ_INT(t.done_calls, 0);
  struct res_set *s = res_first_set(f.e.res);
  CHECK(s != NULL && t.w.set == s);
  /* Told its progress at once: nothing yet, of the slab's size. */
  CHECK_EQ_INT(t.progress_calls >= 1, 1);
  CHECK_EQ_INT(t.first_done, 0);
  if (s != NULL) {
    CHECK_EQ_INT(t.first_total, s->plan->slab_bytes);
    CHECK_EQ_INT(s->state, SET_LOADING);
    CHECK_EQ_INT(ck->loads, 1);
  }
  CHECK(env_run_until(&f.e, wt_fired, &t));
  CHECK_EQ_INT(t.done_calls, 1);
  CHECK_EQ_INT(t.err.code, 0);
  CHECK(t.s == s);
  CHECK(!t.joined);
  CHECK(t.w.set == NULL);
  if (s != NULL && t.s == s) {
    CHECK_EQ_INT(s->state, SET_READY);
    CHECK(strcmp(s->id, "s1") == 0);
    CHECK(s->ck == ck);
    CHECK(s->next == NULL);
    CHECK(s->load.method == LD_METHOD_MEMCPY);
    CHECK_EQ_INT(atomic_load(&s->load.bytes_done), s->plan->slab_bytes);
    CHECK_EQ_INT(used(&f), s->plan->slab_bytes);
    CHECK_EQ_INT(ck->loads, 0);
    CHECK_EQ_INT(ck->refs, 3); /* the registry's, ours, the set's */
    CHECK_EQ_INT(res_count_sets_of(f.e.res, ck), 1);
    CHECK(res_find_set(f.e.res, "s1") == s);
    check_slab_matches_file(&f, s, file);
  }
  reg_unref(ck);
  fix_stop(&f);
}

static void test_identical_load_joins(void) {
  struct fix f;
  if (!fix_start(&f, "res-join")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }

  struct gate g;
  gate_close(&g, f.e.bulk);
  struct wt t1, t2, t3;
  load(&f, ck, &t1);
  load(&f, ck, &t2);
  struct res_set *s = res_first_set(f.e.res);
  CHECK(s != NULL);
  CHECK_EQ_INT(count_sets(f.e.res), 1);
  CHECK(t1.w.set == s && t2.w.set == s);
  CHECK_EQ_INT(t1.done_calls + t2.done_calls, 0);
  CHECK_EQ_INT(t2.progress_calls >= 1, 1);
  if (s != NULL) {
    CHECK_EQ_INT(s->state, SET_LOADING);
    CHECK_EQ_INT(used(&f), s->plan->slab_bytes); /* counted once */
    /* A loading set can be neither leased nor evicted. */
    struct lease_holder hold = {.owner = &t1};
    struct lease *l = NULL;
    struct wd_error err = {0};
    CHECK_EQ_INT(res_lease_add(f.e.res, s, &hold, &l, &err), WEIGHTD_E_BUSY);
    CHECK(l == NULL);
    CHECK_EQ_INT(res_evict(f.e.res, s->id, 0, NULL, NULL, NULL, NULL, &err), WEIGHTD_E_BUSY);
    CHECK_STR_CONTAINS(err.msg, "still loading");
    CHECK(res_first_set(f.e.res) == s);
  }
  gate_open(&g);
  CHECK(env_run_until(&f.e, wt_fired, &t1));
  CHECK(env_run_until(&f.e, wt_fired, &t2));
  CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
  gate_destroy(&g);
  CHECK_EQ_INT(t1.done_calls, 1);
  CHECK_EQ_INT(t2.done_calls, 1);
  CHECK(t1.s == s && t2.s == s);
  CHECK(!t1.joined);
  CHECK(t2.joined);
  CHECK_EQ_INT(t1.err.code + t2.err.code, 0);

  /* Ready now: a third identical request is answered before res_load returns. */
  load(&f, ck, &t3);
  CHECK_EQ_INT(t3.done_calls, 1);
  CHECK(t3.s == s);
  CHECK(t3.joined);
  CHECK_EQ_INT(count_sets(f.e.res), 1);
  CHECK_EQ_INT(res_count_sets_of(f.e.res, ck), 1);
  CHECK_EQ_INT(ck->refs, 3); /* the joiners' references were dropped */
  if (s != NULL) {
    CHECK(strcmp(s->id, "s1") == 0);
    CHECK_EQ_INT(used(&f), s->plan->slab_bytes);
    check_slab_matches_file(&f, s, file);
  }
  reg_unref(ck);
  fix_stop(&f);
}

/* ---- leases ----------------------------------------------------------------------------- */

static void test_leases(void) {
  struct fix f;
  if (!fix_start(&f, "res-lease")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }
  struct res_set *s = load_ready(&f, ck);
  if (s == NULL) {
    reg_unref(ck);
    fix_stop(&f);
    return;
  }
  int owner_a, owner_b;
  struct lease_holder ha = {.owner = &owner_a, .pid = 111, .uid = 222}, hb = {.owner = &owner_b, .pid = 333};
  snprintf(ha.client, sizeof ha.client, "engine-a");
  struct lease *a1 = NULL, *a2 = NULL, *b1 = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(res_lease_add(f.e.res, s, &ha, &a1, &err), 0);
  CHECK_EQ_INT(res_lease_add(f.e.res, s, &ha, &a2, &err), 0);
  CHECK_EQ_INT(res_lease_add(f.e.res, s, &hb, &b1, &err), 0);
  if (a1 == NULL || a2 == NULL || b1 == NULL) {
    reg_unref(ck);
    fix_stop(&f);
    return;
  }
  CHECK_EQ_INT(s->leases, 3);
  CHECK_EQ_INT(count_leases(f.e.res), 3);
  /* Set and lease ids share one counter: s1, then l2, l3, l4. */
  CHECK(strcmp(a1->id, "l2") == 0);
  CHECK(strcmp(a2->id, "l3") == 0);
  CHECK(strcmp(b1->id, "l4") == 0);
  CHECK(a1->set == s && b1->set == s);
  CHECK_EQ_INT(a1->holder.pid, 111);
  CHECK_EQ_INT(a1->holder.uid, 222);
  CHECK(strcmp(a1->holder.client, "engine-a") == 0);
  CHECK(res_find_lease(f.e.res, "l3") == a2);

  res_lease_drop(f.e.res, a1);
  CHECK_EQ_INT(s->leases, 2);
  CHECK(res_find_lease(f.e.res, "l2") == NULL);
  CHECK(res_find_lease(f.e.res, "l3") == a2);

  /* Dropping owner A's leases leaves B's alone. */
  res_leases_drop_owner(f.e.res, &owner_a);
  CHECK_EQ_INT(s->leases, 1);
  CHECK_EQ_INT(count_leases(f.e.res), 1);
  CHECK(res_first_lease(f.e.res) == b1);
  CHECK(res_find_lease(f.e.res, "l3") == NULL);
  res_leases_drop_owner(f.e.res, &owner_a); /* none left: nothing happens */
  CHECK_EQ_INT(s->leases, 1);

  CHECK_EQ_INT(res_evict(f.e.res, "s1", 0, NULL, NULL, NULL, NULL, &err), WEIGHTD_E_BUSY);
  CHECK_STR_CONTAINS(err.msg, "1 lease(s)");
  CHECK(res_find_set(f.e.res, "s1") == s);

  res_leases_drop_owner(f.e.res, &owner_b);
  CHECK_EQ_INT(s->leases, 0);
  CHECK(res_first_lease(f.e.res) == NULL);
  CHECK_EQ_INT(s->state, SET_READY); /* unleased sets stay resident */
  CHECK(res_find_set(f.e.res, "s1") == s);
  reg_unref(ck);
  fix_stop(&f);
}

/* ---- eviction --------------------------------------------------------------------------- */

static void test_lru_eviction_spares_leased_sets(void) {
  struct fix f;
  if (!fix_start(&f, "res-lru")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck[5];
  const char *names[5] = {"m1", "m2", "m3", "m4", "m5"};
  for (int i = 0; i < 5; i++) ck[i] = open_ckpt(&f, names[i], file);
  for (int i = 0; i < 5; i++)
    if (ck[i] == NULL) {
      for (int k = 0; k < 5; k++) reg_unref(ck[k]);
      fix_stop(&f);
      return;
    }
  struct res_set *s1 = load_ready(&f, ck[0]);
  if (s1 == NULL) {
    for (int k = 0; k < 5; k++) reg_unref(ck[k]);
    fix_stop(&f);
    return;
  }
  const uint64_t S = s1->plan->slab_bytes;
  res_device_budget_set(f.e.res, 2 * S + S / 2); /* two sets fit, three do not */
  CHECK_EQ_INT(res_device_budget(f.e.res, 0), 2 * S + S / 2);
  struct res_set *s2 = load_ready(&f, ck[1]);
  CHECK(s2 != NULL && strcmp(s2->id, "s2") == 0);
  CHECK_EQ_INT(used(&f), 2 * S);

  /* s1 is used after s2: s2 is the least recently used (though s1 is older). */
  touch(&f, s1);
  struct wt t3;
  /* Eviction happens when the load's job starts, about to allocate: held in the queue, it evicted nothing. */
  struct gate g;
  gate_close(&g, f.e.bulk);
  load(&f, ck[2], &t3);
  CHECK(res_find_set(f.e.res, "s2") == s2);
  CHECK_EQ_INT(count_sets(f.e.res), 3);
  gate_open(&g);
  CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
  gate_destroy(&g);
  CHECK(env_run_until(&f.e, wt_fired, &t3));
  CHECK(res_find_set(f.e.res, "s2") == NULL);
  CHECK(res_find_set(f.e.res, "s1") == s1);
  CHECK_EQ_INT(count_sets(f.e.res), 2);
  CHECK_EQ_INT(used(&f), 2 * S);
  CHECK_EQ_INT(res_count_sets_of(f.e.res, ck[1]), 0);
  CHECK_EQ_INT(ck[1]->refs, 2); /* the set's reference went with it */
  struct res_set *s3 = t3.s;
  CHECK(s3 != NULL && strcmp(s3->id, "s3") == 0);

  /* Leased, s1 stays even as the least recently used: the load of m4 takes s3's place. */
  struct lease_holder h = {.owner = &f};
  struct lease *l1 = NULL, *l5 = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(res_lease_add(f.e.res, s1, &h, &l1, &err), 0);
  if (s3 != NULL) touch(&f, s3);
  struct wt t4;
  load(&f, ck[3], &t4);
  CHECK(env_run_until(&f.e, wt_fired, &t4));
  CHECK(res_find_set(f.e.res, "s3") == NULL);
  CHECK(res_find_set(f.e.res, "s1") == s1);
  CHECK_EQ_INT(count_sets(f.e.res), 2);
  struct res_set *s5 = t4.s; /* id 4 went to the lease */
  CHECK(s5 != NULL && strcmp(s5->id, "s5") == 0);
  CHECK_EQ_INT(used(&f), 2 * S);

  /* Both leased: the next set cannot fit, fails at once and evicts nothing. */
  if (s5 != NULL) CHECK_EQ_INT(res_lease_add(f.e.res, s5, &h, &l5, &err), 0);
  struct wt t6;
  load(&f, ck[4], &t6);
  CHECK_EQ_INT(t6.done_calls, 1);
  CHECK(t6.s == NULL);
  CHECK_EQ_INT(t6.err.code, WEIGHTD_E_DEVICE_NOMEM);
  CHECK_STR_CONTAINS(t6.err.msg, "budget");
  CHECK_EQ_INT(count_sets(f.e.res), 2);
  CHECK(res_find_set(f.e.res, "s1") == s1);
  CHECK(res_find_set(f.e.res, "s5") == s5);
  CHECK_EQ_INT(used(&f), 2 * S);
  CHECK_EQ_INT(ck[4]->refs, 2); /* the failed load gave its reference back */

  /* One lease dropped: now it fits, in place of the unleased one. */
  res_lease_drop(f.e.res, l1);
  struct wt t7;
  load(&f, ck[4], &t7);
  CHECK(env_run_until(&f.e, wt_fired, &t7));
  CHECK_EQ_INT(t7.err.code, 0);
  CHECK(res_find_set(f.e.res, "s1") == NULL);
  CHECK(res_find_set(f.e.res, "s5") == s5);
  CHECK(t7.s != NULL && strcmp(t7.s->id, "s7") == 0);
  CHECK_EQ_INT(used(&f), 2 * S);
  for (int k = 0; k < 5; k++) reg_unref(ck[k]);
  fix_stop(&f);
}

struct ev {
  bool fired;
  size_t n;
  char ids[4][24];
};

static void ev_cb(void *arg, char *const *ids, size_t n) {
  struct ev *v = arg;
  v->fired = true;
  v->n = n;
  for (size_t i = 0; i < n && i < 4; i++) snprintf(v->ids[i], sizeof v->ids[i], "%s", ids[i]);
}

static void test_evict(void) {
  struct fix f;
  if (!fix_start(&f, "res-evict")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *a = open_ckpt(&f, "ma", file), *b = open_ckpt(&f, "mb", file);
  if (a == NULL || b == NULL) {
    reg_unref(a);
    reg_unref(b);
    fix_stop(&f);
    return;
  }
  struct res_set *sa = load_ready(&f, a), *sb = load_ready(&f, b);
  if (sa == NULL || sb == NULL) {
    reg_unref(a);
    reg_unref(b);
    fix_stop(&f);
    return;
  }
  const uint64_t S = sa->plan->slab_bytes;
  CHECK_EQ_INT(used(&f), 2 * S);
  struct lease_holder h = {.owner = &f};
  struct lease *l = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(res_lease_add(f.e.res, sa, &h, &l, &err), 0);

  struct ev v = {0};
  CHECK_EQ_INT(res_evict(f.e.res, "s1", 0, NULL, NULL, ev_cb, &v, &err), WEIGHTD_E_BUSY);
  CHECK_EQ_INT(res_evict(f.e.res, "s99", 0, NULL, NULL, ev_cb, &v, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(err.msg, "s99");
  CHECK_EQ_INT(count_sets(f.e.res), 2);
  CHECK_EQ_INT(used(&f), 2 * S);

  /* By id: gone at once, reported once its memory is free. */
  CHECK_EQ_INT(res_evict(f.e.res, "s2", 0, NULL, NULL, ev_cb, &v, &err), 0);
  CHECK(res_find_set(f.e.res, "s2") == NULL);
  CHECK_EQ_INT(used(&f), S);
  CHECK_EQ_INT(b->refs, 2);
  CHECK(!v.fired);
  CHECK(env_run_until(&f.e, env_flag_set, &v.fired));
  CHECK_EQ_INT(v.n, 1);
  CHECK(strcmp(v.ids[0], "s2") == 0);

  /* Every unleased set of the device: only the ones without a lease go. */
  struct res_set *sb2 = load_ready(&f, b);
  CHECK(sb2 != NULL && strcmp(sb2->id, "s4") == 0);
  struct ev all = {0};
  CHECK_EQ_INT(res_evict(f.e.res, NULL, 0, NULL, NULL, ev_cb, &all, &err), 0);
  CHECK(env_run_until(&f.e, env_flag_set, &all.fired));
  CHECK_EQ_INT(all.n, 1);
  CHECK(strcmp(all.ids[0], "s4") == 0);
  CHECK_EQ_INT(count_sets(f.e.res), 1);
  CHECK(res_first_set(f.e.res) == sa);
  CHECK_EQ_INT(used(&f), S);

  res_lease_drop(f.e.res, l);
  struct ev last = {0};
  CHECK_EQ_INT(res_evict(f.e.res, "s1", 0, NULL, NULL, ev_cb, &last, &err), 0);
  CHECK(env_run_until(&f.e, env_flag_set, &last.fired));
  CHECK_EQ_INT(last.n, 1);
  CHECK(strcmp(last.ids[0], "s1") == 0);
  CHECK(res_first_set(f.e.res) == NULL);
  CHECK_EQ_INT(used(&f), 0);
  CHECK_EQ_INT(a->refs, 2);
  reg_unref(a);
  reg_unref(b);
  fix_stop(&f);
}

/* ---- canceling ------------------------------------------------------------------------ */

static bool no_sets(void *arg) { return res_first_set(((const struct fix *)arg)->e.res) == NULL; }

static void test_cancel_only_waiter(void) {
  struct fix f;
  if (!fix_start(&f, "res-cancel")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }

  struct gate g;
  gate_close(&g, f.e.bulk);
  struct wt t;
  load(&f, ck, &t);
  struct res_set *s = res_first_set(f.e.res);
  CHECK(s != NULL);
  if (s != NULL) {
    CHECK(!res_set_canceling(s));
    CHECK(res_waiter_cancel(&t.w));
    CHECK(t.w.set == NULL);
    CHECK(res_set_canceling(s));
    CHECK(!res_waiter_cancel(&t.w)); /* no longer waiting */
    CHECK(res_first_set(f.e.res) == s); /* shown until its job returns */
    CHECK_EQ_INT(s->state, SET_LOADING);
  }
  gate_open(&g);
  CHECK(env_run_until(&f.e, no_sets, &f));
  CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
  gate_destroy(&g);
  CHECK_EQ_INT(t.done_calls, 0);
  CHECK_EQ_INT(used(&f), 0);
  CHECK_EQ_INT(ck->loads, 0);
  CHECK_EQ_INT(ck->refs, 2);
  reg_unref(ck);
  fix_stop(&f);
}

/*
 * A load canceled while queued evicts nothing: it would have needed room (a
 * ready set beside it and a budget for one), but evictions wait for the job.
 */
static void test_canceled_load_evicts_nothing(void) {
  struct fix f;
  if (!fix_start(&f, "res-cancel-room")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *a = open_ckpt(&f, "a", file), *b = open_ckpt(&f, "b", file);
  struct res_set *sa = a != NULL ? load_ready(&f, a) : NULL;
  CHECK(sa != NULL && b != NULL);
  if (sa != NULL && b != NULL) {
    res_device_budget_set(f.e.res, sa->plan->slab_bytes + sa->plan->slab_bytes / 2); /* one set fits */
    struct gate g;
    gate_close(&g, f.e.bulk);
    struct wt t;
    load(&f, b, &t);
    CHECK(res_waiter_cancel(&t.w));
    gate_open(&g);
    CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
    gate_destroy(&g);
    CHECK(env_run_until(&f.e, env_pools_idle, &f.e));
    CHECK_EQ_INT(count_sets(f.e.res), 1);
    CHECK(res_find_set(f.e.res, sa->id) == sa); /* still resident: no room was made for a load nobody wanted */
    CHECK_EQ_INT(res_stats(f.e.res)->evictions[RES_EVICT_BUDGET], 0);
    CHECK_EQ_INT(t.done_calls, 0);
  }
  reg_unref(a);
  reg_unref(b);
  fix_stop(&f);
}

/*
 * A cancel that comes while the load's last bytes move (the job has copied
 * everything, its completion not handled yet): its requester was told
 * CANCELED, so the set is not kept. The load waits at the gate (a FIFO it
 * reads a byte from before its window) once its slab exists, so the loop is
 * run until then and no further; the gate is opened with the loop stopped:
 * the job copies everything and its completion waits for the loop, which
 * the test runs again only after the cancel.
 */
static bool slab_allocated(void *arg) { return atomic_load(&((const struct res_set *)arg)->allocated); }

static void test_cancel_as_the_load_completes(void) {
  struct fix f;
  char gate[PATH_MAX];
  char *tmp = fx_tmpdir("res-gate");
  snprintf(gate, sizeof gate, "%s/gate", tmp);
  CHECK_EQ_INT(mkfifo(gate, 0600), 0);
  int gw = open(gate, O_RDWR | O_NONBLOCK); /* a writer from the start: the gate stays shut until a byte comes */
  CHECK(gw >= 0);
  if (!fix_start_gated(&f, "res-cancel-late", gate)) {
    fix_stop(&f);
    if (gw >= 0) close(gw);
    fx_rmtree(tmp);
    free(tmp);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  struct wt t;
  struct res_set *s = NULL;
  if (ck != NULL) {
    load(&f, ck, &t);
    s = res_first_set(f.e.res);
  }
  CHECK(s != NULL);
  if (s != NULL) {
    CHECK(env_run_until(&f.e, slab_allocated, s)); /* the job now waits at the gate */
    CHECK_EQ_INT(write(gw, "x", 1), 1);           /* its one window goes; the loop does not run meanwhile */
    for (int i = 0; i < 60000 && atomic_load(&s->load.ready_bytes) < s->plan->slab_bytes; i++) usleep(1000);
    CHECK_EQ_INT(atomic_load(&s->load.ready_bytes), s->plan->slab_bytes); /* every byte in place */
    CHECK_EQ_INT(s->state, SET_LOADING);                                   /* its completion not handled */
    CHECK(res_waiter_cancel(&t.w));
    CHECK(env_run_until(&f.e, no_sets, &f));
    CHECK(env_run_until(&f.e, env_pools_idle, &f.e));
    CHECK_EQ_INT(t.done_calls, 0);
    CHECK_EQ_INT(used(&f), 0);
    CHECK_EQ_INT(res_stats(f.e.res)->loads[RES_RESULT_CANCELED][LD_METHOD_MEMCPY], 1);
    CHECK_EQ_INT(res_stats(f.e.res)->loads[RES_RESULT_OK][LD_METHOD_MEMCPY], 0);
  }
  if (ck != NULL) reg_unref(ck);
  fix_stop(&f);
  if (gw >= 0) close(gw);
  fx_rmtree(tmp);
  free(tmp);
}

/* One of two waiters leaves: the load goes on for the other. A canceled load asked for again goes on too. */
static void test_cancel_with_other_waiters(void) {
  struct fix f;
  if (!fix_start(&f, "res-cancel2")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }

  struct gate g;
  gate_close(&g, f.e.bulk);
  struct wt t1, t2, t3;
  load(&f, ck, &t1);
  load(&f, ck, &t2);
  struct res_set *s = res_first_set(f.e.res);
  CHECK(s != NULL);
  CHECK(res_waiter_cancel(&t1.w));
  if (s != NULL) CHECK(!res_set_canceling(s));
  CHECK(res_waiter_cancel(&t2.w));
  if (s != NULL) CHECK(res_set_canceling(s));
  load(&f, ck, &t3); /* the same set again: no longer canceling */
  CHECK(t3.w.set == s);
  CHECK_EQ_INT(count_sets(f.e.res), 1);
  if (s != NULL) CHECK(!res_set_canceling(s));
  gate_open(&g);
  CHECK(env_run_until(&f.e, wt_fired, &t3));
  CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
  gate_destroy(&g);
  CHECK_EQ_INT(t1.done_calls + t2.done_calls, 0);
  CHECK_EQ_INT(t3.done_calls, 1);
  CHECK(t3.s == s);
  CHECK(t3.joined);
  if (s != NULL && t3.s == s) {
    CHECK_EQ_INT(s->state, SET_READY);
    check_slab_matches_file(&f, s, file);
  }
  reg_unref(ck);
  fix_stop(&f);
}

/* ---- shards that change under a load ---------------------------------------------------- */

static void test_truncated_shard_fails_load(void) {
  struct fix f;
  if (!fix_start(&f, "res-trunc")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }
  CHECK_EQ_INT(truncate(file, 4096), 0); /* tensor c runs on past the first page */
  struct wt t;
  load(&f, ck, &t);
  CHECK(env_run_until(&f.e, wt_fired, &t));
  CHECK_EQ_INT(t.done_calls, 1);
  CHECK(t.s == NULL);
  CHECK_EQ_INT(t.err.code, WEIGHTD_E_FAULT);
  CHECK_STR_CONTAINS(t.err.msg, "truncated");
  CHECK(res_first_set(f.e.res) == NULL);
  CHECK_EQ_INT(used(&f), 0);
  CHECK_EQ_INT(ck->loads, 0);
  CHECK_EQ_INT(ck->refs, 2);
  reg_unref(ck);
  fix_stop(&f);
}

static void test_replaced_shard_fails_load(void) {
  struct fix f;
  if (!fix_start(&f, "res-stale")) {
    fix_stop(&f);
    return;
  }
  char file[PATH_MAX], tmp[PATH_MAX];
  struct reg_ckpt *ck = open_ckpt(&f, "m", file);
  if (ck == NULL) {
    fix_stop(&f);
    return;
  }
  /* Same bytes, new inode: the load copies the old file, then finds it replaced. */
  snprintf(tmp, sizeof tmp, "%s.new", file);
  CHECK_EQ_INT(fx_write_st(tmp, tensors, NTENSORS), 0);
  CHECK_EQ_INT(rename(tmp, file), 0);
  struct wt t;
  load(&f, ck, &t);
  CHECK(env_run_until(&f.e, wt_fired, &t));
  CHECK(t.s == NULL);
  CHECK_EQ_INT(t.err.code, WEIGHTD_E_STALE);
  CHECK_STR_CONTAINS(t.err.msg, "replaced");
  CHECK(res_first_set(f.e.res) == NULL);
  CHECK_EQ_INT(used(&f), 0);
  CHECK_EQ_INT(ck->refs, 2);
  reg_unref(ck);
  fix_stop(&f);
}

int main(void) {
  log_set_level(LOG_ERROR);
  if (fault_install() != 0) {
    fprintf(stderr, "fault_install failed\n");
    return 1;
  }
  RUN(test_load_fills_slab_with_file_bytes);
  RUN(test_identical_load_joins);
  RUN(test_leases);
  RUN(test_lru_eviction_spares_leased_sets);
  RUN(test_evict);
  RUN(test_cancel_only_waiter);
  RUN(test_cancel_with_other_waiters);
  RUN(test_canceled_load_evicts_nothing);
  RUN(test_cancel_as_the_load_completes);
  RUN(test_truncated_shard_fails_load);
  RUN(test_replaced_shard_fails_load);
  return tu_finish();
}
