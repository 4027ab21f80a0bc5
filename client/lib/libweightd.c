/*
 * libweightd.c - connections: finding the socket, hello, and the blocking
 * request/reply loop every op goes through.
 *
 * DESIGN: a weightd_client is used by one thread at a time (the caller
 * serialises); it owns one socket and sends one request per call, so a call
 * reads frames until the final reply that echoes its id. Every frame is read
 * with json_strict, whose arena tree costs a fraction of cJSON's node-per-
 * allocation parse (an attach reply carries the whole tensor table: at 398
 * tensors cJSON's parse was half of an attach); callers that want cJSON get
 * the final reply parsed again, small replies all. Progress events of
 * that request go to the caller's callback; replies to earlier requests that
 * timed out are discarded (a late attach reply's lease is released and its
 * descriptors closed); the daemon's unsolicited shutdown event is remembered
 * so that a connection that then closes reports WEIGHTD_E_SHUTDOWN.
 */
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pwd.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "lib_internal.h"
#include "sockpath.h"
#include "wire.h"

/* A daemon that has not answered hello within this long is not working. */
#define HELLO_TIMEOUT_MS 30000

/* ---- errors ------------------------------------------------------------------ */

int lib_fail(weightd_client *c, int code, const char *fmt, ...) {
  if (c == NULL) return code;
  c->err.code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err.msg, sizeof c->err.msg, fmt, ap);
  va_end(ap);
  return code;
}

const char *weightd_last_error(const weightd_client *c) {
  if (c == NULL) return "";
  return c->err.msg;
}

static int reconnect(weightd_client *c);

/*
 * True when the daemon's end of the connection is closed and nothing of it is
 * left to read (end of file, or reset), seen without blocking. Unread bytes
 * (a late reply, an event) are left for the call to read as before.
 */
static bool peer_gone(int sock) {
  char b;
  ssize_t n = recv(sock, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE || errno == ENOTCONN));
}

int lib_usable(weightd_client *c) {
  if (c == NULL) return WEIGHTD_E_INVALID;
  if (c->pid != getpid())
    return lib_fail(c, WEIGHTD_E_INVALID,
                    "this handle belongs to process %ld; after fork() connect anew with "
                    "weightd_connect",
                    (long)c->pid);
  if (c->sock < 0) return lib_fail(c, WEIGHTD_E_CLOSED, "not connected");
  if (!c->broken && !c->reconnecting && peer_gone(c->sock))
    c->broken = 1; /* the daemon went away while the handle was idle (a restart): this call reconnects */
  if (c->broken && c->socket_path != NULL && !c->reconnecting) {
    int rc = reconnect(c);
    if (rc != 0) return rc;
  }
  if (c->broken)
    return lib_fail(c, c->shutdown_seen ? WEIGHTD_E_SHUTDOWN : WEIGHTD_E_CLOSED,
                    "the connection to the daemon is no longer usable (%s)",
                    c->shutdown_seen ? "the daemon shut down" : "it closed or fell out of step");
  err_clear(&c->err);
  return 0;
}

/* ---- small JSON helpers ------------------------------------------------------ */

cJSON *lib_request_new(const char *op) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return NULL;
  if (cJSON_AddStringToObject(o, "op", op) == NULL) {
    cJSON_Delete(o);
    return NULL;
  }
  return o;
}

int lib_add_path(weightd_client *c, cJSON *req, const char *path) {
  if (path == NULL || path[0] == '\0') return lib_fail(c, WEIGHTD_E_INVALID, "no checkpoint path given");
  char buf[PATH_MAX];
  const char *p = path;
  if (path[0] != '/' && !wire_path_is_url(path)) {
    /* The daemon resolves paths in its own directory: send ours made absolute (a URL goes as it is). */
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof cwd) == NULL)
      return lib_fail(c, WEIGHTD_E_IO, "%s: cannot make the path absolute: %s", path, strerror(errno));
    int n = snprintf(buf, sizeof buf, "%s/%s", strcmp(cwd, "/") == 0 ? "" : cwd, path);
    if (n < 0 || (size_t)n >= sizeof buf) return lib_fail(c, WEIGHTD_E_INVALID, "%s: path too long", path);
    p = buf;
  }
  if (cJSON_AddStringToObject(req, "path", p) == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  return 0;
}

int lib_get_u64(weightd_client *c, const cJSON *o, const char *key, uint64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  /* cJSON keeps a double: integers are exact below 2^53, more than any byte count here. */
  if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= 9007199254740992.0 ||
      floor(v->valuedouble) != v->valuedouble)
    return lib_fail(c, WEIGHTD_E_PROTOCOL, "the daemon's reply lacks a valid \"%s\"", key);
  *out = (uint64_t)v->valuedouble;
  return 0;
}

const char *lib_get_str(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

const struct sj_node *lib_sj_get(const struct sj_node *o, const char *key) {
  if (o == NULL || o->type != SJ_OBJECT) return NULL;
  size_t len = strlen(key);
  for (const struct sj_node *m = o->child; m != NULL; m = m->next)
    if (m->key_len == len && memcmp(m->key, key, len) == 0) return m;
  return NULL;
}

const char *lib_sj_str(const struct sj_node *o, const char *key) {
  const struct sj_node *v = lib_sj_get(o, key);
  /* json_strict's strings end with a NUL; one that holds a NUL is no C string. */
  return v != NULL && v->type == SJ_STRING && memchr(v->str, '\0', v->len) == NULL ? v->str : NULL;
}

int lib_sj_u64(weightd_client *c, const struct sj_node *o, const char *key, uint64_t *out) {
  if (!sj_u64(lib_sj_get(o, key), out))
    return lib_fail(c, WEIGHTD_E_PROTOCOL, "the daemon's reply lacks a valid \"%s\"", key);
  return 0;
}

/* ---- the request/reply loop -------------------------------------------------- */

/* Sends a request the caller will not wait for (releasing a stray lease, canceling). */
static void send_detached(weightd_client *c, cJSON *req) {
  if (req == NULL) return;
  if (cJSON_AddNumberToObject(req, "id", (double)c->next_id++) != NULL) {
    char *text = cJSON_PrintUnformatted(req);
    struct wd_error e;
    if (text != NULL && wire_send_frame(c->sock, text, strlen(text), NULL, 0, &e) != 0) c->broken = 1;
    free(text);
  }
  cJSON_Delete(req);
}

/* A final reply to a request that gave up waiting: give back what it took. */
static void discard_stale(weightd_client *c, const struct sj_node *msg) {
  const char *lease = lib_sj_str(msg, "lease");
  const struct sj_node *ok = lib_sj_get(msg, "ok");
  if (ok == NULL || ok->type != SJ_TRUE || lease == NULL) return;
  cJSON *req = lib_request_new("release");
  if (req != NULL && cJSON_AddStringToObject(req, "lease", lease) == NULL) {
    cJSON_Delete(req);
    return;
  }
  send_detached(c, req);
}

/* Maps an error object {"code", "message"} to its code and the handle's message. */
static int reply_error(weightd_client *c, const struct sj_node *e) {
  const char *name = lib_sj_str(e, "code");
  const char *message = lib_sj_str(e, "message");
  int code = err_from_name(name);
  if (code == 0) code = WEIGHTD_E_INTERNAL;
  return lib_fail(c, code, "%s", message ? message : weightd_strerror(code));
}

static void call_progress(const struct sj_node *msg, weightd_progress_fn fn, void *arg) {
  uint64_t done, total;
  if (fn == NULL || !sj_u64(lib_sj_get(msg, "bytes_done"), &done) || !sj_u64(lib_sj_get(msg, "bytes_total"), &total))
    return;
  fn(done, total, arg);
}

/* Reads a frame from the daemon into a tree whose root is an object: 0, PROTOCOL or NOMEM. */
static int frame_doc(const struct wire_frame *f, struct sj_doc *doc) {
  doc->root = NULL;
  doc->arena = NULL;
  if (!sj_utf8_valid((const unsigned char *)f->json, f->len, NULL)) return WEIGHTD_E_PROTOCOL;
  char why[96];
  int rc = sj_parse(f->json, f->len, SJ_DEFAULT_MAX_DEPTH, doc, why, sizeof why);
  if (rc == -2) return WEIGHTD_E_NOMEM;
  if (rc != 0) return WEIGHTD_E_PROTOCOL;
  if (doc->root->type != SJ_OBJECT) {
    sj_doc_free(doc);
    return WEIGHTD_E_PROTOCOL;
  }
  return 0;
}

/* Marks the connection dead and turns a transport error into the handle's error. */
static int transport_fail(weightd_client *c, int code, const struct wd_error *e, const char *op) {
  c->broken = 1;
  if (c->shutdown_seen && (code == WEIGHTD_E_CLOSED || code == WEIGHTD_E_IO))
    return lib_fail(c, WEIGHTD_E_SHUTDOWN, "%s: the daemon is shutting down", op);
  if (code == WEIGHTD_E_CLOSED)
    return lib_fail(c, code, "%s: the daemon closed the connection", op);
  return lib_fail(c, code, "%s: %s", op, e->msg[0] ? e->msg : weightd_strerror(code));
}

/*
 * lib_call and lib_call_doc: the final successful reply goes to *reply as
 * cJSON, or to *doc as the json_strict tree, or nowhere.
 */
static int call(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *progress_arg, cJSON **reply,
                struct sj_doc *doc_out, struct wire_frame *frame, char **text) {
  if (reply) *reply = NULL;
  if (doc_out) doc_out->root = NULL, doc_out->arena = NULL;
  if (text) *text = NULL;
  if (frame) memset(frame, 0, sizeof *frame);
  const char *op = lib_get_str(req, "op");
  if (op == NULL) op = "request";
  int64_t id = c->next_id++;
  cJSON_DeleteItemFromObjectCaseSensitive(req, "id");
  if (cJSON_AddNumberToObject(req, "id", (double)id) == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  char *out = cJSON_PrintUnformatted(req);
  if (out == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  struct wd_error e;
  err_clear(&e);
  int rc = wire_send_frame(c->sock, out, strlen(out), NULL, 0, &e);
  free(out);
  if (rc == WEIGHTD_E_LIMIT || rc == WEIGHTD_E_INVALID)
    return lib_fail(c, rc, "%s: %s", op, e.msg);
  if (rc != 0) {
    /* A peer the daemon refuses gets one error frame and is closed, maybe before our request went out: read it. */
    struct wire_frame f;
    memset(&f, 0, sizeof f);
    struct wd_error e2;
    err_clear(&e2);
    struct sj_doc doc;
    if (wire_recv_frame(c->sock, 200, &f, &e2) == 0 && frame_doc(&f, &doc) == 0) {
      const struct sj_node *error = lib_sj_get(doc.root, "error");
      int code = error != NULL && error->type == SJ_OBJECT && lib_sj_get(doc.root, "id") == NULL ? reply_error(c, error) : 0;
      sj_doc_free(&doc);
      wire_frame_clear(&f);
      if (code != 0) {
        c->broken = 1;
        return code;
      }
    }
    return transport_fail(c, rc, &e, op);
  }

  for (;;) {
    struct wire_frame f;
    memset(&f, 0, sizeof f);
    err_clear(&e);
    rc = wire_recv_frame(c->sock, c->timeout_ms, &f, &e);
    if (rc == WEIGHTD_E_TIMEOUT) {
      if (strcmp(op, "load") == 0 || strcmp(op, "load_group") == 0) {
        /* Nobody waits for this load any more: let the daemon stop it. */
        cJSON *cancel = lib_request_new("cancel");
        if (cancel != NULL && cJSON_AddNumberToObject(cancel, "target", (double)id) == NULL) {
          cJSON_Delete(cancel);
          cancel = NULL;
        }
        send_detached(c, cancel);
      }
      return lib_fail(c, rc, "%s: no reply from the daemon within %d ms", op, c->timeout_ms);
    }
    if (rc != 0) return transport_fail(c, rc, &e, op);
    struct sj_doc doc;
    if ((rc = frame_doc(&f, &doc)) != 0) {
      wire_frame_clear(&f);
      c->broken = 1;
      if (rc == WEIGHTD_E_NOMEM) return lib_fail(c, rc, "%s: out of memory reading the daemon's frame", op);
      return lib_fail(c, WEIGHTD_E_PROTOCOL, "%s: the daemon sent a frame that is not a JSON object", op);
    }
    const struct sj_node *msg = doc.root;
    const struct sj_node *mid = lib_sj_get(msg, "id");
    const char *event = lib_sj_str(msg, "event");
    const struct sj_node *error = lib_sj_get(msg, "error");
    if (error != NULL && error->type != SJ_OBJECT) error = NULL;
    if (mid == NULL) {
      if (event != NULL && strcmp(event, "shutdown") == 0) c->shutdown_seen = 1;
      if (event == NULL && error != NULL) {
        /* An error about the connection itself (refused peer, broken framing): it closes. */
        if (text) *text = strndup(f.json, f.len);
        rc = reply_error(c, error);
        c->broken = 1;
        sj_doc_free(&doc);
        wire_frame_clear(&f);
        return rc;
      }
      sj_doc_free(&doc);
      wire_frame_clear(&f);
      continue;
    }
    uint64_t mv;
    if (!sj_u64(mid, &mv) || mv != (uint64_t)id) {
      if (event == NULL) discard_stale(c, msg);
      sj_doc_free(&doc);
      wire_frame_clear(&f);
      continue;
    }
    if (event != NULL) {
      if (strcmp(event, "progress") == 0) call_progress(msg, progress, progress_arg);
      sj_doc_free(&doc);
      wire_frame_clear(&f);
      continue;
    }
    if (text) {
      *text = strndup(f.json, f.len);
      if (*text == NULL) {
        sj_doc_free(&doc);
        wire_frame_clear(&f);
        return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
      }
    }
    const struct sj_node *ok = lib_sj_get(msg, "ok");
    if (ok != NULL && ok->type == SJ_TRUE) rc = 0;
    else if (error != NULL) rc = reply_error(c, error);
    else rc = lib_fail(c, WEIGHTD_E_PROTOCOL, "%s: the reply has neither \"ok\" nor \"error\"", op);
    if (rc == 0 && reply != NULL && (*reply = cJSON_ParseWithLength(f.json, f.len)) == NULL)
      rc = lib_fail(c, WEIGHTD_E_NOMEM, "%s: out of memory reading the reply", op);
    if (rc == 0 && doc_out != NULL) {
      *doc_out = doc;
      doc.root = NULL;
      doc.arena = NULL;
    }
    sj_doc_free(&doc);
    if (rc == 0 && frame != NULL) *frame = f;
    else wire_frame_clear(&f);
    return rc;
  }
}

int lib_call(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *progress_arg,
             cJSON **reply, struct wire_frame *frame, char **text) {
  return call(c, req, progress, progress_arg, reply, NULL, frame, text);
}

int lib_call_doc(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *progress_arg,
                 struct sj_doc *doc, struct wire_frame *frame) {
  return call(c, req, progress, progress_arg, NULL, doc, frame, NULL);
}

int weightd_request(weightd_client *c, const char *request_json, char **reply,
                    weightd_progress_fn progress, void *progress_arg) {
  if (reply) *reply = NULL;
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  if (request_json == NULL) return lib_fail(c, WEIGHTD_E_INVALID, "no request given");
  cJSON *req = cJSON_Parse(request_json);
  if (!cJSON_IsObject(req) || lib_get_str(req, "op") == NULL) {
    cJSON_Delete(req);
    return lib_fail(c, WEIGHTD_E_INVALID, "the request must be a JSON object with a string \"op\"");
  }
  char *text = NULL;
  rc = lib_call(c, req, progress, progress_arg, NULL, NULL, &text);
  cJSON_Delete(req);
  if (reply) *reply = text;
  else free(text);
  return rc;
}

void weightd_free(void *p) { free(p); }

/* ---- connecting -------------------------------------------------------------- */

/* Connects to path; 0 or -errno. */
static int try_connect(const char *path, int *out) {
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (strlen(path) >= sizeof sa.sun_path) return -ENAMETOOLONG;
  memcpy(sa.sun_path, path, strlen(path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  while (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (errno == EINTR) continue;
    int e = errno;
    close(fd);
    return -e;
  }
  *out = fd;
  return 0;
}

/*
 * Why connecting to path failed (e = errno), with what to do about it:
 * "PATH: no daemon is listening (...)", "PATH: no such socket (...)", or for
 * a refusal by permissions the socket's owner, group and mode next to the
 * caller's uid and groups, and the configuration keys that decide.
 */
static void describe_connect_error(const char *path, int e, char *buf, size_t len) {
  if (e == ECONNREFUSED) {
    snprintf(buf, len,
             "no daemon is listening at %s (the socket file is left from a daemon that stopped: start weightd, "
             "which replaces it)",
             path);
    return;
  }
  if (e == ENOENT) {
    snprintf(buf, len, "%s: no such socket", path);
    return;
  }
  if (e != EACCES && e != EPERM) {
    snprintf(buf, len, "%s: %s", path, strerror(e));
    return;
  }
  char groups[256] = "";
  gid_t gl[64];
  int ng = getgroups(64, gl);
  size_t used = 0;
  for (int i = 0; i < ng && used < sizeof groups; i++) {
    struct group gr, *g = NULL;
    char gb[1024];
    getgrgid_r(gl[i], &gr, gb, sizeof gb, &g);
    int w = snprintf(groups + used, sizeof groups - used, "%s%s(%u)", i ? "," : "", g ? g->gr_name : "?",
                     (unsigned)gl[i]);
    if (w > 0) used += (size_t)w;
  }
  struct passwd pw, *me = NULL;
  char pb[1024];
  getpwuid_r(getuid(), &pw, pb, sizeof pb, &me);
  char self[384];
  snprintf(self, sizeof self, "you are uid %u (%s), gid %u, groups %s", (unsigned)getuid(), me ? me->pw_name : "?",
           (unsigned)getgid(), groups[0] ? groups : "none");
  struct stat st;
  if (stat(path, &st) != 0) {
    snprintf(buf, len,
             "permission denied on %s: a directory above it is not searchable by you; %s (the daemon's socket "
             "path is the key socket)",
             path, self);
    return;
  }
  struct passwd opw, *owner = NULL;
  struct group ogr, *group = NULL;
  char ob[1024], gb2[1024];
  getpwuid_r(st.st_uid, &opw, ob, sizeof ob, &owner);
  getgrgid_r(st.st_gid, &ogr, gb2, sizeof gb2, &group);
  snprintf(buf, len,
           "permission denied on %s: the socket is owned by %s(%u), group %s(%u), mode %04o; %s. Join group %s, "
           "or change the daemon's socket_group / socket_mode keys",
           path, owner ? owner->pw_name : "?", (unsigned)st.st_uid, group ? group->gr_name : "?",
           (unsigned)st.st_gid, (unsigned)(st.st_mode & 07777), self, group ? group->gr_name : "?");
}

/*
 * Connects to one socket of the search (sockpath.h), shown in messages as
 * label and path: its private directory (private_dir, NULL or "" for none)
 * is checked first, then the uid of the daemon that listens. Returns 0 with
 * *out open; else a negative errno (-ENOENT: no socket there) or -EPERM for a
 * refusal, with why saying what was wrong and what to do.
 */
static int sock_open(const char *path, const char *label, const char *private_dir, int *out, char *why,
                     size_t len) {
  char shown[PATH_MAX + 32];
  snprintf(shown, sizeof shown, "%s%s", label, path);
  struct wd_error err = {0};
  int rc = private_dir != NULL && private_dir[0] != '\0'
               ? sockpath_dir_check(private_dir, (unsigned)getuid(), false, &err)
               : 0;
  if (rc == WEIGHTD_E_NOT_FOUND) {
    describe_connect_error(shown, ENOENT, why, len);
    return -ENOENT;
  }
  if (rc != 0) {
    snprintf(why, len, "%s: %s", shown, err.msg);
    return -EPERM;
  }
  int fd = -1, e = try_connect(path, &fd);
  if (e != 0) {
    describe_connect_error(shown, -e, why, len);
    return e;
  }
  if (sockpath_peer_check(fd, shown, &err) != 0) {
    close(fd);
    snprintf(why, len, "%s", err.msg);
    return -EPERM;
  }
  *out = fd;
  return 0;
}

/* The name hello sends: the caller's, cut at 63 bytes on a character boundary. */
static void client_name_set(weightd_client *c, const char *name) {
  if (name == NULL) {
    snprintf(c->client_name, sizeof c->client_name, "libweightd %s (%s)", WEIGHTD_VERSION_STRING,
             program_invocation_short_name);
  } else {
    snprintf(c->client_name, sizeof c->client_name, "%s", name);
  }
  /* A character cut short at the end goes whole: the daemon refuses text that is not UTF-8. */
  size_t n = strlen(c->client_name), lead = n;
  while (lead > 0 && ((unsigned char)c->client_name[lead - 1] & 0xC0) == 0x80) lead--;
  if (lead > 0) {
    unsigned char b = (unsigned char)c->client_name[lead - 1];
    size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    if (n - (lead - 1) < need) c->client_name[lead - 1] = '\0';
  }
}

static int hello(weightd_client *c) {
  cJSON *req = lib_request_new("hello");
  /* Every handle kind this library opens (lib_set.c), so the daemon may hand it any set. */
  cJSON *kinds = NULL, *features = NULL, *table = NULL, *page = NULL;
  if (req == NULL || cJSON_AddNumberToObject(req, "protocol", WEIGHTD_PROTOCOL_VERSION) == NULL ||
      cJSON_AddStringToObject(req, "client", c->client_name) == NULL ||
      (kinds = cJSON_AddArrayToObject(req, "handles")) == NULL ||
      (features = cJSON_AddArrayToObject(req, "features")) == NULL ||
      (table = cJSON_CreateString(wd_feature_name(WD_FEATURE_TENSOR_TABLE))) == NULL ||
      !cJSON_AddItemToArray(features, table) ||
      (page = cJSON_CreateString(wd_feature_name(WD_FEATURE_PROGRESS_PAGE))) == NULL ||
      !cJSON_AddItemToArray(features, page)) {
    cJSON_Delete(page);
    cJSON_Delete(req);
    return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  }
  for (int k = 0; k < WD_HANDLE_KIND_COUNT; k++) {
    cJSON *name = cJSON_CreateString(wd_handle_kind_name((enum wd_handle_kind)k));
    if (name == NULL || !cJSON_AddItemToArray(kinds, name)) {
      cJSON_Delete(name);
      cJSON_Delete(req);
      return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
    }
  }
  int saved = c->timeout_ms;
  c->timeout_ms = HELLO_TIMEOUT_MS;
  cJSON *reply = NULL;
  int rc = lib_call(c, req, NULL, NULL, &reply, NULL, NULL);
  c->timeout_ms = saved;
  cJSON_Delete(req);
  if (rc == WEIGHTD_E_VERSION) {
    char msg[WD_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", c->err.msg);
    return lib_fail(c, rc, "the daemon does not speak protocol %d: %s", WEIGHTD_PROTOCOL_VERSION, msg);
  }
  if (rc != 0) return rc;
  const char *backend = lib_get_str(reply, "backend");
  const char *version = lib_get_str(reply, "version");
  snprintf(c->backend, sizeof c->backend, "%s", backend ? backend : "");
  snprintf(c->daemon_version, sizeof c->daemon_version, "%s", version ? version : "");
  const cJSON *f;
  cJSON_ArrayForEach(f, cJSON_GetObjectItemCaseSensitive(reply, "features")) {
    int k = cJSON_IsString(f) ? wd_feature_from_name(f->valuestring) : -1;
    if (k >= 0) c->daemon_features |= WD_FEATURE_BIT(k);
  }
  const cJSON *proto = cJSON_GetObjectItemCaseSensitive(reply, "protocol");
  if (cJSON_IsNumber(proto) && proto->valuedouble != WEIGHTD_PROTOCOL_VERSION)
    rc = lib_fail(c, WEIGHTD_E_VERSION, "the daemon answered hello with protocol %g, this library speaks %d",
                  proto->valuedouble, WEIGHTD_PROTOCOL_VERSION);
  cJSON_Delete(reply);
  return rc;
}

/*
 * A daemon that went away (killed, restarted) comes back on the same socket:
 * one connection attempt per call, a hello, then a reclaim of every lease
 * this handle holds, by id (the daemon grants it to the same uid and pid
 * only). A lease the daemon no longer has (it was not re-adopted, or its
 * grace period passed) stays lost; the set stays mapped as it was, so the
 * caller's pointers never change. Returns 0, or CONNECT/CLOSED when the
 * daemon is not back (the next call tries again).
 */
static int reconnect(weightd_client *c) {
  int fd = -1;
  char why[WD_ERROR_MSG_MAX];
  if (sock_open(c->socket_path, "", c->socket_dir, &fd, why, sizeof why) != 0) {
    return lib_fail(c, c->shutdown_seen ? WEIGHTD_E_SHUTDOWN : WEIGHTD_E_CONNECT,
                    "the connection to weightd closed%s and reconnecting failed: %s",
                    c->shutdown_seen ? " (the daemon shut down)" : "", why);
  }
  close(c->sock);
  c->sock = fd;
  c->broken = 0;
  c->shutdown_seen = 0;
  c->reconnecting = 1;
  int rc = hello(c);
  for (weightd_set *s = c->sets; rc == 0 && s != NULL; s = s->next) {
    if (s->lease == NULL || s->lease[0] == '\0') continue;
    cJSON *req = lib_request_new("reclaim");
    if (req == NULL || cJSON_AddStringToObject(req, "lease", s->lease) == NULL) {
      cJSON_Delete(req);
      rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
      break;
    }
    cJSON *reply = NULL;
    int r = lib_call(c, req, NULL, NULL, &reply, NULL, NULL);
    cJSON_Delete(req);
    cJSON_Delete(reply);
    if (r != 0 && c->broken) rc = r; /* a refused lease is lost; a dead connection stops here */
  }
  c->reconnecting = 0;
  if (rc != 0) c->broken = 1;
  return rc;
}

int weightd_connect(const char *socket_path, weightd_client **out) {
  struct weightd_connect_options o = {sizeof o, socket_path, NULL};
  return weightd_connect_opts(&o, out);
}

/* True when opts (of the caller's struct_size) contains field. */
#define CONNECT_HAS(opts, field)                                                                          \
  ((opts) != NULL &&                                                                                      \
   (opts)->struct_size >= offsetof(struct weightd_connect_options, field) + sizeof((opts)->field))

int weightd_connect_opts(const struct weightd_connect_options *opts, weightd_client **out) {
  if (out == NULL) return WEIGHTD_E_INVALID;
  weightd_client *c = calloc(1, sizeof *c);
  *out = c;
  if (c == NULL) return WEIGHTD_E_NOMEM;
  c->sock = -1;
  c->pid = getpid();
  c->timeout_ms = -1;
  c->next_id = 1;
  if (opts != NULL && opts->struct_size == 0)
    return lib_fail(c, WEIGHTD_E_INVALID, "weightd_connect_options.struct_size is 0: set it to sizeof the struct");
  const char *socket_path = CONNECT_HAS(opts, socket_path) ? opts->socket_path : NULL;
  client_name_set(c, CONNECT_HAS(opts, client_name) ? opts->client_name : NULL);

  /* The sockets to try, in the order sockpath.h gives. */
  struct sockpath cand[2];
  size_t n = 0;
  struct wd_error serr = {0};
  if (sockpath_search(socket_path, (unsigned)getuid(), cand, &n, &serr) != 0)
    return lib_fail(c, WEIGHTD_E_CONNECT, "cannot connect to weightd: %s", serr.msg);
  char tried[WD_ERROR_MSG_MAX] = "";
  size_t len = 0, missing = 0;
  for (size_t i = 0; i < n; i++) {
    char why[WD_ERROR_MSG_MAX];
    int e = sock_open(cand[i].path, cand[i].label, cand[i].private_dir, &c->sock, why, sizeof why);
    if (e == 0) {
      c->socket_path = strdup(cand[i].path);
      c->socket_dir = cand[i].private_dir[0] != '\0' ? strdup(cand[i].private_dir) : NULL;
      if (c->socket_path == NULL || (cand[i].private_dir[0] != '\0' && c->socket_dir == NULL))
        return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
      break;
    }
    missing += e == -ENOENT;
    int w = snprintf(tried + len, sizeof tried - len, "%s%s", i ? "; " : "", why);
    if (w > 0 && (size_t)w < sizeof tried - len) len += (size_t)w;
  }
  if (c->sock < 0)
    return lib_fail(c, WEIGHTD_E_CONNECT, "cannot connect to weightd: %s%s", tried,
                    missing == n ? " (is weightd running? it may listen elsewhere: give --socket or set "
                                   "$WEIGHTD_SOCKET)"
                                 : "");
  return hello(c);
}

void weightd_close(weightd_client *c) {
  if (c == NULL) return;
  /* Sets stay mapped; their weightd_release only unmaps them. The daemon ends the leases. */
  for (weightd_set *s = c->sets, *next; s != NULL; s = next) {
    next = s->next;
    s->client = NULL;
    s->prev = s->next = NULL;
  }
  if (c->sock >= 0) close(c->sock);
  free(c->socket_path);
  free(c->socket_dir);
  free(c);
}

const char *weightd_socket_path(const weightd_client *c) {
  return c != NULL && c->socket_path != NULL ? c->socket_path : "";
}

const char *weightd_backend(const weightd_client *c) {
  return c != NULL ? c->backend : "";
}

void weightd_set_timeout(weightd_client *c, int timeout_ms) {
  if (c != NULL) c->timeout_ms = timeout_ms > 0 ? timeout_ms : -1;
}
