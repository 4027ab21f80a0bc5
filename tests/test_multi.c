/*
 * test_multi.c - several devices, on the host backend presenting several
 * (state_env.h): the fill threads shared round robin between loads, NUMA
 * parsing and thread placement, link rates, the striping split and the
 * replica choice as pure decisions, then real loads on a loop: a replica
 * copied from a peer's copy (and host memory when the peer has no access or
 * is busy), striped loads (which neighbour moved which range, a busy
 * neighbour left alone, rates followed, staged and direct sources, strided
 * pieces and zeros), every slab compared byte for byte with bytes computed
 * here from the fixture's pattern, not by the daemon's gather.
 *
 * Concurrency is decided by the test, never by timing: the fill pool test
 * blocks the callers inside their own tasks so that only the pool thread
 * claims, and a device is made busy by reserving it directly.
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
#include "base/numa.h"
#include "load/multi.h"
#include "state_env.h"

/* ---- the fill pool: round robin between loads ------------------------------------------------- */

#define RR_TASKS 50

struct rr {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct ld_pool *pool;
  bool a_started;       /* A's caller is inside its task: A is in the pool's list */
  bool b_started;       /* B's caller is inside its task: B is in the pool's list */
  bool pool_first_done; /* the pool thread's first task has waited for B */
  bool release;         /* the callers may leave their tasks */
  int log[2 * RR_TASKS];  /* the pool thread's tasks in order: 0 for A, 1 for B */
  int nlog;
};

static _Thread_local int rr_caller = -1; /* the batch this thread called ld_pool_run for; -1 for the pool thread */

static void rr_task(struct rr *r, int batch) {
  pthread_mutex_lock(&r->mu);
  if (rr_caller >= 0) { /* a caller runs exactly one task, and stays in it until the end */
    if (rr_caller == 0) r->a_started = true;
    if (rr_caller == 1) r->b_started = true;
    pthread_cond_broadcast(&r->cv);
    while (!r->release) pthread_cond_wait(&r->cv, &r->mu);
  } else {
    if (!r->pool_first_done) { /* the pool thread's first task waits until B is running too */
      while (!r->b_started) pthread_cond_wait(&r->cv, &r->mu);
      r->pool_first_done = true;
    }
    r->log[r->nlog++] = batch;
    pthread_cond_broadcast(&r->cv);
  }
  pthread_mutex_unlock(&r->mu);
}

static void rr_task_a(void *arg, size_t i) {
  (void)i;
  rr_task(arg, 0);
}

static void rr_task_b(void *arg, size_t i) {
  (void)i;
  rr_task(arg, 1);
}

static struct rr *rr_state;

static void *rr_caller_a(void *arg) {
  (void)arg;
  rr_caller = 0;
  ld_pool_run(rr_state->pool, RR_TASKS, rr_task_a, rr_state);
  return NULL;
}

static void *rr_caller_b(void *arg) {
  (void)arg;
  rr_caller = 1;
  ld_pool_run(rr_state->pool, RR_TASKS, rr_task_b, rr_state);
  return NULL;
}

/*
 * Loads A then B share one pool thread: once B runs, the pool thread takes
 * B's and A's tasks in turn (before, it served the newest load until it was
 * done, and an earlier one waited).
 */
static void test_fill_round_robin(void) {
  struct rr r = {.nlog = 0};
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  CHECK_EQ_INT(ld_pool_start(1, &r.pool), 0);
  rr_state = &r;
  pthread_t ta, tb;
  pthread_create(&ta, NULL, rr_caller_a, NULL);
  /* A starts first (it is the older load); the pool thread's first task, A's, then waits for B. */
  pthread_mutex_lock(&r.mu);
  while (!r.a_started) pthread_cond_wait(&r.cv, &r.mu);
  pthread_mutex_unlock(&r.mu);
  pthread_create(&tb, NULL, rr_caller_b, NULL);
  /* The pool thread runs every task the callers do not: 2 * RR_TASKS - 2. */
  pthread_mutex_lock(&r.mu);
  while (r.nlog < 2 * RR_TASKS - 2) pthread_cond_wait(&r.cv, &r.mu);
  r.release = true;
  pthread_cond_broadcast(&r.cv);
  pthread_mutex_unlock(&r.mu);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  ld_pool_stop(r.pool);
  CHECK_EQ_INT(r.nlog, 2 * RR_TASKS - 2);
  /* Its first task was A's (B did not exist yet); then B, A, B, A ... while both have tasks left. */
  CHECK_EQ_INT(r.log[0], 0);
  int a_left = RR_TASKS - 2, b_left = RR_TASKS - 1;
  for (int i = 1; i < r.nlog; i++) {
    int want = a_left > 0 && b_left > 0 ? (i % 2 == 1 ? 1 : 0) : (a_left > 0 ? 0 : 1);
    if (r.log[i] != want) {
      fprintf(stderr, "pool task %d was %c, expected %c\n", i, "AB"[r.log[i]], "AB"[want]);
      CHECK(r.log[i] == want);
      break;
    }
    if (r.log[i] == 0) a_left--;
    else b_left--;
  }
  pthread_cond_destroy(&r.cv);
  pthread_mutex_destroy(&r.mu);
}

/* Threads spread over two nodes in proportion to their CPUs; one node binds nothing. */
static void test_fill_bind(void) {
  /* Both "nodes" use a CPU this process may run on, so that binding succeeds anywhere. */
  cpu_set_t mine;
  CHECK_EQ_INT(sched_getaffinity(0, sizeof mine, &mine), 0);
  int cpu = 0;
  while (cpu < CPU_SETSIZE - 1 && !CPU_ISSET(cpu, &mine)) cpu++;
  int cpu0[] = {cpu}, cpu3[] = {cpu, cpu, cpu};
  struct numa_node nodes[2] = {{.id = 0, .cpus = cpu0, .ncpus = 1}, {.id = 3, .cpus = cpu3, .ncpus = 3}};
  struct numa_map one = {.nodes = nodes, .n = 1}, two = {.nodes = nodes, .n = 2};
  struct ld_pool *p = NULL;
  CHECK_EQ_INT(ld_pool_start(4, &p), 0);
  CHECK_EQ_INT(ld_pool_bind(p, &one), 0);
  for (unsigned i = 0; i < 4; i++) CHECK_EQ_INT(ld_pool_thread_node(p, i), -1);
  /* Node 3 counts 3 CPUs to node 0's one, so it gets three of the four threads. */
  CHECK_EQ_INT(ld_pool_bind(p, &two), 4);
  CHECK_EQ_INT(ld_pool_thread_node(p, 0), 0);
  for (unsigned i = 1; i < 4; i++) CHECK_EQ_INT(ld_pool_thread_node(p, i), 3);
  CHECK_EQ_INT(ld_pool_thread_node(p, 4), -1);
  CHECK_EQ_INT(ld_pool_threads(p), 5);
  ld_pool_stop(p);
}

/* ---- NUMA from sysfs -------------------------------------------------------------------------- */

static void test_cpulist_parse(void) {
  int *c = NULL;
  size_t n = 0;
  CHECK_EQ_INT(numa_cpulist_parse("0-3,8-11,16\n", &c, &n), 0);
  int want[] = {0, 1, 2, 3, 8, 9, 10, 11, 16};
  CHECK_EQ_INT(n, 9);
  for (size_t i = 0; i < n && i < 9; i++) CHECK_EQ_INT(c[i], want[i]);
  free(c);
  CHECK_EQ_INT(numa_cpulist_parse("7,2", &c, &n), 0); /* sorted */
  CHECK(n == 2 && c[0] == 2 && c[1] == 7);
  free(c);
  CHECK_EQ_INT(numa_cpulist_parse("\n", &c, &n), 0);
  CHECK_EQ_INT(n, 0);
  free(c);
  const char *bad[] = {"3-1", "a", "1,", "1-", "-2", "1 2", "0-3,x", "1\n2"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    c = (int *)1;
    CHECK_EQ_INT(numa_cpulist_parse(bad[i], &c, &n), -1);
    CHECK(c == NULL && n == 0);
  }
}

static void write_file(const char *dir, const char *rel, const char *text) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", dir, rel);
  for (char *p = path + strlen(dir) + 1; *p; p++)
    if (*p == '/') {
      *p = '\0';
      mkdir(path, 0755);
      *p = '/';
    }
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (f != NULL) {
    fputs(text, f);
    fclose(f);
  }
}

static void test_numa_sysfs_tree(void) {
  char *root = fx_tmpdir("numa");
  CHECK(root != NULL);
  if (root == NULL) return;
  write_file(root, "devices/system/node/node1/cpulist", "4-7,16\n");
  write_file(root, "devices/system/node/node0/cpulist", "0-3\n");
  write_file(root, "devices/system/node/node2/cpulist", "\n"); /* memory only: left out */
  write_file(root, "devices/system/node/online", "0-2\n");     /* not a node directory */
  write_file(root, "bus/pci/devices/0000:1b:00.0/numa_node", "1\n");
  write_file(root, "bus/pci/devices/0000:3c:00.0/numa_node", "-1\n");
  struct numa_map m;
  CHECK_EQ_INT(numa_read(root, &m), 0);
  CHECK_EQ_INT(m.n, 2);
  if (m.n == 2) {
    CHECK_EQ_INT(m.nodes[0].id, 0);
    CHECK_EQ_INT(m.nodes[0].ncpus, 4);
    CHECK_EQ_INT(m.nodes[1].id, 1);
    CHECK_EQ_INT(m.nodes[1].ncpus, 5);
    CHECK_EQ_INT(m.nodes[1].cpus[4], 16);
    CHECK(numa_node_find(&m, 1) == &m.nodes[1]);
    CHECK(numa_node_find(&m, 2) == NULL);
  }
  numa_free(&m);
  CHECK_EQ_INT(numa_pci_node(root, "0000:1b:00.0"), 1);
  CHECK_EQ_INT(numa_pci_node(root, "00000000:1b:00.0"), 1); /* an 8-digit domain */
  CHECK_EQ_INT(numa_pci_node(root, "0000:3c:00.0"), -1);
  CHECK_EQ_INT(numa_pci_node(root, "0000:ff:00.0"), -1);
  CHECK_EQ_INT(numa_pci_node(root, "../../etc"), -1);
  char none[PATH_MAX];
  snprintf(none, sizeof none, "%s/nothing", root);
  CHECK_EQ_INT(numa_read(none, &m), 0); /* no node directory: no nodes, nothing bound */
  CHECK_EQ_INT(m.n, 0);
  fx_rmtree(root);
  free(root);
}

static void test_link_rates(void) {
  double r[3];
  struct wd_error err = {0};
  CHECK_EQ_INT(topo_rates_parse("", 3, r, &err), 0);
  CHECK(r[0] == 1.0 && r[1] == 1.0 && r[2] == 1.0);
  CHECK_EQ_INT(topo_rates_parse("51.6,25,0.5", 3, r, &err), 0);
  CHECK(r[0] == 51.6 && r[1] == 25.0 && r[2] == 0.5);
  CHECK_EQ_INT(topo_rates_parse("51.6,25", 3, r, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "2 rate(s) given for 3 device(s)");
  CHECK_EQ_INT(topo_rates_parse("1,0,1", 3, r, &err), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(topo_rates_parse("1,,1", 3, r, &err), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(topo_rates_parse("1;2;3", 3, r, &err), WEIGHTD_E_INVALID);
}

/* ---- the decisions ------------------------------------------------------------------------------- */

#define KiB 1024ull
#define MiB (1024ull * 1024ull)

static void test_stripe_split(void) {
  struct ld_share s[4];
  /* Equal links, 900 MiB in 64 MiB windows: cuts at 300 and 600 MiB rounded to whole windows. */
  struct ld_link_rate eq[3] = {{0, 1}, {1, 1}, {2, 1}};
  CHECK_EQ_INT(ld_stripe_split(eq, 3, 900 * MiB, 64 * MiB, s), 3);
  CHECK(s[0].device == 0 && s[0].lo == 0 && s[0].hi == 320 * MiB);
  CHECK(s[1].device == 1 && s[1].lo == 320 * MiB && s[1].hi == 576 * MiB);
  CHECK(s[2].device == 2 && s[2].lo == 576 * MiB && s[2].hi == 900 * MiB);
  /* Rates 2:1:1 (the target's link twice as fast): half, a quarter, a quarter. */
  struct ld_link_rate r[3] = {{5, 2}, {3, 1}, {7, 1}};
  CHECK_EQ_INT(ld_stripe_split(r, 3, 1024 * MiB, 64 * MiB, s), 3);
  CHECK(s[0].device == 5 && s[0].hi == 512 * MiB);
  CHECK(s[1].device == 3 && s[1].lo == 512 * MiB && s[1].hi == 768 * MiB);
  CHECK(s[2].device == 7 && s[2].lo == 768 * MiB && s[2].hi == 1024 * MiB);
  /* Less than a window each: the cuts round to nothing, one link gets all (nothing to stripe). */
  CHECK_EQ_INT(ld_stripe_split(eq, 3, 40 * MiB, 64 * MiB, s), 1);
  CHECK(s[0].hi == s[0].lo && s[1].hi == s[1].lo && s[2].lo == 0 && s[2].hi == 40 * MiB);
  /* A link of rate 0 gets nothing; the others split the rest. */
  struct ld_link_rate z[3] = {{0, 1}, {1, 0}, {2, 1}};
  CHECK_EQ_INT(ld_stripe_split(z, 3, 256 * MiB, 64 * MiB, s), 2);
  CHECK(s[0].hi == 128 * MiB && s[1].lo == s[1].hi && s[2].lo == 128 * MiB);
  /* One link: everything. */
  CHECK_EQ_INT(ld_stripe_split(eq, 1, 5 * MiB, 64 * MiB, s), 1);
  CHECK(s[0].lo == 0 && s[0].hi == 5 * MiB);
}

static void test_replica_pick(void) {
  struct wd_peer_info peer[16];
  struct topo_device dev[4];
  memset(peer, 0, sizeof peer);
  memset(dev, 0, sizeof dev);
  struct topology t = {.ndev = 4, .dev = dev, .peer = peer};
  /* Onto device 0: device 1 over PCIe (rank 1), device 2 over NVLink (rank 0), device 3 without access. */
  peer[1 * 4 + 0] = (struct wd_peer_info){1, WD_LINK_PCIE, 1};
  peer[2 * 4 + 0] = (struct wd_peer_info){1, WD_LINK_NVLINK, 0};
  peer[3 * 4 + 0] = (struct wd_peer_info){0, WD_LINK_NONE, -1};
  struct ld_copy s[3] = {{NULL, 1}, {NULL, 2}, {NULL, 3}};
  CHECK_EQ_INT(ld_replica_pick(&t, 0, s, 3, NULL), 1); /* NVLink first */
  bool busy[3] = {false, true, false};
  CHECK_EQ_INT(ld_replica_pick(&t, 0, s, 3, busy), 0); /* NVLink busy: PCIe */
  busy[0] = true;
  CHECK_EQ_INT(ld_replica_pick(&t, 0, s, 3, busy), -1); /* the one left has no access: host memory */
  struct ld_copy only3[1] = {{NULL, 3}};
  CHECK_EQ_INT(ld_replica_pick(&t, 0, only3, 1, NULL), -1);
  /* Two PCIe peers: the lower performance rank. */
  peer[3 * 4 + 0] = (struct wd_peer_info){1, WD_LINK_PCIE, 0};
  struct ld_copy pc[2] = {{NULL, 1}, {NULL, 3}};
  CHECK_EQ_INT(ld_replica_pick(&t, 0, pc, 2, NULL), 1);
  struct ld_copy self[1] = {{NULL, 0}};
  CHECK_EQ_INT(ld_replica_pick(&t, 0, self, 1, NULL), -1);
}

/* ---- the host backend's devices ------------------------------------------------------------------ */

static void test_host_devices(void) {
  struct wd_backend b;
  struct wd_error err = {0};
  struct wd_host_options o = {.devices = 3, .peers = "0-1"};
  CHECK_EQ_INT(backend_host_create_devices(&b, &o, &err), 0);
  CHECK_EQ_INT(b.ops->device_count(b.ctx), 3);
  struct wd_device_info d0, d2;
  CHECK_EQ_INT(b.ops->device_info(b.ctx, 0, &d0, &err), 0);
  CHECK_EQ_INT(b.ops->device_info(b.ctx, 2, &d2, &err), 0);
  CHECK(strncmp(d0.uuid, "host-", 5) == 0 && strchr(d0.uuid + 5, '-') == NULL);
  char want[WD_UUID_MAX + 4];
  snprintf(want, sizeof want, "%s-2", d0.uuid);
  CHECK(strcmp(d2.uuid, want) == 0);
  CHECK_EQ_INT(d2.index, 2);
  CHECK_EQ_INT(b.ops->device_info(b.ctx, 3, &d2, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(err.msg, "3 devices (0 to 2)");
  struct wd_peer_info p;
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 0, 1, &p, &err), 0);
  CHECK(p.access && p.link == WD_LINK_HOST);
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 1, 0, &p, &err), 0);
  CHECK(p.access);
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 0, 2, &p, &err), 0);
  CHECK(!p.access && p.link == WD_LINK_NONE);
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 1, 1, &p, &err), 0);
  CHECK(!p.access);
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 0, 9, &p, &err), WEIGHTD_E_NOT_FOUND);
  struct wd_slab *s = NULL;
  CHECK_EQ_INT(b.ops->slab_alloc(b.ctx, 7, 4096, &s, &err), WEIGHTD_E_NOT_FOUND);
  /* A peer copy reads a sealed slab (mapped for the copy) into a writable one. */
  struct wd_slab *a = NULL, *c = NULL;
  CHECK_EQ_INT(b.ops->slab_alloc(b.ctx, 0, 10000, &a, &err), 0);
  CHECK_EQ_INT(b.ops->slab_alloc(b.ctx, 1, 10000, &c, &err), 0);
  if (a != NULL && c != NULL) {
    for (int i = 0; i < 10000; i++) ((unsigned char *)a->host_view)[i] = (unsigned char)(i * 7);
    CHECK_EQ_INT(b.ops->slab_seal(b.ctx, a, &err), 0);
    CHECK_EQ_INT(b.ops->copy_peer(b.ctx, c, 100, a, 50, 9000, NULL, &err), 0);
    int bad = 0;
    for (int i = 0; i < 9000; i++) bad += ((unsigned char *)c->host_view)[100 + i] != (unsigned char)((i + 50) * 7);
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(b.ops->copy_peer(b.ctx, c, 2000, a, 0, 9000, NULL, &err), WEIGHTD_E_INTERNAL);
    CHECK_EQ_INT(b.ops->copy_peer(b.ctx, a, 0, c, 0, 10, NULL, &err), WEIGHTD_E_INTERNAL); /* into a sealed slab */
  }
  b.ops->slab_free(b.ctx, a);
  b.ops->slab_free(b.ctx, c);
  backend_destroy(&b);
  const char *bad_specs[] = {"0-3", "1-1", "0-", "x", "0-1,", "0-1;1-2"};
  for (size_t i = 0; i < sizeof bad_specs / sizeof bad_specs[0]; i++) {
    o.peers = bad_specs[i];
    CHECK_EQ_INT(backend_host_create_devices(&b, &o, &err), WEIGHTD_E_INVALID);
    CHECK(b.ops == NULL);
  }
  o.peers = "none";
  CHECK_EQ_INT(backend_host_create_devices(&b, &o, &err), 0);
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 0, 1, &p, &err), 0);
  CHECK(!p.access);
  backend_destroy(&b);
}

/* ---- loads on several devices ------------------------------------------------------------------ */

/* embed 512 KiB, w [300, 100] F32 (400-byte rows), norm 777 bytes, head 128 KiB + 256: ~770 KiB, 12 windows. */
static const struct fx_tensor tensors[] = {
    {"embed", "BF16", 2, 1024, 256},
    {"w", "F32", 4, 300, 100},
    {"norm", "U8", 1, 777, 0},
    {"head", "BF16", 2, 513, 128},
};
#define NT 4

/* Where tensor i's bytes start in the data section. */
static uint64_t data_off(size_t i) {
  uint64_t off = 0;
  for (size_t k = 0; k < i; k++)
    off += (tensors[k].cols ? tensors[k].rows * tensors[k].cols : tensors[k].rows) * tensors[k].elem_bytes;
  return off;
}

struct mfix {
  struct env e;
  char *dir;
  char path[PATH_MAX];
  struct reg_ckpt *ck;
};

static bool mfix_start(struct mfix *f, const char *tag, const struct env_opts *o) {
  memset(f, 0, sizeof *f);
  f->dir = fx_tmpdir(tag);
  if (f->dir == NULL || env_start(&f->e, o) != 0) {
    CHECK(!"fixture");
    return false;
  }
  snprintf(f->path, sizeof f->path, "%s/model.safetensors", f->dir);
  CHECK_EQ_INT(fx_write_st(f->path, tensors, NT), 0);
  struct acq a = env_acquire(&f->e, f->path);
  CHECK_EQ_INT(a.err.code, 0);
  f->ck = a.ck;
  return f->ck != NULL;
}

static void mfix_stop(struct mfix *f) {
  if (f->ck != NULL) reg_unref(f->ck);
  env_stop(&f->e);
  if (f->dir != NULL) fx_rmtree(f->dir);
  free(f->dir);
}

struct waitfor {
  struct res_waiter w;
  bool fired;
  struct res_set *set;
  struct wd_error err;
};

static void waitfor_done(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err) {
  (void)joined;
  struct waitfor *x = (struct waitfor *)w;
  x->fired = true;
  x->set = s;
  if (err != NULL) x->err = *err;
}

/* Starts loading `spec` (NULL: whole) onto device; the caller runs the loop until x->fired. */
static void start_load(struct mfix *f, const char *spec, int device, struct waitfor *x) {
  memset(x, 0, sizeof *x);
  x->w.done = waitfor_done;
  cJSON *j = spec != NULL ? cJSON_Parse(spec) : NULL;
  struct plan *p = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(plan_build(f->ck->ck, j, &p, &err), 0);
  cJSON_Delete(j);
  reg_ref(f->ck);
  res_load(f->e.res, f->ck, device, p, LD_CHOOSE_MMAP, &x->w);
}

/* Loads and waits; the ready set or NULL. */
static struct res_set *load_on(struct mfix *f, const char *spec, int device) {
  struct waitfor x;
  start_load(f, spec, device, &x);
  CHECK(env_run_until(&f->e, env_flag_set, &x.fired));
  CHECK_EQ_INT(x.err.code, 0);
  CHECK(x.set != NULL && x.set->state == SET_READY && x.set->device == device);
  return x.set;
}

/* The slab image a plan of whole tensors holds, computed from the fixture's byte pattern. */
static void expect_whole(const struct plan *p, unsigned char *img) {
  memset(img, 0, p->slab_bytes);
  for (size_t o = 0; o < p->noutputs; o++) {
    size_t i = 0;
    while (i < NT && strcmp(tensors[i].name, p->outputs[o].name) != 0) i++;
    CHECK(i < NT);
    for (uint64_t k = 0; i < NT && k < p->outputs[o].nbytes; k++)
      img[p->outputs[o].offset + k] = fx_byte((unsigned)i, data_off(i) + k);
  }
}

/* Compares the set's sealed slab with img, byte for byte; reports the first difference. */
static void check_slab(struct mfix *f, const struct res_set *s, const unsigned char *img) {
  const struct wd_backend *b = &f->e.backend;
  struct wd_handle h;
  struct wd_error err = {0};
  CHECK_EQ_INT(b->ops->slab_export(b->ctx, s->load.slab, &h, &err), 0);
  uint64_t n = s->plan->slab_bytes;
  const unsigned char *m = mmap(NULL, n ? n : 1, PROT_READ, MAP_SHARED, h.fd, 0);
  close(h.fd);
  CHECK(m != MAP_FAILED);
  if (m == MAP_FAILED) return;
  for (uint64_t i = 0; i < n; i++)
    if (m[i] != img[i]) {
      fprintf(stderr, "set %s (%s): slab byte %llu is %u, expected %u\n", s->id, ld_method_name(s->load.method),
              (unsigned long long)i, m[i], img[i]);
      CHECK(m[i] == img[i]);
      break;
    }
  munmap((void *)m, n ? n : 1);
}

static void check_whole(struct mfix *f, const struct res_set *s) {
  unsigned char *img = malloc(s->plan->slab_bytes);
  expect_whole(s->plan, img);
  check_slab(f, s, img);
  free(img);
}

/* ---- replicas ---- */

static void test_replica_from_peer(void) {
  struct mfix f;
  struct env_opts o = {.bulk_threads = 1, .residency = true, .host_devices = 3, .replicas = true};
  if (!mfix_start(&f, "mg-replica", &o)) {
    mfix_stop(&f);
    return;
  }
  struct res_set *a = load_on(&f, NULL, 0);
  if (a != NULL) {
    CHECK(a->load.method == LD_METHOD_MEMCPY);
    CHECK_EQ_INT(a->load.source_device, -1);
  }
  /* While the copy onto device 1 is queued, its source is kept: evicting it is BUSY. */
  struct gate g;
  gate_close(&g, f.e.bulk);
  struct waitfor x;
  start_load(&f, NULL, 1, &x);
  struct wd_error err = {0};
  if (a != NULL) {
    CHECK_EQ_INT(a->copying, 1);
    CHECK_EQ_INT(res_evict(f.e.res, a->id, 0, NULL, NULL, NULL, NULL, &err), WEIGHTD_E_BUSY);
    CHECK_STR_CONTAINS(err.msg, "being copied to another device");
  }
  gate_open(&g);
  CHECK(env_run_until(&f.e, env_flag_set, &x.fired));
  CHECK(env_run_until(&f.e, env_flag_set, &g.finished));
  gate_destroy(&g);
  struct res_set *b = x.set;
  CHECK(b != NULL && b != a);
  if (a != NULL && b != NULL) {
    CHECK(b->load.method == LD_METHOD_PEER);
    CHECK_EQ_INT(b->load.source_device, 0);
    CHECK_EQ_INT(a->copying, 0);
    CHECK_EQ_INT(b->load.nshares, 0);
    check_whole(&f, b);
    /* A third copy may come from either ready one; both are on peers of device 2. */
    struct res_set *c = load_on(&f, NULL, 2);
    if (c != NULL) {
      CHECK(c->load.method == LD_METHOD_PEER);
      CHECK(c->load.source_device == 0 || c->load.source_device == 1);
      check_whole(&f, c);
    }
    CHECK_EQ_INT(res_evict(f.e.res, a->id, 0, NULL, NULL, NULL, NULL, &err), 0); /* no copy holds it any more */
  }
  mfix_stop(&f);
}

static void test_replica_without_peer_access(void) {
  struct mfix f;
  struct env_opts o = {.residency = true, .host_devices = 3, .host_peers = "1-2", .replicas = true};
  if (!mfix_start(&f, "mg-nopeer", &o)) {
    mfix_stop(&f);
    return;
  }
  struct res_set *a = load_on(&f, NULL, 0);
  struct res_set *b = load_on(&f, NULL, 1); /* 0 and 1 are not peers: from host memory */
  if (a != NULL && b != NULL) {
    CHECK(b->load.method == LD_METHOD_MEMCPY);
    CHECK_EQ_INT(b->load.source_device, -1);
    check_whole(&f, b);
  }
  struct res_set *c = load_on(&f, NULL, 2); /* 1 and 2 are: from device 1's copy */
  if (c != NULL) {
    CHECK(c->load.method == LD_METHOD_PEER);
    CHECK_EQ_INT(c->load.source_device, 1);
    check_whole(&f, c);
  }
  mfix_stop(&f);
}

static void test_replica_source_busy(void) {
  struct mfix f;
  struct env_opts o = {.residency = true, .host_devices = 2, .replicas = true};
  if (!mfix_start(&f, "mg-busy", &o)) {
    mfix_stop(&f);
    return;
  }
  struct res_set *a = load_on(&f, NULL, 0);
  ld_reserve(f.e.ld, 0); /* a load onto device 0 is queued: it is busy */
  CHECK_EQ_INT(ld_busy(f.e.ld, 0), 1);
  struct res_set *b = load_on(&f, NULL, 1);
  ld_unreserve(f.e.ld, 0);
  if (a != NULL && b != NULL) {
    CHECK(b->load.method == LD_METHOD_MEMCPY);
    CHECK_EQ_INT(b->load.source_device, -1);
    check_whole(&f, b);
  }
  CHECK_EQ_INT(ld_busy(f.e.ld, 0), 0);
  CHECK_EQ_INT(ld_busy(f.e.ld, 1), 0);
  mfix_stop(&f);
}

/* ---- striping ---- */

/* Checks that t's shares are the links `devices` (the target's first) and partition the slab in windows. */
static void check_shares(const struct res_set *s, const int *devices, size_t n, size_t window) {
  const struct ld_target *t = &s->load;
  CHECK(t->method == LD_METHOD_STRIPED);
  CHECK_EQ_INT(t->nshares, n);
  uint64_t at = 0, total = s->plan->slab_bytes;
  for (size_t i = 0; i < t->nshares && i < n; i++) {
    CHECK_EQ_INT(t->shares[i].device, devices[i]);
    CHECK_EQ_INT(t->shares[i].lo, at);
    CHECK(t->shares[i].hi > t->shares[i].lo || i == 0);
    if (i + 1 < t->nshares) CHECK_EQ_INT(t->shares[i].hi % window, 0);
    at = t->shares[i].hi;
  }
  CHECK_EQ_INT(at, total);
}

#define WIN (64 * KiB)

static void test_striped_load(void) {
  struct mfix f;
  struct env_opts o = {.residency = true, .host_devices = 3, .striping = true, .window_bytes = WIN};
  if (!mfix_start(&f, "mg-stripe", &o)) {
    mfix_stop(&f);
    return;
  }
  struct res_set *s = load_on(&f, NULL, 1);
  if (s != NULL) {
    int want[] = {1, 0, 2};
    check_shares(s, want, 3, WIN);
    /* Equal unmeasured links: each within a window of a third. */
    uint64_t third = s->plan->slab_bytes / 3;
    for (size_t i = 0; i < s->load.nshares; i++) {
      uint64_t n = s->load.shares[i].hi - s->load.shares[i].lo;
      CHECK(n + WIN > third && n < third + WIN);
    }
    check_whole(&f, s);
  }
  for (int d = 0; d < 3; d++) CHECK_EQ_INT(ld_busy(f.e.ld, d), 0); /* every link given back */
  mfix_stop(&f);
}

static void test_striped_busy_neighbour(void) {
  struct mfix f;
  struct env_opts o = {.residency = true, .host_devices = 4, .striping = true, .window_bytes = WIN};
  if (!mfix_start(&f, "mg-stripe-busy", &o)) {
    mfix_stop(&f);
    return;
  }
  ld_reserve(f.e.ld, 2); /* device 2 has a load of its own queued: not borrowed */
  struct res_set *s = load_on(&f, NULL, 0);
  ld_unreserve(f.e.ld, 2);
  if (s != NULL) {
    int want[] = {0, 1, 3};
    check_shares(s, want, 3, WIN);
    check_whole(&f, s);
  }
  mfix_stop(&f);
}

static void test_striped_rates_and_peers(void) {
  struct mfix f;
  /* Device 3 is nobody's peer; rates 3:1:2:1 for devices 0..3. */
  struct env_opts o = {.residency = true, .host_devices = 4, .host_peers = "0-1,0-2,1-2", .striping = true,
                       .link_rates = "3,1,2,1", .window_bytes = WIN};
  if (!mfix_start(&f, "mg-stripe-rates", &o)) {
    mfix_stop(&f);
    return;
  }
  struct res_set *s = load_on(&f, NULL, 0);
  if (s != NULL) {
    int want[] = {0, 1, 2};
    check_shares(s, want, 3, WIN);
    /* 3:1:2 of the slab: a half, a sixth, a third, each to the nearest window. */
    uint64_t total = s->plan->slab_bytes;
    CHECK(s->load.shares[0].hi + WIN / 2 >= total / 2 && s->load.shares[0].hi <= total / 2 + WIN / 2);
    CHECK(s->load.shares[1].hi + WIN / 2 >= total * 4 / 6 && s->load.shares[1].hi <= total * 4 / 6 + WIN / 2);
    check_whole(&f, s);
  }
  struct res_set *t = load_on(&f, NULL, 3); /* no peers: its own link alone */
  if (t != NULL) {
    CHECK(t->load.method == LD_METHOD_MEMCPY);
    CHECK_EQ_INT(t->load.nshares, 0);
    check_whole(&f, t);
  }
  mfix_stop(&f);
}

static void test_not_striped_below_min(void) {
  struct mfix f;
  struct env_opts o = {.residency = true, .host_devices = 2, .striping = true, .window_bytes = WIN,
                       .stripe_min_bytes = 64 * MiB};
  if (!mfix_start(&f, "mg-stripe-min", &o)) {
    mfix_stop(&f);
    return;
  }
  struct res_set *s = load_on(&f, NULL, 0);
  if (s != NULL) {
    CHECK(s->load.method == LD_METHOD_MEMCPY);
    CHECK_EQ_INT(s->load.nshares, 0);
  }
  mfix_stop(&f);
}

/*
 * An explicit plan with a strided piece (columns 30..70 of w), a piece of
 * zeros after norm, and the embedding: computed here element by element.
 */
static const char *mixed_plan =
    "{\"outputs\":["
    "{\"name\":\"w.cols\",\"dtype\":\"F32\",\"shape\":[300,40],\"pieces\":[{\"tensor\":\"w\",\"dim\":1,\"start\":30,\"end\":70}]},"
    "{\"name\":\"norm.padded\",\"dtype\":\"U8\",\"shape\":[1000],\"pieces\":[{\"tensor\":\"norm\"},{\"zeros\":223}]},"
    "{\"name\":\"embed\",\"dtype\":\"BF16\",\"shape\":[1024,256],\"pieces\":[{\"tensor\":\"embed\"}]},"
    "{\"name\":\"w.tail\",\"dtype\":\"F32\",\"shape\":[300,3],\"pieces\":[{\"tensor\":\"w\",\"dim\":1,\"start\":97,\"end\":100}]}"
    "]}";

static void expect_mixed(const struct plan *p, unsigned char *img) {
  memset(img, 0, p->slab_bytes);
  CHECK_EQ_INT(p->noutputs, 4);
  if (p->noutputs != 4) return;
  unsigned char *cols = img + p->outputs[0].offset, *norm = img + p->outputs[1].offset;
  unsigned char *emb = img + p->outputs[2].offset, *tail = img + p->outputs[3].offset;
  for (uint64_t r = 0; r < 300; r++) {
    for (uint64_t k = 0; k < 160; k++) cols[r * 160 + k] = fx_byte(1, data_off(1) + r * 400 + 120 + k);
    for (uint64_t k = 0; k < 12; k++) tail[r * 12 + k] = fx_byte(1, data_off(1) + r * 400 + 388 + k);
  }
  for (uint64_t k = 0; k < 777; k++) norm[k] = fx_byte(2, data_off(2) + k);
  for (uint64_t k = 0; k < 1024 * 256 * 2; k++) emb[k] = fx_byte(0, data_off(0) + k);
}

static void stripe_mixed(bool direct) {
  struct mfix f;
  /* Windows of 20 KiB: they cut through the strided rows of w.cols, and a window holds several pieces. */
  struct env_opts o = {.residency = true, .host_devices = 2, .striping = true, .window_bytes = 20 * KiB};
  if (!mfix_start(&f, direct ? "mg-direct" : "mg-staged", &o)) {
    mfix_stop(&f);
    return;
  }
  /*
   * The host backend registers nothing and its copies read any mapping, so
   * the test says the file is registered: as two registrations that meet
   * inside row 150 of the strided piece w.cols, which the direct copies must
   * split there (a 2D copy of the rows before, the row in two, the rest).
   */
  struct plan_range pins[2];
  if (direct) {
    const struct ckpt_shard *sh = &f.ck->ck->shards[0];
    uint64_t cut = sh->hdr->data_start + data_off(1) + 150 * 400 + 200;
    pins[0] = (struct plan_range){0, 0, cut};
    pins[1] = (struct plan_range){0, cut, sh->size - cut};
    f.ck->pins = pins;
    f.ck->npins = 2;
  }
  struct res_set *s = load_on(&f, mixed_plan, 0);
  if (direct) {
    f.ck->pins = NULL;
    f.ck->npins = 0;
  }
  if (s != NULL) CHECK(s->load.method == LD_METHOD_STRIPED);
  if (s != NULL) {
    int want[] = {0, 1};
    check_shares(s, want, 2, 20 * KiB);
    unsigned char *img = malloc(s->plan->slab_bytes);
    expect_mixed(s->plan, img);
    check_slab(&f, s, img);
    free(img);
  }
  mfix_stop(&f);
}

static void test_striped_staged_strided(void) { stripe_mixed(false); }

static void test_striped_direct_strided(void) { stripe_mixed(true); }

/* Loads onto two devices at once both end with their bytes; neither device lends while it loads. */
static void test_concurrent_loads(void) {
  struct mfix f;
  struct env_opts o = {.bulk_threads = 2, .residency = true, .host_devices = 2, .striping = true, .window_bytes = WIN};
  if (!mfix_start(&f, "mg-concurrent", &o)) {
    mfix_stop(&f);
    return;
  }
  /* Both bulk threads are held until both loads are queued. */
  struct gate g0, g1;
  gate_close(&g0, f.e.bulk);
  gate_close(&g1, f.e.bulk);
  struct waitfor x0, x1;
  start_load(&f, NULL, 0, &x0);
  start_load(&f, mixed_plan, 1, &x1);
  CHECK_EQ_INT(ld_busy(f.e.ld, 0), 1);
  CHECK_EQ_INT(ld_busy(f.e.ld, 1), 1);
  /* Each device stays busy until both loads are done, as it would with another load queued on it: the
   * decision is taken when a load runs, and one load may finish before the other's thread gets there. */
  ld_reserve(f.e.ld, 0);
  ld_reserve(f.e.ld, 1);
  gate_open(&g0);
  gate_open(&g1);
  CHECK(env_run_until(&f.e, env_flag_set, &g0.finished));
  CHECK(env_run_until(&f.e, env_flag_set, &g1.finished));
  gate_destroy(&g0);
  gate_destroy(&g1);
  CHECK(env_run_until(&f.e, env_flag_set, &x0.fired));
  CHECK(env_run_until(&f.e, env_flag_set, &x1.fired));
  ld_unreserve(f.e.ld, 0);
  ld_unreserve(f.e.ld, 1);
  CHECK(x0.set != NULL && x1.set != NULL);
  if (x0.set != NULL && x1.set != NULL) {
    /* Each device was busy whenever the other's load ran, so neither borrowed the other's link. */
    CHECK(x0.set->load.method == LD_METHOD_MEMCPY);
    CHECK(x1.set->load.method == LD_METHOD_MEMCPY);
    check_whole(&f, x0.set);
    unsigned char *img = malloc(x1.set->plan->slab_bytes);
    expect_mixed(x1.set->plan, img);
    check_slab(&f, x1.set, img);
    free(img);
  }
  CHECK_EQ_INT(ld_busy(f.e.ld, 0) + ld_busy(f.e.ld, 1), 0);
  mfix_stop(&f);
}

int main(void) {
  log_set_level(LOG_ERROR);
  if (fault_install() != 0) {
    fprintf(stderr, "fault_install failed\n");
    return 1;
  }
  RUN(test_fill_round_robin);
  RUN(test_fill_bind);
  RUN(test_cpulist_parse);
  RUN(test_numa_sysfs_tree);
  RUN(test_link_rates);
  RUN(test_stripe_split);
  RUN(test_replica_pick);
  RUN(test_host_devices);
  RUN(test_replica_from_peer);
  RUN(test_replica_without_peer_access);
  RUN(test_replica_source_busy);
  RUN(test_striped_load);
  RUN(test_striped_busy_neighbour);
  RUN(test_striped_rates_and_peers);
  RUN(test_not_striped_below_min);
  RUN(test_striped_staged_strided);
  RUN(test_striped_direct_strided);
  RUN(test_concurrent_loads);
  return tu_finish();
}
