/*
 * mkcheckpoint.c - `weightctl mkcheckpoint`: writes a synthetic checkpoint
 * with the exact tensor names, shapes, dtypes and shard files of a
 * published Hugging Face model, filled with seeded random bytes.
 *
 * DESIGN: The main thread parses the options, builds the layout
 * (ckpt_presets.c), checks the output directory, creates every shard as
 * "<name>.tmp", writes its header and reserves its size. Then worker
 * threads, one per usable CPU, fill the tensor data: the data of all
 * shards is cut into jobs of at most 8 MiB; a worker takes the next job
 * number from an atomic counter, generates that range into its own buffer
 * and pwrite()s it to the shard. Workers share the read-only layout, keys,
 * job list and descriptors, the atomic counter and stop flag, and the
 * first-error slot, which a mutex guards. After joining the workers the
 * main thread writes config.json and the index, renames every .tmp file
 * into place (the index last) and removes files of an earlier run that
 * this run did not write. Nothing is fsync()ed.
 *
 * The bytes are a counter-based stream, so any job can be generated alone
 * and the output does not depend on the thread count: 8-byte word i of a
 * tensor is splitmix64's output function applied to key + (i + 1) * golden,
 * stored little-endian, where key mixes the seed with an FNV-1a hash of the
 * tensor's name. F32 tensors (DeepSeek's weight_scale_inv and
 * e_score_correction_bias) hold finite values in [1e-4, 1e-2] instead,
 * element i taken from word i.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_presets.h"
#include "ctl.h"
#include "error.h"
#include "weightd.h"

#define CHUNK_BYTES ((size_t)8 << 20)
#define MAX_THREADS 64
#define GOLDEN 0x9e3779b97f4a7c15ULL

/* ---- the byte stream -------------------------------------------------------- */

/* splitmix64's output function. */
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Converts a host-order word to little-endian. */
static inline uint64_t to_le64(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return __builtin_bswap64(v);
#else
  return v;
#endif
}

/* The stream key of a tensor: the seed mixed with the FNV-1a hash of its name. */
static uint64_t tensor_key(uint64_t seed, const char *name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char *s = (const unsigned char *)name; *s != '\0'; s++) {
    h ^= *s;
    h *= 0x100000001b3ULL;
  }
  return mix64(mix64(seed + GOLDEN) ^ h);
}

/* Writes bytes [off, off+len) of the random stream with key `key` into dst. */
static void fill_bytes(unsigned char *dst, uint64_t key, uint64_t off, size_t len) {
  uint64_t i = off / 8;
  size_t skip = (size_t)(off % 8);
  uint64_t w;
  if (skip != 0 && len > 0) {
    size_t n = 8 - skip < len ? 8 - skip : len;
    w = to_le64(mix64(key + (i + 1) * GOLDEN));
    memcpy(dst, (unsigned char *)&w + skip, n);
    dst += n;
    len -= n;
    i++;
  }
  size_t words = len / 8;
  uint64_t z = key + (i + 1) * GOLDEN;
  for (size_t k = 0; k < words; k++, z += GOLDEN) {
    w = to_le64(mix64(z));
    memcpy(dst + 8 * k, &w, 8);
  }
  dst += 8 * words;
  len -= 8 * words;
  if (len > 0) {
    w = to_le64(mix64(z));
    memcpy(dst, &w, len);
  }
}

/* Writes bytes [off, off+len) of an F32 tensor of finite values in [1e-4, 1e-2] into dst. */
static void fill_f32_positive(unsigned char *dst, uint64_t key, uint64_t off, size_t len) {
  uint64_t e = off / 4;
  size_t skip = (size_t)(off % 4);
  while (len > 0) {
    float u = (float)(mix64(key + (e + 1) * GOLDEN) >> 40) * (1.0f / 16777216.0f);
    float v = 1e-4f + u * (1e-2f - 1e-4f);
    unsigned char le[4];
    uint32_t bits;
    memcpy(&bits, &v, 4);
    for (int b = 0; b < 4; b++) le[b] = (unsigned char)(bits >> (8 * b));
    size_t n = 4 - skip < len ? 4 - skip : len;
    memcpy(dst, le + skip, n);
    dst += n;
    len -= n;
    skip = 0;
    e++;
  }
}

/* The fill of each ckpt_fill kind. */
static void (*const fillers[])(unsigned char *, uint64_t, uint64_t, size_t) = {
    [CKPT_FILL_BYTES] = fill_bytes,
    [CKPT_FILL_F32_POSITIVE] = fill_f32_positive,
};

/* ---- small helpers ------------------------------------------------------------ */

/* A growing text buffer whose error is sticky: after a failed append, rc < 0. */
struct sbuf {
  char *p;
  size_t len;
  size_t cap;
  int rc;
};

/* Appends formatted text to b. */
static void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(struct sbuf *b, const char *fmt, ...) {
  if (b->rc < 0) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->rc = WEIGHTD_E_INTERNAL;
      return;
    }
    if (b->p != NULL && (size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len <= (size_t)n) cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL) {
      b->rc = WEIGHTD_E_NOMEM;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
}

/* Writes all of buf at file offset off; returns 0 or -1 with errno set. */
static int pwrite_all(int fd, const void *buf, size_t len, uint64_t off) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = pwrite(fd, p, len, (off_t)off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
    off += (uint64_t)n;
  }
  return 0;
}

/* Joins dir and name into buf; returns 0 or WEIGHTD_E_INVALID when it does not fit. */
static int path_join(char *buf, size_t buflen, const char *dir, const char *name, const char *suffix,
                     struct wd_error *err) {
  int n = snprintf(buf, buflen, "%s/%s%s", dir, name, suffix);
  if (n < 0 || (size_t)n >= buflen) return err_set(err, WEIGHTD_E_INVALID, "%s: path too long", dir);
  return 0;
}

/* The number of CPUs this process may run on (at least 1). */
static unsigned usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return (unsigned)CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (unsigned)n : 1;
}

/* ---- the output directory ------------------------------------------------------ */

/*
 * Whether `name` is a file mkcheckpoint writes: config.json,
 * model.safetensors, model.safetensors.index.json or
 * model-NNNNN-of-NNNNN.safetensors, each optionally with ".tmp".
 */
static bool own_file_name(const char *name) {
  static const char *const fixed[] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
  size_t len = strlen(name);
  if (len > 4 && strcmp(name + len - 4, ".tmp") == 0) len -= 4;
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
    if (strlen(fixed[i]) == len && memcmp(fixed[i], name, len) == 0) return true;
  const char *s = name, *end = name + len;
  static const char *const parts[] = {"model-", "-of-", ".safetensors"};
  for (size_t i = 0; i < 3; i++) {
    size_t plen = strlen(parts[i]);
    if ((size_t)(end - s) < plen || memcmp(s, parts[i], plen) != 0) return false;
    s += plen;
    if (i == 2) break;
    const char *digits = s;
    while (s < end && *s >= '0' && *s <= '9') s++;
    if (s - digits < 5) return false;
  }
  return s == end;
}

/* Creates dir and its missing parents; returns 0 or WEIGHTD_E_IO. */
static int make_dirs(const char *dir, struct wd_error *err) {
  char buf[PATH_MAX];
  size_t len = strlen(dir);
  if (len == 0 || len >= sizeof buf) return err_set(err, WEIGHTD_E_INVALID, "bad output directory '%s'", dir);
  memcpy(buf, dir, len + 1);
  for (size_t i = 1; i <= len; i++) {
    if (buf[i] != '/' && buf[i] != '\0') continue;
    char c = buf[i];
    buf[i] = '\0';
    if (mkdir(buf, 0755) < 0 && errno != EEXIST)
      return err_set(err, WEIGHTD_E_IO, "%s: cannot create directory: %s", buf, strerror(errno));
    buf[i] = c;
  }
  struct stat st;
  if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
    return err_set(err, WEIGHTD_E_IO, "%s: not a directory", dir);
  return 0;
}

/*
 * Creates dir if missing and checks that it holds only files mkcheckpoint
 * writes. Returns 0, WEIGHTD_E_IO, or WEIGHTD_E_INVALID for a foreign entry.
 */
static int prepare_dir(const char *dir, struct wd_error *err) {
  int rc = make_dirs(dir, err);
  if (rc < 0) return rc;
  DIR *d = opendir(dir);
  if (d == NULL) return err_set(err, WEIGHTD_E_IO, "%s: %s", dir, strerror(errno));
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    if (!own_file_name(e->d_name)) {
      rc = err_set(err, WEIGHTD_E_INVALID,
                   "%s: holds '%s', which mkcheckpoint does not write; choose an empty directory", dir,
                   e->d_name);
      break;
    }
  }
  closedir(d);
  return rc;
}

/* Removes the files of an earlier run from dir: own-named files not in keep[0..nkeep). */
static void remove_stale(const char *dir, const char *const *keep, size_t nkeep) {
  DIR *d = opendir(dir);
  if (d == NULL) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!own_file_name(e->d_name)) continue;
    bool kept = false;
    for (size_t i = 0; i < nkeep && !kept; i++) kept = strcmp(keep[i], e->d_name) == 0;
    if (!kept) unlinkat(dirfd(d), e->d_name, 0);
  }
  closedir(d);
}

/* ---- writing -------------------------------------------------------------------- */

/* One output file: its final name, its descriptor while open, its tensors. */
struct out_file {
  char name[64];
  int fd;
  bool created;
  size_t first;
  size_t count;
  uint64_t data_start;
  uint64_t data_bytes;
};

/* One job: bytes [off, off+len) of a shard's data. */
struct job {
  uint32_t shard;
  uint32_t len;
  uint64_t off;
};

/* What the workers share (see DESIGN above). */
struct writer {
  const struct ckpt_layout *l;
  const char *dir;
  uint64_t *keys;
  struct out_file *files;
  struct job *jobs;
  size_t njobs;
  atomic_size_t next;
  atomic_bool stop;
  pthread_mutex_t lock;
  struct wd_error err; /* guarded by lock; err.code 0 until the first failure */
};

/* Records the first failure and tells every worker to stop. */
static void writer_fail(struct writer *w, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void writer_fail(struct writer *w, int code, const char *fmt, ...) {
  pthread_mutex_lock(&w->lock);
  if (w->err.code == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err.msg, sizeof w->err.msg, fmt, ap);
    va_end(ap);
    w->err.code = code;
  }
  pthread_mutex_unlock(&w->lock);
  atomic_store(&w->stop, true);
}

/* Generates the bytes of job j into buf. */
static void job_generate(const struct writer *w, const struct job *j, unsigned char *buf) {
  const struct out_file *f = &w->files[j->shard];
  const struct ckpt_tensor *t = w->l->tensors + f->first;
  size_t lo = 0, hi = f->count;
  while (hi - lo > 1) { /* the last tensor that starts at or before j->off */
    size_t mid = lo + (hi - lo) / 2;
    if (t[mid].offset <= j->off) lo = mid;
    else hi = mid;
  }
  uint64_t end = j->off + j->len;
  for (size_t i = lo; i < f->count && t[i].offset < end; i++) {
    uint64_t a = t[i].offset > j->off ? t[i].offset : j->off;
    uint64_t b = t[i].offset + t[i].nbytes < end ? t[i].offset + t[i].nbytes : end;
    if (b <= a) continue;
    fillers[t[i].fill](buf + (a - j->off), w->keys[f->first + i], a - t[i].offset, (size_t)(b - a));
  }
}

/* A worker: takes jobs until none are left or one failed. */
static void *worker_main(void *arg) {
  struct writer *w = arg;
  unsigned char *buf = malloc(CHUNK_BYTES);
  if (buf == NULL) {
    writer_fail(w, WEIGHTD_E_NOMEM, "cannot allocate a %zu-byte buffer", CHUNK_BYTES);
    return NULL;
  }
  while (!atomic_load(&w->stop)) {
    size_t n = atomic_fetch_add(&w->next, 1);
    if (n >= w->njobs) break;
    const struct job *j = &w->jobs[n];
    const struct out_file *f = &w->files[j->shard];
    job_generate(w, j, buf);
    if (pwrite_all(f->fd, buf, j->len, f->data_start + j->off) < 0) {
      writer_fail(w, WEIGHTD_E_IO, "%s/%s.tmp: write: %s", w->dir, f->name, strerror(errno));
      break;
    }
  }
  free(buf);
  return NULL;
}

/* Builds the safetensors header of file f: 8-byte length, JSON, spaces to a multiple of 8. */
static int header_build(const struct ckpt_layout *l, const struct out_file *f, struct sbuf *b) {
  sb_printf(b, "12345678{\"__metadata__\":{\"format\":\"pt\"}");
  for (size_t i = f->first; i < f->first + f->count; i++) {
    const struct ckpt_tensor *t = &l->tensors[i];
    sb_printf(b, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu", t->name, dtype_name(t->dtype),
              (unsigned long long)t->shape[0]);
    if (t->ndim > 1) sb_printf(b, ",%llu", (unsigned long long)t->shape[1]);
    sb_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->offset,
              (unsigned long long)(t->offset + t->nbytes));
  }
  sb_printf(b, "}");
  while (b->rc == 0 && b->len % 8 != 0) sb_printf(b, " ");
  if (b->rc < 0) return b->rc;
  uint64_t n = b->len - 8;
  for (int i = 0; i < 8; i++) b->p[i] = (char)(n >> (8 * i));
  return 0;
}

/* Creates shard file i as "<name>.tmp", writes its header and reserves its size. */
static int shard_open(struct writer *w, uint32_t i, struct wd_error *err) {
  struct out_file *f = &w->files[i];
  struct sbuf hdr = {0};
  char path[PATH_MAX];
  int rc = path_join(path, sizeof path, w->dir, f->name, ".tmp", err);
  if (rc < 0) goto fail;
  f->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s", path, strerror(errno));
    goto fail;
  }
  f->created = true;
  rc = header_build(w->l, f, &hdr);
  if (rc < 0) {
    err_set(err, rc, "%s: cannot build the header", path);
    goto fail;
  }
  f->data_start = hdr.len;
  uint64_t size = f->data_start + f->data_bytes;
  if (fallocate(f->fd, 0, 0, (off_t)size) < 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: cannot reserve %llu bytes: %s", path, (unsigned long long)size,
                 strerror(errno));
    goto fail;
  }
  if (ftruncate(f->fd, (off_t)size) < 0 || pwrite_all(f->fd, hdr.p, hdr.len, 0) < 0) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s", path, strerror(errno));
    goto fail;
  }
  free(hdr.p);
  return 0;

fail:
  free(hdr.p);
  return rc;
}

/* Cuts the data of every shard into jobs of at most CHUNK_BYTES. */
static int jobs_build(struct writer *w, struct wd_error *err) {
  size_t n = 0;
  for (uint32_t s = 0; s < w->l->shards; s++) n += (size_t)((w->files[s].data_bytes + CHUNK_BYTES - 1) / CHUNK_BYTES);
  w->jobs = calloc(n ? n : 1, sizeof *w->jobs);
  if (w->jobs == NULL) return err_set(err, WEIGHTD_E_NOMEM, "cannot allocate %zu jobs", n);
  for (uint32_t s = 0; s < w->l->shards; s++) {
    for (uint64_t off = 0; off < w->files[s].data_bytes; off += CHUNK_BYTES) {
      uint64_t left = w->files[s].data_bytes - off;
      w->jobs[w->njobs++] = (struct job){s, (uint32_t)(left < CHUNK_BYTES ? left : CHUNK_BYTES), off};
    }
  }
  return 0;
}

/* Runs `nthreads` workers over all jobs; returns 0 or the first worker's error. */
static int workers_run(struct writer *w, unsigned nthreads, struct wd_error *err) {
  pthread_t threads[MAX_THREADS];
  unsigned started = 0;
  int rc = 0;
  for (; started < nthreads; started++) {
    int e = pthread_create(&threads[started], NULL, worker_main, w);
    if (e != 0) {
      writer_fail(w, WEIGHTD_E_INTERNAL, "cannot start a worker thread: %s", strerror(e));
      break;
    }
  }
  for (unsigned i = 0; i < started; i++) pthread_join(threads[i], NULL);
  if (w->err.code != 0) rc = err_set(err, w->err.code, "%s", w->err.msg);
  return rc;
}

/* Writes `text` to dir/name.tmp; the caller renames it. */
static int small_file_write(const char *dir, const char *name, const char *text, size_t len,
                            struct wd_error *err) {
  char path[PATH_MAX];
  int rc = path_join(path, sizeof path, dir, name, ".tmp", err);
  if (rc < 0) return rc;
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return err_set(err, WEIGHTD_E_IO, "%s: %s", path, strerror(errno));
  if (pwrite_all(fd, text, len, 0) < 0) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s", path, strerror(errno));
    goto fail;
  }
  if (close(fd) < 0) {
    fd = -1;
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s", path, strerror(errno));
    goto fail;
  }
  return 0;

fail:
  if (fd >= 0) close(fd);
  unlink(path);
  return rc;
}

/* Orders tensors by name, as the index's sorted weight_map does. */
static int tensor_name_cmp(const void *a, const void *b) {
  const struct ckpt_tensor *const *x = a, *const *y = b;
  return strcmp((*x)->name, (*y)->name);
}

/* Builds model.safetensors.index.json as save_pretrained writes it (sorted keys, indent 2). */
static int index_build(const struct writer *w, struct sbuf *b) {
  const struct ckpt_layout *l = w->l;
  const struct ckpt_tensor **sorted = malloc(l->count * sizeof *sorted);
  if (sorted == NULL) return WEIGHTD_E_NOMEM;
  for (size_t i = 0; i < l->count; i++) sorted[i] = &l->tensors[i];
  qsort(sorted, l->count, sizeof *sorted, tensor_name_cmp);
  sb_printf(b, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {\n",
            (unsigned long long)l->total_bytes);
  for (size_t i = 0; i < l->count; i++)
    sb_printf(b, "    \"%s\": \"%s\"%s\n", sorted[i]->name, w->files[sorted[i]->shard].name,
              i + 1 < l->count ? "," : "");
  sb_printf(b, "  }\n}\n");
  free(sorted);
  return b->rc;
}

/* Writes config.json.tmp and, for a sharded layout, model.safetensors.index.json.tmp. */
static int meta_write(const struct writer *w, struct wd_error *err) {
  struct sbuf idx = {0};
  char *cfg = NULL;
  size_t cfglen = 0;
  int rc;
  FILE *f = open_memstream(&cfg, &cfglen);
  if (f == NULL) return err_set(err, WEIGHTD_E_NOMEM, "cannot build config.json");
  rc = ckpt_config_write(w->l, f);
  if (fclose(f) != 0 && rc == 0) rc = WEIGHTD_E_NOMEM;
  if (rc < 0) {
    err_set(err, rc, "cannot build config.json");
    goto fail;
  }
  rc = small_file_write(w->dir, "config.json", cfg, cfglen, err);
  if (rc < 0) goto fail;
  if (w->l->shards > 1) {
    rc = index_build(w, &idx);
    if (rc < 0) {
      err_set(err, rc, "cannot build model.safetensors.index.json");
      goto fail;
    }
    rc = small_file_write(w->dir, "model.safetensors.index.json", idx.p, idx.len, err);
    if (rc < 0) goto fail;
  }
  free(cfg);
  free(idx.p);
  return 0;

fail:
  free(cfg);
  free(idx.p);
  return rc;
}

/* Renames dir/name.tmp to dir/name. */
static int rename_into_place(const char *dir, const char *name, struct wd_error *err) {
  char from[PATH_MAX], to[PATH_MAX];
  int rc = path_join(from, sizeof from, dir, name, ".tmp", err);
  if (rc == 0) rc = path_join(to, sizeof to, dir, name, "", err);
  if (rc == 0 && rename(from, to) < 0) rc = err_set(err, WEIGHTD_E_IO, "%s: rename: %s", to, strerror(errno));
  return rc;
}

/* Closes the shards and removes every .tmp file this run created (nothing before the files exist). */
static void tmp_cleanup(const struct writer *w) {
  static const char *const meta[] = {"config.json", "model.safetensors.index.json"};
  char path[PATH_MAX];
  if (w->files == NULL) return;
  for (uint32_t s = 0; s < w->l->shards; s++) {
    if (w->files[s].fd >= 0) close(w->files[s].fd);
    w->files[s].fd = -1;
    if (w->files[s].created && path_join(path, sizeof path, w->dir, w->files[s].name, ".tmp", NULL) == 0)
      unlink(path);
  }
  for (size_t i = 0; i < sizeof meta / sizeof meta[0]; i++)
    if (path_join(path, sizeof path, w->dir, meta[i], ".tmp", NULL) == 0) unlink(path);
}

/*
 * Writes layout l into dir with the given seed: every shard, config.json
 * and (for several shards) the index. Fills *seconds with the time the
 * writing took. Returns 0 or a negative code with err filled.
 */
static int checkpoint_write(const struct ckpt_layout *l, const char *dir, uint64_t seed, unsigned nthreads,
                            double *seconds, struct wd_error *err) {
  struct writer w = {.l = l, .dir = dir};
  const char **keep = NULL;
  size_t nkeep = 0;
  int rc;
  atomic_init(&w.next, 0);
  atomic_init(&w.stop, false);
  pthread_mutex_init(&w.lock, NULL);
  double t0 = clock_s();

  rc = prepare_dir(dir, err);
  if (rc < 0) goto fail;
  w.keys = malloc(l->count * sizeof *w.keys);
  w.files = calloc(l->shards, sizeof *w.files);
  keep = calloc((size_t)l->shards + 2, sizeof *keep);
  if (w.keys == NULL || w.files == NULL || keep == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "cannot allocate the writer state");
    goto fail;
  }
  for (size_t i = 0; i < l->count; i++) w.keys[i] = tensor_key(seed, l->tensors[i].name);
  for (uint32_t s = 0; s < l->shards; s++) {
    w.files[s].fd = -1;
    ckpt_shard_name(l, s, w.files[s].name, sizeof w.files[s].name);
  }
  for (size_t i = 0; i < l->count; i++) {
    struct out_file *f = &w.files[l->tensors[i].shard];
    if (f->count == 0) f->first = i;
    f->count++;
    f->data_bytes += l->tensors[i].nbytes;
  }
  for (uint32_t s = 0; s < l->shards; s++) {
    rc = shard_open(&w, s, err);
    if (rc < 0) goto fail;
  }
  rc = jobs_build(&w, err);
  if (rc < 0) goto fail;
  if (nthreads > w.njobs) nthreads = (unsigned)w.njobs;
  if (nthreads == 0) nthreads = 1;
  rc = workers_run(&w, nthreads, err);
  if (rc < 0) goto fail;
  for (uint32_t s = 0; s < l->shards; s++) {
    int fd = w.files[s].fd;
    w.files[s].fd = -1;
    if (close(fd) < 0) {
      rc = err_set(err, WEIGHTD_E_IO, "%s/%s.tmp: close: %s", dir, w.files[s].name, strerror(errno));
      goto fail;
    }
  }
  rc = meta_write(&w, err);
  if (rc < 0) goto fail;

  /* Shards first, the index last: a reader that finds the index finds every shard. */
  for (uint32_t s = 0; s < l->shards; s++) {
    rc = rename_into_place(dir, w.files[s].name, err);
    if (rc < 0) goto fail;
    w.files[s].created = false;
    keep[nkeep++] = w.files[s].name;
  }
  rc = rename_into_place(dir, "config.json", err);
  if (rc < 0) goto fail;
  keep[nkeep++] = "config.json";
  if (l->shards > 1) {
    rc = rename_into_place(dir, "model.safetensors.index.json", err);
    if (rc < 0) goto fail;
    keep[nkeep++] = "model.safetensors.index.json";
  }
  remove_stale(dir, keep, nkeep);
  *seconds = clock_s() - t0;
  free(keep);
  free(w.jobs);
  free(w.files);
  free(w.keys);
  pthread_mutex_destroy(&w.lock);
  return 0;

fail:
  tmp_cleanup(&w);
  free(keep);
  free(w.jobs);
  free(w.files);
  free(w.keys);
  pthread_mutex_destroy(&w.lock);
  return rc;
}

/* ---- the command ------------------------------------------------------------------ */

enum opt_id { OPT_PRESET, OPT_OUT, OPT_LAYERS, OPT_EXPERTS, OPT_SEED, OPT_LIST, OPT_COUNT };
enum opt_kind { OPT_KIND_STRING, OPT_KIND_U64, OPT_KIND_FLAG };

/* The options, one row each. */
static const struct {
  const char *name;
  enum opt_kind kind;
} opt_defs[OPT_COUNT] = {
    [OPT_PRESET] = {"--preset", OPT_KIND_STRING},
    [OPT_OUT] = {"--out", OPT_KIND_STRING},
    [OPT_LAYERS] = {"--layers", OPT_KIND_U64},
    [OPT_EXPERTS] = {"--experts", OPT_KIND_U64},
    [OPT_SEED] = {"--seed", OPT_KIND_U64},
    [OPT_LIST] = {"--list", OPT_KIND_FLAG},
};

struct options {
  bool given[OPT_COUNT];
  const char *text[OPT_COUNT];
  unsigned long long num[OPT_COUNT];
};

/* Parses argv (argv[0] is the command) into o; returns 0 or -1 after printing why. */
static int options_parse(int argc, char **argv, struct options *o) {
  memset(o, 0, sizeof *o);
  for (int a = 1; a < argc; a++) {
    const char *arg = argv[a];
    const char *eq = strchr(arg, '=');
    size_t nlen = eq ? (size_t)(eq - arg) : strlen(arg);
    int id = -1;
    for (int k = 0; k < OPT_COUNT; k++)
      if (strlen(opt_defs[k].name) == nlen && strncmp(opt_defs[k].name, arg, nlen) == 0) id = k;
    if (id < 0) {
      ctl_errorf("mkcheckpoint: unknown argument '%s'", arg);
      return -1;
    }
    const char *value = NULL;
    if (opt_defs[id].kind == OPT_KIND_FLAG) {
      if (eq != NULL) {
        ctl_errorf("mkcheckpoint: %s takes no value", opt_defs[id].name);
        return -1;
      }
    } else if (eq != NULL) {
      value = eq + 1;
    } else if (a + 1 < argc) {
      value = argv[++a];
    } else {
      ctl_errorf("mkcheckpoint: %s needs a value", opt_defs[id].name);
      return -1;
    }
    if (opt_defs[id].kind == OPT_KIND_U64 && ctl_parse_u64(value, &o->num[id]) < 0) {
      ctl_errorf("mkcheckpoint: %s: '%s' is not a non-negative integer", opt_defs[id].name, value);
      return -1;
    }
    o->given[id] = true;
    o->text[id] = value;
  }
  return 0;
}

/* The variant of preset p that the options ask for (they were checked against p). */
static struct ckpt_variant variant_of(const struct options *o, const struct ckpt_preset *p) {
  return (struct ckpt_variant){
      .layers = o->given[OPT_LAYERS] ? (uint32_t)o->num[OPT_LAYERS] : p->num_layers,
      .experts = o->given[OPT_EXPERTS] ? (uint32_t)o->num[OPT_EXPERTS] : 0,
  };
}

/*
 * Prints the presets (or the one named, as the options cut it) with their
 * layers, routed experts per MoE layer ("-" for a dense model), tensor
 * count, payload bytes and shards.
 */
static int list_presets(const struct options *o) {
  struct wd_error err = {0};
  printf("%-14s %-22s %6s %7s %8s %15s %10s %6s\n", "PRESET", "ARCHITECTURE", "LAYERS", "EXPERTS", "TENSORS",
         "PAYLOAD_BYTES", "PAYLOAD_GB", "SHARDS");
  for (size_t i = 0; i < ckpt_preset_count(); i++) {
    const struct ckpt_preset *p = ckpt_preset_at(i);
    if (o->given[OPT_PRESET] && strcmp(p->name, o->text[OPT_PRESET]) != 0) continue;
    struct ckpt_variant v = variant_of(o, p);
    struct ckpt_layout l;
    if (ckpt_layout_build(p, &v, &l, &err) < 0) {
      ctl_errorf("%s", err.msg);
      return CTL_EXIT_FAIL;
    }
    char experts[16] = "-";
    if (l.model.num_experts > 0) snprintf(experts, sizeof experts, "%u", l.model.num_experts);
    printf("%-14s %-22s %6u %7s %8zu %15llu %10.2f %6u\n", p->name, p->architecture, l.layers, experts, l.count,
           (unsigned long long)l.total_bytes, (double)l.total_bytes / 1e9, l.shards);
    ckpt_layout_free(&l);
  }
  return CTL_EXIT_OK;
}

/*
 * Checks --experts against preset p (NULL when none was named). Returns 0,
 * or -1 after printing one line that says why.
 */
static int experts_check(const struct options *o, const struct ckpt_preset *p) {
  unsigned long long n = o->num[OPT_EXPERTS];
  if (!o->given[OPT_EXPERTS]) return 0;
  if (p == NULL) {
    ctl_errorf("mkcheckpoint: --experts needs --preset");
    return -1;
  }
  if (p->num_experts == 0) {
    ctl_errorf("mkcheckpoint: --experts: %s is a dense model without routed experts", p->name);
    return -1;
  }
  if (n < 1 || n > p->num_experts) {
    ctl_errorf("mkcheckpoint: --experts must be 1 to %u for %s, not %llu", p->num_experts, p->name, n);
    return -1;
  }
  return 0;
}

int cmd_mkcheckpoint(int argc, char **argv) {
  struct options o;
  struct wd_error err = {0};
  struct ckpt_layout l = {0};
  const struct ckpt_preset *p = NULL;
  double seconds = 0;

  if (options_parse(argc, argv, &o) < 0) return ctl_usage("mkcheckpoint");
  if (o.given[OPT_PRESET]) {
    p = ckpt_preset_find(o.text[OPT_PRESET]);
    if (p == NULL) {
      ctl_errorf("mkcheckpoint: unknown preset '%s' (--list shows them)", o.text[OPT_PRESET]);
      return ctl_usage("mkcheckpoint");
    }
  }
  if (o.given[OPT_LAYERS] && (p == NULL || o.num[OPT_LAYERS] < 1 || o.num[OPT_LAYERS] > p->num_layers)) {
    if (p == NULL) ctl_errorf("mkcheckpoint: --layers needs --preset");
    else ctl_errorf("mkcheckpoint: --layers must be 1 to %u for %s", p->num_layers, p->name);
    return ctl_usage("mkcheckpoint");
  }
  if (experts_check(&o, p) < 0) return CTL_EXIT_USAGE;
  if (o.given[OPT_LIST]) return list_presets(&o);
  if (p == NULL || !o.given[OPT_OUT]) {
    ctl_errorf("mkcheckpoint: needs --preset and --out");
    return ctl_usage("mkcheckpoint");
  }

  struct ckpt_variant v = variant_of(&o, p);
  unsigned nthreads = usable_cpus();
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (ckpt_layout_build(p, &v, &l, &err) < 0) goto fail;
  if (checkpoint_write(&l, o.text[OPT_OUT], o.num[OPT_SEED], nthreads, &seconds, &err) < 0) goto fail;
  char experts[48] = "";
  if (p->num_experts > 0) snprintf(experts, sizeof experts, ", %u of %u experts", l.model.num_experts, p->num_experts);
  printf("wrote %s (%u of %u layers%s): %zu tensors, %llu payload bytes, %u shard%s in %s; %.2f s, %.2f GB/s, "
         "%u thread%s\n",
         p->name, l.layers, p->num_layers, experts, l.count, (unsigned long long)l.total_bytes, l.shards,
         l.shards == 1 ? "" : "s", o.text[OPT_OUT], seconds, seconds > 0 ? (double)l.total_bytes / 1e9 / seconds : 0.0,
         nthreads, nthreads == 1 ? "" : "s");
  ckpt_layout_free(&l);
  return CTL_EXIT_OK;

fail:
  ctl_errorf("mkcheckpoint: %s", err.msg);
  ckpt_layout_free(&l);
  return CTL_EXIT_FAIL;
}
