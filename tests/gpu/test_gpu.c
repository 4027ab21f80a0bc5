/*
 * test_gpu.c - the cuda backend end to end, on a real GPU.
 *
 *   test_gpu [vmm|legacy]      the suite, against a weightd started with
 *                              cuda_handles=vmm (the default) or legacy
 *   test_gpu --write-probe SOCKET SET   (internal: a fresh process that tries
 *                              to write an attached set; see below)
 *
 * Starts a weightd with --backend cuda on a private socket, generates a
 * checkpoint, and checks: every byte of every tensor after a staged load and
 * after a direct (pinned-resident) load, read back from the device pointers
 * libweightd hands out; attach from a second process (weightctl attach
 * --verify, which compares with the files); the handle kind the daemon was
 * configured for, and the access the driver granted the mapping (cuMemGetAccess:
 * read-only for VMM sets where libweightd says so); two weightd_client handles
 * of one process attaching one set; 1000 attach/release cycles leaving the
 * daemon's and this process's descriptor counts and the GPU's used memory as
 * they were; a process SIGKILLed while it maps a set freeing nothing under
 * another that keeps reading it; handle-kind negotiation with raw-protocol
 * clients (one that lists no kinds gets UNSUPPORTED for a VMM set, naming
 * cuda_handles); a write into a read-only VMM mapping failing in its own
 * process and leaving the bytes intact (set WD_TEST_NO_GPU_FAULT=1 to skip
 * that one: it provokes a GPU MMU fault, which the kernel log reports); and a
 * clear DEVICE_NOMEM when the GPU is full, after which the daemon keeps
 * serving; early attach of a set while it loads, staged and direct, every
 * tensor read back from the GPU as soon as libweightd says it is in place
 * (the progress page's watermark) and compared with the files. The main
 * daemon runs with pin off, so that its staged loads stay staged; two more
 * (with the same cuda_handles) check the other paths on the real device:
 * staged_strided rows (2D copies out of the pinned slots; a rank's set also
 * attached early, each tensor checked as its window's copies complete) and
 * the default pin policy (a rank's ranges registered after its first load
 * with cudaHostRegister on parts of the mappings, the next load direct with
 * its copies cut at registration boundaries), every byte read back; scrubs
 * (the kernel's digests at load taken again; with legacy handles a byte
 * written through the IPC mapping named, and the set refusing leases). Every
 * daemon runs without metrics (metrics_address=: no port shared with other
 * tests). Exits 77 (skipped) without a GPU.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "fixture.h"
#include "plan.h"
#include "testutil.h"
#include "weightd.h"
#include "wire.h"

static char *dir, sock[PATH_MAX], ckpt[PATH_MAX], moe[PATH_MAX];
static const char *weightd_bin, *weightctl_bin, *self_bin;
static const char *mode = "vmm"; /* the daemon's cuda_handles */
static enum weightd_handle_kind want_kind = WEIGHTD_HANDLE_CUDA_VMM;
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
    char setting[64];
    snprintf(setting, sizeof setting, "cuda_handles=%s", mode);
    /* No metrics: no port shared with other tests (or the other daemons here). */
    const char *argv[40] = {weightd_bin, "--foreground", "--backend", "cuda", "--socket", path, "--model-root", dir,
                            "--log-level", "debug", "--set", setting, "--set", "metrics_address=",
                            "--set", "scrub=on"};
    int n = 16;
    for (; extra != NULL && *extra != NULL && n < 39; extra++) argv[n++] = *extra;
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
static void verify_plan_waiting(weightd_set *s, const struct ckpt *c, const char *spec_json, int wait_each);

static void verify_plan(weightd_set *s, const struct ckpt *c, const char *spec_json) {
  verify_plan_waiting(s, c, spec_json, 0);
}

/* verify_plan; wait_each: first waits for each tensor to be in place (an early attach), in slab order. */
static void verify_plan_waiting(weightd_set *s, const struct ckpt *c, const char *spec_json, int wait_each) {
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
    weightd_tensor t = {.struct_size = sizeof t};
    CHECK_EQ_INT(weightd_set_tensor(s, i, &t), 0);
    const struct plan_output *o = NULL;
    for (size_t k = 0; k < p->noutputs; k++)
      if (strcmp(p->outputs[k].name, t.name) == 0) o = &p->outputs[k];
    CHECK(o != NULL);
    if (o == NULL) continue;
    CHECK_EQ_INT(t.nbytes, o->nbytes);
    CHECK_EQ_INT(t.offset % 256, 0);
    if (wait_each) {
      int rc = weightd_set_wait_tensor(s, i, 120000);
      CHECK_EQ_INT(rc, 0);
      CHECK(weightd_set_ready_bytes(s) >= t.offset + t.nbytes);
      if (rc != 0) break;
    }
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

/* Descriptors open in process pid (0: this one). */
static int fd_count(pid_t pid) {
  char path[64];
  if (pid == 0) snprintf(path, sizeof path, "/proc/self/fd");
  else snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - (pid == 0); /* not the one opendir holds */
}

/* Device memory in use on the current device, by every process. */
static uint64_t gpu_used(void) {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return 0;
  return (uint64_t)(total_b - free_b);
}

/* The status reply's text (free it). */
static char *status_text(weightd_client *c) {
  char *reply = NULL;
  if (weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL) != 0) {
    weightd_free(reply);
    return NULL;
  }
  return reply;
}

static int wait_leases(weightd_client *c, int want) {
  int leases = -1;
  for (int i = 0; i < 500 && (leases = count_leases(c)) != want; i++) usleep(20000);
  return leases;
}

static const char *kind_name(enum weightd_handle_kind k) {
  return k == WEIGHTD_HANDLE_CUDA_VMM ? "cuda_vmm" : k == WEIGHTD_HANDLE_CUDA_IPC ? "cuda_ipc" : "fd";
}

/* Loads and attaches the whole checkpoint; NULL (with the reason printed) on failure. */
static weightd_set *attach_whole(weightd_client *c) {
  weightd_set *s = NULL;
  int rc = weightd_attach_path(c, ckpt, NULL, &s);
  CHECK_EQ_INT(rc, 0);
  if (rc != 0) fprintf(stderr, "attach: %s\n", weightd_last_error(c));
  return s;
}

static void release_and_evict(weightd_client *c, weightd_set *s) {
  char id[32];
  snprintf(id, sizeof id, "%s", weightd_set_id(s));
  CHECK_EQ_INT(weightd_release(s), 0);
  CHECK_EQ_INT(weightd_evict(c, id), 0);
}

static void test_load_attach_every_byte(void) {
  weightd_set *s = attach_whole(g_c);
  if (s == NULL) return;
  verify_set(s, g_ck);
  /* A second process attaches the same set and checks every byte against the files itself. */
  char *argv[] = {(char *)weightctl_bin, "--socket", sock, "attach", (char *)weightd_set_id(s), "--verify", NULL};
  CHECK_EQ_INT(run_cmd(argv), 0);
  CHECK_EQ_INT(count_leases(g_c), 1);
  release_and_evict(g_c, s);
}

/*
 * The kind the daemon was told to use, and what the driver granted this
 * process's mapping: read-only VMM mappings are asked of the driver and
 * confirmed here independently with cuMemGetAccess.
 */
static void test_handle_kind_and_access(void) {
  weightd_set *s = attach_whole(g_c);
  if (s == NULL) return;
  CHECK_EQ_INT(weightd_set_handle_kind(s), want_kind);
  CHECK_EQ_INT(weightd_set_memory_kind(s), WEIGHTD_MEMORY_CUDA);
  char *st = status_text(g_c);
  char want[64];
  snprintf(want, sizeof want, "\"handles\":\"%s\"", kind_name(want_kind));
  CHECK_STR_CONTAINS(st, want); /* the device and the set both say so */
  weightd_free(st);
  if (want_kind == WEIGHTD_HANDLE_CUDA_IPC) {
    CHECK_EQ_INT(weightd_set_read_only(s), 0); /* legacy IPC mappings are writable */
  } else {
    PFN_cuMemGetAccess_v10020 get_access = NULL;
    PFN_cuDeviceGet_v2000 device_get = NULL;
    enum cudaDriverEntryPointQueryResult q1 = cudaDriverEntryPointSymbolNotFound, q2 = q1;
    CHECK_EQ_INT(cudaGetDriverEntryPointByVersion("cuMemGetAccess", (void **)&get_access, 12000, cudaEnableDefault, &q1),
                 cudaSuccess);
    CHECK_EQ_INT(cudaGetDriverEntryPointByVersion("cuDeviceGet", (void **)&device_get, 12000, cudaEnableDefault, &q2),
                 cudaSuccess);
    struct cudaPointerAttributes pa;
    CHECK_EQ_INT(cudaPointerGetAttributes(&pa, weightd_set_base(s)), cudaSuccess);
    CHECK_EQ_INT(pa.type, cudaMemoryTypeDevice);
    if (get_access != NULL && device_get != NULL) {
      CUdevice dev = 0;
      CHECK_EQ_INT(device_get(&dev, pa.device), CUDA_SUCCESS);
      CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev};
      unsigned long long flags = 0;
      CHECK_EQ_INT(get_access(&flags, &loc, (CUdeviceptr)(uintptr_t)weightd_set_base(s)), CUDA_SUCCESS);
      CHECK_EQ_INT(flags, weightd_set_read_only(s) ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
      printf("  cuda_vmm mapping: %s (cuMemGetAccess flags %llu)\n",
             weightd_set_read_only(s) ? "read-only" : "read-write: this driver refused a read-only mapping", flags);
    }
  }
  release_and_evict(g_c, s);
}

/* Two weightd_client handles of one process attach one set: both map it (one mapping), same bytes. */
static void test_two_handles_one_process(void) {
  weightd_client *c2 = NULL;
  CHECK_EQ_INT(weightd_connect(sock, &c2), 0);
  weightd_set *a = attach_whole(g_c), *b = NULL;
  if (a == NULL || c2 == NULL) goto out;
  CHECK_EQ_INT(weightd_attach(c2, weightd_set_id(a), &b), 0);
  if (b == NULL) goto out;
  CHECK(strcmp(weightd_set_lease(a), weightd_set_lease(b)) != 0);
  CHECK(weightd_set_base(a) == weightd_set_base(b));
  CHECK_EQ_INT(weightd_set_handle_kind(b), want_kind);
  CHECK_EQ_INT(count_leases(g_c), 2);
  verify_set(b, g_ck);
  /* The first release leaves the mapping to the other; the other still reads every byte. */
  CHECK_EQ_INT(weightd_release(a), 0);
  a = NULL;
  verify_set(b, g_ck);
  char id[32];
  snprintf(id, sizeof id, "%s", weightd_set_id(b));
  CHECK_EQ_INT(weightd_release(b), 0);
  b = NULL;
  /* Mapped again from scratch after both are gone. */
  CHECK_EQ_INT(weightd_attach(c2, id, &b), 0);
  if (b != NULL) verify_set(b, g_ck);
out:
  if (a != NULL) weightd_release(a);
  if (b != NULL) release_and_evict(c2, b);
  weightd_close(c2);
  CHECK_EQ_INT(wait_leases(g_c, 0), 0);
}

/* One attach and release of set_id, reading the first bytes of its first tensor into out[n]; 0 or -1. */
static int attach_cycle(const char *set_id, unsigned char *out, size_t *n) {
  weightd_set *s = NULL;
  if (weightd_attach(g_c, set_id, &s) != 0) {
    fprintf(stderr, "attach: %s\n", weightd_last_error(g_c));
    return -1;
  }
  weightd_tensor t = {.struct_size = sizeof t};
  int rc = weightd_set_tensor(s, 0, &t) == 0 ? 0 : -1;
  *n = rc == 0 && t.nbytes < *n ? (size_t)t.nbytes : *n;
  if (rc == 0 && cudaMemcpy(out, t.data, *n, cudaMemcpyDeviceToHost) != cudaSuccess) rc = -1;
  if (weightd_release(s) != 0) {
    fprintf(stderr, "release: %s\n", weightd_last_error(g_c));
    rc = -1;
  }
  return rc;
}

/* 1000 attach/release cycles: nothing accumulates in the daemon, in this process or on the GPU. */
static void test_leak_cycles(void) {
  enum { CYCLES = 1000, WARMUP = 5 };
  char set_id[32];
  if (weightd_load(g_c, ckpt, NULL, set_id, sizeof set_id) != 0) {
    CHECK(!"load");
    return;
  }
  unsigned char first[64], again[64];
  size_t n = sizeof first;
  int ok = 1;
  /* Warm up first: the driver sets up per-process state on the first mappings. */
  for (int i = 0; i < WARMUP && ok; i++) ok = attach_cycle(set_id, first, &n) == 0;
  CHECK_EQ_INT(count_leases(g_c), 0);
  /* Connections earlier tests closed may still be open on the daemon's side for a moment. */
  int conns = -1;
  for (int i = 0; i < 500 && conns != 1; i++) {
    char *st = status_text(g_c);
    const char *p = st ? strstr(st, "\"connections\":") : NULL;
    conns = p ? atoi(p + 14) : -1;
    weightd_free(st);
    if (conns != 1) usleep(20000);
  }
  CHECK_EQ_INT(conns, 1);
  int daemon_fds = fd_count(daemon_pid), own_fds = fd_count(0);
  uint64_t used = gpu_used();
  for (int i = 0; i < CYCLES && ok; i++) {
    size_t m = n;
    ok = attach_cycle(set_id, again, &m) == 0 && m == n && memcmp(first, again, n) == 0;
    if (!ok) fprintf(stderr, "cycle %d failed, or the set's first bytes changed\n", i);
  }
  CHECK(ok);
  int dfds = fd_count(daemon_pid), ofds = fd_count(0);
  uint64_t u = gpu_used();
  printf("  %d cycles: daemon fds %d -> %d, own fds %d -> %d, GPU used %llu -> %llu MiB\n", CYCLES, daemon_fds, dfds,
         own_fds, ofds, (unsigned long long)(used >> 20), (unsigned long long)(u >> 20));
  CHECK(daemon_fds > 0);
  CHECK_EQ_INT(dfds, daemon_fds);
  CHECK_EQ_INT(ofds, own_fds);
  /*
   * cudaMemGetInfo counts in 2 MiB pages; a mapping or allocation leaked per
   * cycle would show as GiBs. Only growth counts: memory earlier tests evicted
   * may still be in the driver's background scrub when the baseline is taken.
   */
  CHECK(u <= used + (2u << 20));
  CHECK_EQ_INT(count_leases(g_c), 0);
  CHECK_EQ_INT(weightd_evict(g_c, set_id), 0);
}

/* A process SIGKILLed while it maps a set frees nothing under another that keeps reading it. */
static void test_sigkill_while_mapped(void) {
  weightd_set *s = attach_whole(g_c);
  if (s == NULL) return;
  char *hold[] = {(char *)weightctl_bin, "--socket", sock, "attach", (char *)weightd_set_id(s), "--hold", NULL};
  pid_t p = spawn(hold);
  CHECK_EQ_INT(wait_leases(g_c, 2), 2);
  kill(p, SIGKILL);
  waitpid(p, NULL, 0);
  CHECK_EQ_INT(wait_leases(g_c, 1), 1);
  verify_set(s, g_ck); /* every byte, through this process's own mapping */
  char *st = status_text(g_c);
  char want[48];
  snprintf(want, sizeof want, "\"set\":\"%s\"", weightd_set_id(s));
  CHECK_STR_CONTAINS(st, want);
  weightd_free(st);
  /* And a new process still maps and verifies it. */
  char *verify[] = {(char *)weightctl_bin, "--socket", sock, "attach", (char *)weightd_set_id(s), "--verify", NULL};
  CHECK_EQ_INT(run_cmd(verify), 0);
  release_and_evict(g_c, s);
}

/* ---- raw-protocol clients: handle-kind negotiation --------------------------------------- */

/* Connects and says hello, with "handles": handles_json when it is not NULL; -1 on failure. */
static int raw_connect(const char *handles_json) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  char hello[256];
  snprintf(hello, sizeof hello, "{\"op\":\"hello\",\"id\":1,\"protocol\":1%s%s}", handles_json ? ",\"handles\":" : "",
           handles_json ? handles_json : "");
  struct wd_error err = {0};
  struct wire_frame f = {0};
  if (wire_send_frame(fd, hello, strlen(hello), NULL, 0, &err) != 0 || wire_recv_frame(fd, 30000, &f, &err) != 0 ||
      strstr(f.json, "\"ok\":true") == NULL) {
    wire_frame_clear(&f);
    close(fd);
    return -1;
  }
  wire_frame_clear(&f);
  return fd;
}

/* Sends one request and returns its final reply's text (free it); *nfds: descriptors that came (closed). */
static char *raw_call(int fd, const char *json, size_t *nfds) {
  struct wd_error err = {0};
  *nfds = 0;
  if (wire_send_frame(fd, json, strlen(json), NULL, 0, &err) != 0) return NULL;
  for (;;) {
    struct wire_frame f = {0};
    if (wire_recv_frame(fd, 60000, &f, &err) != 0) return NULL;
    if (strstr(f.json, "\"event\"") != NULL) {
      wire_frame_clear(&f);
      continue;
    }
    char *text = strdup(f.json);
    *nfds = f.nfds;
    wire_frame_clear(&f);
    return text;
  }
}

/*
 * What a client that lists no kinds (every libweightd before cuda_vmm) gets:
 * UNSUPPORTED for a VMM set, naming the setting, and no lease; a legacy set as
 * before. A client that lists only the other CUDA kind is refused the same way.
 */
static void test_negotiation_raw_clients(void) {
  char set_id[32], req[96];
  if (weightd_load(g_c, ckpt, NULL, set_id, sizeof set_id) != 0) {
    CHECK(!"load");
    return;
  }
  snprintf(req, sizeof req, "{\"op\":\"attach\",\"id\":2,\"set\":\"%s\"}", set_id);
  int old = raw_connect(NULL);
  const char *other = want_kind == WEIGHTD_HANDLE_CUDA_VMM ? "[\"fd\",\"cuda_ipc\"]" : "[\"fd\",\"cuda_vmm\"]";
  int picky = raw_connect(other);
  int current = raw_connect("[\"fd\",\"cuda_ipc\",\"cuda_vmm\",\"some_future_kind\"]");
  CHECK(old >= 0 && picky >= 0 && current >= 0);
  size_t nfds = 0;
  char *r = old >= 0 ? raw_call(old, req, &nfds) : NULL;
  if (want_kind == WEIGHTD_HANDLE_CUDA_VMM) {
    CHECK_STR_CONTAINS(r, "\"code\":\"UNSUPPORTED\"");
    CHECK_STR_CONTAINS(r, "cuda_vmm");
    CHECK_STR_CONTAINS(r, "\\\"cuda_handles\\\": \\\"legacy\\\"");
    CHECK_EQ_INT(nfds, 0);
  } else {
    CHECK_STR_CONTAINS(r, "\"kind\":\"cuda_ipc\"");
  }
  free(r);
  r = picky >= 0 ? raw_call(picky, req, &nfds) : NULL;
  CHECK_STR_CONTAINS(r, "\"code\":\"UNSUPPORTED\"");
  CHECK_STR_CONTAINS(r, want_kind == WEIGHTD_HANDLE_CUDA_VMM ? "\"legacy\\\"" : "\"vmm\\\"");
  CHECK_EQ_INT(nfds, 0);
  free(r);
  r = current >= 0 ? raw_call(current, req, &nfds) : NULL;
  CHECK_STR_CONTAINS(r, want_kind == WEIGHTD_HANDLE_CUDA_VMM ? "\"kind\":\"cuda_vmm\"" : "\"kind\":\"cuda_ipc\"");
  CHECK_EQ_INT(nfds, want_kind == WEIGHTD_HANDLE_CUDA_VMM ? 1 : 0);
  free(r);
  /* Only the accepted attaches hold a lease: the current client's, and the old one's for a legacy set. */
  CHECK_EQ_INT(count_leases(g_c), want_kind == WEIGHTD_HANDLE_CUDA_VMM ? 1 : 2);
  if (old >= 0) close(old);
  if (picky >= 0) close(picky);
  if (current >= 0) close(current);
  CHECK_EQ_INT(wait_leases(g_c, 0), 0);
  CHECK_EQ_INT(weightd_evict(g_c, set_id), 0);
}

/* ---- writes into a read-only VMM mapping ------------------------------------------------ */

/*
 * The probe process: attaches set, tries to overwrite its first 4 KiB with the
 * GPU. Exits 0 when the write failed, 2 when it went through, 77 when this
 * driver mapped the set read-write (nothing to test), 1 on other failures.
 */
static int write_probe(const char *socket_path, const char *set_id) {
  weightd_client *c = NULL;
  weightd_set *s = NULL;
  if (weightd_connect(socket_path, &c) != 0 || weightd_attach(c, set_id, &s) != 0) {
    fprintf(stderr, "write probe: %s\n", weightd_last_error(c));
    _exit(1);
  }
  if (!weightd_set_read_only(s)) _exit(77);
  cudaError_t e = cudaMemset(weightd_set_base(s), 0xab, 4096);
  cudaError_t e2 = cudaDeviceSynchronize();
  printf("write probe: cudaMemset %s, synchronize %s\n", cudaGetErrorName(e), cudaGetErrorName(e2));
  fflush(stdout);
  _exit(e == cudaSuccess && e2 == cudaSuccess ? 2 : 0); /* the daemon ends the lease when the socket closes */
}

static void test_read_only_write_refused(void) {
  if (want_kind != WEIGHTD_HANDLE_CUDA_VMM) return;
  if (getenv("WD_TEST_NO_GPU_FAULT") != NULL) {
    printf("  skipped: WD_TEST_NO_GPU_FAULT is set\n");
    return;
  }
  /* A set of its own (another plan), so that a write that went through spoils no other test. */
  static const char *const spec = "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}";
  struct weightd_load_options o = {sizeof o, NULL, spec, NULL, NULL};
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach_path(g_c, ckpt, &o, &s), 0);
  if (s == NULL) return;
  char *probe[] = {(char *)self_bin, "--write-probe", sock, (char *)weightd_set_id(s), NULL};
  int rc = run_cmd(probe);
  if (rc == 77) printf("  this driver maps VMM sets read-write: no write to refuse\n");
  else CHECK_EQ_INT(rc, 0);
  verify_plan(s, g_ck, spec); /* not one byte changed */
  CHECK_EQ_INT(wait_leases(g_c, 1), 1);
  release_and_evict(g_c, s);
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

/*
 * Early attach: the set is attached while it loads (evicted first, so the
 * load starts with the attach), each tensor read back as soon as it is
 * reported in place; method is the load's ("staged" or "direct").
 */
static void early_attach_plan(weightd_client *c, const char *spec, const char *method) {
  char req[64];
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":0}");
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, req, &reply, NULL, NULL), 0);
  weightd_free(reply);
  struct weightd_load_options o = {.struct_size = sizeof o, .plan_json = spec, .flags = WEIGHTD_ATTACH_EARLY};
  weightd_set *s = NULL;
  int rc = weightd_attach_path(c, ckpt, &o, &s);
  CHECK_EQ_INT(rc, 0);
  if (s == NULL) {
    fprintf(stderr, "early attach: %s\n", weightd_last_error(c));
    return;
  }
  enum weightd_set_state st = weightd_set_state(s);
  printf("  early attach (%s): state %d, %llu of %llu bytes in place at attach\n", method, (int)st,
         (unsigned long long)weightd_set_ready_bytes(s), (unsigned long long)weightd_set_bytes(s));
  CHECK(st == WEIGHTD_SET_LOADING || st == WEIGHTD_SET_READY);
  verify_plan_waiting(s, g_ck, spec, 1);
  CHECK_EQ_INT(weightd_set_wait(s, NULL, 120000), 0);
  CHECK_EQ_INT(weightd_set_state(s), WEIGHTD_SET_READY);
  reply = NULL;
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL), 0);
  char want[64];
  snprintf(want, sizeof want, "\"method\":\"%s\"", method);
  CHECK_STR_CONTAINS(reply, want);
  weightd_free(reply);
  release_and_evict(c, s);
}

static void test_early_attach_direct(void) { early_attach_plan(g_c, NULL, "direct"); }
static void test_early_attach_staged(void) { early_attach_plan(g_c, NULL, "staged"); }

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
  CHECK_STR_CONTAINS(weightd_last_error(c), want_kind == WEIGHTD_HANDLE_CUDA_VMM ? "cuMemCreate" : "cudaMalloc");
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
  /* Early attach of a rank whose column slices go as whole rows: the watermark per completed window. */
  if (c != NULL) early_attach_plan(c, specs[0], "staged");
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

/* ---- scrubs ----------------------------------------------------------------------------------- */

/* The scrub op's reply for set id (malloc'd JSON text), or NULL after a failed check. */
static char *scrub_reply(const char *id) {
  char req[128], *reply = NULL;
  snprintf(req, sizeof req, "{\"op\":\"scrub\",\"set\":\"%s\"}", id);
  int rc = weightd_request(g_c, req, &reply, NULL, NULL);
  CHECK_EQ_INT(rc, 0);
  return rc == 0 ? reply : NULL;
}

/*
 * The scrub kernel on the real device: a set scrubs clean after its load
 * (the digests the kernel took after the copies, taken again); with legacy
 * handles, one byte written through this process's writable IPC mapping is
 * named by the next scrub (the op, and weightctl scrub's exit 1); the holder
 * sees the corrupt flag, the set is retired (attach by id: NOT_FOUND) and an
 * attach by path gets the new set loaded in its place, every byte right.
 */
static void test_scrub(void) {
  static const char *const spec = "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":0}";
  struct weightd_load_options o = {sizeof o, NULL, spec, NULL, NULL};
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach_path(g_c, ckpt, &o, &s), 0);
  if (s == NULL) return;
  char id[32];
  snprintf(id, sizeof id, "%s", weightd_set_id(s));
  char *r = scrub_reply(id);
  CHECK_STR_CONTAINS(r, "\"clean\":true");
  weightd_free(r);
  char *clean[] = {(char *)weightctl_bin, "--socket", sock, "scrub", id, NULL};
  CHECK_EQ_INT(run_cmd(clean), 0);
  if (want_kind != WEIGHTD_HANDLE_CUDA_IPC) { /* libweightd maps VMM sets read-only: no write to make */
    release_and_evict(g_c, s);
    return;
  }
  weightd_tensor t = {.struct_size = sizeof t};
  CHECK_EQ_INT(weightd_set_tensor(s, weightd_set_tensor_count(s) / 2, &t), 0);
  unsigned char b = 0;
  CHECK_EQ_INT(cudaMemcpy(&b, (char *)t.data + t.nbytes - 1, 1, cudaMemcpyDeviceToHost), cudaSuccess);
  b ^= 0x40;
  CHECK_EQ_INT(cudaMemcpy((char *)t.data + t.nbytes - 1, &b, 1, cudaMemcpyHostToDevice), cudaSuccess);
  r = scrub_reply(id);
  CHECK_STR_CONTAINS(r, "\"clean\":false");
  char want[256];
  snprintf(want, sizeof want, "\"tensor\":\"%s\"", t.name);
  CHECK_STR_CONTAINS(r, want);
  weightd_free(r);
  CHECK_EQ_INT(run_cmd(clean), 1);
  /* The holder is told on its page; the set is retired (scrub_reload on) and loaded again as a new one. */
  CHECK_EQ_INT(weightd_set_corrupt(s), 1);
  weightd_set *again = NULL;
  CHECK_EQ_INT(weightd_attach(g_c, id, &again), WEIGHTD_E_NOT_FOUND);
  weightd_set *fresh = NULL;
  CHECK_EQ_INT(weightd_attach_path(g_c, ckpt, &o, &fresh), 0);
  if (fresh != NULL) {
    CHECK(strcmp(weightd_set_id(fresh), id) != 0);
    CHECK_EQ_INT(weightd_set_corrupt(fresh), 0);
    verify_plan(fresh, g_ck, spec); /* every byte against the files again */
    r = scrub_reply(weightd_set_id(fresh));
    CHECK_STR_CONTAINS(r, "\"clean\":true");
    weightd_free(r);
    release_and_evict(g_c, fresh);
  }
  CHECK_EQ_INT(weightd_release(s), 0); /* the retired set's memory goes with its last lease */
}

int main(int argc, char **argv) {
  self_bin = argv[0];
  if (argc == 4 && strcmp(argv[1], "--write-probe") == 0) return write_probe(argv[2], argv[3]);
  if (argc > 1) mode = argv[1];
  if (strcmp(mode, "vmm") != 0 && strcmp(mode, "legacy") != 0) {
    fprintf(stderr, "usage: test_gpu [vmm|legacy]\n");
    return 2;
  }
  want_kind = strcmp(mode, "legacy") == 0 ? WEIGHTD_HANDLE_CUDA_IPC : WEIGHTD_HANDLE_CUDA_VMM;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) SKIP_ALL("no GPU");
  weightd_bin = getenv("WEIGHTD");
  weightctl_bin = getenv("WEIGHTCTL");
  if (weightd_bin == NULL || weightctl_bin == NULL) SKIP_ALL("WEIGHTD and WEIGHTCTL must name the binaries");
  printf("daemon with cuda_handles=%s\n", mode);
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
  RUN(test_handle_kind_and_access);
  RUN(test_two_handles_one_process);
  RUN(test_leak_cycles);
  RUN(test_sigkill_while_mapped);
  RUN(test_negotiation_raw_clients);
  RUN(test_out_of_memory);
  RUN(test_pinned_direct);
  RUN(test_rank_layouts); /* direct (the checkpoint is pinned now) */
  RUN(test_early_attach_direct);
  char req[PATH_MAX + 64];
  snprintf(req, sizeof req, "{\"op\":\"close\",\"path\":\"%s\"}", ckpt);
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, req, &reply, NULL, NULL), 0); /* unpins */
  weightd_free(reply);
  RUN(test_rank_layouts); /* staged */
  RUN(test_early_attach_staged);
  RUN(test_moe_layouts);
  RUN(test_staged_rows);
  RUN(test_pin_after_load);
  RUN(test_scrub);
  RUN(test_read_only_write_refused); /* last: it makes a GPU fault in a process of its own */
  weightd_close(c);
  stop_daemon();
  ckpt_free(ck);
  fx_rmtree(dir);
  return tu_finish();
}
