/*
 * test_gpu.c - the cuda backend end to end, on a real GPU.
 *
 * Starts a weightd with --backend cuda on a private socket, generates a
 * checkpoint, and checks: every byte of every tensor after a staged load and
 * after a direct (pinned-resident) load, read back from the device pointers
 * libweightd hands out; attach from a second process (weightctl attach
 * --verify); two processes sharing one set; lease release when an attached
 * process is killed with SIGKILL; and a clear DEVICE_NOMEM when the GPU is
 * full, after which the daemon keeps serving. The main daemon runs with pin
 * off, so that its staged loads stay staged; two more check the other paths
 * on the real device: staged_strided rows (2D copies out of the pinned slots)
 * and the default pin policy (a rank's ranges registered after its first
 * load with cudaHostRegister on parts of the mappings, the next load direct
 * with its copies cut at registration boundaries), every byte read back.
 * Exits 77 (skipped) without a GPU.
 */
#include <cuda_runtime.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "plan.h"
#include <sys/mman.h>
#include "fixture.h"
#include "testutil.h"
#include "weightd.h"

static char *dir, sock[PATH_MAX], ckpt[PATH_MAX], moe[PATH_MAX];
static const char *weightd_bin, *weightctl_bin;
static pid_t daemon_pid = -1;
static weightd_client *g_c;
static struct ckpt *g_ck;

static int run_cmd(char *const argv[]) {
  pid_t p = fork();
  if (p == 0) {
    execv(argv[0], argv);
    _exit(127);
  }
  int st = 0;
  waitpid(p, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static pid_t spawn(char *const argv[]) {
  pid_t p = fork();
  if (p == 0) {
    execv(argv[0], argv);
    _exit(127);
  }
  return p;
}

/* Starts a weightd (cuda backend, model root dir) on socket path with extra flags; its pid. */
static pid_t daemon_start(const char *path, const char *log_name, const char *const *extra) {
  char log[PATH_MAX];
  snprintf(log, sizeof log, "%s/%s", dir, log_name);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    const char *argv[32] = {weightd_bin, "--foreground", "--backend", "cuda", "--socket", path, "--model-root", dir,
                            "--log-level", "debug"};
    int n = 10;
    for (; extra != NULL && *extra != NULL && n < 31; extra++) argv[n++] = *extra;
    argv[n] = NULL;
    execv(weightd_bin, (char *const *)argv);
    _exit(127);
  }
  for (int i = 0; i < 300; i++) {
    struct stat sb;
    if (stat(path, &sb) == 0) return pid;
    usleep(20000);
  }
  return pid;
}

static void daemon_stop(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void start_daemon(void) {
  static const char *const extra[] = {"--set", "pin=off", NULL};
  snprintf(sock, sizeof sock, "%s/wd.sock", dir);
  daemon_pid = daemon_start(sock, "weightd.log", extra);
}

static void stop_daemon(void) {
  daemon_stop(daemon_pid);
  daemon_pid = -1;
}

/*
 * Compares every tensor of an attached set with what the plan spec says it
 * holds, computed here from the checkpoint's files (NULL spec: whole tensors).
 */
static void verify_plan(weightd_set *s, const struct ckpt *c, const char *spec_json) {
  CHECK_EQ_INT(weightd_set_memory_kind(s), WEIGHTD_MEMORY_CUDA);
  cJSON *spec = spec_json ? cJSON_Parse(spec_json) : NULL;
  struct plan *p = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(plan_build(c, spec, &p, &err), 0);
  cJSON_Delete(spec);
  if (p == NULL) return;
  void **maps = calloc(c->nshards, sizeof *maps);
  const unsigned char **data = calloc(c->nshards, sizeof *data);
  for (size_t i = 0; i < c->nshards; i++) {
    int fd = open(c->shards[i].path, O_RDONLY);
    maps[i] = mmap(NULL, c->shards[i].size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    data[i] = (const unsigned char *)maps[i] + c->shards[i].hdr->data_start;
  }
  size_t n = weightd_set_tensor_count(s);
  CHECK_EQ_INT(n, p->noutputs);
  size_t cap = 64u << 20, bad = 0;
  unsigned char *dev = malloc(cap), *want = malloc(cap);
  for (size_t i = 0; i < n; i++) {
    weightd_tensor t;
    CHECK_EQ_INT(weightd_set_tensor(s, i, &t), 0);
    const struct plan_output *o = NULL;
    for (size_t k = 0; k < p->noutputs; k++)
      if (strcmp(p->outputs[k].name, t.name) == 0) o = &p->outputs[k];
    CHECK(o != NULL);
    if (o == NULL) continue;
    CHECK_EQ_INT(t.nbytes, o->nbytes);
    CHECK_EQ_INT(t.offset % 256, 0);
    for (uint64_t off = 0; off < t.nbytes; off += cap) {
      size_t len = t.nbytes - off < cap ? (size_t)(t.nbytes - off) : cap;
      plan_gather(p, data, o->offset + off, o->offset + off + len, want);
      if (cudaMemcpy(dev, (char *)t.data + off, len, cudaMemcpyDeviceToHost) != cudaSuccess ||
          memcmp(dev, want, len) != 0) {
        fprintf(stderr, "tensor %s differs in [%llu, +%zu)\n", t.name, (unsigned long long)off, len);
        bad++;
        break;
      }
    }
  }
  CHECK_EQ_INT(bad, 0);
  free(dev);
  free(want);
  for (size_t i = 0; i < c->nshards; i++) munmap(maps[i], c->shards[i].size);
  free(maps);
  free(data);
  plan_free(p);
}

static void verify_set(weightd_set *s, const struct ckpt *c) { verify_plan(s, c, NULL); }

static int count_leases(weightd_client *c) {
  char *reply = NULL;
  int leases = -1;
  if (weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL) == 0) {
    const char *p = strstr(reply, "\"leases\":");
    if (p) leases = atoi(p + 9);
  }
  weightd_free(reply);
  return leases;
}

static void test_load_attach_every_byte(void) {
  weightd_client *c = g_c;
  const struct ckpt *ck = g_ck;
  weightd_set *s = NULL;
  int rc = weightd_attach_path(c, ckpt, NULL, &s);
  CHECK_EQ_INT(rc, 0);
  if (rc != 0) {
    fprintf(stderr, "attach: %s\n", weightd_last_error(c));
    return;
  }
  verify_set(s, ck);
  /* A second process attaches the same set and checks every byte itself. */
  char *argv[] = {(char *)weightctl_bin, "--socket", sock, "attach", (char *)weightd_set_id(s), "--verify", NULL};
  CHECK_EQ_INT(run_cmd(argv), 0);
  /* Two processes share the set: the other holds a lease until it is killed. */
  char *hold[] = {(char *)weightctl_bin, "--socket", sock, "attach", (char *)weightd_set_id(s), "--hold", NULL};
  pid_t p = spawn(hold);
  int leases = 0;
  for (int i = 0; i < 500 && leases < 2; i++) {
    usleep(20000);
    leases = count_leases(c);
  }
  CHECK_EQ_INT(leases, 2);
  kill(p, SIGKILL);
  waitpid(p, NULL, 0);
  for (int i = 0; i < 500 && leases != 1; i++) {
    usleep(20000);
    leases = count_leases(c);
  }
  CHECK_EQ_INT(leases, 1);
  char set_id[32];
  snprintf(set_id, sizeof set_id, "%s", weightd_set_id(s));
  CHECK_EQ_INT(weightd_release(s), 0);
  CHECK_EQ_INT(count_leases(c), 0);
  CHECK_EQ_INT(weightd_evict(c, set_id), 0);
}

static void test_pinned_direct(void) {
  weightd_client *c = g_c;
  const struct ckpt *ck = g_ck;
  CHECK_EQ_INT(weightd_prefetch(c, ckpt, 1, 1), 0);
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL), 0);
  CHECK_STR_CONTAINS(reply, "\"pinned\":true");
  weightd_free(reply);
  weightd_set *s = NULL;
  char req[PATH_MAX + 64];
  snprintf(req, sizeof req, "{\"op\":\"load\",\"path\":\"%s\"}", ckpt);
  reply = NULL;
  CHECK_EQ_INT(weightd_request(c, req, &reply, NULL, NULL), 0);
  CHECK_STR_CONTAINS(reply, "\"method\":\"direct\"");
  weightd_free(reply);
  CHECK_EQ_INT(weightd_attach_path(c, ckpt, NULL, &s), 0);
  if (s != NULL) {
    verify_set(s, ck);
    char id[32];
    snprintf(id, sizeof id, "%s", weightd_set_id(s));
    weightd_release(s);
    CHECK_EQ_INT(weightd_evict(c, id), 0);
  }
}

/* Per-rank layouts on the GPU: staged and direct loads of sliced, fused and replicated outputs. */
static void test_rank_layouts(void) {
  static const char *const specs[] = {
      "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}",
      "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":0,\"fuse\":true}",
      "{\"preset\":\"auto\",\"tp_size\":16,\"tp_rank\":5,\"fuse\":true}",
      "{\"preset\":\"auto\",\"tp_size\":4,\"tp_rank\":3}",
  };
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
    struct weightd_load_options o = {sizeof o, NULL, specs[i], NULL, NULL};
    weightd_set *s = NULL;
    int rc = weightd_attach_path(g_c, ckpt, &o, &s);
    CHECK_EQ_INT(rc, 0);
    if (rc != 0) {
      fprintf(stderr, "%s: %s\n", specs[i], weightd_last_error(g_c));
      continue;
    }
    verify_plan(s, g_ck, specs[i]);
    char id[32];
    snprintf(id, sizeof id, "%s", weightd_set_id(s));
    weightd_release(s);
    CHECK_EQ_INT(weightd_evict(g_c, id), 0);
  }
}

/* Experts: EP ranks, TP-sliced experts, stacked w13/w2 (2D copies of row-parallel slices). */
static void test_moe_layouts(void) {
  static const char *const specs[] = {
      "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1,\"ep_size\":2,\"ep_rank\":1,\"fuse\":true}",
      "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":0,\"fuse\":true}",
      "{\"preset\":\"auto\",\"tp_size\":4,\"tp_rank\":2}",
  };
  struct ckpt *mc = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(moe, NULL, &mc, &err), 0);
  for (size_t i = 0; mc != NULL && i < sizeof specs / sizeof specs[0]; i++) {
    struct weightd_load_options o = {sizeof o, NULL, specs[i], NULL, NULL};
    weightd_set *s = NULL;
    int rc = weightd_attach_path(g_c, moe, &o, &s);
    CHECK_EQ_INT(rc, 0);
    if (rc != 0) {
      fprintf(stderr, "%s: %s\n", specs[i], weightd_last_error(g_c));
      continue;
    }
    verify_plan(s, mc, specs[i]);
    char id[32];
    snprintf(id, sizeof id, "%s", weightd_set_id(s));
    weightd_release(s);
    CHECK_EQ_INT(weightd_evict(g_c, id), 0);
  }
  ckpt_free(mc);
}

static void test_out_of_memory(void) {
  weightd_client *c = g_c;
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  /* Leave less free than the set needs (but enough for the daemon's own work). */
  void *hog = NULL;
  size_t take = free_b > (96u << 20) ? free_b - (96u << 20) : 0;
  if (cudaMalloc(&hog, take) != cudaSuccess) {
    fprintf(stderr, "could not fill the GPU; skipping the OOM check\n");
    return;
  }
  char set_id[32];
  int rc = weightd_load(c, ckpt, NULL, set_id, sizeof set_id);
  CHECK_EQ_INT(rc, WEIGHTD_E_DEVICE_NOMEM);
  CHECK_STR_CONTAINS(weightd_last_error(c), "cudaMalloc");
  cudaFree(hog);
  rc = weightd_load(c, ckpt, NULL, set_id, sizeof set_id);
  CHECK_EQ_INT(rc, 0);
  if (rc == 0) CHECK_EQ_INT(weightd_evict(c, set_id), 0);
}


/* The method of a load of spec through c (the load's reply), "" on failure; the set id goes to id. */
static void load_method(weightd_client *c, const char *spec, char *method, size_t mlen, char *id, size_t idlen) {
  char *req = NULL, *reply = NULL;
  method[0] = id[0] = '\0';
  if (asprintf(&req, "{\"op\":\"load\",\"path\":\"%s\"%s%s}", ckpt, spec ? ",\"plan\":" : "", spec ? spec : "") < 0) return;
  int rc = weightd_request(c, req, &reply, NULL, NULL);
  CHECK_EQ_INT(rc, 0);
  const char *m = reply ? strstr(reply, "\"method\":\"") : NULL, *i = reply ? strstr(reply, "\"set\":\"") : NULL;
  if (m != NULL) snprintf(method, mlen, "%.*s", (int)strcspn(m + 10, "\""), m + 10);
  if (i != NULL) snprintf(id, idlen, "%.*s", (int)strcspn(i + 7, "\""), i + 7);
  weightd_free(reply);
  free(req);
}

/* Attaches set id through c, verifies every byte against spec, releases and evicts it. */
static void verify_and_evict(weightd_client *c, const char *id, const char *spec) {
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, id, &s), 0);
  if (s != NULL) {
    verify_plan(s, g_ck, spec);
    weightd_release(s);
  }
  CHECK_EQ_INT(weightd_evict(c, id), 0);
}

/* Staged loads with strided pieces staged as whole rows: 2D copies from the pinned slots. */
static void test_staged_rows(void) {
  static const char *const extra[] = {"--set", "pin=off", "--set", "staged_strided=rows", NULL};
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/rows.sock", dir);
  pid_t pid = daemon_start(path, "weightd-rows.log", extra);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(path, &c), 0);
  static const char *const specs[] = {"{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}",
                                      "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":0,\"fuse\":true}",
                                      "{\"preset\":\"auto\",\"tp_size\":4,\"tp_rank\":3}"};
  for (size_t i = 0; c != NULL && i < sizeof specs / sizeof specs[0]; i++) {
    char method[16], id[32];
    load_method(c, specs[i], method, sizeof method, id, sizeof id);
    CHECK(strcmp(method, "staged") == 0);
    verify_and_evict(c, id, specs[i]);
  }
  weightd_close(c);
  daemon_stop(pid);
}

/* True once the daemon has registered part of the checkpoint and no pin job runs. */
static bool wait_pinned(weightd_client *c) {
  for (int i = 0; i < 1000; i++) {
    char *reply = NULL;
    bool done = false;
    if (weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL) == 0 && reply != NULL) {
      const char *b = strstr(reply, "\"checkpoints\"");
      done = b != NULL && strstr(b, "\"pinning\":false") != NULL && strstr(b, "\"pinned_bytes\":0,") == NULL;
    }
    weightd_free(reply);
    if (done) return true;
    usleep(20000);
  }
  return false;
}

/* The default pin policy: a rank's first load stages, its ranges get pinned, the next load is direct. */
static void test_pin_after_load(void) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/auto.sock", dir);
  pid_t pid = daemon_start(path, "weightd-auto.log", NULL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(path, &c), 0);
  static const char *const specs[] = {"{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}", NULL};
  for (size_t i = 0; c != NULL && i < 2; i++) {
    char method[16], id[32];
    load_method(c, specs[i], method, sizeof method, id, sizeof id);
    CHECK(strcmp(method, "staged") == 0); /* the first: nothing registered (the whole set: not all of it) */
    verify_and_evict(c, id, specs[i]);
    CHECK(wait_pinned(c));
    load_method(c, specs[i], method, sizeof method, id, sizeof id);
    CHECK(strcmp(method, "direct") == 0);
    verify_and_evict(c, id, specs[i]);
  }
  weightd_close(c);
  daemon_stop(pid);
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) SKIP_ALL("no GPU");
  weightd_bin = getenv("WEIGHTD");
  weightctl_bin = getenv("WEIGHTCTL");
  if (weightd_bin == NULL || weightctl_bin == NULL) SKIP_ALL("WEIGHTD and WEIGHTCTL must name the binaries");
  dir = fx_tmpdir("gpu");
  snprintf(ckpt, sizeof ckpt, "%s/qwen3-4b-3l", dir);
  char *gen[] = {(char *)weightctl_bin, "mkcheckpoint", "--preset", "qwen3-4b", "--layers", "3",
                 "--seed", "7", "--out", ckpt, NULL};
  snprintf(moe, sizeof moe, "%s/qwen3-30b-a3b-1l-8e", dir);
  char *gen_moe[] = {(char *)weightctl_bin, "mkcheckpoint", "--preset", "qwen3-30b-a3b", "--layers", "1",
                     "--experts", "8", "--seed", "3", "--out", moe, NULL};
  if (run_cmd(gen) != 0 || run_cmd(gen_moe) != 0) {
    fprintf(stderr, "mkcheckpoint failed\n");
    return 1;
  }
  struct ckpt *ck = NULL;
  struct wd_error err = {0};
  if (ckpt_open(ckpt, NULL, &ck, &err) != 0) {
    fprintf(stderr, "%s\n", err.msg);
    return 1;
  }
  start_daemon();
  weightd_client *c = NULL;
  if (weightd_connect(sock, &c) != 0) {
    fprintf(stderr, "connect: %s\n", weightd_last_error(c));
    stop_daemon();
    return 1;
  }
  CHECK(strcmp(weightd_backend(c), "cuda") == 0);
  g_c = c;
  g_ck = ck;
  RUN(test_load_attach_every_byte);
  RUN(test_out_of_memory);
  RUN(test_pinned_direct);
  RUN(test_rank_layouts); /* direct (the checkpoint is pinned now) */
  char req[PATH_MAX + 64];
  snprintf(req, sizeof req, "{\"op\":\"close\",\"path\":\"%s\"}", ckpt);
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, req, &reply, NULL, NULL), 0); /* unpins */
  weightd_free(reply);
  RUN(test_rank_layouts); /* staged */
  RUN(test_moe_layouts);
  RUN(test_staged_rows);
  RUN(test_pin_after_load);
  weightd_close(c);
  stop_daemon();
  ckpt_free(ck);
  fx_rmtree(dir);
  return tu_finish();
}
