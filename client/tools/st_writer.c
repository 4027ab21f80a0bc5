/*
 * st_writer.c - the safetensors checkpoint writer (see st_writer.h).
 *
 * DESIGN: stw_run() runs on the caller's thread: it creates every shard as
 * "<name>.tmp" with its header and its full size, cuts the shards' data into
 * jobs of at most chunk bytes and starts the workers. A worker takes the
 * next job number from an atomic counter, has the fill callback produce
 * that range into the worker's own buffer tensor by tensor, pwrite()s it
 * and adds its length to the atomic progress counter. Workers share the
 * writer read-only (layout, descriptors, jobs) except for the job counter,
 * the stop flag and the progress counter (atomics) and the first-error slot
 * `err`, which `lock` guards. After joining them the calling thread closes
 * the shards, writes the companions and the index, renames everything into
 * place (the index last) and removes what an earlier run left.
 */
#include "st_writer.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "jsonutil.h"
#include "safetensors.h"

#define SINGLE_NAME "model.safetensors"
#define MIN_NAME_DIGITS 5u
#define MAX_NAME_DIGITS 20u

/* The companion files a checkpoint directory holds that a writer may write (and remove when stale). */
static const char *const companion_names[] = {"config.json"};

/* One file of the output: a safetensors file, a companion or the index. */
struct out {
  char *name; /* the final name */
  char *tmp;  /* DIR/name.tmp */
  int fd;
  bool created; /* this run made tmp, which has not been renamed yet */
  /* A safetensors file: tensors [first, first + count), its header, its data bytes. */
  size_t first, count;
  char *header;
  size_t header_len; /* 8 + the padded JSON */
  uint64_t data_bytes;
  /* A companion or the index: the whole text. */
  const char *text;
  size_t text_len;
};

/* One job: bytes [off, off + len) of the data of safetensors file `file`. */
struct job {
  size_t file;
  uint64_t off, len;
};

/* See DESIGN above. */
struct stw_writer {
  char *dir;
  const struct stw_tensor *tensors;
  size_t ntensors;
  uint64_t *offset; /* per tensor: where it starts in its file's data */
  struct out *outs; /* the safetensors files, the companions, the index */
  size_t nfiles, nouts;
  char *index_text;
  const char **tmp_paths; /* nouts + 1, NULL-terminated */
  stw_fill_fn fill;
  void *fill_arg;
  unsigned threads;
  uint64_t chunk;
  uint64_t total;
  bool sparse;
  uint64_t disk_bytes; /* allocated blocks of the files, after the run */
  bool ran;
  struct job *jobs;
  size_t njobs;
  atomic_size_t next;
  atomic_bool stop;
  _Atomic uint64_t done;
  pthread_mutex_t lock;
  struct wd_error err; /* guarded by lock; code 0 until the first failure */
};

unsigned stw_cpus_usable(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return (unsigned)CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (unsigned)n : 1;
}

/* Writes all of buf at file offset off; 0, or -1 with errno set. */
static int pwrite_all(int fd, const void *buf, size_t len, uint64_t off) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = pwrite(fd, p, len, (off_t)off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) {
      errno = EIO;
      return -1;
    }
    p += n;
    len -= (size_t)n;
    off += (uint64_t)n;
  }
  return 0;
}

/* ---- names ------------------------------------------------------------------------------ */

/* Advances *p past at least min decimal digits; false when there are fewer. */
static bool skip_digits(const char **p, size_t min) {
  const char *start = *p;
  while (**p >= '0' && **p <= '9') (*p)++;
  return (size_t)(*p - start) >= min;
}

/* True for a name the writer writes (a file name, the index, a companion) or its ".tmp" form. */
static bool name_is_own(const char *name) {
  char base[256];
  size_t len = strlen(name);
  if (len >= sizeof base) return false;
  memcpy(base, name, len + 1);
  if (len > 4 && strcmp(base + len - 4, ".tmp") == 0) base[len - 4] = '\0';
  if (strcmp(base, SINGLE_NAME) == 0 || strcmp(base, STW_INDEX_NAME) == 0) return true;
  for (size_t i = 0; i < sizeof companion_names / sizeof companion_names[0]; i++)
    if (strcmp(base, companion_names[i]) == 0) return true;
  const char *p = base;
  if (strncmp(p, "model-", 6) != 0) return false;
  p += 6;
  if (!skip_digits(&p, MIN_NAME_DIGITS) || strncmp(p, "-of-", 4) != 0) return false;
  p += 4;
  return skip_digits(&p, MIN_NAME_DIGITS) && strcmp(p, ".safetensors") == 0;
}

static bool name_is_companion(const char *name) {
  for (size_t i = 0; i < sizeof companion_names / sizeof companion_names[0]; i++)
    if (strcmp(name, companion_names[i]) == 0) return true;
  return false;
}

int stw_dir_find_foreign(const char *dir, char *name, size_t cap, struct wd_error *err) {
  DIR *d = opendir(dir);
  if (d == NULL) return err_set(err, WEIGHTD_E_IO, "%s: %s", dir, strerror(errno));
  int found = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 || name_is_own(e->d_name)) continue;
    if (cap > 0) snprintf(name, cap, "%s", e->d_name);
    found = 1;
    break;
  }
  closedir(d);
  return found;
}

/* ---- the layout --------------------------------------------------------------------------- */

/* Checks one tensor: a name, a known dtype, a byte count that its shape and dtype make. */
static int tensor_check(const struct stw_tensor *t, struct wd_error *err) {
  if (t->name == NULL || strcmp(t->name, "__metadata__") == 0)
    return err_set(err, WEIGHTD_E_INVALID, "tensor '%s': not a tensor name", t->name ? t->name : "(null)");
  unsigned bits = dtype_bits(t->dtype);
  if (bits == 0) return err_set(err, WEIGHTD_E_INVALID, "tensor '%s': unknown dtype", t->name);
  if (t->ndim > 0 && t->shape == NULL) return err_set(err, WEIGHTD_E_INVALID, "tensor '%s': no shape", t->name);
  uint64_t elems = 1, total_bits;
  for (unsigned d = 0; d < t->ndim; d++)
    if (__builtin_mul_overflow(elems, t->shape[d], &elems))
      return err_set(err, WEIGHTD_E_INVALID, "tensor '%s': the shape overflows", t->name);
  if (__builtin_mul_overflow(elems, (uint64_t)bits, &total_bits) || total_bits % 8 != 0 ||
      total_bits / 8 != t->nbytes)
    return err_set(err, WEIGHTD_E_INVALID, "tensor '%s': %" PRIu64 " bytes do not match its dtype %s and shape",
                   t->name, t->nbytes, dtype_name(t->dtype));
  return 0;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp((*(const struct stw_tensor *const *)a)->name, (*(const struct stw_tensor *const *)b)->name);
}

/* Sets *out to a new array of the tensors sorted by name, after checking that none is given twice. */
static int tensors_by_name(const struct stw_writer *w, const struct stw_tensor ***out, struct wd_error *err) {
  const struct stw_tensor **by = malloc((w->ntensors ? w->ntensors : 1) * sizeof *by);
  if (by == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory sorting %zu tensor names", w->ntensors);
  for (size_t i = 0; i < w->ntensors; i++) by[i] = &w->tensors[i];
  qsort(by, w->ntensors, sizeof *by, cmp_name);
  for (size_t i = 1; i < w->ntensors; i++) {
    if (strcmp(by[i - 1]->name, by[i]->name) == 0) {
      int rc = err_set(err, WEIGHTD_E_INVALID, "two tensors named '%s'", by[i]->name);
      free(by);
      return rc;
    }
  }
  *out = by;
  return 0;
}

/*
 * The file of every tensor: save_pretrained's greedy rule at max bytes, or
 * the spec's own assignment checked. Fills file_of; returns the file count
 * (1 when there are no tensors), or 0 with err filled.
 */
static size_t files_assign(const struct stw_spec *s, size_t *file_of, struct wd_error *err) {
  size_t f = 0, open_count = 0;
  uint64_t open_bytes = 0;
  for (size_t i = 0; i < s->ntensors; i++) {
    const struct stw_tensor *t = &s->tensors[i];
    if (s->max_file_bytes > 0) {
      if (open_count > 0 && open_bytes + t->nbytes > s->max_file_bytes) {
        f++;
        open_count = 0;
        open_bytes = 0;
      }
    } else {
      size_t next = i == 0 ? 0 : f + 1; /* the first tensor opens file 0; later ones stay or open the next */
      if (t->file > next || (i > 0 && t->file < f)) {
        err_set(err, WEIGHTD_E_INVALID, "tensor '%s': in file %zu after file %zu; files start at 0 and follow in order",
                t->name, t->file, f);
        return 0;
      }
      f = t->file;
    }
    file_of[i] = f;
    open_count++;
    open_bytes += t->nbytes;
  }
  return f + 1;
}

/* Adds the entry {"dtype", "shape", "data_offsets"} of t, at data offset off, to header h. */
static int header_tensor_add(cJSON *h, const struct stw_tensor *t, uint64_t off) {
  cJSON *e = cJSON_AddObjectToObject(h, t->name);
  if (e == NULL || cJSON_AddStringToObject(e, "dtype", dtype_name(t->dtype)) == NULL) return WEIGHTD_E_NOMEM;
  cJSON *shape = cJSON_AddArrayToObject(e, "shape");
  if (shape == NULL) return WEIGHTD_E_NOMEM;
  for (unsigned d = 0; d < t->ndim; d++)
    if (json_u64_add(shape, NULL, t->shape[d]) < 0) return WEIGHTD_E_NOMEM;
  cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
  if (offs == NULL || json_u64_add(offs, NULL, off) < 0 || json_u64_add(offs, NULL, off + t->nbytes) < 0)
    return WEIGHTD_E_NOMEM;
  return 0;
}

/*
 * Builds the header of safetensors file f: the 8-byte length, then the JSON
 * padded with spaces to a multiple of 8.
 */
static int header_build(struct stw_writer *w, struct out *f, const struct stw_spec *s, struct wd_error *err) {
  cJSON *h = cJSON_CreateObject();
  char *text = NULL;
  int rc = h != NULL ? 0 : WEIGHTD_E_NOMEM;
  if (rc == 0 && s->nmeta > 0) {
    cJSON *meta = cJSON_AddObjectToObject(h, "__metadata__");
    if (meta == NULL) rc = WEIGHTD_E_NOMEM;
    for (size_t i = 0; i < s->nmeta && rc == 0; i++)
      if (cJSON_AddStringToObject(meta, s->meta[i].key, s->meta[i].value) == NULL) rc = WEIGHTD_E_NOMEM;
  }
  for (size_t i = f->first; i < f->first + f->count && rc == 0; i++)
    rc = header_tensor_add(h, &w->tensors[i], w->offset[i]);
  if (rc == 0 && (text = cJSON_PrintUnformatted(h)) == NULL) rc = WEIGHTD_E_NOMEM;
  if (rc < 0) {
    err_set(err, rc, "out of memory building the header of %s", f->name);
    goto fail;
  }
  size_t n = strlen(text), padded = (n + 7) / 8 * 8;
  if (padded > ST_MAX_HEADER_LEN) {
    rc = err_set(err, WEIGHTD_E_LIMIT, "the header of %s would be %zu bytes, over safetensors' limit of %llu",
                 f->name, padded, ST_MAX_HEADER_LEN);
    goto fail;
  }
  f->header = malloc(8 + padded);
  if (f->header == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory building the header of %s", f->name);
    goto fail;
  }
  for (int i = 0; i < 8; i++) f->header[i] = (char)((uint64_t)padded >> (8 * i));
  memcpy(f->header + 8, text, n);
  memset(f->header + 8 + n, ' ', padded - n);
  f->header_len = 8 + padded;
  rc = 0;

fail:
  free(text);
  cJSON_Delete(h);
  return rc;
}

/* Writes s as a JSON string: quotes, backslashes and control characters escaped, UTF-8 as is. */
static void json_string_put(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
    if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
    else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
    else fputc(*p, f);
  }
  fputc('"', f);
}

/*
 * Builds model.safetensors.index.json as save_pretrained writes it (json.dumps
 * with indent 2 and sorted keys) into w->index_text.
 */
static int index_build(struct stw_writer *w, const struct stw_tensor *const *by_name, const size_t *file_of,
                       size_t *len, struct wd_error *err) {
  FILE *f = open_memstream(&w->index_text, len);
  if (f == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory building %s", STW_INDEX_NAME);
  fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %" PRIu64 "\n  },\n  \"weight_map\": {\n", w->total);
  for (size_t k = 0; k < w->ntensors; k++) {
    fputs("    ", f);
    json_string_put(f, by_name[k]->name);
    fputs(": ", f);
    json_string_put(f, w->outs[file_of[by_name[k] - w->tensors]].name);
    fputs(k + 1 < w->ntensors ? ",\n" : "\n", f);
  }
  fputs("  }\n}\n", f);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad) return err_set(err, WEIGHTD_E_NOMEM, "out of memory building %s", STW_INDEX_NAME);
  return 0;
}

/* Gives output o its name and DIR/name.tmp path. */
static int out_name(struct stw_writer *w, struct out *o, char *name, struct wd_error *err) {
  o->name = name;
  o->fd = -1;
  if (o->name == NULL || asprintf(&o->tmp, "%s/%s.tmp", w->dir, o->name) < 0) {
    o->tmp = NULL;
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory naming the output files");
  }
  return 0;
}

/* Names the safetensors files and builds their headers and the index. */
static int layout_build(struct stw_writer *w, const struct stw_spec *s, const size_t *file_of,
                        const struct stw_tensor *const *by_name, struct wd_error *err) {
  unsigned digits = s->name_digits > MIN_NAME_DIGITS ? s->name_digits : MIN_NAME_DIGITS;
  int rc = 0;
  for (size_t k = 0; k < w->nfiles && rc == 0; k++) {
    char *name = NULL;
    if (w->nfiles == 1) name = strdup(SINGLE_NAME);
    else if (asprintf(&name, "model-%05zu-of-%0*zu.safetensors", k + 1, (int)digits, w->nfiles) < 0) name = NULL;
    rc = out_name(w, &w->outs[k], name, err);
  }
  for (size_t i = 0; i < w->ntensors && rc == 0; i++) {
    struct out *f = &w->outs[file_of[i]];
    if (f->count == 0) f->first = i;
    w->offset[i] = f->data_bytes;
    f->data_bytes += w->tensors[i].nbytes;
    f->count++;
  }
  for (size_t k = 0; k < w->nfiles && rc == 0; k++) rc = header_build(w, &w->outs[k], s, err);
  for (size_t c = 0; c < s->ncompanions && rc == 0; c++) {
    struct out *o = &w->outs[w->nfiles + c];
    rc = out_name(w, o, strdup(s->companions[c].name), err);
    o->text = s->companions[c].text;
    o->text_len = s->companions[c].len;
  }
  if (rc == 0 && w->nfiles > 1) {
    struct out *o = &w->outs[w->nouts - 1];
    rc = index_build(w, by_name, file_of, &o->text_len, err);
    o->text = w->index_text;
    if (rc == 0) rc = out_name(w, o, strdup(STW_INDEX_NAME), err);
  }
  for (size_t k = 0; k < w->nouts && rc == 0; k++) w->tmp_paths[k] = w->outs[k].tmp;
  return rc;
}

/* Checks the spec's scalars and companions; 0 or WEIGHTD_E_INVALID. */
static int spec_check(const struct stw_spec *s, struct wd_error *err) {
  if (s->dir == NULL || (s->fill == NULL && !s->sparse) || (s->ntensors > 0 && s->tensors == NULL))
    return err_set(err, WEIGHTD_E_INVALID, "no directory, tensors or fill callback");
  if (s->name_digits > MAX_NAME_DIGITS)
    return err_set(err, WEIGHTD_E_INVALID, "%u digits in file names; at most %u", s->name_digits, MAX_NAME_DIGITS);
  for (size_t i = 0; i < s->nmeta; i++)
    if (s->meta[i].key == NULL || s->meta[i].value == NULL)
      return err_set(err, WEIGHTD_E_INVALID, "metadata entry %zu has no key or value", i);
  for (size_t c = 0; c < s->ncompanions; c++) {
    const struct stw_companion *p = &s->companions[c];
    if (p->name == NULL || !name_is_companion(p->name) || (p->len > 0 && p->text == NULL))
      return err_set(err, WEIGHTD_E_INVALID, "'%s' is not a companion file a writer knows",
                     p->name ? p->name : "(null)");
    for (size_t k = 0; k < c; k++)
      if (strcmp(s->companions[k].name, p->name) == 0)
        return err_set(err, WEIGHTD_E_INVALID, "companion '%s' given twice", p->name);
  }
  return 0;
}

int stw_create(const struct stw_spec *s, struct stw_writer **out, struct wd_error *err) {
  struct stw_writer *w = NULL;
  const struct stw_tensor **by_name = NULL;
  size_t *file_of = NULL;
  *out = NULL;
  int rc = spec_check(s, err);
  for (size_t i = 0; i < s->ntensors && rc == 0; i++) rc = tensor_check(&s->tensors[i], err);
  if (rc < 0) return rc;
  w = calloc(1, sizeof *w);
  if (w == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory for the writer");
  pthread_mutex_init(&w->lock, NULL);
  atomic_init(&w->next, 0);
  atomic_init(&w->stop, false);
  atomic_init(&w->done, 0);
  w->tensors = s->tensors;
  w->ntensors = s->ntensors;
  w->fill = s->fill;
  w->fill_arg = s->fill_arg;
  w->threads = s->threads ? s->threads : stw_cpus_usable();
  if (w->threads > STW_THREADS_MAX) w->threads = STW_THREADS_MAX;
  w->chunk = s->chunk_bytes ? s->chunk_bytes : STW_CHUNK_DEFAULT;
  w->sparse = s->sparse != 0;
  file_of = malloc((s->ntensors ? s->ntensors : 1) * sizeof *file_of);
  if (file_of == NULL || (w->dir = strdup(s->dir)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory for the writer");
    goto fail;
  }
  for (size_t i = 0; i < s->ntensors; i++) {
    if (__builtin_add_overflow(w->total, s->tensors[i].nbytes, &w->total)) {
      rc = err_set(err, WEIGHTD_E_INVALID, "the tensors' bytes add up past 2^64");
      goto fail;
    }
  }
  rc = tensors_by_name(w, &by_name, err);
  if (rc < 0) goto fail;
  w->nfiles = files_assign(s, file_of, err);
  if (w->nfiles == 0) {
    rc = WEIGHTD_E_INVALID;
    goto fail;
  }
  w->nouts = w->nfiles + s->ncompanions + (w->nfiles > 1);
  w->offset = calloc(s->ntensors ? s->ntensors : 1, sizeof *w->offset);
  w->outs = calloc(w->nouts, sizeof *w->outs);
  w->tmp_paths = calloc(w->nouts + 1, sizeof *w->tmp_paths);
  if (w->offset == NULL || w->outs == NULL || w->tmp_paths == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory for %zu files", w->nouts);
    goto fail;
  }
  rc = layout_build(w, s, file_of, by_name, err);
  if (rc < 0) goto fail;
  free(by_name);
  free(file_of);
  *out = w;
  return 0;

fail:
  free(by_name);
  free(file_of);
  stw_free(w);
  return rc;
}

void stw_free(struct stw_writer *w) {
  if (w == NULL) return;
  for (size_t k = 0; w->outs != NULL && k < w->nouts; k++) {
    free(w->outs[k].name);
    free(w->outs[k].tmp);
    free(w->outs[k].header);
  }
  pthread_mutex_destroy(&w->lock);
  free(w->outs);
  free(w->tmp_paths);
  free(w->index_text);
  free(w->offset);
  free(w->jobs);
  free(w->dir);
  free(w);
}

size_t stw_file_count(const struct stw_writer *w) { return w->nfiles; }

const char *stw_file_name(const struct stw_writer *w, size_t i) { return i < w->nfiles ? w->outs[i].name : NULL; }

const char *const *stw_tmp_paths(const struct stw_writer *w) { return w->tmp_paths; }

void stw_progress_get(const struct stw_writer *w, uint64_t *done, uint64_t *total) {
  *done = atomic_load(&w->done);
  *total = w->total;
}

/* ---- workers ------------------------------------------------------------------------------- */

static void writer_fail(struct stw_writer *w, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Records the first failure and tells every worker to stop. */
static void writer_fail(struct stw_writer *w, int code, const char *fmt, ...) {
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

/* Has the fill callback produce the bytes of job j (tensors end to end, as the file holds them) into buf. */
static int job_fill(const struct stw_writer *w, const struct job *j, unsigned char *buf, struct wd_error *err) {
  const struct out *f = &w->outs[j->file];
  size_t lo = f->first, hi = f->first + f->count;
  while (hi - lo > 1) { /* the last tensor that starts at or before j->off */
    size_t mid = lo + (hi - lo) / 2;
    if (w->offset[mid] <= j->off) lo = mid;
    else hi = mid;
  }
  uint64_t end = j->off + j->len;
  for (size_t i = lo; i < f->first + f->count && w->offset[i] < end; i++) {
    uint64_t a = w->offset[i] > j->off ? w->offset[i] : j->off;
    uint64_t b = w->offset[i] + w->tensors[i].nbytes < end ? w->offset[i] + w->tensors[i].nbytes : end;
    if (b <= a) continue;
    int rc = w->fill(w->fill_arg, i, a - w->offset[i], (size_t)(b - a), buf + (a - j->off), err);
    if (rc < 0) {
      if (err->msg[0] == '\0') err_set(err, rc, "tensor '%s': the fill callback failed", w->tensors[i].name);
      return rc;
    }
  }
  return 0;
}

static void *worker_main(void *arg) {
  struct stw_writer *w = arg;
  unsigned char *buf = malloc((size_t)w->chunk);
  if (buf == NULL) {
    writer_fail(w, WEIGHTD_E_NOMEM, "out of memory for a %" PRIu64 "-byte buffer", w->chunk);
    return NULL;
  }
  while (!atomic_load(&w->stop)) {
    size_t n = atomic_fetch_add(&w->next, 1);
    if (n >= w->njobs) break;
    const struct job *j = &w->jobs[n];
    const struct out *f = &w->outs[j->file];
    struct wd_error e = {0};
    int rc = job_fill(w, j, buf, &e);
    if (rc < 0) {
      writer_fail(w, rc, "%s", e.msg);
      break;
    }
    if (pwrite_all(f->fd, buf, (size_t)j->len, f->header_len + j->off) < 0) {
      writer_fail(w, WEIGHTD_E_IO, "%s: write: %s", f->tmp, strerror(errno));
      break;
    }
    atomic_fetch_add(&w->done, j->len);
  }
  free(buf);
  return NULL;
}

/* Cuts every safetensors file's data into jobs of at most w->chunk bytes. */
static int jobs_build(struct stw_writer *w, struct wd_error *err) {
  size_t n = 0;
  for (size_t f = 0; f < w->nfiles; f++) n += (size_t)((w->outs[f].data_bytes + w->chunk - 1) / w->chunk);
  w->jobs = calloc(n ? n : 1, sizeof *w->jobs);
  if (w->jobs == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory for %zu jobs", n);
  for (size_t f = 0; f < w->nfiles; f++)
    for (uint64_t off = 0; off < w->outs[f].data_bytes; off += w->chunk) {
      uint64_t left = w->outs[f].data_bytes - off;
      w->jobs[w->njobs++] = (struct job){f, off, left < w->chunk ? left : w->chunk};
    }
  return 0;
}

/* Runs the workers over every job; 0 or the first failure. */
static int workers_run(struct stw_writer *w, struct wd_error *err) {
  pthread_t threads[STW_THREADS_MAX];
  unsigned nthreads = w->threads < w->njobs ? w->threads : (unsigned)w->njobs, started = 0;
  for (; started < nthreads; started++) {
    int e = pthread_create(&threads[started], NULL, worker_main, w);
    if (e != 0) {
      writer_fail(w, WEIGHTD_E_INTERNAL, "cannot start a worker thread: %s", strerror(e));
      break;
    }
  }
  for (unsigned i = 0; i < started; i++) pthread_join(threads[i], NULL);
  if (w->err.code != 0) return err_set(err, w->err.code, "%s", w->err.msg);
  return 0;
}

/* ---- files ------------------------------------------------------------------------------------ */

/* Creates o's .tmp file; for a safetensors file with its header and its full size (data a hole when sparse). */
static int out_create(struct out *o, bool sparse, struct wd_error *err) {
  o->fd = open(o->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (o->fd < 0) return err_set(err, WEIGHTD_E_IO, "%s: %s", o->tmp, strerror(errno));
  o->created = true;
  if (o->header == NULL) return 0;
  uint64_t size = o->header_len + o->data_bytes;
  if (!sparse && fallocate(o->fd, 0, 0, (off_t)size) < 0 && errno != EOPNOTSUPP && errno != ENOSYS)
    return err_set(err, WEIGHTD_E_IO, "%s: cannot reserve %" PRIu64 " bytes: %s", o->tmp, size, strerror(errno));
  if (ftruncate(o->fd, (off_t)size) < 0 || pwrite_all(o->fd, o->header, o->header_len, 0) < 0)
    return err_set(err, WEIGHTD_E_IO, "%s: %s", o->tmp, strerror(errno));
  return 0;
}

/* Closes o's .tmp file. */
static int out_close(struct out *o, const char *what, struct wd_error *err) {
  int fd = o->fd;
  o->fd = -1;
  if (close(fd) < 0) return err_set(err, WEIGHTD_E_IO, "%s: %s%s", o->tmp, what, strerror(errno));
  return 0;
}

/* Writes a companion or the index to its .tmp file. */
static int out_text_write(struct out *o, struct wd_error *err) {
  int rc = out_create(o, false, err);
  if (rc == 0 && pwrite_all(o->fd, o->text, o->text_len, 0) < 0)
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s", o->tmp, strerror(errno));
  if (rc == 0) return out_close(o, "", err);
  return rc;
}

/* Renames o's .tmp file to its final name. */
static int out_rename(const struct stw_writer *w, struct out *o, struct wd_error *err) {
  char *to = NULL;
  if (asprintf(&to, "%s/%s", w->dir, o->name) < 0) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int rc = 0;
  if (rename(o->tmp, to) < 0) rc = err_set(err, WEIGHTD_E_IO, "%s: rename: %s", to, strerror(errno));
  else o->created = false;
  free(to);
  return rc;
}

/* Removes the writer's own files in the directory that this run did not write. */
static void stale_remove(const struct stw_writer *w) {
  DIR *d = opendir(w->dir);
  if (d == NULL) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!name_is_own(e->d_name)) continue;
    bool kept = false;
    for (size_t k = 0; k < w->nouts && !kept; k++) kept = strcmp(w->outs[k].name, e->d_name) == 0;
    if (!kept) unlinkat(dirfd(d), e->d_name, 0);
  }
  closedir(d);
}

/*
 * Checks that a file grown with ftruncate in dir stays a hole (the file
 * systems weightd meets do; FAT-like ones fill it with zeros), with a 64 MiB
 * probe that is removed again. 0, or WEIGHTD_E_IO.
 */
static int holes_check(const struct stw_writer *w, struct wd_error *err) {
  char *probe = NULL;
  if (asprintf(&probe, "%s/" STW_INDEX_NAME ".tmp", w->dir) < 0) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int rc = 0, fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  struct stat st;
  if (fd < 0) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s", probe, strerror(errno));
  } else {
    if (ftruncate(fd, 64ll << 20) < 0 || fstat(fd, &st) < 0)
      rc = err_set(err, WEIGHTD_E_IO, "%s: %s", probe, strerror(errno));
    else if ((uint64_t)st.st_blocks * 512 > (1ull << 20))
      rc = err_set(err, WEIGHTD_E_IO,
                   "%s: the file system does not keep holes (a 64 MiB hole took %llu bytes): a sparse checkpoint "
                   "would take its full size",
                   w->dir, (unsigned long long)st.st_blocks * 512);
    close(fd);
    unlink(probe);
  }
  free(probe);
  return rc;
}

uint64_t stw_disk_bytes(const struct stw_writer *w) { return w->disk_bytes; }

int stw_run(struct stw_writer *w, struct wd_error *err) {
  int rc;
  if (w->ran) return err_set(err, WEIGHTD_E_INVALID, "this writer has run already");
  w->ran = true;
  if (w->sparse && (rc = holes_check(w, err)) < 0) return rc;
  for (size_t k = 0; k < w->nfiles; k++) {
    rc = out_create(&w->outs[k], w->sparse, err);
    if (rc < 0) goto fail;
  }
  if (!w->sparse) {
    rc = jobs_build(w, err);
    if (rc < 0) goto fail;
    rc = workers_run(w, err);
    if (rc < 0) goto fail;
  }
  for (size_t k = 0; k < w->nfiles; k++) {
    struct stat st;
    if (fstat(w->outs[k].fd, &st) == 0) w->disk_bytes += (uint64_t)st.st_blocks * 512;
    rc = out_close(&w->outs[k], "close: ", err);
    if (rc < 0) goto fail;
  }
  for (size_t k = w->nfiles; k < w->nouts; k++) {
    rc = out_text_write(&w->outs[k], err);
    if (rc < 0) goto fail;
  }
  /* In order: shards, companions, the index last. */
  for (size_t k = 0; k < w->nouts; k++) {
    rc = out_rename(w, &w->outs[k], err);
    if (rc < 0) goto fail;
  }
  stale_remove(w);
  return 0;

fail:
  for (size_t k = 0; k < w->nouts; k++) {
    struct out *o = &w->outs[k];
    if (o->fd >= 0) close(o->fd);
    o->fd = -1;
    if (o->created) unlink(o->tmp);
    o->created = false;
  }
  return rc;
}
