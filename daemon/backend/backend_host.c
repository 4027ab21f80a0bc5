/*
 * backend_host.c - the host backend: "device" memory is a memfd.
 *
 * A slab is a memfd mapped writable in the daemon while it is filled. From
 * allocation on it is sealed against shrinking, growth and future writes
 * (F_SEAL_FUTURE_WRITE, Linux 5.1): the daemon's mapping made before the seal
 * still writes, every other mapping can only read, so the slab may be handed
 * to clients while it fills (early attach). Once filled, the writable mapping
 * goes away and the memfd is sealed against writes and further seals, so
 * that clients (which map it read-only) can never change shared weights. A
 * copy is a memcpy on the calling thread, so streams and events are
 * trivially complete.
 *
 * Several devices (backend_host_create_devices): each "device" is host memory
 * under its own UUID, and the pairs the options name have "peer access",
 * where a peer copy is a memcpy from the source slab (mapped read-only for
 * the copy once it is sealed). So multi-device placement, replicas and
 * striping run their real decisions and data paths in CI.
 *
 * Threads: the context is written only at creation; each slab is used by one
 * thread at a time, or read by several peer copies at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "manifest.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1 */
#endif

struct host_slab {
  int fd;
  size_t map_len;
};

struct wd_stream {
  int unused;
};

struct wd_event {
  int unused;
};

struct host_ctx {
  int ndev;
  unsigned char *peer; /* ndev * ndev: peer[src * ndev + dst] */
  int writable;        /* tests: slabs never sealed against writes (wd_host_options.writable) */
};

/* The context of backend_host_create: one device, no peers. */
static struct host_ctx host_one = {.ndev = 1};

static int host_device_count(void *ctx) { return ((const struct host_ctx *)ctx)->ndev; }

/*
 * Reads MemTotal and MemAvailable ("Key:   123 kB") from /proc/meminfo; a key
 * that is absent reads 0. Fails when the file cannot be read (out of
 * descriptors, say): the device's memory is then unknown, not zero.
 */
static int meminfo_read(uint64_t *total, uint64_t *available, struct wd_error *err) {
  FILE *f = fopen("/proc/meminfo", "re");
  if (f == NULL) return err_set(err, WEIGHTD_E_IO, "host memory: cannot read /proc/meminfo: %s", strerror(errno));
  char line[256];
  *total = *available = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    if (strncmp(line, "MemTotal:", 9) == 0) *total = strtoull(line + 9, NULL, 10) * 1024;
    else if (strncmp(line, "MemAvailable:", 13) == 0) *available = strtoull(line + 13, NULL, 10) * 1024;
  }
  fclose(f);
  return 0;
}

static int no_device(const struct host_ctx *c, int device, struct wd_error *err) {
  if (c->ndev == 1) return err_set(err, WEIGHTD_E_NOT_FOUND, "host backend has one device (0), not %d", device);
  return err_set(err, WEIGHTD_E_NOT_FOUND, "host backend has %d devices (0 to %d), not %d", c->ndev, c->ndev - 1,
                 device);
}

static int host_device_info(void *ctx, int device, struct wd_device_info *out, struct wd_error *err) {
  const struct host_ctx *c = ctx;
  if (device < 0 || device >= c->ndev) return no_device(c, device, err);
  memset(out, 0, sizeof *out);
  int rc = meminfo_read(&out->memory_total, &out->memory_free, err);
  if (rc != 0) return rc;
  out->index = device;
  snprintf(out->name, sizeof out->name, "host memory");
  char id[64] = "";
  FILE *f = fopen("/etc/machine-id", "re");
  if (f != NULL) {
    if (fgets(id, sizeof id, f) == NULL) id[0] = '\0';
    fclose(f);
  }
  id[strcspn(id, "\r\n")] = '\0';
  if (strlen(id) > 32) id[32] = '\0';
  if (device == 0) snprintf(out->uuid, sizeof out->uuid, "host-%.32s", id[0] ? id : "0");
  else snprintf(out->uuid, sizeof out->uuid, "host-%.32s-%d", id[0] ? id : "0", device);
  out->handles = WD_HANDLE_FD;
  return 0;
}

static int host_slab_alloc(void *ctx, int device, uint64_t bytes, struct wd_slab **out,
                           struct wd_error *err) {
  *out = NULL;
  if (device < 0 || device >= ((const struct host_ctx *)ctx)->ndev) return no_device(ctx, device, err);
  int rc = 0;
  struct wd_slab *s = calloc(1, sizeof *s);
  struct host_slab *h = calloc(1, sizeof *h);
  if (s == NULL || h == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  h->fd = -1;
  /* A mapping cannot be empty: a set of zero-size tensors still gets one page. */
  long page = sysconf(_SC_PAGESIZE);
  h->map_len = bytes ? (size_t)bytes : (size_t)page;
  h->fd = memfd_create("weightd-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (h->fd < 0) {
    rc = err_set(err, WEIGHTD_E_DEVICE, "memfd_create: %s", strerror(errno));
    goto fail;
  }
  if (ftruncate(h->fd, (off_t)h->map_len) != 0) {
    rc = err_set(err, errno == ENOSPC || errno == ENOMEM ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE,
                 "memfd of %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
    goto fail;
  }
  void *p = mmap(NULL, h->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, h->fd, 0);
  if (p == MAP_FAILED) {
    rc = err_set(err, errno == ENOMEM ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE,
                 "mapping a slab of %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
    goto fail;
  }
  s->device = device;
  s->kind = WD_HANDLE_FD;
  s->bytes = bytes;
  s->host_view = p;
  /* Before Linux 5.1 the slab is shared only once sealed whole (no early attach). */
  if (((const struct host_ctx *)ctx)->writable)
    s->export_while_filling = fcntl(h->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0;
  else
    s->export_while_filling = fcntl(h->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) == 0;
  s->impl = h;
  *out = s;
  return 0;
fail:
  if (h != NULL && h->fd >= 0) close(h->fd);
  free(h);
  free(s);
  return rc;
}

static int host_slab_seal(void *ctx, struct wd_slab *s, struct wd_error *err) {
  struct host_slab *h = s->impl;
  if (s->host_view != NULL) {
    munmap(s->host_view, h->map_len);
    s->host_view = NULL;
  }
  if (((const struct host_ctx *)ctx)->writable) return 0; /* tests: clients may write it */
  if (fcntl(h->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0) return 0;
  /*
   * A client that attached early holds a read-write descriptor of the memfd
   * and may have added F_SEAL_SEAL itself. The slab is immutable all the same
   * (future writes sealed, no writable mapping left), so it is served.
   */
  int e = errno, seals = fcntl(h->fd, F_GET_SEALS);
  int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
  if (e == EPERM && seals >= 0 && (seals & need) == need) return 0;
  return err_set(err, WEIGHTD_E_DEVICE, "sealing the slab: %s", strerror(e));
}

static int host_slab_export(void *ctx, struct wd_slab *s, struct wd_handle *out, struct wd_error *err) {
  (void)ctx;
  struct host_slab *h = s->impl;
  memset(out, 0, sizeof *out);
  out->kind = WD_HANDLE_FD;
  out->bytes = s->bytes;
  out->fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
  if (out->fd < 0) return err_set(err, WEIGHTD_E_DEVICE, "dup of slab fd: %s", strerror(errno));
  return 0;
}

static void host_slab_free(void *ctx, struct wd_slab *s) {
  (void)ctx;
  if (s == NULL) return;
  struct host_slab *h = s->impl;
  if (s->host_view != NULL) munmap(s->host_view, h->map_len);
  close(h->fd);
  free(h);
  free(s);
}

/* A memfd an earlier daemon filled and sealed: served read-only, as a sealed slab is. */
static int host_slab_adopt(void *ctx, int device, enum wd_handle_kind kind, int fd, uint64_t bytes,
                           uint64_t alloc_bytes, const unsigned char *alloc_id, struct wd_slab **out,
                           struct wd_error *err) {
  (void)ctx;
  (void)alloc_bytes;
  (void)alloc_id;
  *out = NULL;
  if (kind != WD_HANDLE_FD)
    return err_set(err, WEIGHTD_E_UNSUPPORTED, "the host backend adopts fd slabs, not %s", wd_handle_kind_name(kind));
  long page = sysconf(_SC_PAGESIZE);
  size_t map_len = bytes ? (size_t)bytes : (size_t)page;
  struct stat st;
  int seals = fcntl(fd, F_GET_SEALS);
  int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;
  if (seals < 0 || (seals & need) != need)
    return err_set(err, WEIGHTD_E_INVALID, "slab descriptor is not a memfd sealed against writes and resizing");
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != map_len)
    return err_set(err, WEIGHTD_E_INVALID, "slab memfd has %lld bytes, the set needs %zu", (long long)st.st_size,
                   map_len);
  struct wd_slab *s = calloc(1, sizeof *s);
  struct host_slab *h = calloc(1, sizeof *h);
  if (s == NULL || h == NULL) {
    free(s);
    free(h);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  fcntl(fd, F_SETFD, FD_CLOEXEC);
  h->fd = fd;
  h->map_len = map_len;
  s->device = device;
  s->kind = WD_HANDLE_FD;
  s->bytes = bytes;
  s->export_while_filling = 1;
  s->impl = h;
  *out = s;
  return 0;
}

static int host_pinned_alloc(void *ctx, int device, size_t bytes, unsigned flags, void **out, struct wd_error *err) {
  (void)ctx;
  (void)device;
  (void)flags; /* memfd slabs are filled by memcpy from the buffer: it stays cached */
  *out = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (*out == NULL) return err_set(err, WEIGHTD_E_NOMEM, "staging buffer of %zu bytes", bytes);
  return 0;
}

static void host_pinned_free(void *ctx, int device, void *p) {
  (void)ctx;
  (void)device;
  free(p);
}

static int host_stream_create(void *ctx, int device, struct wd_stream **out, struct wd_error *err) {
  (void)ctx;
  (void)device;
  *out = calloc(1, sizeof **out);
  return *out ? 0 : err_set(err, WEIGHTD_E_NOMEM, "out of memory");
}

static void host_stream_destroy(void *ctx, struct wd_stream *s) {
  (void)ctx;
  free(s);
}

static int host_event_create(void *ctx, int device, struct wd_event **out, struct wd_error *err) {
  (void)ctx;
  (void)device;
  *out = calloc(1, sizeof **out);
  return *out ? 0 : err_set(err, WEIGHTD_E_NOMEM, "out of memory");
}

static void host_event_destroy(void *ctx, struct wd_event *e) {
  (void)ctx;
  free(e);
}

/* Copies complete before copy_h2d returns, so an event is complete when recorded. */
static int host_event_record(void *ctx, struct wd_event *e, struct wd_stream *s, struct wd_error *err) {
  (void)ctx;
  (void)e;
  (void)s;
  (void)err;
  return 0;
}

static int host_event_wait(void *ctx, struct wd_event *e, struct wd_error *err) {
  (void)ctx;
  (void)e;
  (void)err;
  return 0;
}

static int host_copy_h2d(void *ctx, struct wd_slab *dst, uint64_t dst_offset, size_t dst_pitch,
                         const void *src, size_t src_pitch, size_t width, size_t height,
                         struct wd_stream *s, struct wd_error *err) {
  (void)ctx;
  (void)s;
  if (dst->host_view == NULL) return err_set(err, WEIGHTD_E_INTERNAL, "copy into a sealed slab");
  uint64_t span = height ? (uint64_t)(height - 1) * dst_pitch + width : 0;
  if (dst_offset > dst->bytes || span > dst->bytes - dst_offset)
    return err_set(err, WEIGHTD_E_INTERNAL, "copy past the end of the slab");
  char *d = (char *)dst->host_view + dst_offset;
  const char *p = src;
  if (height == 1 || (dst_pitch == width && src_pitch == width)) {
    memcpy(d, p, width * height);
    return 0;
  }
  for (size_t r = 0; r < height; r++) memcpy(d + r * dst_pitch, p + r * src_pitch, width);
  return 0;
}

/* ---- several devices ------------------------------------------------------------- */

static int host_peer_query(void *ctx, int src, int dst, struct wd_peer_info *out, struct wd_error *err) {
  const struct host_ctx *c = ctx;
  if (src < 0 || src >= c->ndev) return no_device(c, src, err);
  if (dst < 0 || dst >= c->ndev) return no_device(c, dst, err);
  memset(out, 0, sizeof *out);
  out->access = src != dst && c->peer != NULL && c->peer[src * c->ndev + dst];
  out->link = out->access ? WD_LINK_HOST : WD_LINK_NONE;
  out->performance_rank = out->access ? 0 : -1;
  return 0;
}

/* A peer copy is a memcpy; a sealed source is mapped read-only for it. */
static int host_copy_peer(void *ctx, struct wd_slab *dst, uint64_t dst_offset, const struct wd_slab *src,
                          uint64_t src_offset, uint64_t bytes, struct wd_stream *s, struct wd_error *err) {
  (void)ctx;
  (void)s;
  if (dst->host_view == NULL) return err_set(err, WEIGHTD_E_INTERNAL, "peer copy into a sealed slab");
  if (dst_offset > dst->bytes || bytes > dst->bytes - dst_offset || src_offset > src->bytes ||
      bytes > src->bytes - src_offset)
    return err_set(err, WEIGHTD_E_INTERNAL, "peer copy past the end of a slab");
  const struct host_slab *h = src->impl;
  const char *view = src->host_view;
  if (view == NULL) {
    view = mmap(NULL, h->map_len, PROT_READ, MAP_SHARED, h->fd, 0);
    if (view == MAP_FAILED)
      return err_set(err, errno == ENOMEM ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE,
                     "mapping the source of a peer copy: %s", strerror(errno));
  }
  memcpy((char *)dst->host_view + dst_offset, view + src_offset, (size_t)bytes);
  if (view != src->host_view) munmap((void *)view, h->map_len);
  return 0;
}

/* ---- digests ---------------------------------------------------------------------- */

/* Tensor digests (mf_tensor_digest) of the slab's bytes: its writable mapping while it fills, else a read-only one made for the call. */
static int host_slab_hash(void *ctx, const struct wd_slab *s, const struct wd_hash_range *ranges, size_t n,
                          unsigned char (*out)[WD_DIGEST_BYTES], struct wd_error *err) {
  (void)ctx;
  for (size_t i = 0; i < n; i++)
    if (ranges[i].off > s->bytes || ranges[i].len > s->bytes - ranges[i].off)
      return err_set(err, WEIGHTD_E_INTERNAL, "digest of bytes %llu+%llu past the end of a slab of %llu",
                     (unsigned long long)ranges[i].off, (unsigned long long)ranges[i].len,
                     (unsigned long long)s->bytes);
  const struct host_slab *h = s->impl;
  const unsigned char *view = s->host_view;
  if (view == NULL) {
    view = mmap(NULL, h->map_len, PROT_READ, MAP_SHARED, h->fd, 0);
    if (view == MAP_FAILED)
      return err_set(err, errno == ENOMEM ? WEIGHTD_E_NOMEM : WEIGHTD_E_DEVICE, "mapping a slab to digest it: %s",
                     strerror(errno));
  }
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    if (mf_tensor_digest(view + ranges[i].off, (size_t)ranges[i].len, out[i]) != 0)
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory for the leaf digests of bytes %llu+%llu of a slab",
                   (unsigned long long)ranges[i].off, (unsigned long long)ranges[i].len);
  if (view != s->host_view) munmap((void *)view, h->map_len);
  return rc;
}

static void host_destroy(void *ctx) {
  struct host_ctx *c = ctx;
  if (c == NULL || c == &host_one) return;
  free(c->peer);
  free(c);
}

static const struct wd_backend_ops host_ops = {
    .name = "host",
    .caps = WD_CAP_HOST_SLABS,
    .device_count = host_device_count,
    .device_info = host_device_info,
    .slab_alloc = host_slab_alloc,
    .slab_seal = host_slab_seal,
    .slab_export = host_slab_export,
    .slab_free = host_slab_free,
    .slab_adopt = host_slab_adopt,
    .pinned_alloc = host_pinned_alloc,
    .pinned_free = host_pinned_free,
    .host_register = NULL, /* the CPU reads any host memory: no registration */
    .host_unregister = NULL,
    .stream_create = host_stream_create,
    .stream_destroy = host_stream_destroy,
    .event_create = host_event_create,
    .event_destroy = host_event_destroy,
    .event_record = host_event_record,
    .event_wait = host_event_wait,
    .copy_h2d = host_copy_h2d,
    .peer_query = host_peer_query,
    .copy_peer = host_copy_peer,
    .slab_hash = host_slab_hash,
    .scratch_alloc = host_slab_alloc, /* a slab that is never sealed nor exported */
    .pci_bus_id = NULL,               /* host memory is no PCI device */
    .destroy = host_destroy,
};

int backend_host_create(struct wd_backend *out, struct wd_error *err) {
  (void)err;
  out->ops = &host_ops;
  out->ctx = &host_one;
  return 0;
}

/* Reads "all", "none" or "A-B,C-D" into c->peer; 0 or INVALID naming the bad part. */
static int parse_peers(struct host_ctx *c, const char *spec, struct wd_error *err) {
  int n = c->ndev;
  if (spec == NULL || strcmp(spec, "all") == 0) {
    for (int a = 0; a < n; a++)
      for (int b = 0; b < n; b++) c->peer[a * n + b] = a != b;
    return 0;
  }
  if (strcmp(spec, "none") == 0 || spec[0] == '\0') return 0;
  const char *p = spec;
  while (*p != '\0') {
    char *end;
    long a = strtol(p, &end, 10), b = -1;
    if (end != p && *end == '-') {
      const char *q = end + 1;
      b = strtol(q, &end, 10);
      if (end == q) b = -1;
    }
    if (a < 0 || b < 0 || a >= n || b >= n || a == b || (*end != ',' && *end != '\0') || (*end == ',' && end[1] == '\0'))
      return err_set(err, WEIGHTD_E_INVALID,
                     "host_peers: '%s' is not all, none, or pairs of distinct devices below %d such as 0-1,2-3", spec,
                     n);
    c->peer[a * n + b] = c->peer[b * n + a] = 1;
    p = *end == ',' ? end + 1 : end;
  }
  return 0;
}

int backend_host_create_devices(struct wd_backend *out, const struct wd_host_options *o, struct wd_error *err) {
  out->ops = NULL;
  out->ctx = NULL;
  if (o == NULL || (o->devices <= 1 && !o->writable)) return backend_host_create(out, err);
  int ndev = o->devices > 1 ? o->devices : 1;
  struct host_ctx *c = calloc(1, sizeof *c);
  if (c != NULL) c->peer = calloc((size_t)ndev * (size_t)ndev, 1);
  if (c == NULL || c->peer == NULL) {
    free(c);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  c->ndev = ndev;
  c->writable = o->writable;
  int rc = parse_peers(c, o->peers, err);
  if (rc != 0) {
    host_destroy(c);
    return rc;
  }
  out->ops = &host_ops;
  out->ctx = c;
  return 0;
}
