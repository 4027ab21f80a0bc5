/*
 * test_client_daemon.c - libweightd against the real weightd on a private
 * socket: load, attach (twice by set, once by path: one mapping), every byte
 * of every tensor against the file, evict of a leased set, leases ended by
 * close, early attach (each tensor waited for, then compared with the file;
 * the states and the watermark), path confinement, a named socket as the
 * only one tried, a group load
 * (weightd_load_group), and a clean shutdown.
 *
 * The backend comes from argv[1] ("host" by default, "cuda" for the GPU run,
 * which reads device memory back through the dlopen'd driver). The test skips
 * (77) when $WEIGHTD does not name the daemon, or for cuda when this machine
 * has no CUDA driver or device.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_import.h"
#include "fixture.h"
#include "safetensors.h"
#include "testutil.h"
#include "weightd.h"

static const char *backend = "host";
static char dir[PATH_MAX], ckpt[PATH_MAX], sock[PATH_MAX], logpath[PATH_MAX];
static pid_t daemon_pid = -1;

static const struct fx_tensor tensors[] = {
    {"model.embed_tokens.weight", "BF16", 2, 512, 1024},
    {"model.layers.0.input_layernorm.weight", "F32", 4, 256, 0},
    {"model.layers.0.odd", "U8", 1, 1001, 0},
    {"lm_head.weight", "BF16", 2, 64, 128},
};
#define NTENSORS (sizeof tensors / sizeof tensors[0])

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void show_log(void) {
  FILE *f = fopen(logpath, "r");
  char line[512];
  while (f && fgets(line, sizeof line, f)) fprintf(stderr, "  weightd| %s", line);
  if (f) fclose(f);
}

/* Starts the daemon; 0 when it answers, -1 when it exited first or never answered. */
static int daemon_start(const char *exe) {
  daemon_pid = fork();
  if (daemon_pid == 0) {
    int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    /* Metrics off: ctest runs daemons in parallel, and they would all want the default port. */
    execl(exe, exe, "--foreground", "--backend", backend, "--socket", sock, "--model-root", dir, "--set",
          "metrics_address=", (char *)NULL);
    _exit(127);
  }
  for (int i = 0; i < 400; i++) {
    weightd_client *c = NULL;
    int rc = weightd_connect(sock, &c);
    weightd_close(c);
    if (rc == 0) return 0;
    if (waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid) {
      daemon_pid = -1;
      return -1;
    }
    sleep_ms(50);
  }
  return -1;
}

/* Compares every tensor of s with the file, byte for byte. */
static int set_matches_file(const weightd_set *s) {
  struct st_header *h = NULL;
  struct wd_error err;
  char file[PATH_MAX + 32];
  snprintf(file, sizeof file, "%s/model.safetensors", ckpt);
  if (st_header_read_path(file, "model", &h, &err) != 0) return 0;
  int fd = open(file, O_RDONLY);
  int ok = fd >= 0 && weightd_set_tensor_count(s) == NTENSORS;
  for (size_t i = 0; ok && i < h->ntensors; i++) {
    const struct st_tensor *t = &h->tensors[i];
    weightd_tensor wt = {.struct_size = sizeof wt};
    if (weightd_set_find(s, t->name, &wt) != 0 || wt.nbytes != t->end - t->begin) {
      ok = 0;
      break;
    }
    unsigned char *want = malloc(wt.nbytes), *got = malloc(wt.nbytes);
    ok = pread(fd, want, wt.nbytes, (off_t)(h->data_start + t->begin)) == (ssize_t)wt.nbytes;
    if (ok && weightd_set_memory_kind(s) == WEIGHTD_MEMORY_CUDA) {
      ok = cuimp_copy_to_host_uuid(weightd_set_device(s), got, (uint64_t)(uintptr_t)wt.data, wt.nbytes, &err) == 0;
      if (!ok) fprintf(stderr, "device read: %s\n", err.msg);
    } else if (ok) {
      memcpy(got, wt.data, wt.nbytes);
    }
    ok = ok && memcmp(want, got, wt.nbytes) == 0;
    if (!ok) fprintf(stderr, "tensor %s differs from the file\n", t->name);
    free(want);
    free(got);
  }
  if (fd >= 0) close(fd);
  st_header_free(h);
  return ok;
}

/* Leases the daemon's status reports for set_id, or -1. */
static int set_leases(weightd_client *c, const char *set_id) {
  char *reply = NULL, pat[64];
  if (weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL) != 0) return -1;
  snprintf(pat, sizeof pat, "\"set\":\"%s\"", set_id);
  const char *p = strstr(reply, pat);
  const char *l = p ? strstr(p, "\"leases\":") : NULL;
  int n = l ? atoi(l + 9) : -1;
  weightd_free(reply);
  return n;
}

static void test_load_attach_verify(void) {
  weightd_client *c = NULL, *c2 = NULL;
  CHECK_EQ_INT(weightd_connect(sock, &c), 0);
  CHECK_EQ_INT(weightd_connect(sock, &c2), 0);
  CHECK(strcmp(weightd_backend(c), backend) == 0);
  char set_id[32];
  CHECK_EQ_INT(weightd_load(c, ckpt, NULL, set_id, sizeof set_id), 0);
  printf("  loaded %s on the %s backend\n", set_id, weightd_backend(c));

  weightd_set *a = NULL, *b = NULL, *p = NULL;
  CHECK_EQ_INT(weightd_attach(c, set_id, &a), 0);
  CHECK_EQ_INT(weightd_attach(c2, set_id, &b), 0);
  struct weightd_load_options o = {.struct_size = sizeof o};
  CHECK_EQ_INT(weightd_attach_path(c, ckpt, &o, &p), 0);
  if (a && b && p) {
    int cuda = strcmp(backend, "cuda") == 0;
    CHECK_EQ_INT(weightd_set_memory_kind(a), cuda ? WEIGHTD_MEMORY_CUDA : WEIGHTD_MEMORY_HOST);
    /* The daemon runs with its defaults: GPU sets are VMM allocations (read-only where the driver allows). */
    CHECK_EQ_INT(weightd_set_handle_kind(a), cuda ? WEIGHTD_HANDLE_CUDA_VMM : WEIGHTD_HANDLE_FD);
    CHECK_EQ_INT(weightd_set_handle_kind(b), weightd_set_handle_kind(a));
    if (!cuda) CHECK_EQ_INT(weightd_set_read_only(a), 1);
    CHECK_EQ_INT(weightd_set_handle_kind(NULL), 0);
    CHECK_EQ_INT(weightd_set_read_only(NULL), 0);
    CHECK(strcmp(weightd_set_id(p), set_id) == 0);
    CHECK(weightd_set_base(a) != NULL);
    CHECK(weightd_set_base(b) == weightd_set_base(a));
    CHECK(weightd_set_base(p) == weightd_set_base(a));
    CHECK(strcmp(weightd_set_lease(a), weightd_set_lease(b)) != 0);
    CHECK(set_matches_file(a));
    CHECK_EQ_INT(set_leases(c, set_id), 3);
    CHECK_EQ_INT(weightd_evict(c, set_id), WEIGHTD_E_BUSY);
    CHECK_EQ_INT(weightd_release(a), 0);
    CHECK_EQ_INT(weightd_release(p), 0);
    CHECK_EQ_INT(set_leases(c, set_id), 1);
    CHECK(set_matches_file(b));
    /* Closing c2 ends its lease in the daemon; the set stays readable here until released. */
    weightd_close(c2);
    c2 = NULL;
    int leases = -1;
    for (int i = 0; i < 100 && (leases = set_leases(c, set_id)) != 0; i++) sleep_ms(20);
    CHECK_EQ_INT(leases, 0);
    CHECK(set_matches_file(b));
    CHECK_EQ_INT(weightd_release(b), 0);
    CHECK_EQ_INT(weightd_evict(c, set_id), 0);
    CHECK_EQ_INT(weightd_attach(c, set_id, &a), WEIGHTD_E_NOT_FOUND);
  } else {
    fprintf(stderr, "attach failed: %s\n", weightd_last_error(c));
    weightd_release(a);
    weightd_release(b);
    weightd_release(p);
  }
  weightd_close(c2);
  weightd_close(c);
}

static void test_early_attach(void) {
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(sock, &c), 0);
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"evict\",\"device\":0}", &reply, NULL, NULL), 0);
  weightd_free(reply);
  struct weightd_load_options o = {.struct_size = sizeof o, .flags = WEIGHTD_ATTACH_EARLY};
  weightd_set *s = NULL, *r = NULL;
  CHECK_EQ_INT(weightd_attach_path(c, ckpt, &o, &s), 0);
  if (s == NULL) {
    fprintf(stderr, "early attach: %s\n", weightd_last_error(c));
    weightd_close(c);
    return;
  }
  enum weightd_set_state st = weightd_set_state(s);
  CHECK(st == WEIGHTD_SET_LOADING || st == WEIGHTD_SET_READY);
  CHECK_EQ_INT(weightd_set_tensor_count(s), NTENSORS);
  uint64_t last = 0;
  for (size_t i = 0; i < weightd_set_tensor_count(s); i++) {
    weightd_tensor t = {.struct_size = sizeof t};
    CHECK_EQ_INT(weightd_set_wait_tensor(s, i, 30000), 0);
    CHECK_EQ_INT(weightd_set_tensor(s, i, &t), 0);
    uint64_t ready = weightd_set_ready_bytes(s);
    CHECK(ready >= t.offset + t.nbytes && ready >= last);
    last = ready;
  }
  CHECK_EQ_INT(weightd_set_wait(s, NULL, 30000), 0);
  CHECK_EQ_INT(weightd_set_state(s), WEIGHTD_SET_READY);
  CHECK_EQ_INT(weightd_set_ready_bytes(s), weightd_set_bytes(s));
  CHECK(strcmp(weightd_set_load_error(s), "") == 0);
  CHECK_EQ_INT(weightd_set_wait(s, "no.such.tensor", 0), WEIGHTD_E_NOT_FOUND);
  CHECK_EQ_INT(weightd_set_wait_tensor(s, NTENSORS, 0), WEIGHTD_E_NOT_FOUND);
  CHECK_EQ_INT(weightd_set_wait(s, "model.layers.0.odd", 0), 0);
  CHECK(set_matches_file(s));
  /* The same set attached the ordinary way: ready, one mapping with the early one. */
  CHECK_EQ_INT(weightd_attach(c, weightd_set_id(s), &r), 0);
  if (r != NULL) {
    CHECK_EQ_INT(weightd_set_state(r), WEIGHTD_SET_READY);
    CHECK_EQ_INT(weightd_set_wait(r, NULL, 0), 0);
    CHECK(weightd_set_base(r) == weightd_set_base(s));
    CHECK_EQ_INT(weightd_release(r), 0);
  }
  CHECK_EQ_INT(weightd_release(s), 0);
  CHECK_EQ_INT(weightd_set_state(NULL), 0);
  weightd_close(c);
}

/*
 * A second daemon whose loads the test gate (a FIFO nobody writes) holds
 * before the first window, killed while an early set of it is loading: the
 * wait must end with CLOSED and the set say FAILED. 60 s bounds the wait
 * only so that the old behaviour (waiting forever) fails instead of hanging.
 */
static void test_wait_after_daemon_death(void) {
  const char *exe = getenv("WEIGHTD");
  char gate[PATH_MAX + 16], sock2[PATH_MAX + 16], log2[PATH_MAX + 16];
  snprintf(gate, sizeof gate, "%s/gate", dir);
  snprintf(sock2, sizeof sock2, "%s/gated.sock", dir);
  snprintf(log2, sizeof log2, "%s/gated.log", dir);
  CHECK_EQ_INT(mkfifo(gate, 0600), 0);
  int writer = open(gate, O_RDWR | O_NONBLOCK | O_CLOEXEC); /* keeps the gate shut: no byte, no end of file */
  char setting[PATH_MAX + 32];
  snprintf(setting, sizeof setting, "test_load_gate=%s", gate);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log2, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    execl(exe, exe, "--foreground", "--backend", backend, "--socket", sock2, "--model-root", dir, "--set",
          "metrics_address=", "--set", setting, (char *)NULL);
    _exit(127);
  }
  weightd_client *c = NULL;
  for (int i = 0; i < 400 && weightd_connect(sock2, &c) != 0; i++) {
    weightd_close(c);
    c = NULL;
    sleep_ms(50);
  }
  CHECK(c != NULL);
  weightd_set *s = NULL;
  struct weightd_load_options o = {.struct_size = sizeof o, .flags = WEIGHTD_ATTACH_EARLY};
  if (c != NULL) CHECK_EQ_INT(weightd_attach_path(c, ckpt, &o, &s), 0);
  if (s != NULL) {
    CHECK_EQ_INT(weightd_set_state(s), WEIGHTD_SET_LOADING);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    pid = -1;
    CHECK_EQ_INT(weightd_set_wait(s, NULL, 60000), WEIGHTD_E_CLOSED);
    CHECK_EQ_INT(weightd_set_wait_tensor(s, 0, 60000), WEIGHTD_E_CLOSED);
    CHECK_EQ_INT(weightd_set_state(s), WEIGHTD_SET_FAILED);
    CHECK_STR_CONTAINS(weightd_set_load_error(s), "exited");
    CHECK_EQ_INT(weightd_release(s), 0);
  }
  weightd_close(c);
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
  }
  if (writer >= 0) close(writer);
}

static void test_errors(void) {
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(sock, &c), 0);
  CHECK_EQ_INT(weightd_open(c, "/etc"), WEIGHTD_E_PATH_DENIED);
  CHECK(weightd_last_error(c)[0] != '\0');
  CHECK_EQ_INT(weightd_attach(c, "s999999", &(weightd_set *){NULL}), WEIGHTD_E_NOT_FOUND);
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"load\",\"path\":42}", &reply, NULL, NULL), WEIGHTD_E_BAD_REQUEST);
  CHECK_STR_CONTAINS(reply, "BAD_REQUEST");
  weightd_free(reply);
  weightd_close(c);
}

/*
 * A socket named in $WEIGHTD_SOCKET where no daemon answers is the only one
 * tried, though the daemon answers on the per-user socket ($XDG_RUNTIME_DIR
 * is its directory here); without it the search reaches that daemon.
 */
static void test_named_socket_only(void) {
  char dead[PATH_MAX + 16];
  snprintf(dead, sizeof dead, "%s/no-daemon.sock", dir);
  setenv("XDG_RUNTIME_DIR", dir, 1);
  unsetenv("WEIGHTD_SOCKET");
  weightd_client *c = NULL;
  int rc = weightd_connect(NULL, &c);
  if (access("/run/weightd/weightd.sock", F_OK) != 0) {
    CHECK_EQ_INT(rc, 0);
    CHECK(strcmp(weightd_socket_path(c), sock) == 0);
  }
  weightd_close(c);
  setenv("WEIGHTD_SOCKET", dead, 1);
  CHECK_EQ_INT(weightd_connect(NULL, &c), WEIGHTD_E_CONNECT);
  CHECK_STR_CONTAINS(weightd_last_error(c), dead);
  CHECK(strstr(weightd_last_error(c), sock) == NULL);
  weightd_close(c);
  struct weightd_connect_options o = {.struct_size = sizeof o, .socket_path = dead};
  CHECK_EQ_INT(weightd_connect_opts(&o, &c), WEIGHTD_E_CONNECT);
  CHECK_STR_CONTAINS(weightd_last_error(c), dead);
  weightd_close(c);
  unsetenv("WEIGHTD_SOCKET");
  unsetenv("XDG_RUNTIME_DIR");
}

/* weightd_load_group: a group of one rank (whole tensors) on device 0, its set's bytes, and a group that cannot plan. */
static void test_group(void) {
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(sock, &c), 0);
  const char *devices[] = {"0"};
  struct weightd_group_options o = {.struct_size = sizeof o, .devices = devices, .ndevices = 1,
                                    .plan_json = "{\"preset\":\"whole\"}"};
  weightd_group *g = NULL;
  CHECK_EQ_INT(weightd_load_group(c, ckpt, &o, &g), 0);
  CHECK_EQ_INT(weightd_group_size(g), 1);
  struct weightd_group_rank r = {.struct_size = sizeof r};
  CHECK_EQ_INT(weightd_group_rank(g, 0, &r), 0);
  CHECK_EQ_INT(r.error, 0);
  CHECK(strcmp(r.source, "host") == 0 && r.set_id[0] == 's' && r.bytes > 0);
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, r.set_id, &s), 0);
  if (s != NULL) {
    CHECK(strcmp(weightd_set_device(s), r.device) == 0);
    CHECK(set_matches_file(s));
    weightd_release(s);
  }
  /* The version field decides what is written: a caller's struct one field long gets only that. */
  struct weightd_group_rank small = {.struct_size = offsetof(struct weightd_group_rank, tp_rank), .tp_rank = 77};
  CHECK_EQ_INT(weightd_group_rank(g, 0, &small), 0);
  CHECK_EQ_INT(small.tp_rank, 77);
  CHECK_EQ_INT(weightd_group_rank(g, 1, &r), WEIGHTD_E_NOT_FOUND);
  weightd_group_free(g);
  /* The whole preset has no ranks: every rank's plan fails, nothing loads, and no group comes back. */
  o.tp_size = 2;
  const char *two[] = {"0", "0"};
  o.devices = two;
  o.ndevices = 2;
  g = (weightd_group *)1;
  CHECK_EQ_INT(weightd_load_group(c, ckpt, &o, &g), WEIGHTD_E_BAD_PLAN);
  CHECK(g == NULL);
  CHECK_STR_CONTAINS(weightd_last_error(c), "rank 0 (tp_rank 0 of 2");
  o.struct_size = 0;
  CHECK_EQ_INT(weightd_load_group(c, ckpt, &o, &g), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(weightd_group_size(NULL), 0);
  weightd_group_free(NULL);
  weightd_close(c);
}

static void test_shutdown(void) {
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(sock, &c), 0);
  int rc = weightd_request(c, "{\"op\":\"shutdown\"}", NULL, NULL, NULL);
  CHECK(rc == 0 || rc == WEIGHTD_E_SHUTDOWN);
  weightd_close(c);
  int status = -1;
  for (int i = 0; i < 400 && waitpid(daemon_pid, &status, WNOHANG) == 0; i++) sleep_ms(50);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  if (!(WIFEXITED(status))) {
    kill(daemon_pid, SIGKILL);
    waitpid(daemon_pid, NULL, 0);
  }
  daemon_pid = -1;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc > 1) backend = argv[1];
  const char *exe = getenv("WEIGHTD");
  if (exe == NULL || access(exe, X_OK) != 0) SKIP_ALL("$WEIGHTD does not name the weightd binary");
  if (strcmp(backend, "cuda") == 0) {
    struct cuimp_device d;
    struct wd_error err;
    int rc = cuimp_device_find("GPU-00000000-0000-0000-0000-000000000000", &d, &err);
    if (rc == WEIGHTD_E_UNSUPPORTED || (rc != 0 && strstr(err.msg, "sees 0 CUDA devices") != NULL))
      SKIP_ALL("no CUDA driver or device here");
  }
  char *d = fx_tmpdir("client-daemon");
  snprintf(dir, sizeof dir, "%s", d);
  free(d);
  snprintf(ckpt, sizeof ckpt, "%s/tiny", dir);
  snprintf(sock, sizeof sock, "%s/weightd.sock", dir);
  snprintf(logpath, sizeof logpath, "%s/weightd.log", dir);
  mkdir(ckpt, 0755);
  char file[PATH_MAX + 32];
  snprintf(file, sizeof file, "%s/model.safetensors", ckpt);
  if (fx_write_st(file, tensors, NTENSORS) != 0) {
    fprintf(stderr, "cannot write %s\n", file);
    return 1;
  }
  if (daemon_start(exe) != 0) {
    fprintf(stderr, "weightd did not start on the %s backend\n", backend);
    show_log();
    if (daemon_pid > 0) kill(daemon_pid, SIGKILL);
    fx_rmtree(dir);
    return 1;
  }
  RUN(test_load_attach_verify);
  RUN(test_early_attach);
  RUN(test_errors);
  RUN(test_named_socket_only);
  RUN(test_group);
  RUN(test_wait_after_daemon_death);
  RUN(test_shutdown);
  if (tu_tests_failed) show_log();
  if (daemon_pid > 0) {
    kill(daemon_pid, SIGKILL);
    waitpid(daemon_pid, NULL, 0);
  }
  fx_rmtree(dir);
  return tu_finish();
}
