/*
 * test_gpu_multi.c - the multi-GPU paths on whatever GPUs this machine has
 * (one is enough; everything that needs two is tested in CI on the host
 * backend, tests/test_multi.c and tests/integration/test_multi.py).
 *
 * In this process, on the cuda backend: the peer queries say there is no
 * peer of a device for itself and fail cleanly (NOT_FOUND) for a device that
 * does not exist; the topology reads the GPU's PCI bus id and NUMA node; the
 * multi-device context is not made with one GPU (every load uses its own
 * link); copy_peer moves bytes between a VMM slab and a bounce buffer and on
 * into another VMM slab on one GPU (device-to-device), read back here
 * through the slab's exported descriptor and compared; a striping kit is
 * allocated and freed on the GPU.
 *
 * Against a weightd with the cuda backend and replicas and striping on: a
 * TP=2 group with both ranks on GPU 0 through weightd_load_group, each
 * rank's set compared byte for byte with its plan built from the files
 * (weightctl attach --verify, in another process); with no peer, a load
 * is neither a replica nor striped (source host, no links) and the status
 * says so; a group or load naming a GPU that is not there fails with
 * NOT_FOUND and the daemon keeps serving. Exits 77 (skipped) without a GPU.
 */
#include <cuda_runtime.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_import.h"
#include "fixture.h"
#include "load/loader.h"
#include "testutil.h"
#include "base/topology.h"
#include "weightd.h"

static char *dir, sock[PATH_MAX], ckpt[PATH_MAX];
static const char *weightd_bin, *weightctl_bin;
static pid_t daemon_pid = -1;
static int ngpus;
static weightd_client *g_c;

extern char **environ;

/* Runs argv to its end; its exit status (127: it could not start). */
static int run(char *const argv[]) {
  pid_t p;
  int st = 0;
  if (posix_spawn(&p, argv[0], NULL, NULL, argv, environ) != 0) return 127;
  waitpid(p, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ---- in this process: the backend ---------------------------------------------------------- */

#define COPY_BYTES ((8u << 20) + 4099u)

static void test_backend_without_peers(void) {
  struct wd_backend b;
  struct wd_error err = {0};
  CHECK_EQ_INT(backend_cuda_create(&b, WD_HANDLE_CUDA_VMM, &err), 0);
  if (b.ops == NULL) return;
  int n = b.ops->device_count(b.ctx);
  CHECK_EQ_INT(n, ngpus);
  struct wd_peer_info p;
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 0, 0, &p, &err), 0);
  CHECK(!p.access && p.link == WD_LINK_NONE); /* a GPU is not its own peer */
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, 0, n, &p, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(err.msg, "no GPU");
  CHECK_EQ_INT(b.ops->peer_query(b.ctx, -1, 0, &p, &err), WEIGHTD_E_NOT_FOUND);
  struct topology *t = NULL;
  CHECK_EQ_INT(topo_create(&b, n, NULL, "", &t, &err), 0);
  if (t != NULL) {
    CHECK(strlen(t->dev[0].pci) >= 12); /* "0000:1b:00.0" */
    CHECK(t->dev[0].numa_node >= -1);
    printf("GPU 0: PCI %s, NUMA node %d, %zu NUMA node(s) on this machine\n", t->dev[0].pci, t->dev[0].numa_node,
           t->numa.n);
    for (int i = 0; i < n; i++)
      for (int j = 0; j < n; j++)
        if (i != j) printf("GPU %d -> %d: access %d, %s\n", i, j, topo_peer(t, i, j)->access, wd_link_name(topo_peer(t, i, j)->link));
    /* One GPU: no peers, every load uses its own link; several: lending links and replica lanes on each. */
    struct ld_pool *pool = NULL;
    CHECK_EQ_INT(ld_pool_start(1, &pool), 0);
    struct loader *ld = NULL;
    struct ld_params lp = {.backend = &b, .pool = pool, .ndevices = n, .staging_slots = 2,
                           .staging_slot_bytes = 4u << 20, .topo = t, .replicas = true, .striping = true};
    CHECK_EQ_INT(ld_create(&lp, &ld, &err), 0);
    if (n == 1) CHECK(!ld_has_peers(ld));
    CHECK_EQ_INT(ld_staging_start(ld, &err), 0); /* the staging and lending links on the GPU(s) */
    ld_destroy(ld);
    ld_pool_stop(pool);
    topo_destroy(t);
  }
  backend_destroy(&b);
}

/* copy_peer on one GPU: a VMM slab -> a bounce buffer -> another VMM slab, read back through its descriptor. */
static void test_copy_peer_one_gpu(void) {
  struct wd_backend b;
  struct wd_error err = {0};
  CHECK_EQ_INT(backend_cuda_create(&b, WD_HANDLE_CUDA_VMM, &err), 0);
  if (b.ops == NULL) return;
  const struct wd_backend_ops *ops = b.ops;
  struct wd_device_info info;
  CHECK_EQ_INT(ops->device_info(b.ctx, 0, &info, &err), 0);
  struct wd_slab *src = NULL, *bounce = NULL, *dst = NULL;
  struct wd_stream *s = NULL;
  struct wd_event *e = NULL;
  unsigned char *pattern = NULL;
  CHECK_EQ_INT(ops->pinned_alloc(b.ctx, 0, COPY_BYTES, 0, (void **)&pattern, &err), 0);
  CHECK_EQ_INT(ops->slab_alloc(b.ctx, 0, COPY_BYTES, &src, &err), 0);
  CHECK_EQ_INT(ops->scratch_alloc(b.ctx, 0, COPY_BYTES, &bounce, &err), 0);
  CHECK_EQ_INT(ops->slab_alloc(b.ctx, 0, COPY_BYTES, &dst, &err), 0);
  CHECK_EQ_INT(ops->stream_create(b.ctx, 0, &s, &err), 0);
  CHECK_EQ_INT(ops->event_create(b.ctx, 0, &e, &err), 0);
  if (pattern == NULL || src == NULL || bounce == NULL || dst == NULL || s == NULL || e == NULL) goto out;
  for (uint32_t i = 0; i < COPY_BYTES; i++) pattern[i] = (unsigned char)((i * 2654435761u) >> 13);
  CHECK_EQ_INT(ops->copy_h2d(b.ctx, src, 0, COPY_BYTES, pattern, COPY_BYTES, COPY_BYTES, 1, s, &err), 0);
  CHECK_EQ_INT(ops->copy_peer(b.ctx, bounce, 0, src, 17, COPY_BYTES - 17, s, &err), 0);
  CHECK_EQ_INT(ops->copy_peer(b.ctx, dst, 5, bounce, 0, COPY_BYTES - 17, s, &err), 0);
  CHECK_EQ_INT(ops->copy_peer(b.ctx, dst, 5, bounce, 0, COPY_BYTES, s, &err), WEIGHTD_E_INTERNAL); /* past the end */
  CHECK_EQ_INT(ops->event_record(b.ctx, e, s, &err), 0);
  CHECK_EQ_INT(ops->event_wait(b.ctx, e, &err), 0);
  /* Read dst back as a client would: import its descriptor, map it, copy to the host. */
  struct wd_handle h;
  CHECK_EQ_INT(ops->slab_export(b.ctx, dst, &h, &err), 0);
  struct cuimp_device dev;
  struct cuimp_vmm m;
  if (cuimp_device_find(info.uuid, &dev, &err) == 0) {
    if (cuimp_vmm_map(&dev, h.fd, h.bytes, &m, &err) == 0) {
      unsigned char *back = malloc(COPY_BYTES);
      CHECK_EQ_INT(cuimp_copy_to_host(&dev, back, m.va, COPY_BYTES, &err), 0);
      size_t bad = 0;
      for (uint32_t i = 0; i < COPY_BYTES - 17; i++) bad += back[5 + i] != pattern[17 + i];
      CHECK_EQ_INT(bad, 0);
      free(back);
      cuimp_vmm_unmap(&dev, &m, &err);
    } else {
      fprintf(stderr, "cuimp_vmm_map: %s\n", err.msg);
      CHECK(!"mapped");
    }
    cuimp_device_put(&dev);
  }
  close(h.fd);
out:
  if (e) ops->event_destroy(b.ctx, e);
  if (s) ops->stream_destroy(b.ctx, s);
  ops->slab_free(b.ctx, dst);
  ops->slab_free(b.ctx, bounce);
  ops->slab_free(b.ctx, src);
  if (pattern) ops->pinned_free(b.ctx, 0, pattern);
  backend_destroy(&b);
}

/* ---- against the daemon ---------------------------------------------------------------------- */

/* A weightd with the cuda backend, replicas and striping on (with no peer they find nothing to do); a client of it. */
static weightd_client *start_daemon(void) {
  char log[PATH_MAX];
  snprintf(sock, sizeof sock, "%s/wd.sock", dir);
  snprintf(log, sizeof log, "%s/weightd.log", dir);
  char *argv[] = {(char *)weightd_bin, "--foreground", "--backend", "cuda", "--socket", sock, "--model-root", dir,
                  "--log-level", "debug", "--set", "replicas=auto", "--set", "striping=auto",
                  "--set", "stripe_min_bytes=0", "--set", "metrics_address=", NULL};
  daemon_pid = fork();
  if (daemon_pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDERR_FILENO);
    execv(argv[0], argv);
    _exit(127);
  }
  weightd_client *c = NULL;
  for (int tries = 0; tries < 600 && waitpid(daemon_pid, NULL, WNOHANG) == 0; tries++, usleep(50000)) {
    if (weightd_connect(sock, &c) == 0) return c;
    weightd_close(c);
    c = NULL;
  }
  fprintf(stderr, "weightd did not answer (its log: %s)\n", log);
  return NULL;
}

/* The reply to one request, parsed (NULL when it failed: *rc says how). */
static cJSON *call(weightd_client *c, const char *json, int *rc) {
  char *text = NULL;
  *rc = weightd_request(c, json, &text, NULL, NULL);
  cJSON *r = text ? cJSON_Parse(text) : NULL;
  weightd_free(text);
  if (*rc != 0) {
    cJSON_Delete(r);
    return NULL;
  }
  return r;
}

/* weightctl attach SET --verify: every byte of the set against its plan from the files, in another process. */
static int verify_set(const char *set_id) {
  char *argv[] = {(char *)weightctl_bin, "--socket", sock, "attach", (char *)set_id, "--verify", NULL};
  return run(argv);
}

static void test_group_on_one_gpu(void) {
  weightd_client *c = g_c;
  const char *devices[] = {"0", "0"};
  struct weightd_group_options o = {.struct_size = sizeof o, .tp_size = 2, .devices = devices, .ndevices = 2,
                                    .plan_json = "{\"preset\":\"auto\",\"fuse\":true}"};
  weightd_group *g = NULL;
  int rc = weightd_load_group(c, ckpt, &o, &g);
  if (rc != 0) fprintf(stderr, "load_group: %s\n", weightd_last_error(c));
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(weightd_group_size(g), 2);
  char first[32] = "";
  for (size_t i = 0; i < weightd_group_size(g); i++) {
    struct weightd_group_rank r = {.struct_size = sizeof r};
    CHECK_EQ_INT(weightd_group_rank(g, i, &r), 0);
    CHECK_EQ_INT(r.rank, i);
    CHECK_EQ_INT(r.tp_rank, i);
    CHECK_EQ_INT(r.error, 0);
    CHECK(strncmp(r.device, "GPU-", 4) == 0);
    CHECK(strcmp(r.source, "host") == 0); /* no peer holds these ranks */
    CHECK(strcmp(r.method, "staged") == 0 || strcmp(r.method, "direct") == 0);
    CHECK(strcmp(r.set_id, first) != 0);
    snprintf(first, sizeof first, "%s", r.set_id);
    printf("rank %u: set %s on %s, %llu bytes in %.3f s (%s)\n", r.rank, r.set_id, r.device,
           (unsigned long long)r.bytes, r.seconds, r.method);
    CHECK_EQ_INT(verify_set(r.set_id), 0);
  }
  struct weightd_group_rank past = {.struct_size = sizeof past};
  CHECK_EQ_INT(weightd_group_rank(g, 2, &past), WEIGHTD_E_NOT_FOUND);
  weightd_group_free(g);
}

static void test_no_peer(void) {
  weightd_client *c = g_c;
  int rc;
  cJSON *st = call(c, "{\"op\":\"status\"}", &rc);
  CHECK_EQ_INT(rc, 0);
  const cJSON *topo = cJSON_GetObjectItemCaseSensitive(st, "topology");
  const cJSON *dev0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(st, "devices"), 0);
  if (ngpus == 1) {
    CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(topo, "active")));
    CHECK_EQ_INT(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(dev0, "peers")), 0);
  }
  CHECK(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(dev0, "pci_bus_id")));
  cJSON_Delete(st);
  /* Replicas and striping are on, but no peer: the load reads host memory over GPU 0's own link. */
  char req[PATH_MAX + 128];
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":0}");
  cJSON_Delete(call(c, req, &rc));
  snprintf(req, sizeof req, "{\"op\":\"load\",\"path\":\"%s\",\"device\":0}", ckpt);
  cJSON *r = call(c, req, &rc);
  CHECK_EQ_INT(rc, 0);
  const cJSON *src = cJSON_GetObjectItemCaseSensitive(r, "source");
  CHECK(cJSON_IsString(src) && strcmp(src->valuestring, "host") == 0);
  CHECK(cJSON_GetObjectItemCaseSensitive(r, "links") == NULL);
  const cJSON *method = cJSON_GetObjectItemCaseSensitive(r, "method");
  CHECK(cJSON_IsString(method) && strcmp(method->valuestring, "striped") != 0 && strcmp(method->valuestring, "peer") != 0);
  cJSON_Delete(r);
  /* A GPU that is not there: NOT_FOUND, nothing loaded, and the daemon serves on. */
  snprintf(req, sizeof req, "{\"op\":\"load\",\"path\":\"%s\",\"device\":%d}", ckpt, ngpus);
  CHECK(call(c, req, &rc) == NULL);
  CHECK_EQ_INT(rc, WEIGHTD_E_NOT_FOUND);
  snprintf(req, sizeof req, "{\"op\":\"load_group\",\"path\":\"%s\",\"group\":{\"tp_size\":2,\"devices\":[0,%d]}}",
           ckpt, ngpus);
  CHECK(call(c, req, &rc) == NULL);
  CHECK_EQ_INT(rc, WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(weightd_last_error(c), "group.devices[1]");
  cJSON_Delete(call(c, "{\"op\":\"status\"}", &rc));
  CHECK_EQ_INT(rc, 0);
}

int main(void) {
  if (cudaGetDeviceCount(&ngpus) != cudaSuccess || ngpus == 0) SKIP_ALL("no GPU");
  weightd_bin = getenv("WEIGHTD");
  weightctl_bin = getenv("WEIGHTCTL");
  if (weightd_bin == NULL || weightctl_bin == NULL) SKIP_ALL("WEIGHTD and WEIGHTCTL must name the binaries");
  printf("%d GPU(s)\n", ngpus);
  RUN(test_backend_without_peers);
  RUN(test_copy_peer_one_gpu);
  dir = fx_tmpdir("gpu-multi");
  snprintf(ckpt, sizeof ckpt, "%s/qwen3-0.6b-2l", dir);
  char *gen[] = {(char *)weightctl_bin, "mkcheckpoint", "--preset", "qwen3-0.6b", "--layers", "2", "--seed", "5",
                 "--out", ckpt, NULL};
  if (run(gen) != 0) {
    fprintf(stderr, "mkcheckpoint failed\n");
    return 1;
  }
  weightd_client *c = start_daemon();
  if (c == NULL) {
    if (daemon_pid > 0) kill(daemon_pid, SIGKILL);
    return 1;
  }
  CHECK(strcmp(weightd_backend(c), "cuda") == 0);
  g_c = c;
  RUN(test_group_on_one_gpu);
  RUN(test_no_peer);
  weightd_close(c);
  /* A clean stop: SIGTERM, exit status 0. */
  int st = -1;
  kill(daemon_pid, SIGTERM);
  waitpid(daemon_pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "weightd exited with status %d\n", st);
    return 1;
  }
  fx_rmtree(dir);
  free(dir);
  return tu_finish();
}
