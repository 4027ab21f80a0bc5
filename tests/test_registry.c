/*
 * test_registry.c - the registry driven directly on a real loop (no socket,
 * no server), on the host backend: acquiring opens once and shares the entry,
 * model roots and missing paths fail with their codes, a replaced shard
 * detaches the old entry and opens a new generation, closing respects
 * references, prefetch reports page-cache bytes (and a truncated shard),
 * resolve, the mapping bound, destroying the registry while an entry is
 * still held, and a client's own access however its acquire meets another's.
 */
#include <limits.h>
#include <stdbool.h>
#include <sys/stat.h>

#include "testutil.h"

#include "fixture.h"
#include "state_env.h"

static const struct fx_tensor shard1[] = {
    {"model.embed_tokens.weight", "BF16", 2, 64, 16},
    {"model.layers.0.mlp.up_proj.weight", "BF16", 2, 32, 16},
};
static const struct fx_tensor shard2[] = {
    {"model.layers.0.mlp.down_proj.weight", "BF16", 2, 16, 32},
    {"model.norm.weight", "F32", 4, 16, 0},
};
/* shard2 with a longer norm: a different size, for the replaced-shard test. */
static const struct fx_tensor shard2_grown[] = {
    {"model.layers.0.mlp.down_proj.weight", "BF16", 2, 16, 32},
    {"model.norm.weight", "F32", 4, 48, 0},
};

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

static const char *index_json = "{\"metadata\":{},\"weight_map\":{"
                                "\"model.embed_tokens.weight\":\"" SHARD1 "\","
                                "\"model.layers.0.mlp.up_proj.weight\":\"" SHARD1 "\","
                                "\"model.layers.0.mlp.down_proj.weight\":\"" SHARD2 "\","
                                "\"model.norm.weight\":\"" SHARD2 "\"}}";

/* Writes a two-shard checkpoint into dir (created). Returns 0 or -1. */
static int write_ckpt(const char *dir) {
  char p[PATH_MAX];
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) return -1;
  snprintf(p, sizeof p, "%s/" SHARD1, dir);
  if (fx_write_st(p, shard1, 2) != 0) return -1;
  snprintf(p, sizeof p, "%s/" SHARD2, dir);
  if (fx_write_st(p, shard2, 2) != 0) return -1;
  return fx_write_text(dir, "model.safetensors.index.json", index_json);
}

static uint64_t file_size(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

/* A scratch directory holding a checkpoint at <scratch>/ck; *ck_path receives its resolved path. */
static char *scratch_with_ckpt(const char *tag, char ck_path[PATH_MAX]) {
  char *d = fx_tmpdir(tag);
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/ck", d);
  CHECK_EQ_INT(write_ckpt(p), 0);
  CHECK(realpath(p, ck_path) != NULL);
  return d;
}

static size_t count_entries(const struct registry *r) {
  size_t n = 0;
  for (const struct reg_ckpt *c = reg_first(r); c != NULL; c = c->next) n++;
  return n;
}

/* ---- acquiring ------------------------------------------------------------------ */

static void test_acquire_opens_once(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX], p[PATH_MAX];
  char *d = scratch_with_ckpt("reg-open", ck);

  struct acq a = env_acquire(&e, ck);
  CHECK_EQ_INT(a.err.code, 0);
  CHECK(a.ck != NULL);
  if (a.ck != NULL) {
    CHECK_EQ_INT(a.ck->state, REG_OPEN);
    CHECK_EQ_INT(a.ck->generation, 1);
    CHECK(strcmp(a.ck->path, ck) == 0);
    CHECK_EQ_INT(a.ck->ck->nshards, 2);
    CHECK_EQ_INT(a.ck->ck->ntensors, 4);
    CHECK_EQ_INT(a.ck->refs, 2); /* the registry's and ours */
    CHECK(!a.ck->detached);
    CHECK(reg_first(e.reg) == a.ck);
    CHECK(reg_find(e.reg, ck) == a.ck);
  }

  /* Again, spelled differently: the same entry, not reopened. */
  snprintf(p, sizeof p, "%s/./ck/", d);
  struct acq b = env_acquire(&e, p);
  CHECK_EQ_INT(b.err.code, 0);
  CHECK(b.ck == a.ck);
  if (b.ck != NULL) {
    CHECK_EQ_INT(b.ck->generation, 1);
    CHECK_EQ_INT(b.ck->refs, 3);
  }
  CHECK_EQ_INT(count_entries(e.reg), 1);

  reg_unref(b.ck);
  reg_unref(a.ck);
  if (a.ck != NULL) CHECK_EQ_INT(a.ck->refs, 1);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* Two acquires asked before either resolves: one open, one entry, both continuations get it. */
static void test_acquire_concurrent_share_one_open(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX];
  char *d = scratch_with_ckpt("reg-join", ck);
  struct acq a = {0}, b = {0};
  reg_acquire(e.reg, ck, NULL, acq_cb, &a);
  reg_acquire(e.reg, ck, NULL, acq_cb, &b);
  CHECK(env_run_until(&e, env_flag_set, &a.fired));
  CHECK(env_run_until(&e, env_flag_set, &b.fired));
  CHECK(a.ck != NULL);
  CHECK(a.ck == b.ck);
  if (a.ck != NULL) {
    CHECK_EQ_INT(a.ck->generation, 1);
    CHECK_EQ_INT(a.ck->refs, 3);
  }
  CHECK_EQ_INT(count_entries(e.reg), 1);
  reg_unref(a.ck);
  reg_unref(b.ck);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* Whether every acquire of the batch has fired (the loop runs until then). */
struct acq_batch {
  struct acq *v;
  size_t n;
};

static bool batch_done(void *arg) {
  const struct acq_batch *b = arg;
  for (size_t i = 0; i < b->n; i++)
    if (!b->v[i].fired) return false;
  return true;
}

/*
 * A client's own access: a checkpoint only its owner may read (a 0700
 * directory) is refused to another uid and served to its owner however
 * their acquires meet: asked together (one may join the other's open, which
 * the verdict of an open for other credentials must never answer), in
 * either order, and again once it is open.
 */
static void test_acquire_for_other_credentials(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char *d = fx_tmpdir("reg-access");
  CHECK_EQ_INT(chmod(d, 0755), 0); /* the walk to the checkpoint is open to all: its own directory is not */
  const struct acc_cred other = {.uid = geteuid() == 65534 ? 65533 : 65534, .gid = 65534};
  for (int round = 0; round < 8; round++) {
    char p[PATH_MAX], ck[PATH_MAX];
    snprintf(p, sizeof p, "%s/ck%d", d, round);
    CHECK_EQ_INT(write_ckpt(p), 0);
    CHECK_EQ_INT(chmod(p, 0700), 0);
    CHECK(realpath(p, ck) != NULL);
    struct acq v[4] = {{0}};
    struct acq *mine = &v[round % 2]; /* first or second of three, the others for other */
    for (int i = 0; i < 3; i++) reg_acquire(e.reg, ck, &v[i] == mine ? NULL : &other, acq_cb, &v[i]);
    struct acq_batch b = {v, 3};
    CHECK(env_run_until(&e, batch_done, &b));
    CHECK(mine->ck != NULL && mine->err.code == 0);
    for (int i = 0; i < 3; i++) {
      if (&v[i] == mine) continue;
      CHECK(v[i].ck == NULL);
      CHECK_EQ_INT(v[i].err.code, WEIGHTD_E_PERMISSION);
      CHECK_STR_CONTAINS(v[i].err.msg, "may not search");
    }
    /* Open now: checked on this request too. */
    reg_acquire(e.reg, ck, &other, acq_cb, &v[3]);
    CHECK(env_run_until(&e, env_flag_set, &v[3].fired));
    CHECK(v[3].ck == NULL);
    CHECK_EQ_INT(v[3].err.code, WEIGHTD_E_PERMISSION);
    CHECK_EQ_INT(count_entries(e.reg), (size_t)round + 1);
    reg_unref(mine->ck);
  }
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

static void test_model_roots(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char *scratch = fx_tmpdir("reg-roots");
  char root[PATH_MAX], inside[PATH_MAX], outside[PATH_MAX], link[PATH_MAX], p[PATH_MAX];
  snprintf(p, sizeof p, "%s/root", scratch);
  CHECK_EQ_INT(mkdir(p, 0755), 0);
  CHECK(realpath(p, root) != NULL);
  snprintf(inside, sizeof inside, "%s/in", root);
  CHECK_EQ_INT(write_ckpt(inside), 0);
  snprintf(p, sizeof p, "%s/out", scratch);
  CHECK_EQ_INT(write_ckpt(p), 0);
  CHECK(realpath(p, outside) != NULL);
  snprintf(link, sizeof link, "%s/escape", root);
  CHECK_EQ_INT(symlink(outside, link), 0);

  const char *roots[] = {root};
  struct wd_error err = {0};
  CHECK_EQ_INT(reg_roots_set(e.reg, roots, 1, &err), 0);
  CHECK_EQ_INT(reg_roots_count(e.reg), 1);
  CHECK(reg_root(e.reg, 0) != NULL && strcmp(reg_root(e.reg, 0), root) == 0);
  CHECK(reg_root(e.reg, 1) == NULL);

  struct acq in = env_acquire(&e, inside);
  CHECK_EQ_INT(in.err.code, 0);
  CHECK(in.ck != NULL);

  struct acq out = env_acquire(&e, outside);
  CHECK(out.ck == NULL);
  CHECK_EQ_INT(out.err.code, WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(out.err.msg, outside);

  /* A symlink under the root that leads out: denied, naming the link and the
   * rule but not where it leads (that would tell what exists outside). */
  struct acq esc = env_acquire(&e, link);
  CHECK(esc.ck == NULL);
  CHECK_EQ_INT(esc.err.code, WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(esc.err.msg, link);
  CHECK_STR_CONTAINS(esc.err.msg, "outside the model roots");
  CHECK(strstr(esc.err.msg, outside) == NULL);
  /* The same link to something that does not exist gets the same answer. */
  char dangling[PATH_MAX + 16];
  snprintf(dangling, sizeof dangling, "%s-gone", outside);
  CHECK_EQ_INT(unlink(link), 0);
  CHECK_EQ_INT(symlink(dangling, link), 0);
  struct acq gone = env_acquire(&e, link);
  CHECK(gone.ck == NULL);
  CHECK_EQ_INT(gone.err.code, WEIGHTD_E_PATH_DENIED);
  CHECK(strcmp(gone.err.msg, esc.err.msg) == 0);

  /* Only the allowed checkpoint was opened. */
  CHECK_EQ_INT(count_entries(e.reg), 1);
  CHECK(reg_first(e.reg) == in.ck);

  /* No roots: no confinement. */
  CHECK_EQ_INT(reg_roots_set(e.reg, NULL, 0, &err), 0);
  CHECK_EQ_INT(reg_roots_count(e.reg), 0);
  struct acq now = env_acquire(&e, outside);
  CHECK_EQ_INT(now.err.code, 0);
  CHECK(now.ck != NULL && now.ck != in.ck);
  CHECK_EQ_INT(count_entries(e.reg), 2);

  reg_unref(in.ck);
  reg_unref(now.ck);
  env_stop(&e);
  fx_rmtree(scratch);
  free(scratch);
}

static void test_missing_and_invalid(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char *d = fx_tmpdir("reg-missing");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/nothing-here", d);
  struct acq a = env_acquire(&e, p);
  CHECK(a.ck == NULL);
  CHECK_EQ_INT(a.err.code, WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(a.err.msg, p);

  /* A file that is not safetensors: the open fails and leaves no entry behind. */
  snprintf(p, sizeof p, "%s/bad", d);
  CHECK_EQ_INT(mkdir(p, 0755), 0);
  CHECK_EQ_INT(fx_write_text(p, "model.safetensors", "this is not a safetensors header"), 0);
  struct acq b = env_acquire(&e, p);
  CHECK(b.ck == NULL);
  CHECK_EQ_INT(b.err.code, WEIGHTD_E_BAD_HEADER);
  CHECK(reg_first(e.reg) == NULL);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* A shard replaced by rename (new inode and size): the next acquire opens a new generation. */
static void test_replaced_shard_reopens(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX], shard[PATH_MAX], tmp[PATH_MAX];
  char *d = scratch_with_ckpt("reg-replace", ck);
  struct acq a = env_acquire(&e, ck);
  CHECK(a.ck != NULL);
  if (a.ck == NULL) {
    env_stop(&e);
    fx_rmtree(d);
    free(d);
    return;
  }
  uint64_t old_size = a.ck->ck->shards[1].size;

  snprintf(shard, sizeof shard, "%s/" SHARD2, ck);
  snprintf(tmp, sizeof tmp, "%s/replacement.tmp", ck);
  CHECK_EQ_INT(fx_write_st(tmp, shard2_grown, 2), 0);
  CHECK_EQ_INT(rename(tmp, shard), 0);
  uint64_t new_size = file_size(shard);
  CHECK_EQ_INT(new_size, old_size + 32 * 4);

  struct acq b = env_acquire(&e, ck);
  CHECK_EQ_INT(b.err.code, 0);
  CHECK(b.ck != NULL && b.ck != a.ck);
  if (b.ck != NULL && b.ck != a.ck) {
    CHECK_EQ_INT(b.ck->generation, 2);
    CHECK_EQ_INT(b.ck->state, REG_OPEN);
    CHECK_EQ_INT(b.ck->ck->shards[1].size, new_size);
    CHECK_EQ_INT(b.ck->refs, 2);
  }
  /* The old entry is out of the registry, alive only through our reference. */
  CHECK(a.ck->detached);
  CHECK_EQ_INT(a.ck->refs, 1);
  CHECK_EQ_INT(a.ck->generation, 1);
  CHECK_EQ_INT(a.ck->ck->shards[1].size, old_size);
  CHECK_EQ_INT(count_entries(e.reg), 1);
  CHECK(reg_first(e.reg) == b.ck);
  CHECK(reg_find(e.reg, ck) == b.ck);

  reg_unref(a.ck);
  reg_unref(b.ck);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* ---- closing -------------------------------------------------------------------- */

static void test_close(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX];
  char *d = scratch_with_ckpt("reg-close", ck);
  struct acq a = env_acquire(&e, ck);
  CHECK(a.ck != NULL);
  struct wd_error err = {0};
  CHECK_EQ_INT(reg_close(e.reg, ck, &err), WEIGHTD_E_BUSY);
  CHECK_STR_CONTAINS(err.msg, ck);
  CHECK_STR_CONTAINS(err.msg, "in use by 1 ");
  CHECK(reg_first(e.reg) == a.ck);
  if (a.ck != NULL) CHECK(!a.ck->detached);

  reg_unref(a.ck);
  memset(&err, 0, sizeof err);
  CHECK_EQ_INT(reg_close(e.reg, ck, &err), 0);
  CHECK(reg_first(e.reg) == NULL);
  CHECK(reg_find(e.reg, ck) == NULL);
  CHECK_EQ_INT(reg_close(e.reg, ck, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(err.msg, ck);

  /* Opening it again makes a new entry. */
  struct acq b = env_acquire(&e, ck);
  CHECK(b.ck != NULL);
  if (b.ck != NULL) CHECK_EQ_INT(b.ck->generation, 2);
  reg_unref(b.ck);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* ---- prefetch ------------------------------------------------------------------- */

struct pf {
  bool fired;
  struct reg_ckpt *ck;
  uint64_t resident;
  bool failed;
  struct wd_error err;
};

static void pf_cb(void *arg, struct reg_ckpt *ck, const struct reg_prefetched *res, const struct wd_error *err) {
  struct pf *p = arg;
  p->fired = true;
  p->ck = ck;
  p->resident = res->resident;
  p->failed = err != NULL;
  if (err != NULL) p->err = *err;
}

static void test_prefetch_reports_resident_bytes(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX], p[PATH_MAX];
  char *d = scratch_with_ckpt("reg-prefetch", ck);
  struct acq a = env_acquire(&e, ck);
  CHECK(a.ck != NULL);
  if (a.ck == NULL) {
    env_stop(&e);
    fx_rmtree(d);
    free(d);
    return;
  }
  /* Every page of every shard, counted whole. */
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), want = 0;
  const char *names[] = {SHARD1, SHARD2};
  for (size_t i = 0; i < 2; i++) {
    snprintf(p, sizeof p, "%s/%s", ck, names[i]);
    want += (file_size(p) + page - 1) / page * page;
  }
  CHECK(want > 0);

  struct pf r = {0};
  struct wd_error err = {0};
  CHECK_EQ_INT(reg_prefetch(e.reg, a.ck, NULL, 0, false, pf_cb, &r, &err), 0);
  CHECK(a.ck->prefetching);
  CHECK_EQ_INT(a.ck->refs, 3); /* the registry's, ours, the prefetch's */
  CHECK(env_run_until(&e, env_flag_set, &r.fired));
  CHECK(!r.failed);
  CHECK(r.ck == a.ck);
  CHECK_EQ_INT(r.resident, want);
  CHECK_EQ_INT(reg_resident_bytes(a.ck), want);
  CHECK(!a.ck->prefetching);
  CHECK_EQ_INT(a.ck->refs, 2);

  /* Pinning asked of the host backend: nothing to register, nothing counted. */
  struct pf r2 = {0};
  CHECK_EQ_INT(reg_prefetch(e.reg, a.ck, NULL, 0, true, pf_cb, &r2, &err), 0);
  CHECK(env_run_until(&e, env_flag_set, &r2.fired));
  CHECK(!r2.failed);
  CHECK_EQ_INT(r2.resident, want);
  CHECK(!reg_pinned_whole(a.ck));
  CHECK_EQ_INT(a.ck->npins, 0);
  CHECK_EQ_INT(reg_pinned_bytes(e.reg), 0);

  reg_unref(a.ck);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* A shard truncated under its mapping: the prefetch reports FAULT instead of dying of SIGBUS. */
static void test_prefetch_truncated_shard(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  static const struct fx_tensor big[] = {{"w", "U8", 1, 64, 1024}}; /* 64 KiB: many pages */
  char *d = fx_tmpdir("reg-trunc");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model.safetensors", d);
  CHECK_EQ_INT(fx_write_st(p, big, 1), 0);
  struct acq a = env_acquire(&e, d);
  CHECK(a.ck != NULL);
  if (a.ck != NULL) {
    CHECK_EQ_INT(truncate(p, 4096), 0);
    struct pf r = {0};
    struct wd_error err = {0};
    CHECK_EQ_INT(reg_prefetch(e.reg, a.ck, NULL, 0, false, pf_cb, &r, &err), 0);
    CHECK(env_run_until(&e, env_flag_set, &r.fired));
    CHECK(r.failed);
    CHECK_EQ_INT(r.err.code, WEIGHTD_E_FAULT);
    CHECK_STR_CONTAINS(r.err.msg, "truncated");
    CHECK(!a.ck->prefetching);
  }
  reg_unref(a.ck);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* ---- resolving ------------------------------------------------------------------ */

struct rs {
  bool fired;
  char resolved[PATH_MAX];
  bool got;
  struct wd_error err;
};

static void rs_cb(void *arg, const char *resolved, const struct wd_error *err) {
  struct rs *r = arg;
  r->fired = true;
  r->got = resolved != NULL;
  if (resolved != NULL) snprintf(r->resolved, sizeof r->resolved, "%s", resolved);
  if (err != NULL) r->err = *err;
}

static struct rs resolve(struct env *e, const char *path) {
  struct rs r = {0};
  reg_resolve(e->reg, path, NULL, rs_cb, &r);
  CHECK(env_run_until(e, env_flag_set, &r.fired));
  return r;
}

static void test_resolve(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX], link[PATH_MAX], p[PATH_MAX], other[PATH_MAX];
  char *d = scratch_with_ckpt("reg-resolve", ck);
  snprintf(link, sizeof link, "%s/link", d);
  CHECK_EQ_INT(symlink("ck", link), 0);

  struct rs a = resolve(&e, link);
  CHECK(a.got);
  CHECK_EQ_INT(a.err.code, 0);
  CHECK(strcmp(a.resolved, ck) == 0);

  snprintf(p, sizeof p, "%s/absent", d);
  struct rs b = resolve(&e, p);
  CHECK(!b.got);
  CHECK_EQ_INT(b.err.code, WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(b.err.msg, p);

  /* Confined to another directory: the checkpoint is outside it. */
  snprintf(p, sizeof p, "%s/elsewhere", d);
  CHECK_EQ_INT(mkdir(p, 0755), 0);
  CHECK(realpath(p, other) != NULL);
  const char *roots[] = {other};
  struct wd_error err = {0};
  CHECK_EQ_INT(reg_roots_set(e.reg, roots, 1, &err), 0);
  struct rs c = resolve(&e, link);
  CHECK(!c.got);
  CHECK_EQ_INT(c.err.code, WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(c.err.msg, link);
  CHECK(strstr(c.err.msg, ck) == NULL);
  /* Outside the roots, a missing path is denied too: no answer says what exists there. */
  snprintf(p, sizeof p, "%s/absent", d);
  struct rs c2 = resolve(&e, p);
  CHECK(!c2.got);
  CHECK_EQ_INT(c2.err.code, WEIGHTD_E_PATH_DENIED);

  /* Resolving opens nothing. */
  CHECK(reg_first(e.reg) == NULL);
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

/* ---- destroying ----------------------------------------------------------------- */

/* registry.h: reg_destroy detaches every entry and frees the registry once none is left. */
/* ---- bounds ---------------------------------------------------------------------- */

/* Acquires path for uid and runs the loop until the continuation fired. */
static struct acq acquire_as(struct env *e, const char *path, uid_t uid) {
  struct acq a = {0};
  reg_acquire_as(e->reg, path, uid, NULL, acq_cb, &a);
  CHECK(env_run_until(e, env_flag_set, &a.fired));
  return a;
}

/*
 * The mapping bound (a quarter of vm.max_map_count in the daemon): an open
 * whose shards would pass it closes an idle entry first, and is refused with
 * LIMIT naming the bound when the entries are held; the daemon's own
 * acquires (re-adoption) are never refused, and count.
 */
static void test_mapping_bound(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  reg_limits_set(e.reg, &(struct reg_limits){.max_maps = 5});
  char a[PATH_MAX], b[PATH_MAX], c[PATH_MAX];
  char *da = scratch_with_ckpt("reg-maps-a", a), *db = scratch_with_ckpt("reg-maps-b", b),
       *dc = scratch_with_ckpt("reg-maps-c", c);
  struct acq x = acquire_as(&e, a, 1000), y = acquire_as(&e, b, 1000);
  CHECK_EQ_INT(x.err.code, 0);
  CHECK_EQ_INT(y.err.code, 0);
  struct reg_counts n;
  reg_counts(e.reg, &n);
  CHECK_EQ_INT(n.maps, 4);
  CHECK_EQ_INT(n.open, 2);
  CHECK(n.charged > 0);
  reg_unref(x.ck); /* a is idle now: it makes room for c */
  struct acq z = acquire_as(&e, c, 1001);
  CHECK_EQ_INT(z.err.code, 0);
  CHECK(reg_find(e.reg, a) == NULL);
  reg_counts(e.reg, &n);
  CHECK_EQ_INT(n.maps, 4);
  CHECK_EQ_INT(n.closed_room, 1);
  /* b and c are held: a's open is refused, and nothing changes. */
  struct acq w = acquire_as(&e, a, 1000);
  CHECK_EQ_INT(w.err.code, WEIGHTD_E_LIMIT);
  CHECK(strstr(w.err.msg, "vm.max_map_count") != NULL);
  reg_counts(e.reg, &n);
  CHECK_EQ_INT(n.open, 2);
  CHECK_EQ_INT(n.refused, 1);
  /* The daemon's own work is not refused. */
  struct acq v = env_acquire(&e, a);
  CHECK_EQ_INT(v.err.code, 0);
  reg_counts(e.reg, &n);
  CHECK_EQ_INT(n.maps, 6);
  reg_unref(v.ck);
  reg_unref(z.ck);
  reg_unref(y.ck);
  env_stop(&e);
  fx_rmtree(da);
  fx_rmtree(db);
  fx_rmtree(dc);
  free(da);
  free(db);
  free(dc);
}

static void test_destroy_while_entry_held(void) {
  struct env e;
  struct env_opts o = {0};
  if (env_start(&e, &o) != 0) {
    CHECK(0);
    return;
  }
  char ck[PATH_MAX];
  char *d = scratch_with_ckpt("reg-destroy", ck);
  struct acq a = env_acquire(&e, ck);
  CHECK(a.ck != NULL);
  reg_destroy(e.reg);
  e.reg = NULL;
  if (a.ck != NULL) {
    CHECK(a.ck->detached);
    CHECK_EQ_INT(a.ck->refs, 1);
    CHECK_EQ_INT(a.ck->ck->nshards, 2); /* still readable: its mappings live on */
    CHECK_EQ_INT(ld_source_map(a.ck->src, 0)[0] != 0, 1);
  }
  reg_unref(a.ck); /* the last reference: the entry goes, then the registry */
  env_stop(&e);
  fx_rmtree(d);
  free(d);
}

int main(void) {
  log_set_level(LOG_WARN);
  if (fault_install() != 0) {
    fprintf(stderr, "fault_install failed\n");
    return 1;
  }
  RUN(test_acquire_opens_once);
  RUN(test_acquire_concurrent_share_one_open);
  RUN(test_acquire_for_other_credentials);
  RUN(test_model_roots);
  RUN(test_missing_and_invalid);
  RUN(test_replaced_shard_reopens);
  RUN(test_close);
  RUN(test_prefetch_reports_resident_bytes);
  RUN(test_prefetch_truncated_shard);
  RUN(test_resolve);
  RUN(test_mapping_bound);
  RUN(test_destroy_while_entry_held);
  return tu_finish();
}
