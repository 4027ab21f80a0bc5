/*
 * lib_set.c - attached sets: building one from an attach reply, and its
 * accessors. The tensor table is either the daemon's binary table (mapped
 * read-only and read in place: an accessor reads one record, a lookup by
 * name is a binary search over its index; nothing is allocated per tensor)
 * or, from a daemon without it, the JSON list copied into arrays here.
 * An early attach's progress page is read in place too; waiting on it is a
 * FUTEX_WAIT, which touches no handle, so any thread may wait. Only the
 * daemon writes that page, so a daemon that dies mid-load would leave it
 * saying "loading" for good: the set follows the daemon's process (its pid
 * from SO_PEERCRED, through a pidfd where the kernel has them) and a wait
 * asks between slices whether it still runs.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lib_internal.h"
#include "msg.h"

/* ---- the tensor table ------------------------------------------------------------ */

/* qsort_r's context: the tensors whose indexes are sorted. */
static int by_name_cmp(const void *a, const void *b, void *arg) {
  const struct weightd_tensor *t = arg;
  return strcmp(t[*(const size_t *)a].name, t[*(const size_t *)b].name);
}

/* One tensor entry's members, found in one pass over them. */
struct entry {
  const struct sj_node *name, *dtype, *shape, *offset, *nbytes;
};

static void entry_read(const struct sj_node *t, struct entry *e) {
  memset(e, 0, sizeof *e);
  for (const struct sj_node *m = t->type == SJ_OBJECT ? t->child : NULL; m != NULL; m = m->next) {
    const struct sj_node **slot = NULL;
    switch (m->key_len) {
    case 4: slot = memcmp(m->key, "name", 4) == 0 ? &e->name : NULL; break;
    case 5: slot = memcmp(m->key, "dtype", 5) == 0 ? &e->dtype : memcmp(m->key, "shape", 5) == 0 ? &e->shape : NULL; break;
    case 6: slot = memcmp(m->key, "offset", 6) == 0 ? &e->offset : memcmp(m->key, "nbytes", 6) == 0 ? &e->nbytes : NULL; break;
    }
    if (slot != NULL && *slot == NULL) *slot = m;
  }
}

/* A string without NULs inside. */
static int is_text(const struct sj_node *n) {
  return n != NULL && n->type == SJ_STRING && memchr(n->str, '\0', n->len) == NULL;
}

/* Reads "tensors" into s (names, dtypes and shapes copied; data pointers from the base). */
static int read_tensors(weightd_client *c, weightd_set *s, const struct sj_node *reply) {
  const struct sj_node *arr = lib_sj_get(reply, "tensors");
  if (arr == NULL || arr->type != SJ_ARRAY) return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the reply has no \"tensors\" list");
  size_t n = arr->count, text = 0, dims = 0;
  struct entry e;
  for (const struct sj_node *t = arr->child; t != NULL; t = t->next) {
    entry_read(t, &e);
    if (!is_text(e.name) || !is_text(e.dtype) || e.shape == NULL || e.shape->type != SJ_ARRAY)
      return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: a tensor entry lacks \"name\", \"dtype\" or \"shape\"");
    text += e.name->len + e.dtype->len + 2;
    dims += e.shape->count;
  }
  s->ntensors = n;
  s->tensors = calloc(n ? n : 1, sizeof *s->tensors);
  s->by_name = calloc(n ? n : 1, sizeof *s->by_name);
  s->strings = malloc(text ? text : 1);
  s->shapes = calloc(dims ? dims : 1, sizeof *s->shapes);
  if (!s->tensors || !s->by_name || !s->strings || !s->shapes) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  char *sp = s->strings;
  int64_t *dp = s->shapes;
  size_t i = 0;
  for (const struct sj_node *t = arr->child; t != NULL; t = t->next, i++) {
    struct weightd_tensor *x = &s->tensors[i];
    entry_read(t, &e);
    x->name = memcpy(sp, e.name->str, e.name->len + 1);
    sp += e.name->len + 1;
    x->dtype = memcpy(sp, e.dtype->str, e.dtype->len + 1);
    sp += e.dtype->len + 1;
    x->shape = dp;
    for (const struct sj_node *d = e.shape->child; d != NULL; d = d->next) {
      uint64_t v;
      if (!sj_u64(d, &v) || v > (uint64_t)INT64_MAX)
        return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: tensor '%s' has a bad shape", x->name);
      *dp++ = (int64_t)v;
      x->ndim++;
    }
    if (!sj_u64(e.offset, &x->offset) || !sj_u64(e.nbytes, &x->nbytes))
      return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: tensor '%s' lacks a valid \"offset\" or \"nbytes\"", x->name);
    if (x->offset > s->bytes || x->nbytes > s->bytes - x->offset)
      return lib_fail(c, WEIGHTD_E_PROTOCOL,
                      "attach: tensor '%s' (offset %llu, %llu bytes) lies outside the %llu-byte slab", x->name,
                      (unsigned long long)x->offset, (unsigned long long)x->nbytes,
                      (unsigned long long)s->bytes);
    s->by_name[i] = i;
  }
  qsort_r(s->by_name, n, sizeof *s->by_name, by_name_cmp, s->tensors);
  return 0;
}

/* Takes the descriptor a reply object names by "fd_index" out of the frame (-1 with an error). */
static int take_fd(weightd_client *c, const struct sj_node *o, const char *what, struct wire_frame *frame, int *fd) {
  uint64_t idx;
  *fd = -1;
  int rc = lib_sj_u64(c, o, "fd_index", &idx);
  if (rc != 0) return rc;
  if (idx >= frame->nfds || frame->fds[idx] < 0)
    return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the %s names fd %llu but the reply carried %zu descriptor%s", what,
                    (unsigned long long)idx, frame->nfds, frame->nfds == 1 ? "" : "s");
  *fd = frame->fds[idx];
  frame->fds[idx] = -1;
  return 0;
}

/* Maps the reply's binary tensor table ("tensor_table": {"fd_index", "bytes", "version"}). */
static int read_table(weightd_client *c, weightd_set *s, const struct sj_node *tt, struct wire_frame *frame) {
  uint64_t bytes, version;
  int fd, rc;
  if ((rc = lib_sj_u64(c, tt, "version", &version)) != 0 || (rc = lib_sj_u64(c, tt, "bytes", &bytes)) != 0) return rc;
  if (version != TTAB_VERSION)
    return lib_fail(c, WEIGHTD_E_UNSUPPORTED, "attach: tensor table version %llu; this library reads %u",
                    (unsigned long long)version, TTAB_VERSION);
  if ((rc = take_fd(c, tt, "tensor table", frame, &fd)) != 0) return rc;
  struct wd_error e;
  err_clear(&e);
  if ((rc = lib_map_table(fd, bytes, &s->table, &e)) != 0) return lib_fail(c, rc, "set %s: %s", s->id, e.msg);
  if (s->table->t.slab_bytes != s->bytes)
    return lib_fail(c, WEIGHTD_E_BAD_TABLE, "set %s: the tensor table describes a %llu-byte slab, the set has %llu",
                    s->id, (unsigned long long)s->table->t.slab_bytes, (unsigned long long)s->bytes);
  return 0;
}

/* Maps an early attach's progress page ("progress": {"fd_index", "bytes", "version"}). */
static int map_page(weightd_client *c, weightd_set *s, const struct sj_node *pg, struct wire_frame *frame) {
  uint64_t version;
  int fd, rc;
  if ((rc = lib_sj_u64(c, pg, "version", &version)) != 0) return rc;
  if (version != WD_PAGE_VERSION)
    return lib_fail(c, WEIGHTD_E_UNSUPPORTED, "attach: progress page version %llu; this library reads %u",
                    (unsigned long long)version, WD_PAGE_VERSION);
  if ((rc = take_fd(c, pg, "progress page", frame, &fd)) != 0) return rc;
  struct wd_error e;
  err_clear(&e);
  rc = ppage_map(fd, &s->page, &e);
  close(fd);
  if (rc != 0) return lib_fail(c, rc, "set %s: %s", s->id, e.msg);
  if (s->page->total_bytes != s->bytes)
    return lib_fail(c, WEIGHTD_E_PROTOCOL, "set %s: the progress page counts %llu bytes, the set has %llu", s->id,
                    (unsigned long long)s->page->total_bytes, (unsigned long long)s->bytes);
  return 0;
}

/* ---- the daemon's process ------------------------------------------------------------ */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* Linux 5.3, the same number on every architecture */
#endif

/*
 * Records which process writes the set's page: the peer of the connection
 * the attach reply came on, which is running now (it just answered), opened
 * as a pidfd so that a later reuse of the pid cannot pass for it. The pid is
 * unknown (0: waits then cannot tell) when the daemon lives in a pid
 * namespace this process does not see. Under socket activation the peer is
 * the service manager that listened, which outlives the daemon: waits then
 * behave as without this.
 */
static void daemon_watch(weightd_client *c, weightd_set *s) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(c->sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return;
  s->daemon_pid = cred.pid;
  long fd = syscall(SYS_pidfd_open, cred.pid, 0);
  s->daemon_pidfd = fd >= 0 ? (int)fd : -1;
}

/* Whether the daemon that writes s's page still runs (ppage_alive_fn): unknown counts as running. */
static int daemon_alive(const void *arg) {
  const weightd_set *s = arg;
  if (s->daemon_pidfd >= 0) {
    /* A pidfd turns readable when its process has exited. */
    struct pollfd p = {.fd = s->daemon_pidfd, .events = POLLIN};
    return poll(&p, 1, 0) <= 0;
  }
  if (s->daemon_pid > 0) return kill(s->daemon_pid, 0) == 0 || errno != ESRCH;
  return 1;
}

/* ---- handles ------------------------------------------------------------------------ */

/* Maps the reply's single slab handle. */
static int map_handle(weightd_client *c, weightd_set *s, const struct sj_node *reply, struct wire_frame *frame) {
  const struct sj_node *handles = lib_sj_get(reply, "handles");
  if (handles == NULL || handles->type != SJ_ARRAY || handles->count < 1)
    return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the reply has no \"handles\"");
  if (handles->count > 1)
    return lib_fail(c, WEIGHTD_E_UNSUPPORTED, "attach: set %s has %zu slabs; this library maps one", s->id,
                    handles->count);
  const struct sj_node *h = handles->child;
  const char *kind = lib_sj_str(h, "kind");
  uint64_t hbytes;
  int rc = lib_sj_u64(c, h, "bytes", &hbytes);
  if (rc != 0) return rc;
  if (hbytes < s->bytes)
    return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the handle covers %llu bytes, the set has %llu",
                    (unsigned long long)hbytes, (unsigned long long)s->bytes);
  struct wd_error e;
  err_clear(&e);
  int k = wd_handle_kind_from_name(kind);
  int fd = -1;
  uint64_t idx = 0;
  if (k == WD_HANDLE_FD || k == WD_HANDLE_CUDA_VMM) {
    if ((rc = lib_sj_u64(c, h, "fd_index", &idx)) != 0) return rc;
    if (idx >= frame->nfds || frame->fds[idx] < 0)
      return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the reply names fd %llu but carried %zu descriptor%s",
                      (unsigned long long)idx, frame->nfds, frame->nfds == 1 ? "" : "s");
    fd = frame->fds[idx];
  }
  if (k == WD_HANDLE_FD) {
    frame->fds[idx] = -1; /* lib_map_host closes it */
    s->kind = WEIGHTD_MEMORY_HOST;
    rc = lib_map_host(s->id, fd, s->bytes, &s->map, &e);
  } else if (k == WD_HANDLE_CUDA_IPC) {
    const char *hex = lib_sj_str(h, "handle");
    unsigned char raw[WD_IPC_HANDLE_BYTES];
    if (hex == NULL || msg_hex_decode(hex, raw, sizeof raw) != 0)
      return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the cuda_ipc handle is not %d hex digits",
                      2 * WD_IPC_HANDLE_BYTES);
    s->kind = WEIGHTD_MEMORY_CUDA;
    rc = lib_map_cuda(s->id, s->device, raw, s->bytes, &s->map, &e);
  } else if (k == WD_HANDLE_CUDA_VMM) {
    const char *hex = lib_sj_str(h, "alloc_id");
    unsigned char id[WD_ALLOC_ID_BYTES];
    if (hex == NULL || msg_hex_decode(hex, id, sizeof id) != 0)
      return lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the cuda_vmm handle's alloc_id is not %d hex digits",
                      2 * WD_ALLOC_ID_BYTES);
    frame->fds[idx] = -1; /* lib_map_vmm keeps or closes it */
    s->kind = WEIGHTD_MEMORY_CUDA;
    /* The whole allocation is mapped (hbytes), of which the set uses the first s->bytes. */
    rc = lib_map_vmm(s->id, s->device, fd, hbytes, id, &s->map, &e);
  } else {
    return lib_fail(c, WEIGHTD_E_UNSUPPORTED, "attach: unknown handle kind '%s'", kind ? kind : "(none)");
  }
  s->handle = (enum wd_handle_kind)k;
  if (rc != 0) return lib_fail(c, rc, "set %s: %s", s->id, e.msg);
  return 0;
}

/* ---- building and freeing ---------------------------------------------------------- */

int lib_set_from_reply(weightd_client *c, const struct sj_node *reply, struct wire_frame *frame,
                       weightd_set **out) {
  weightd_set *s = calloc(1, sizeof *s);
  if (s == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  s->pid = getpid();
  s->daemon_pidfd = -1;
  const char *id = lib_sj_str(reply, "set"), *lease = lib_sj_str(reply, "lease");
  const char *device = lib_sj_str(reply, "device");
  int rc;
  if (id == NULL || lease == NULL || device == NULL) {
    rc = lib_fail(c, WEIGHTD_E_PROTOCOL, "attach: the reply lacks \"set\", \"lease\" or \"device\"");
    goto fail;
  }
  s->id = strdup(id);
  s->lease = strdup(lease);
  s->device = strdup(device);
  if (!s->id || !s->lease || !s->device) {
    rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  if ((rc = lib_sj_u64(c, reply, "bytes", &s->bytes)) != 0) goto fail;
  const struct sj_node *tt = lib_sj_get(reply, "tensor_table"), *pg = lib_sj_get(reply, "progress");
  if ((rc = tt != NULL ? read_table(c, s, tt, frame) : read_tensors(c, s, reply)) != 0) goto fail;
  if (pg != NULL && (rc = map_page(c, s, pg, frame)) != 0) goto fail;
  if (pg != NULL) daemon_watch(c, s);
  if ((rc = map_handle(c, s, reply, frame)) != 0) goto fail;
  for (size_t i = 0; i < s->ntensors; i++)
    s->tensors[i].data = s->map->base ? (char *)s->map->base + s->tensors[i].offset : NULL;
  s->client = c;
  s->next = c->sets;
  if (c->sets) c->sets->prev = s;
  c->sets = s;
  *out = s;
  return 0;
fail:
  lib_set_free(s);
  return rc;
}

void lib_set_free(weightd_set *s) {
  if (s == NULL) return;
  free(s->id);
  free(s->lease);
  free(s->device);
  lib_table_put(s->table);
  ppage_unmap(s->page);
  if (s->daemon_pidfd >= 0) close(s->daemon_pidfd);
  free(s->tensors);
  free(s->by_name);
  free(s->strings);
  free(s->shapes);
  free(s);
}

/* ---- accessors ----------------------------------------------------------------------- */

const char *weightd_set_id(const weightd_set *s) { return s ? s->id : NULL; }
const char *weightd_set_lease(const weightd_set *s) { return s ? s->lease : NULL; }
const char *weightd_set_device(const weightd_set *s) { return s ? s->device : NULL; }
enum weightd_memory_kind weightd_set_memory_kind(const weightd_set *s) {
  return s ? s->kind : (enum weightd_memory_kind)0;
}
enum weightd_handle_kind weightd_set_handle_kind(const weightd_set *s) {
  static const enum weightd_handle_kind public_kind[WD_HANDLE_KIND_COUNT] = {
      [WD_HANDLE_FD] = WEIGHTD_HANDLE_FD,
      [WD_HANDLE_CUDA_IPC] = WEIGHTD_HANDLE_CUDA_IPC,
      [WD_HANDLE_CUDA_VMM] = WEIGHTD_HANDLE_CUDA_VMM,
  };
  return s && s->map ? public_kind[s->handle] : (enum weightd_handle_kind)0;
}
int weightd_set_read_only(const weightd_set *s) { return s && s->map ? s->map->read_only : 0; }
void *weightd_set_base(const weightd_set *s) { return s && s->map ? s->map->base : NULL; }
uint64_t weightd_set_bytes(const weightd_set *s) { return s ? s->bytes : 0; }
size_t weightd_set_tensor_count(const weightd_set *s) {
  return s == NULL ? 0 : s->table != NULL ? (size_t)s->table->t.count : s->ntensors;
}

/* The size of weightd_tensor's first version, which struct_size 0 stands for. */
#define TENSOR_V1_BYTES (offsetof(weightd_tensor, data) + sizeof(void *))
_Static_assert(TENSOR_V1_BYTES == sizeof(weightd_tensor), "struct_size 0 means the whole first version");

/* Copies t into the caller's out, as much of it as out's struct_size holds (see weightd.h). */
static int tensor_out(const weightd_tensor *t, weightd_tensor *out) {
  size_t n = out->struct_size == 0 ? TENSOR_V1_BYTES : out->struct_size;
  if (n < sizeof out->struct_size) return WEIGHTD_E_INVALID;
  if (n > sizeof *t) n = sizeof *t;
  const size_t skip = sizeof out->struct_size;
  memcpy((char *)out + skip, (const char *)t + skip, n - skip);
  return 0;
}

/* Tensor i of a binary table as the public struct: pointers into the table. */
static void table_tensor(const weightd_set *s, size_t i, weightd_tensor *out) {
  struct ttab_entry e;
  ttab_get(&s->table->t, i, &e);
  out->name = e.name;
  out->dtype = e.dtype;
  out->ndim = (int)e.ndim;
  out->shape = e.shape;
  out->offset = e.offset;
  out->nbytes = e.nbytes;
  out->data = s->map != NULL && s->map->base != NULL ? (char *)s->map->base + e.offset : NULL;
}

int weightd_set_tensor(const weightd_set *s, size_t i, weightd_tensor *out) {
  if (s == NULL || out == NULL) return WEIGHTD_E_INVALID;
  if (i >= weightd_set_tensor_count(s)) return WEIGHTD_E_NOT_FOUND;
  if (s->table == NULL) return tensor_out(&s->tensors[i], out);
  weightd_tensor t;
  table_tensor(s, i, &t);
  return tensor_out(&t, out);
}

/* The number of the tensor called name in slab order, or -1. */
static int64_t find_index(const weightd_set *s, const char *name) {
  if (s->table != NULL) return ttab_find(&s->table->t, name, strlen(name));
  size_t lo = 0, hi = s->ntensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int cmp = strcmp(s->tensors[s->by_name[mid]].name, name);
    if (cmp == 0) return (int64_t)s->by_name[mid];
    if (cmp < 0) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}

int weightd_set_find(const weightd_set *s, const char *name, weightd_tensor *out) {
  if (s == NULL || name == NULL || out == NULL) return WEIGHTD_E_INVALID;
  int64_t i = find_index(s, name);
  return i < 0 ? WEIGHTD_E_NOT_FOUND : weightd_set_tensor(s, (size_t)i, out);
}

/* ---- early attach: the load's progress --------------------------------------------------- */

enum weightd_set_state weightd_set_state(const weightd_set *s) {
  static const enum weightd_set_state from_page[] = {
      [WD_PAGE_LOADING] = WEIGHTD_SET_LOADING,
      [WD_PAGE_READY] = WEIGHTD_SET_READY,
      [WD_PAGE_FAILED] = WEIGHTD_SET_FAILED,
      [WD_PAGE_CANCELED] = WEIGHTD_SET_CANCELED,
  };
  if (s == NULL) return (enum weightd_set_state)0;
  if (s->page == NULL) return WEIGHTD_SET_READY;
  uint32_t st = atomic_load_explicit(&s->page->state, memory_order_acquire);
  /* The daemon's last words are on the page before it exits: look again once it is gone. */
  if (st == WD_PAGE_LOADING && !daemon_alive(s)) {
    st = atomic_load_explicit(&s->page->state, memory_order_acquire);
    if (st == WD_PAGE_LOADING) return WEIGHTD_SET_FAILED;
  }
  return st <= WD_PAGE_CANCELED ? from_page[st] : WEIGHTD_SET_FAILED;
}

uint64_t weightd_set_ready_bytes(const weightd_set *s) {
  if (s == NULL) return 0;
  if (s->page == NULL) return s->bytes;
  uint64_t v = atomic_load_explicit(&s->page->ready_bytes, memory_order_acquire);
  return v < s->bytes ? v : s->bytes;
}

const char *weightd_set_load_error(const weightd_set *s) {
  enum weightd_set_state st = weightd_set_state(s);
  if (st != WEIGHTD_SET_FAILED && st != WEIGHTD_SET_CANCELED) return "";
  if (atomic_load_explicit(&s->page->state, memory_order_acquire) == WD_PAGE_LOADING)
    return "the daemon exited before the load finished";
  /* Written before the state: complete now. A message without its NUL is no message. */
  return memchr(s->page->message, '\0', sizeof s->page->message) != NULL ? s->page->message : "";
}

int weightd_set_corrupt(const weightd_set *s) {
  if (s == NULL || s->page == NULL) return 0;
  return (atomic_load_explicit(&s->page->flags, memory_order_acquire) & WD_PAGE_FLAG_CORRUPT) != 0;
}

int weightd_set_wait_tensor(const weightd_set *s, size_t index, int timeout_ms) {
  if (s == NULL) return WEIGHTD_E_INVALID;
  if (index >= weightd_set_tensor_count(s)) return WEIGHTD_E_NOT_FOUND;
  if (s->page == NULL) return 0;
  weightd_tensor t = {.struct_size = sizeof t};
  weightd_set_tensor(s, index, &t);
  return ppage_wait(s->page, t.offset + t.nbytes, timeout_ms < 0 ? -1 : timeout_ms, daemon_alive, s);
}

int weightd_set_wait(const weightd_set *s, const char *name, int timeout_ms) {
  if (s == NULL) return WEIGHTD_E_INVALID;
  if (name == NULL) return s->page == NULL ? 0 : ppage_wait(s->page, UINT64_MAX, timeout_ms < 0 ? -1 : timeout_ms, daemon_alive, s);
  int64_t i = find_index(s, name);
  return i < 0 ? WEIGHTD_E_NOT_FOUND : weightd_set_wait_tensor(s, (size_t)i, timeout_ms);
}
