/*
 * test_client.c - libweightd against a fake daemon that speaks the documented
 * frames on a private socket: the socket search, hello and VERSION, error
 * mapping, progress events among stray frames, attach with a sealed memfd
 * over SCM_RIGHTS, the process-wide mapping cache (two attaches, one mmap,
 * one base), release and unmap, timeouts, the shutdown event, close
 * semantics and fork.
 *
 * DESIGN: the fake daemon is one accept thread plus one thread per
 * connection; they share struct fake (its lock guards the counters the tests
 * read). Every test starts its own fake and stops it after closing its
 * clients, so each connection thread has ended when it is joined.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fixture.h"
#include "testutil.h"
#include "weightd.h"
#include "wire.h"

/* ---- the fake daemon -------------------------------------------------------------- */

enum fake_mode {
  FAKE_NORMAL,
  FAKE_VERSION, /* hello answers VERSION */
  FAKE_REFUSE,  /* every connection gets an id-less PERMISSION error and is closed */
};

#define SLAB_BYTES (4u * 4096u)
#define MAX_CONNS 16

struct fake {
  char dir[PATH_MAX];
  char sock_path[PATH_MAX];
  int listen_fd;
  int slab_fd;      /* sealed memfd holding the set's bytes */
  int unsealed_fd;  /* a memfd without seals */
  enum fake_mode mode;
  pthread_t accept_thread;
  pthread_t conns[MAX_CONNS];
  int nconns;
  int stop;
  pthread_mutex_t lock;
  int leases;              /* leases granted */
  int releases;            /* release requests */
  char last_released[32];
  char last_path[PATH_MAX];   /* "path" of the last request that had one */
  char last_device[64];
  char hello_handles[128]; /* the "handles" list of the last hello, as JSON ("" when absent) */
  int cancels;
  int release_delay_ms;    /* how long release waits before it answers */
};

static unsigned char slab_byte(size_t i) { return (unsigned char)((i * 7u + 3u) & 0xFF); }

static int make_memfd(int seal) {
  int fd = memfd_create("wd-test-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  unsigned char *buf = malloc(SLAB_BYTES);
  for (size_t i = 0; i < SLAB_BYTES; i++) buf[i] = slab_byte(i);
  ssize_t w = write(fd, buf, SLAB_BYTES);
  free(buf);
  if (w != (ssize_t)SLAB_BYTES) return -1;
  if (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) return -1;
  return fd;
}

static void send_json(int fd, cJSON *o, const int *fds, size_t nfds) {
  char *text = cJSON_PrintUnformatted(o);
  struct wd_error e;
  wire_send_frame(fd, text, strlen(text), fds, nfds, &e);
  free(text);
  cJSON_Delete(o);
}

static cJSON *reply_ok(const cJSON *req) {
  cJSON *o = cJSON_CreateObject();
  const cJSON *id = cJSON_GetObjectItemCaseSensitive(req, "id");
  if (id) cJSON_AddItemToObject(o, "id", cJSON_Duplicate(id, 1));
  cJSON_AddTrueToObject(o, "ok");
  return o;
}

static cJSON *reply_err(const cJSON *req, const char *code, const char *message) {
  cJSON *o = cJSON_CreateObject();
  const cJSON *id = req ? cJSON_GetObjectItemCaseSensitive(req, "id") : NULL;
  if (id) cJSON_AddItemToObject(o, "id", cJSON_Duplicate(id, 1));
  cJSON *e = cJSON_AddObjectToObject(o, "error");
  cJSON_AddStringToObject(e, "code", code);
  cJSON_AddStringToObject(e, "message", message);
  return o;
}

/* The attach reply: set s1 (or the named one), three tensors, one handle. */
static cJSON *attach_reply(struct fake *f, const cJSON *req, const char *set, const char *kind) {
  cJSON *o = reply_ok(req);
  pthread_mutex_lock(&f->lock);
  char lease[32];
  snprintf(lease, sizeof lease, "l%d", ++f->leases);
  pthread_mutex_unlock(&f->lock);
  cJSON_AddStringToObject(o, "set", set);
  cJSON_AddStringToObject(o, "lease", lease);
  cJSON_AddStringToObject(o, "device", strcmp(kind, "fd") == 0 ? "host-test" : "GPU-00000000-1111-2222-3333-444444444444");
  cJSON_AddNumberToObject(o, "bytes", SLAB_BYTES);
  cJSON *hs = cJSON_AddArrayToObject(o, "handles");
  cJSON *h = cJSON_CreateObject();
  cJSON_AddStringToObject(h, "kind", kind);
  if (strcmp(kind, "fd") == 0) {
    cJSON_AddNumberToObject(h, "fd_index", 0);
  } else if (strncmp(kind, "cuda_vmm", 8) == 0) {
    cJSON_ReplaceItemInObjectCaseSensitive(h, "kind", cJSON_CreateString("cuda_vmm"));
    cJSON_AddNumberToObject(h, "fd_index", 0);
    /* "cuda_vmm/badid": an alloc_id that is not 32 hex digits. */
    cJSON_AddStringToObject(h, "alloc_id", strcmp(kind, "cuda_vmm") == 0 ? "00112233445566778899aabbccddeeff" : "0011");
  } else {
    char hex[129];
    for (int i = 0; i < 128; i++) hex[i] = "0123456789abcdef"[i % 16];
    hex[128] = '\0';
    cJSON_AddStringToObject(h, "handle", hex);
  }
  cJSON_AddNumberToObject(h, "bytes", SLAB_BYTES);
  cJSON_AddItemToArray(hs, h);
  cJSON *ts = cJSON_AddArrayToObject(o, "tensors");
  const struct {
    const char *name, *dtype;
    int rows, cols;
    unsigned offset, nbytes;
  } tab[] = {
      {"model.embed_tokens.weight", "BF16", 16, 64, 0, 2048},
      {"model.norm.weight", "F32", 64, 0, 2048, 256},
      {"lm_head.weight", "BF16", 32, 64, 4096, 4096},
  };
  for (size_t i = 0; i < 3; i++) {
    cJSON *t = cJSON_CreateObject();
    cJSON_AddStringToObject(t, "name", tab[i].name);
    cJSON_AddStringToObject(t, "dtype", tab[i].dtype);
    cJSON *shape = cJSON_AddArrayToObject(t, "shape");
    cJSON_AddItemToArray(shape, cJSON_CreateNumber(tab[i].rows));
    if (tab[i].cols) cJSON_AddItemToArray(shape, cJSON_CreateNumber(tab[i].cols));
    cJSON_AddNumberToObject(t, "offset", tab[i].offset);
    cJSON_AddNumberToObject(t, "nbytes", tab[i].nbytes);
    cJSON_AddItemToArray(ts, t);
  }
  return o;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

struct conn_arg {
  struct fake *f;
  int fd;
};

/* Answers one request; returns 0 to go on, -1 to close the connection. */
static int handle(struct fake *f, int fd, const cJSON *req) {
  const cJSON *opj = cJSON_GetObjectItemCaseSensitive(req, "op");
  const char *op = cJSON_IsString(opj) ? opj->valuestring : "";
  const cJSON *path = cJSON_GetObjectItemCaseSensitive(req, "path");
  const cJSON *dev = cJSON_GetObjectItemCaseSensitive(req, "device");
  pthread_mutex_lock(&f->lock);
  if (cJSON_IsString(path)) snprintf(f->last_path, sizeof f->last_path, "%s", path->valuestring);
  if (cJSON_IsString(dev)) snprintf(f->last_device, sizeof f->last_device, "%s", dev->valuestring);
  else if (cJSON_IsNumber(dev)) snprintf(f->last_device, sizeof f->last_device, "#%d", dev->valueint);
  pthread_mutex_unlock(&f->lock);

  if (strcmp(op, "hello") == 0) {
    const cJSON *proto = cJSON_GetObjectItemCaseSensitive(req, "protocol");
    char *handles = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(req, "handles"));
    pthread_mutex_lock(&f->lock);
    snprintf(f->hello_handles, sizeof f->hello_handles, "%s", handles ? handles : "");
    pthread_mutex_unlock(&f->lock);
    free(handles);
    if (f->mode == FAKE_VERSION || !cJSON_IsNumber(proto) || proto->valueint != 1) {
      send_json(fd, reply_err(req, "VERSION", "this daemon speaks protocol 7 only"), NULL, 0);
      return -1;
    }
    cJSON *o = reply_ok(req);
    cJSON_AddNumberToObject(o, "protocol", 1);
    cJSON_AddStringToObject(o, "version", "0.1.0");
    cJSON_AddStringToObject(o, "backend", "host");
    cJSON_AddNumberToObject(o, "pid", getpid());
    cJSON_AddArrayToObject(o, "devices");
    send_json(fd, o, NULL, 0);
  } else if (strcmp(op, "open") == 0) {
    if (cJSON_IsString(path) && strcmp(path->valuestring, "/denied") == 0) {
      send_json(fd, reply_err(req, "PATH_DENIED", "/denied resolves outside the model roots"), NULL, 0);
    } else {
      cJSON *o = reply_ok(req);
      cJSON_AddObjectToObject(o, "checkpoint");
      send_json(fd, o, NULL, 0);
    }
  } else if (strcmp(op, "load") == 0 && cJSON_IsString(path) && strcmp(path->valuestring, "/slow") == 0) {
    sleep_ms(400);
    send_json(fd, reply_err(req, "CANCELED", "canceled"), NULL, 0);
  } else if (strcmp(op, "load") == 0) {
    /* Among the progress events: a stray reply to another id and an unsolicited event. */
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(req, "id");
    for (int i = 1; i <= 3; i++) {
      cJSON *ev = cJSON_CreateObject();
      cJSON_AddItemToObject(ev, "id", cJSON_Duplicate(id, 1));
      cJSON_AddStringToObject(ev, "event", "progress");
      cJSON_AddNumberToObject(ev, "bytes_done", i * 1000);
      cJSON_AddNumberToObject(ev, "bytes_total", 3000);
      send_json(fd, ev, NULL, 0);
      if (i == 2) {
        cJSON *stray = cJSON_CreateObject();
        cJSON_AddNumberToObject(stray, "id", 99999);
        cJSON_AddTrueToObject(stray, "ok");
        send_json(fd, stray, NULL, 0);
        cJSON *other = cJSON_CreateObject();
        cJSON_AddStringToObject(other, "event", "something-new");
        send_json(fd, other, NULL, 0);
      }
    }
    cJSON *o = reply_ok(req);
    cJSON_AddStringToObject(o, "set", "s1");
    cJSON_AddNumberToObject(o, "bytes", SLAB_BYTES);
    send_json(fd, o, NULL, 0);
  } else if (strcmp(op, "attach") == 0) {
    const cJSON *set = cJSON_GetObjectItemCaseSensitive(req, "set");
    const char *name = cJSON_IsString(set) ? set->valuestring : "s1";
    if (cJSON_IsString(path)) {
      const cJSON *id = cJSON_GetObjectItemCaseSensitive(req, "id");
      cJSON *ev = cJSON_CreateObject();
      cJSON_AddItemToObject(ev, "id", cJSON_Duplicate(id, 1));
      cJSON_AddStringToObject(ev, "event", "progress");
      cJSON_AddNumberToObject(ev, "bytes_done", 5);
      cJSON_AddNumberToObject(ev, "bytes_total", 5);
      send_json(fd, ev, NULL, 0);
    }
    if (strcmp(name, "s_slow") == 0) sleep_ms(300);
    if (strcmp(name, "missing") == 0) {
      send_json(fd, reply_err(req, "NOT_FOUND", "no set 'missing'"), NULL, 0);
    } else if (strcmp(name, "s_cuda") == 0) {
      send_json(fd, attach_reply(f, req, name, "cuda_ipc"), NULL, 0);
    } else if (strcmp(name, "s_vmm") == 0) {
      send_json(fd, attach_reply(f, req, name, "cuda_vmm"), &f->slab_fd, 1);
    } else if (strcmp(name, "s_vmm_badid") == 0) {
      send_json(fd, attach_reply(f, req, name, "cuda_vmm/badid"), &f->slab_fd, 1);
    } else if (strcmp(name, "s_unsealed") == 0) {
      send_json(fd, attach_reply(f, req, name, "fd"), &f->unsealed_fd, 1);
    } else if (strcmp(name, "s_nofd") == 0) {
      send_json(fd, attach_reply(f, req, name, "fd"), NULL, 0);
    } else {
      send_json(fd, attach_reply(f, req, name, "fd"), &f->slab_fd, 1);
    }
  } else if (strcmp(op, "release") == 0) {
    const cJSON *lease = cJSON_GetObjectItemCaseSensitive(req, "lease");
    pthread_mutex_lock(&f->lock);
    int delay = f->release_delay_ms;
    pthread_mutex_unlock(&f->lock);
    if (delay > 0) sleep_ms(delay);
    pthread_mutex_lock(&f->lock);
    f->releases++;
    snprintf(f->last_released, sizeof f->last_released, "%s", cJSON_IsString(lease) ? lease->valuestring : "?");
    pthread_mutex_unlock(&f->lock);
    cJSON *o = reply_ok(req);
    cJSON_AddTrueToObject(o, "released");
    send_json(fd, o, NULL, 0);
  } else if (strcmp(op, "cancel") == 0) {
    pthread_mutex_lock(&f->lock);
    f->cancels++;
    pthread_mutex_unlock(&f->lock);
    cJSON *o = reply_ok(req);
    cJSON_AddFalseToObject(o, "canceled");
    send_json(fd, o, NULL, 0);
  } else if (strcmp(op, "status") == 0) {
    const cJSON *slow = cJSON_GetObjectItemCaseSensitive(req, "slow_ms");
    if (cJSON_IsNumber(slow)) sleep_ms(slow->valueint);
    cJSON *o = reply_ok(req);
    cJSON_AddObjectToObject(o, "daemon");
    send_json(fd, o, NULL, 0);
  } else if (strcmp(op, "shutdown") == 0) {
    cJSON *ev = cJSON_CreateObject();
    cJSON_AddStringToObject(ev, "event", "shutdown");
    cJSON_AddStringToObject(ev, "message", "stopping");
    send_json(fd, ev, NULL, 0);
    return -1; /* gone before the reply, as a daemon killed mid-shutdown would be */
  } else {
    send_json(fd, reply_err(req, "BAD_REQUEST", "unknown op"), NULL, 0);
  }
  return 0;
}

static void *conn_main(void *p) {
  struct conn_arg *a = p;
  struct fake *f = a->f;
  int fd = a->fd;
  free(a);
  if (f->mode == FAKE_REFUSE) {
    send_json(fd, reply_err(NULL, "PERMISSION", "uid 1234 may not use this daemon"), NULL, 0);
    close(fd);
    return NULL;
  }
  for (;;) {
    struct wire_frame fr;
    memset(&fr, 0, sizeof fr);
    struct wd_error e;
    if (wire_recv_frame(fd, -1, &fr, &e) != 0) break;
    cJSON *req = cJSON_ParseWithLength(fr.json, fr.len);
    wire_frame_clear(&fr);
    int rc = handle(f, fd, req);
    cJSON_Delete(req);
    if (rc != 0) break;
  }
  close(fd);
  return NULL;
}

static void *accept_main(void *p) {
  struct fake *f = p;
  for (;;) {
    int fd = accept4(f->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (f->stop || f->nconns == MAX_CONNS) {
      close(fd);
      if (f->stop) break;
      continue;
    }
    struct conn_arg *a = malloc(sizeof *a);
    a->f = f;
    a->fd = fd;
    pthread_create(&f->conns[f->nconns++], NULL, conn_main, a);
  }
  return NULL;
}

static struct fake *fake_start(enum fake_mode mode) {
  struct fake *f = calloc(1, sizeof *f);
  char *dir = fx_tmpdir("client");
  snprintf(f->dir, sizeof f->dir, "%s", dir);
  free(dir);
  snprintf(f->sock_path, sizeof f->sock_path, "%s/fake.sock", f->dir);
  f->mode = mode;
  pthread_mutex_init(&f->lock, NULL);
  f->slab_fd = make_memfd(1);
  f->unsealed_fd = make_memfd(0);
  f->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", f->sock_path);
  if (bind(f->listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(f->listen_fd, 16) != 0) {
    fprintf(stderr, "fake daemon: cannot listen on %s: %s\n", f->sock_path, strerror(errno));
    exit(1);
  }
  pthread_create(&f->accept_thread, NULL, accept_main, f);
  return f;
}

/* Stops the fake; every client must be closed already. */
static void fake_stop(struct fake *f) {
  f->stop = 1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", f->sock_path);
  connect(fd, (struct sockaddr *)&sa, sizeof sa);
  pthread_join(f->accept_thread, NULL);
  close(fd);
  for (int i = 0; i < f->nconns; i++) pthread_join(f->conns[i], NULL);
  close(f->listen_fd);
  close(f->slab_fd);
  close(f->unsealed_fd);
  fx_rmtree(f->dir);
  pthread_mutex_destroy(&f->lock);
  free(f);
}

/* How many mappings of the test's memfd this process holds (lines of /proc/self/maps). */
static int slab_mappings(void) {
  FILE *m = fopen("/proc/self/maps", "r");
  char line[1024];
  int n = 0;
  while (m && fgets(line, sizeof line, m)) n += strstr(line, "memfd:wd-test-slab") != NULL;
  if (m) fclose(m);
  return n;
}

static int count_open_fds(void) {
  int n = 0;
  for (int fd = 0; fd < 1024; fd++) n += fcntl(fd, F_GETFD) != -1;
  return n;
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_connect_search(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  char xdg[PATH_MAX], link[PATH_MAX + 16];
  snprintf(xdg, sizeof xdg, "%s/xdg", f->dir);
  snprintf(link, sizeof link, "%s/weightd.sock", xdg);
  mkdir(xdg, 0700);
  unsetenv("WEIGHTD_SOCKET");
  setenv("XDG_RUNTIME_DIR", xdg, 1);
  weightd_client *c = NULL;
  /* Nothing named: the service's socket, then the per-user one; the message names both. */
  int rc = weightd_connect(NULL, &c);
  CHECK_EQ_INT(rc, WEIGHTD_E_CONNECT);
  CHECK(c != NULL);
  CHECK_STR_CONTAINS(weightd_last_error(c), "/run/weightd/weightd.sock");
  CHECK_STR_CONTAINS(weightd_last_error(c), xdg);
  CHECK_EQ_INT(weightd_open(c, "/x"), WEIGHTD_E_CLOSED);
  weightd_close(c);
  /* The per-user socket answers. */
  CHECK_EQ_INT(symlink(f->sock_path, link), 0);
  rc = weightd_connect(NULL, &c);
  CHECK_EQ_INT(rc, 0);
  CHECK(strcmp(weightd_socket_path(c), link) == 0);
  weightd_close(c);

  /* A $WEIGHTD_SOCKET where no daemon answers is the only socket tried, though the per-user one answers. */
  setenv("WEIGHTD_SOCKET", "/nonexistent/weightd.sock", 1);
  rc = weightd_connect(NULL, &c);
  CHECK_EQ_INT(rc, WEIGHTD_E_CONNECT);
  CHECK_STR_CONTAINS(weightd_last_error(c), "$WEIGHTD_SOCKET=/nonexistent/weightd.sock");
  CHECK(strstr(weightd_last_error(c), xdg) == NULL && strstr(weightd_last_error(c), "/run/weightd") == NULL);
  weightd_close(c);
  /* So is one that answers, and so is the caller's argument over $WEIGHTD_SOCKET. */
  setenv("WEIGHTD_SOCKET", f->sock_path, 1);
  rc = weightd_connect(NULL, &c);
  CHECK_EQ_INT(rc, 0);
  CHECK(strcmp(weightd_backend(c), "host") == 0);
  CHECK(strcmp(weightd_last_error(c), "") == 0);
  CHECK(strcmp(weightd_socket_path(c), f->sock_path) == 0);
  weightd_close(c);
  rc = weightd_connect("/nonexistent/other.sock", &c);
  CHECK_EQ_INT(rc, WEIGHTD_E_CONNECT);
  CHECK_STR_CONTAINS(weightd_last_error(c), "/nonexistent/other.sock: no such socket");
  CHECK(strstr(weightd_last_error(c), f->sock_path) == NULL);
  weightd_close(c);
  unsetenv("WEIGHTD_SOCKET");
  unsetenv("XDG_RUNTIME_DIR");
  weightd_close(NULL);
  CHECK(strcmp(weightd_last_error(NULL), "") == 0);
  fake_stop(f);
}

static void test_version_and_refusal(void) {
  struct fake *f = fake_start(FAKE_VERSION);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), WEIGHTD_E_VERSION);
  CHECK_STR_CONTAINS(weightd_last_error(c), "protocol 7 only");
  weightd_close(c);
  fake_stop(f);

  f = fake_start(FAKE_REFUSE);
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(weightd_last_error(c), "uid 1234");
  weightd_close(c);
  fake_stop(f);
}

static void test_error_mapping(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  CHECK_EQ_INT(weightd_open(c, "/denied"), WEIGHTD_E_PATH_DENIED);
  CHECK(strcmp(weightd_last_error(c), "/denied resolves outside the model roots") == 0);
  /* The connection stays usable after a daemon error, and a success clears the message. */
  CHECK_EQ_INT(weightd_open(c, "/models/ok"), 0);
  CHECK(strcmp(weightd_last_error(c), "") == 0);
  /* Relative paths are sent absolute: the daemon resolves in its own directory. */
  CHECK_EQ_INT(weightd_open(c, "rel/model"), 0);
  char cwd[PATH_MAX], want[PATH_MAX + 16];
  CHECK(getcwd(cwd, sizeof cwd) != NULL);
  snprintf(want, sizeof want, "%s/rel/model", cwd);
  CHECK(strcmp(f->last_path, want) == 0);
  /* The raw request returns the reply text, also for errors. */
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"attach\",\"set\":\"missing\"}", &reply, NULL, NULL),
               WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(reply, "\"NOT_FOUND\"");
  weightd_free(reply);
  CHECK_EQ_INT(weightd_request(c, "[1,2]", &reply, NULL, NULL), WEIGHTD_E_INVALID);
  CHECK(reply == NULL);
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"status\",\"id\":\"mine\"}", &reply, NULL, NULL), 0);
  CHECK_STR_CONTAINS(reply, "\"ok\":true");
  weightd_free(reply);
  weightd_set *s = (weightd_set *)1;
  CHECK_EQ_INT(weightd_attach(c, "missing", &s), WEIGHTD_E_NOT_FOUND);
  CHECK(s == NULL);
  weightd_close(c);
  fake_stop(f);
}

struct progress_log {
  int calls;
  uint64_t last_done, last_total;
};

static void on_progress(uint64_t done, uint64_t total, void *arg) {
  struct progress_log *p = arg;
  p->calls++;
  p->last_done = done;
  p->last_total = total;
}

static void test_load_progress(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  struct progress_log log = {0};
  struct weightd_load_options o = {
      .struct_size = sizeof o, .device = "GPU-abc", .progress = on_progress, .progress_arg = &log};
  char set[32];
  CHECK_EQ_INT(weightd_load(c, "/models/m", &o, set, sizeof set), 0);
  CHECK(strcmp(set, "s1") == 0);
  CHECK_EQ_INT(log.calls, 3);
  CHECK_EQ_INT(log.last_done, 3000);
  CHECK_EQ_INT(log.last_total, 3000);
  CHECK(strcmp(f->last_device, "GPU-abc") == 0);
  /* No options: device 0, no callback; a buffer too small for the id. */
  char tiny[2];
  CHECK_EQ_INT(weightd_load(c, "/models/m", NULL, tiny, sizeof tiny), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(weightd_last_error(c), "'s1'");
  CHECK(strcmp(f->last_device, "#0") == 0);
  /* An old caller's smaller struct: fields past struct_size are not read. */
  struct weightd_load_options old = {.struct_size = offsetof(struct weightd_load_options, progress),
                                     .device = "1", .progress = on_progress, .progress_arg = NULL};
  CHECK_EQ_INT(weightd_load(c, "/models/m", &old, set, sizeof set), 0);
  CHECK_EQ_INT(log.calls, 3);
  struct weightd_load_options zero = {0};
  CHECK_EQ_INT(weightd_load(c, "/models/m", &zero, set, sizeof set), WEIGHTD_E_INVALID);
  struct weightd_load_options badplan = {.struct_size = sizeof badplan, .plan_json = "{\"preset\""};
  CHECK_EQ_INT(weightd_load(c, "/models/m", &badplan, set, sizeof set), WEIGHTD_E_INVALID);
  weightd_close(c);
  fake_stop(f);
}

static int check_tensor_bytes(const weightd_tensor *t) {
  const unsigned char *p = t->data;
  for (uint64_t i = 0; i < t->nbytes; i++)
    if (p[i] != slab_byte((size_t)(t->offset + i))) return 0;
  return 1;
}

static void test_attach_shared_mapping(void) {
  int fds_before = count_open_fds();
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c1 = NULL, *c2 = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c1), 0);
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c2), 0);
  CHECK_EQ_INT(slab_mappings(), 0);
  int fds_connected = count_open_fds();

  weightd_set *a = NULL, *b = NULL, *d = NULL;
  CHECK_EQ_INT(weightd_attach(c1, "s1", &a), 0);
  if (a == NULL) goto out;
  CHECK(strcmp(weightd_set_id(a), "s1") == 0);
  CHECK(strcmp(weightd_set_lease(a), "l1") == 0);
  CHECK(strcmp(weightd_set_device(a), "host-test") == 0);
  CHECK_EQ_INT(weightd_set_memory_kind(a), WEIGHTD_MEMORY_HOST);
  CHECK_EQ_INT(weightd_set_bytes(a), SLAB_BYTES);
  CHECK_EQ_INT(weightd_set_tensor_count(a), 3);
  CHECK_EQ_INT(slab_mappings(), 1);

  weightd_tensor t = {.struct_size = sizeof t};
  CHECK_EQ_INT(weightd_set_tensor(a, 2, &t), 0);
  CHECK(strcmp(t.name, "lm_head.weight") == 0);
  CHECK_EQ_INT(t.struct_size, sizeof t);
  /* A caller built against a smaller struct gets only its fields; 0 means the original (whole) struct. */
  weightd_tensor small = {.struct_size = sizeof small};
  memset(&small, 0xA5, sizeof small);
  small.struct_size = offsetof(weightd_tensor, offset);
  CHECK_EQ_INT(weightd_set_tensor(a, 2, &small), 0);
  CHECK(strcmp(small.name, "lm_head.weight") == 0 && small.ndim == t.ndim && small.shape == t.shape);
  CHECK_EQ_INT(small.struct_size, offsetof(weightd_tensor, offset));
  unsigned char past[sizeof small - offsetof(weightd_tensor, offset)];
  memset(past, 0xA5, sizeof past);
  CHECK(memcmp((char *)&small + offsetof(weightd_tensor, offset), past, sizeof past) == 0);
  weightd_tensor zero = {0};
  CHECK_EQ_INT(weightd_set_find(a, "lm_head.weight", &zero), 0);
  CHECK(zero.data == t.data && zero.nbytes == t.nbytes && zero.struct_size == 0);
  weightd_tensor tiny = {.struct_size = 2};
  CHECK_EQ_INT(weightd_set_tensor(a, 2, &tiny), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(weightd_set_tensor(a, 3, &t), WEIGHTD_E_NOT_FOUND);
  CHECK_EQ_INT(weightd_set_find(a, "model.norm.weight", &t), 0);
  CHECK(strcmp(t.dtype, "F32") == 0);
  CHECK_EQ_INT(t.ndim, 1);
  CHECK_EQ_INT(t.shape[0], 64);
  CHECK_EQ_INT(t.offset, 2048);
  CHECK(t.data == (char *)weightd_set_base(a) + 2048);
  CHECK(check_tensor_bytes(&t));
  CHECK_EQ_INT(weightd_set_find(a, "model.embed_tokens.weight", &t), 0);
  CHECK_EQ_INT(t.ndim, 2);
  CHECK_EQ_INT(t.shape[1], 64);
  CHECK(check_tensor_bytes(&t));
  CHECK_EQ_INT(weightd_set_find(a, "nope", &t), WEIGHTD_E_NOT_FOUND);
  /* Mapped read-only. */
  CHECK(mprotect(weightd_set_base(a), SLAB_BYTES, PROT_READ | PROT_WRITE) != 0);

  /* Same handle again, then another handle: one mapping, one base. */
  CHECK_EQ_INT(weightd_attach(c1, "s1", &b), 0);
  CHECK_EQ_INT(weightd_attach(c2, "s1", &d), 0);
  if (b == NULL || d == NULL) goto out;
  CHECK(weightd_set_base(b) == weightd_set_base(a));
  CHECK(weightd_set_base(d) == weightd_set_base(a));
  CHECK(strcmp(weightd_set_lease(b), "l2") == 0);
  CHECK(strcmp(weightd_set_lease(d), "l3") == 0);
  CHECK_EQ_INT(slab_mappings(), 1);
  /* Every received descriptor was closed once mapped (or found mapped already). */
  CHECK_EQ_INT(count_open_fds(), fds_connected);

  CHECK_EQ_INT(weightd_release(a), 0);
  CHECK_EQ_INT(f->releases, 1);
  CHECK(strcmp(f->last_released, "l1") == 0);
  CHECK_EQ_INT(slab_mappings(), 1);
  CHECK_EQ_INT(weightd_set_find(d, "lm_head.weight", &t), 0);
  CHECK(check_tensor_bytes(&t));
  CHECK_EQ_INT(weightd_release(d), 0);
  CHECK(strcmp(f->last_released, "l3") == 0);
  CHECK_EQ_INT(slab_mappings(), 1);
  CHECK_EQ_INT(weightd_release(b), 0);
  CHECK_EQ_INT(f->releases, 3);
  CHECK_EQ_INT(slab_mappings(), 0);
  CHECK_EQ_INT(weightd_release(NULL), 0);
  a = b = d = NULL;
out:
  weightd_release(a);
  weightd_release(b);
  weightd_release(d);
  weightd_close(c1);
  weightd_close(c2);
  fake_stop(f);
  CHECK_EQ_INT(count_open_fds(), fds_before);
}

static void test_attach_path(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  struct progress_log log = {0};
  struct weightd_load_options o = {
      .struct_size = sizeof o, .device = "0", .progress = on_progress, .progress_arg = &log};
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach_path(c, "/models/m", &o, &s), 0);
  CHECK(strcmp(f->last_path, "/models/m") == 0);
  CHECK(strcmp(f->last_device, "0") == 0);
  CHECK_EQ_INT(log.calls, 1);
  CHECK(s != NULL && weightd_set_base(s) != NULL);
  CHECK_EQ_INT(weightd_release(s), 0);
  weightd_close(c);
  fake_stop(f);
}

static void test_bad_handles_release_lease(void) {
  int fds_before = count_open_fds();
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  int fds_connected = count_open_fds();
  weightd_set *s = NULL;
  /* An unsealed memfd is refused, and the lease it came with is handed back. */
  CHECK_EQ_INT(weightd_attach(c, "s_unsealed", &s), WEIGHTD_E_PROTOCOL);
  CHECK_STR_CONTAINS(weightd_last_error(c), "not sealed");
  CHECK(s == NULL);
  CHECK_EQ_INT(f->releases, 1);
  CHECK(strcmp(f->last_released, "l1") == 0);
  /* A reply that names a descriptor it did not carry. */
  CHECK_EQ_INT(weightd_attach(c, "s_nofd", &s), WEIGHTD_E_PROTOCOL);
  CHECK_STR_CONTAINS(weightd_last_error(c), "carried 0 descriptors");
  CHECK_EQ_INT(f->releases, 2);
  CHECK_EQ_INT(slab_mappings(), 0);
  CHECK_EQ_INT(count_open_fds(), fds_connected);
  weightd_close(c);
  fake_stop(f);
  CHECK_EQ_INT(count_open_fds(), fds_before);
}

/* Last of all: a CUDA driver, once loaded, keeps descriptors open for the process's life. */
static void test_cuda_handle_unknown_device(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  weightd_set *s = NULL;
  /* No driver here (UNSUPPORTED), or no GPU with the reply's UUID (DEVICE); the lease goes back. */
  int rc = weightd_attach(c, "s_cuda", &s);
  CHECK(rc == WEIGHTD_E_UNSUPPORTED || rc == WEIGHTD_E_DEVICE);
  CHECK(s == NULL);
  if (rc == WEIGHTD_E_UNSUPPORTED) CHECK_STR_CONTAINS(weightd_last_error(c), "libcuda.so.1");
  else CHECK_STR_CONTAINS(weightd_last_error(c), "GPU-00000000-1111-2222-3333-444444444444");
  printf("  %s\n", weightd_last_error(c));
  CHECK_EQ_INT(f->releases, 1);
  weightd_close(c);
  fake_stop(f);
}

/*
 * A cuda_vmm handle: hello lists every kind libweightd opens; without a CUDA
 * driver (or with one that has no GPU of that UUID) the attach fails, the
 * lease goes back, and the received descriptor is closed, also when the
 * handle is malformed.
 */
static void test_vmm_handle_without_device(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  CHECK(strcmp(f->hello_handles, "[\"fd\",\"cuda_ipc\",\"cuda_vmm\"]") == 0);
  int fds = count_open_fds();
  weightd_set *s = NULL;
  int rc = weightd_attach(c, "s_vmm", &s);
  CHECK(rc == WEIGHTD_E_UNSUPPORTED || rc == WEIGHTD_E_DEVICE);
  CHECK(s == NULL);
  if (rc == WEIGHTD_E_UNSUPPORTED) CHECK_STR_CONTAINS(weightd_last_error(c), "libcuda.so.1");
  else CHECK_STR_CONTAINS(weightd_last_error(c), "GPU-00000000-1111-2222-3333-444444444444");
  CHECK_EQ_INT(f->releases, 1);
  CHECK_EQ_INT(count_open_fds(), fds);
  CHECK_EQ_INT(weightd_attach(c, "s_vmm_badid", &s), WEIGHTD_E_PROTOCOL);
  CHECK_STR_CONTAINS(weightd_last_error(c), "alloc_id");
  CHECK_EQ_INT(f->releases, 2);
  CHECK_EQ_INT(count_open_fds(), fds);
  weightd_close(c);
  fake_stop(f);
}

static long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static void test_timeout(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  weightd_set_timeout(c, 100);
  long t0 = now_ms();
  char *reply = NULL;
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"status\",\"slow_ms\":400}", &reply, NULL, NULL), WEIGHTD_E_TIMEOUT);
  long took = now_ms() - t0;
  CHECK(took >= 90 && took < 350);
  CHECK(reply == NULL);
  CHECK_STR_CONTAINS(weightd_last_error(c), "100 ms");
  /* The late reply is told apart by its id: the next request gets its own answer. */
  weightd_set_timeout(c, 0);
  CHECK_EQ_INT(weightd_open(c, "/denied"), WEIGHTD_E_PATH_DENIED);

  /* A load nobody waits for any more is canceled. */
  weightd_set_timeout(c, 100);
  char set[32];
  CHECK_EQ_INT(weightd_load(c, "/slow", NULL, set, sizeof set), WEIGHTD_E_TIMEOUT);
  weightd_set_timeout(c, 0);
  CHECK_EQ_INT(weightd_open(c, "/models/ok"), 0);
  CHECK_EQ_INT(f->cancels, 1);

  /* A late attach reply: its descriptor is closed and its lease released. */
  int fds = count_open_fds();
  weightd_set_timeout(c, 100);
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, "s_slow", &s), WEIGHTD_E_TIMEOUT);
  CHECK(s == NULL);
  weightd_set_timeout(c, 0);
  CHECK_EQ_INT(weightd_open(c, "/models/ok"), 0);
  CHECK_EQ_INT(weightd_open(c, "/models/ok"), 0);
  CHECK_EQ_INT(f->releases, 1);
  CHECK(strcmp(f->last_released, "l1") == 0);
  CHECK_EQ_INT(count_open_fds(), fds);
  CHECK_EQ_INT(slab_mappings(), 0);
  weightd_close(c);
  fake_stop(f);
}

/*
 * A release answered after the handle's timeout still ends (0): it is not
 * subject to the per-frame timeout, so a lease is never left to a late reply.
 */
static void test_release_outlasts_the_timeout(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, "s1", &s), 0);
  pthread_mutex_lock(&f->lock);
  f->release_delay_ms = 300;
  pthread_mutex_unlock(&f->lock);
  weightd_set_timeout(c, 20);
  CHECK_EQ_INT(weightd_release(s), 0);
  pthread_mutex_lock(&f->lock);
  CHECK_EQ_INT(f->releases, 1);
  CHECK(strcmp(f->last_released, "l1") == 0);
  pthread_mutex_unlock(&f->lock);
  CHECK_EQ_INT(slab_mappings(), 0);
  /* The timeout still holds for other calls, and the stream is in step. */
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"status\",\"slow_ms\":300}", NULL, NULL, NULL), WEIGHTD_E_TIMEOUT);
  weightd_set_timeout(c, 0);
  CHECK_EQ_INT(weightd_open(c, "/denied"), WEIGHTD_E_PATH_DENIED);
  weightd_close(c);
  fake_stop(f);
}

static void test_shutdown_event(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"shutdown\"}", NULL, NULL, NULL), WEIGHTD_E_SHUTDOWN);
  CHECK_STR_CONTAINS(weightd_last_error(c), "shutting down");
  /* A daemon back on the socket (a restart): the next call reconnects once and is served. */
  CHECK_EQ_INT(weightd_open(c, "/models/ok"), 0);
  /* Shut down again and gone: the next call's one reconnect fails, and says so. */
  CHECK_EQ_INT(weightd_request(c, "{\"op\":\"shutdown\"}", NULL, NULL, NULL), WEIGHTD_E_SHUTDOWN);
  char away[PATH_MAX + 8];
  snprintf(away, sizeof away, "%s.away", f->sock_path);
  CHECK_EQ_INT(rename(f->sock_path, away), 0);
  CHECK_EQ_INT(weightd_open(c, "/x"), WEIGHTD_E_SHUTDOWN);
  CHECK_STR_CONTAINS(weightd_last_error(c), "reconnecting failed");
  CHECK_EQ_INT(weightd_open(c, "/x"), WEIGHTD_E_SHUTDOWN); /* each call tries once more */
  CHECK_EQ_INT(rename(away, f->sock_path), 0); /* fake_stop wakes its accept through the path */
  weightd_close(c);
  fake_stop(f);
}

static void test_close_detaches_sets(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, "s1", &s), 0);
  weightd_close(c);
  /* The set stays mapped and readable; release only unmaps (nothing is sent). */
  weightd_tensor t = {.struct_size = sizeof t};
  CHECK_EQ_INT(weightd_set_find(s, "lm_head.weight", &t), 0);
  CHECK(check_tensor_bytes(&t));
  CHECK_EQ_INT(slab_mappings(), 1);
  CHECK_EQ_INT(weightd_release(s), 0);
  CHECK_EQ_INT(slab_mappings(), 0);
  CHECK_EQ_INT(f->releases, 0);
  fake_stop(f);
}

static void test_fork_child(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, "s1", &s), 0);
  pid_t pid = fork();
  if (pid == 0) {
    /* The child may not use the parent's handle, and its release sends nothing. */
    int ok = weightd_open(c, "/x") == WEIGHTD_E_INVALID && strstr(weightd_last_error(c), "fork") != NULL;
    weightd_tensor t = {.struct_size = sizeof t};
    ok = ok && weightd_set_find(s, "lm_head.weight", &t) == 0 && check_tensor_bytes(&t);
    ok = ok && weightd_release(s) == 0;
    _exit(ok ? 0 : 1);
  }
  int status = -1;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ_INT(f->releases, 0);
  /* The parent's handle and set still work. */
  CHECK_EQ_INT(weightd_open(c, "/models/ok"), 0);
  CHECK_EQ_INT(weightd_release(s), 0);
  CHECK_EQ_INT(f->releases, 1);
  weightd_close(c);
  fake_stop(f);
}

/*
 * fork() while another thread maps and unmaps: the child's release of an
 * inherited set must not find the process-wide mapping table locked by a
 * thread that does not exist in the child. The attaching thread maps a set of
 * its own (s2), so every attach runs mmap under the table's lock and every
 * release unlinks under it; the parent forks repeatedly meanwhile, and each
 * child releases its inherited s1 and exits. A child that has not exited
 * after 20 s is taken to be deadlocked (it is killed and the test fails).
 */
struct churn {
  const char *sock_path;
  atomic_int stop;
  atomic_int rounds;
};

static void *churn_main(void *p) {
  struct churn *ch = p;
  weightd_client *c = NULL;
  if (weightd_connect(ch->sock_path, &c) != 0) return NULL;
  while (!ch->stop) {
    weightd_set *s = NULL;
    if (weightd_attach(c, "s2", &s) != 0) break;
    weightd_release(s);
    ch->rounds++;
  }
  weightd_close(c);
  return NULL;
}

/* Waits for pid at most limit_ms; returns its status, or -1 after killing it. */
static int wait_bounded(pid_t pid, long limit_ms) {
  long t0 = now_ms();
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) return -1;
    if (now_ms() - t0 > limit_ms) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    sleep_ms(2);
  }
}

static void test_fork_while_mapping(void) {
  struct fake *f = fake_start(FAKE_NORMAL);
  weightd_client *c = NULL;
  CHECK_EQ_INT(weightd_connect(f->sock_path, &c), 0);
  weightd_set *s = NULL;
  CHECK_EQ_INT(weightd_attach(c, "s1", &s), 0);
  struct churn ch = {.sock_path = f->sock_path};
  pthread_t th;
  CHECK_EQ_INT(pthread_create(&th, NULL, churn_main, &ch), 0);
  int forks = 0, hung = 0, failed = 0;
  for (; forks < 400 && !hung; forks++) {
    pid_t pid = fork();
    if (pid == 0) _exit(weightd_release(s) == 0 ? 0 : 1);
    if (pid < 0) break;
    int status = wait_bounded(pid, 20000);
    if (status == -1) hung++;
    else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
  }
  ch.stop = 1;
  pthread_join(th, NULL);
  CHECK_EQ_INT(hung, 0);
  CHECK_EQ_INT(failed, 0);
  CHECK_EQ_INT(forks, 400);
  CHECK(ch.rounds > 0);
  CHECK_EQ_INT(weightd_release(s), 0);
  CHECK_EQ_INT(slab_mappings(), 0);
  weightd_close(c);
  fake_stop(f);
}

static void test_misc_api(void) {
  CHECK(weightd_version() == WEIGHTD_VERSION_HEX);
  CHECK(strcmp(weightd_version_string(), WEIGHTD_VERSION_STRING) == 0);
  CHECK(strcmp(weightd_err_name(WEIGHTD_E_PATH_DENIED), "PATH_DENIED") == 0);
  CHECK(strcmp(weightd_strerror(WEIGHTD_E_TIMEOUT), "timed out") == 0);
  CHECK_EQ_INT(weightd_open(NULL, "/x"), WEIGHTD_E_INVALID);
  CHECK(weightd_set_base(NULL) == NULL);
  CHECK_EQ_INT(weightd_set_tensor_count(NULL), 0);
  weightd_set_timeout(NULL, 5);
  CHECK(strcmp(weightd_backend(NULL), "") == 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  RUN(test_misc_api);
  RUN(test_connect_search);
  RUN(test_version_and_refusal);
  RUN(test_error_mapping);
  RUN(test_load_progress);
  RUN(test_attach_shared_mapping);
  RUN(test_attach_path);
  RUN(test_bad_handles_release_lease);
  RUN(test_timeout);
  RUN(test_release_outlasts_the_timeout);
  RUN(test_shutdown_event);
  RUN(test_close_detaches_sets);
  RUN(test_fork_child);
  RUN(test_fork_while_mapping);
  RUN(test_cuda_handle_unknown_device);
  RUN(test_vmm_handle_without_device);
  return tu_finish();
}
