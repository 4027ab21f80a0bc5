/*
 * cmd_export.c - `weightctl export PATH [plan flags] --out DIR`: writes one
 * rank's plan outputs as a safetensors checkpoint that any reader loads:
 * model.safetensors, or shards model-0000k-of-0000n.safetensors cut by
 * save_pretrained's greedy rule at --max-shard-bytes (4,000,000,000 by
 * default) with model.safetensors.index.json; tensors in plan order, each
 * header padded with spaces to a multiple of 8 bytes, __metadata__ holding
 * {"format": "pt", "weightd_plan": the plan's key (docs/protocol.md, "Identity"),
 * "weightd_source": the checkpoint's resolved path}; config.json copied
 * along when the checkpoint has one.
 *
 * DESIGN: The main thread builds the plan from read-only mappings of the
 * shards (ctl_local_open), checks the output directory, assigns outputs to
 * files, creates each file as "<name>.tmp" with its header and its full
 * size, and cuts the files' data into jobs of at most CHUNK bytes. Worker
 * threads take the next job number from an atomic counter, gather that
 * range of the outputs into their own buffer with plan_gather and pwrite()
 * it. Workers share the read-only plan, mappings, file table and job list,
 * the atomic counter and stop flag, and the first-error slot, which a mutex
 * guards. After joining them the main thread writes the index and
 * config.json, renames every .tmp file into place (the index last) and
 * removes files of an earlier export that this one did not write. A SIGBUS
 * (a shard truncated under its mapping) removes the .tmp files and exits
 * with one error line. Nothing is fsync()ed.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "ctl.h"
#include "pathutil.h"
#include "plan.h"
#include "safetensors.h"

/* A job's bytes: small enough that a worker's buffer stays in its L2 cache between gather and write. */
#define CHUNK ((uint64_t)2 << 20)
#define DEFAULT_MAX_SHARD 4000000000ull
/* Writers into the page cache stop gaining past about 4 (16-core host: 3.3 GB/s with 1, 5.9 with 4, 5.4 with 8). */
#define DEFAULT_MAX_THREADS 4u
#define MAX_THREADS 64u
#define CONFIG_MAX_BYTES (16u << 20)
#define INDEX_NAME "model.safetensors.index.json"

/* One output file: its name, descriptor while open, and the outputs it holds. */
struct out_file {
  char name[64];
  char *tmp; /* DIR/name.tmp */
  int fd;
  int created;
  size_t first, count; /* outputs [first, first + count) of the plan */
  uint64_t data_start; /* 8 + header length */
  uint64_t data_bytes;
};

/* One job: bytes [off, off + len) of a file's data. */
struct job {
  size_t file;
  uint64_t off, len;
};

/* What the workers share (see DESIGN above). */
struct exporter {
  const struct ctl_local *local;
  const char *dir;
  struct out_file *files;
  size_t nfiles;
  uint64_t *data_off; /* per output: its offset in its file's data */
  const char **cleanup; /* the .tmp paths, NULL-terminated, for the SIGBUS guard */
  struct job *jobs;
  size_t njobs;
  atomic_size_t next;
  atomic_int stop;
  pthread_mutex_t lock;
  struct wd_error err; /* guarded by lock; code 0 until the first failure */
};

static unsigned usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return (unsigned)CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (unsigned)n : 1;
}

static int pwrite_all(int fd, const void *buf, size_t len, uint64_t off) {
  const char *p = buf;
  while (len > 0) {
    ssize_t w = pwrite(fd, p, len, (off_t)off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    len -= (size_t)w;
    off += (uint64_t)w;
  }
  return 0;
}

/* ---- the output directory ------------------------------------------------------------ */

/* Advances *p past a run of decimal digits; false when there is none. */
static int skip_digits(const char **p) {
  const char *start = *p;
  while (**p >= '0' && **p <= '9') (*p)++;
  return *p > start;
}

/* True for the names export writes: config.json, model.safetensors, the index, shards; and their .tmp. */
static int own_file_name(const char *name) {
  char base[NAME_MAX + 1];
  size_t len = strlen(name);
  if (len > NAME_MAX) return 0;
  memcpy(base, name, len + 1);
  if (len > 4 && strcmp(base + len - 4, ".tmp") == 0) base[len - 4] = '\0';
  if (strcmp(base, "config.json") == 0 || strcmp(base, "model.safetensors") == 0 || strcmp(base, INDEX_NAME) == 0)
    return 1;
  const char *p = base;
  if (strncmp(p, "model-", 6) != 0) return 0;
  p += 6;
  if (!skip_digits(&p) || strncmp(p, "-of-", 4) != 0) return 0;
  p += 4;
  if (!skip_digits(&p)) return 0;
  return strcmp(p, ".safetensors") == 0;
}

/*
 * Creates dir if missing (its parent must exist) and checks that it is not the
 * checkpoint's own directory and holds only files export writes.
 */
static int prepare_dir(const char *dir, const struct ckpt *ck) {
  struct stat st, src;
  if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
    ctl_errorf("export: %s: cannot create the directory: %s", dir, strerror(errno));
    return CTL_EXIT_FAIL;
  }
  if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) {
    ctl_errorf("export: %s: not a directory", dir);
    return CTL_EXIT_FAIL;
  }
  if (stat(ck->dir, &src) == 0 && src.st_dev == st.st_dev && src.st_ino == st.st_ino) {
    ctl_errorf("export: %s is the checkpoint's own directory; choose another --out", dir);
    return CTL_EXIT_FAIL;
  }
  DIR *d = opendir(dir);
  if (d == NULL) {
    ctl_errorf("export: %s: %s", dir, strerror(errno));
    return CTL_EXIT_FAIL;
  }
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 || own_file_name(e->d_name)) continue;
    ctl_errorf("export: %s holds '%s', which export does not write; choose an empty directory", dir, e->d_name);
    rc = CTL_EXIT_FAIL;
    break;
  }
  closedir(d);
  return rc;
}

/* Removes the files of an earlier export: own-named files not among the n names in keep. */
static void remove_stale(const char *dir, const char *const *keep, size_t n) {
  DIR *d = opendir(dir);
  if (d == NULL) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!own_file_name(e->d_name)) continue;
    int kept = 0;
    for (size_t i = 0; i < n && !kept; i++) kept = strcmp(keep[i], e->d_name) == 0;
    if (!kept) unlinkat(dirfd(d), e->d_name, 0);
  }
  closedir(d);
}

/* ---- layout --------------------------------------------------------------------------- */

/*
 * Assigns outputs to files by save_pretrained's rule: a new file starts when
 * the next output would push the open one past max (so an output larger
 * than max gets a file of its own). Fills x->files, x->nfiles and
 * x->data_off.
 */
static int files_assign(struct exporter *x, uint64_t max) {
  const struct plan *p = x->local->plan;
  size_t n = p->noutputs, f = 0;
  x->data_off = calloc(n ? n : 1, sizeof *x->data_off);
  x->files = calloc(n ? n : 1, sizeof *x->files);
  if (x->data_off == NULL || x->files == NULL) return -1;
  for (size_t i = 0; i < n; i++) {
    uint64_t b = p->outputs[i].nbytes;
    if (x->files[f].count > 0 && x->files[f].data_bytes + b > max) x->files[++f].first = i;
    x->data_off[i] = x->files[f].data_bytes;
    x->files[f].data_bytes += b;
    x->files[f].count++;
  }
  x->nfiles = f + 1;
  for (size_t k = 0; k < x->nfiles; k++) {
    x->files[k].fd = -1;
    if (x->nfiles == 1) snprintf(x->files[k].name, sizeof x->files[k].name, "model.safetensors");
    else
      snprintf(x->files[k].name, sizeof x->files[k].name, "model-%05zu-of-%05zu.safetensors", k + 1, x->nfiles);
  }
  return 0;
}

/*
 * The header of file f: the 8-byte length, then the JSON padded with spaces
 * to a multiple of 8. A new buffer of *len bytes, or NULL.
 */
static char *header_build(const struct exporter *x, const struct out_file *f, const char *source, size_t *len) {
  const struct plan *p = x->local->plan;
  cJSON *h = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(h, "__metadata__");
  cJSON_AddStringToObject(meta, "format", "pt");
  cJSON_AddStringToObject(meta, "weightd_plan", p->key);
  cJSON_AddStringToObject(meta, "weightd_source", source);
  for (size_t i = f->first; i < f->first + f->count; i++) {
    const struct plan_output *o = &p->outputs[i];
    cJSON *t = cJSON_CreateObject();
    cJSON_AddStringToObject(t, "dtype", dtype_name(o->dtype));
    cJSON *shape = cJSON_AddArrayToObject(t, "shape");
    for (unsigned d = 0; d < o->ndim; d++) cJSON_AddItemToArray(shape, json_u64_create(o->shape[d]));
    cJSON *offs = cJSON_AddArrayToObject(t, "data_offsets");
    cJSON_AddItemToArray(offs, json_u64_create(x->data_off[i]));
    cJSON_AddItemToArray(offs, json_u64_create(x->data_off[i] + o->nbytes));
    cJSON_AddItemToObject(h, o->name, t);
  }
  char *text = cJSON_PrintUnformatted(h);
  cJSON_Delete(h);
  if (text == NULL) return NULL;
  size_t n = strlen(text), padded = (n + 7) / 8 * 8;
  char *buf = malloc(8 + padded);
  if (buf != NULL) {
    for (int i = 0; i < 8; i++) buf[i] = (char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, text, n);
    memset(buf + 8 + n, ' ', padded - n);
    *len = 8 + padded;
  }
  free(text);
  return buf;
}

/* Creates file f as DIR/name.tmp with its header and its full size. */
static int file_create(struct exporter *x, struct out_file *f, const char *source) {
  size_t hlen = 0;
  char *hdr = header_build(x, f, source, &hlen);
  if (hdr == NULL) {
    ctl_errorf("export: out of memory building the header of %s", f->name);
    return CTL_EXIT_FAIL;
  }
  if (hlen - 8 > ST_MAX_HEADER_LEN) {
    ctl_errorf("export: the header of %s would be %zu bytes, over safetensors' limit of %llu; "
               "use a smaller --max-shard-bytes",
               f->name, hlen - 8, ST_MAX_HEADER_LEN);
    free(hdr);
    return CTL_EXIT_FAIL;
  }
  f->data_start = hlen;
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    ctl_errorf("export: %s: %s", f->tmp, strerror(errno));
    free(hdr);
    return CTL_EXIT_FAIL;
  }
  f->created = 1;
  uint64_t size = f->data_start + f->data_bytes;
  int rc = 0;
  if (size > 0 && fallocate(f->fd, 0, 0, (off_t)size) < 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
    ctl_errorf("export: %s: cannot reserve %" PRIu64 " bytes: %s", f->tmp, size, strerror(errno));
    rc = CTL_EXIT_FAIL;
  } else if (ftruncate(f->fd, (off_t)size) < 0 || pwrite_all(f->fd, hdr, hlen, 0) < 0) {
    ctl_errorf("export: %s: %s", f->tmp, strerror(errno));
    rc = CTL_EXIT_FAIL;
  }
  free(hdr);
  return rc;
}

/* Cuts every file's data into jobs of at most CHUNK bytes. */
static int jobs_build(struct exporter *x) {
  size_t n = 0;
  for (size_t f = 0; f < x->nfiles; f++) n += (size_t)((x->files[f].data_bytes + CHUNK - 1) / CHUNK);
  x->jobs = calloc(n ? n : 1, sizeof *x->jobs);
  if (x->jobs == NULL) return -1;
  for (size_t f = 0; f < x->nfiles; f++)
    for (uint64_t off = 0; off < x->files[f].data_bytes; off += CHUNK) {
      uint64_t left = x->files[f].data_bytes - off;
      x->jobs[x->njobs++] = (struct job){f, off, left < CHUNK ? left : CHUNK};
    }
  return 0;
}

/* ---- workers ---------------------------------------------------------------------------- */

static void exporter_fail(struct exporter *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Records the first failure and tells every worker to stop. */
static void exporter_fail(struct exporter *x, const char *fmt, ...) {
  pthread_mutex_lock(&x->lock);
  if (x->err.code == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->err.msg, sizeof x->err.msg, fmt, ap);
    va_end(ap);
    x->err.code = WEIGHTD_E_IO;
  }
  pthread_mutex_unlock(&x->lock);
  atomic_store(&x->stop, 1);
}

/* Gathers the bytes of job j (outputs laid end to end, as the file holds them) into buf. */
static void job_gather(const struct exporter *x, const struct job *j, unsigned char *buf) {
  const struct plan *p = x->local->plan;
  const struct out_file *f = &x->files[j->file];
  size_t lo = f->first, hi = f->first + f->count;
  while (hi - lo > 1) { /* the last output that starts at or before j->off */
    size_t mid = lo + (hi - lo) / 2;
    if (x->data_off[mid] <= j->off) lo = mid;
    else hi = mid;
  }
  uint64_t end = j->off + j->len;
  for (size_t i = lo; i < f->first + f->count && x->data_off[i] < end; i++) {
    const struct plan_output *o = &p->outputs[i];
    uint64_t a = x->data_off[i] > j->off ? x->data_off[i] : j->off;
    uint64_t b = x->data_off[i] + o->nbytes < end ? x->data_off[i] + o->nbytes : end;
    if (b <= a) continue;
    uint64_t in = a - x->data_off[i];
    plan_gather(p, x->local->data, o->offset + in, o->offset + in + (b - a), buf + (a - j->off));
  }
}

static void *worker_main(void *arg) {
  struct exporter *x = arg;
  unsigned char *buf = malloc(CHUNK);
  if (buf == NULL) {
    exporter_fail(x, "out of memory for a %" PRIu64 "-byte buffer", CHUNK);
    return NULL;
  }
  while (!atomic_load(&x->stop)) {
    size_t n = atomic_fetch_add(&x->next, 1);
    if (n >= x->njobs) break;
    const struct job *j = &x->jobs[n];
    const struct out_file *f = &x->files[j->file];
    job_gather(x, j, buf);
    if (pwrite_all(f->fd, buf, (size_t)j->len, f->data_start + j->off) < 0) {
      exporter_fail(x, "%s: write: %s", f->tmp, strerror(errno));
      break;
    }
  }
  free(buf);
  return NULL;
}

/* Runs nthreads workers over every job; 0, or CTL_EXIT_FAIL after printing the first failure. */
static int workers_run(struct exporter *x, unsigned nthreads) {
  pthread_t threads[MAX_THREADS];
  unsigned started = 0;
  if (nthreads > x->njobs) nthreads = (unsigned)x->njobs;
  for (; started < nthreads; started++) {
    int e = pthread_create(&threads[started], NULL, worker_main, x);
    if (e != 0) {
      exporter_fail(x, "cannot start a worker thread: %s", strerror(e));
      break;
    }
  }
  for (unsigned i = 0; i < started; i++) pthread_join(threads[i], NULL);
  if (x->err.code != 0) {
    ctl_errorf("export: %s", x->err.msg);
    return CTL_EXIT_FAIL;
  }
  return 0;
}

/* ---- the small files ------------------------------------------------------------------- */

/* Writes len bytes of text to DIR/name.tmp. */
static int small_file_write(const char *dir, const char *name, const char *text, size_t len) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s.tmp", dir, name);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    ctl_errorf("export: %s: %s", path, strerror(errno));
    return CTL_EXIT_FAIL;
  }
  int rc = pwrite_all(fd, text, len, 0);
  int saved = errno;
  if (close(fd) < 0 && rc == 0) {
    rc = -1;
    saved = errno;
  }
  if (rc < 0) {
    ctl_errorf("export: %s: %s", path, strerror(saved));
    unlink(path);
    return CTL_EXIT_FAIL;
  }
  return 0;
}

static int cmp_output_name(const void *a, const void *b) {
  return strcmp((*(const struct plan_output *const *)a)->name, (*(const struct plan_output *const *)b)->name);
}

/*
 * The plan's outputs sorted by name, checked for a name given twice (a file
 * can hold only one). A new array, or NULL after printing why.
 */
static const struct plan_output **outputs_by_name(const struct plan *p) {
  const struct plan_output **by = malloc((p->noutputs ? p->noutputs : 1) * sizeof *by);
  if (by == NULL) {
    ctl_errorf("export: out of memory");
    return NULL;
  }
  for (size_t i = 0; i < p->noutputs; i++) by[i] = &p->outputs[i];
  qsort(by, p->noutputs, sizeof *by, cmp_output_name);
  for (size_t i = 1; i < p->noutputs; i++) {
    if (strcmp(by[i - 1]->name, by[i]->name) == 0) {
      ctl_errorf("export: the plan has two outputs named '%s'", by[i]->name);
      free(by);
      return NULL;
    }
  }
  return by;
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
 * model.safetensors.index.json as save_pretrained writes it (json.dumps with
 * indent 2 and sorted keys): total_size and the weight_map.
 */
static int index_write(const struct exporter *x, const struct plan_output *const *by_name) {
  const struct plan *p = x->local->plan;
  size_t *file_of = malloc((p->noutputs ? p->noutputs : 1) * sizeof *file_of);
  char *text = NULL;
  size_t len = 0;
  FILE *f = file_of != NULL ? open_memstream(&text, &len) : NULL;
  if (f == NULL) {
    free(file_of);
    ctl_errorf("export: out of memory building %s", INDEX_NAME);
    return CTL_EXIT_FAIL;
  }
  for (size_t k = 0; k < x->nfiles; k++)
    for (size_t i = x->files[k].first; i < x->files[k].first + x->files[k].count; i++) file_of[i] = k;
  fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %" PRIu64 "\n  },\n  \"weight_map\": {\n", p->payload_bytes);
  for (size_t k = 0; k < p->noutputs; k++) {
    fputs("    ", f);
    json_string_put(f, by_name[k]->name);
    fputs(": ", f);
    json_string_put(f, x->files[file_of[by_name[k] - p->outputs]].name);
    fputs(k + 1 < p->noutputs ? ",\n" : "\n", f);
  }
  fputs("  }\n}\n", f);
  int bad = ferror(f);
  int rc = fclose(f) != 0 || bad ? CTL_EXIT_FAIL : 0;
  if (rc != 0) ctl_errorf("export: out of memory building %s", INDEX_NAME);
  else rc = small_file_write(x->dir, INDEX_NAME, text, len);
  free(text);
  free(file_of);
  return rc;
}

/* Copies the checkpoint's config.json to DIR/config.json.tmp when there is one; *copied says so. */
static int config_copy(const struct ckpt *ck, const char *dir, int *copied) {
  *copied = 0;
  if (ck->layout == CKPT_FILE) return 0;
  char *src = path_join(ck->dir, "config.json"), *text = NULL;
  size_t len = 0;
  if (src == NULL) {
    ctl_errorf("export: out of memory");
    return CTL_EXIT_FAIL;
  }
  int r = path_read_file(src, CONFIG_MAX_BYTES, &text, &len);
  int rc = 0;
  if (r == -ENOENT) {
    rc = 0;
  } else if (r != 0) {
    ctl_errorf("export: %s: %s", src, strerror(-r));
    rc = CTL_EXIT_FAIL;
  } else {
    rc = small_file_write(dir, "config.json", text, len);
    *copied = rc == 0;
  }
  free(text);
  free(src);
  return rc;
}

/* Renames DIR/name.tmp to DIR/name. */
static int rename_into_place(const char *dir, const char *name) {
  char from[PATH_MAX], to[PATH_MAX];
  snprintf(from, sizeof from, "%s/%s.tmp", dir, name);
  snprintf(to, sizeof to, "%s/%s", dir, name);
  if (rename(from, to) < 0) {
    ctl_errorf("export: %s: rename: %s", to, strerror(errno));
    return CTL_EXIT_FAIL;
  }
  return 0;
}

/* Removes every .tmp file this export may have left. */
static void tmp_cleanup(const struct exporter *x) {
  static const char *const small[] = {"config.json", INDEX_NAME};
  char path[PATH_MAX];
  for (size_t f = 0; f < x->nfiles; f++) {
    if (x->files[f].fd >= 0) close(x->files[f].fd);
    if (x->files[f].created && x->files[f].tmp != NULL) unlink(x->files[f].tmp);
  }
  for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
    snprintf(path, sizeof path, "%s/%s.tmp", x->dir, small[i]);
    unlink(path);
  }
}

/* ---- the command ------------------------------------------------------------------------- */

struct export_opts {
  const char *path, *out;
  unsigned long long max_shard, threads;
};

static void print_done(const struct exporter *x, const struct export_opts *o, int config, double secs) {
  const struct plan *p = x->local->plan;
  if (ctl_opts.json) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "out", o->out);
    cJSON_AddItemToObject(r, "plan", cJSON_Parse(p->key));
    cJSON_AddItemToObject(r, "tensors", json_u64_create(p->noutputs));
    cJSON_AddItemToObject(r, "bytes", json_u64_create(p->payload_bytes));
    cJSON *files = cJSON_AddArrayToObject(r, "files");
    for (size_t f = 0; f < x->nfiles; f++) cJSON_AddItemToArray(files, cJSON_CreateString(x->files[f].name));
    if (x->nfiles > 1) cJSON_AddItemToArray(files, cJSON_CreateString(INDEX_NAME));
    if (config) cJSON_AddItemToArray(files, cJSON_CreateString("config.json"));
    cJSON_AddNumberToObject(r, "seconds", secs);
    char *text = cJSON_PrintUnformatted(r);
    if (text != NULL) puts(text);
    free(text);
    cJSON_Delete(r);
    return;
  }
  char h[32], files[200];
  ctl_human_bytes(p->payload_bytes, h, sizeof h);
  if (x->nfiles == 1)
    snprintf(files, sizeof files, "1 file, %s", x->files[0].name);
  else
    snprintf(files, sizeof files, "%zu files, %s to %s and %s", x->nfiles, x->files[0].name,
             x->files[x->nfiles - 1].name, INDEX_NAME);
  printf("exported plan %s of %s to %s\n  %zu tensors, %" PRIu64 " bytes (%s) in %s%s; %.2f s, %.2f GB/s\n", p->key,
         x->local->ck->path, o->out, p->noutputs, p->payload_bytes, h, files, config ? "; config.json copied" : "",
         secs, secs > 0 ? (double)p->payload_bytes / 1e9 / secs : 0.0);
}

/* Writes the export; the exit code. */
static int export_run(struct exporter *x, const struct export_opts *o) {
  const struct ckpt *ck = x->local->ck;
  const struct plan_output **by_name = NULL;
  const char **keep = NULL;
  size_t nkeep = 0;
  char source[PATH_MAX];
  int config = 0, rc = CTL_EXIT_FAIL;
  double t0 = clock_s();
  if (realpath(o->path, source) == NULL) snprintf(source, sizeof source, "%s", o->path);
  if ((by_name = outputs_by_name(x->local->plan)) == NULL) goto fail;
  if ((rc = prepare_dir(o->out, ck)) != 0) goto fail;
  rc = CTL_EXIT_FAIL;
  if (files_assign(x, o->max_shard) != 0) goto nomem;
  x->cleanup = calloc(x->nfiles + 1, sizeof *x->cleanup);
  keep = calloc(x->nfiles + 2, sizeof *keep);
  if (x->cleanup == NULL || keep == NULL) goto nomem;
  for (size_t f = 0; f < x->nfiles; f++) {
    if (asprintf(&x->files[f].tmp, "%s/%s.tmp", o->out, x->files[f].name) < 0) {
      x->files[f].tmp = NULL;
      goto nomem;
    }
    x->cleanup[f] = x->files[f].tmp;
  }
  ctl_sigbus_guard("export", x->cleanup);
  for (size_t f = 0; f < x->nfiles; f++)
    if (file_create(x, &x->files[f], source) != 0) goto fail;
  if (jobs_build(x) != 0) goto nomem;
  if (workers_run(x, (unsigned)o->threads) != 0) goto fail;
  for (size_t f = 0; f < x->nfiles; f++) {
    int fd = x->files[f].fd;
    x->files[f].fd = -1;
    if (close(fd) < 0) {
      ctl_errorf("export: %s: close: %s", x->files[f].tmp, strerror(errno));
      goto fail;
    }
  }
  if (x->nfiles > 1 && index_write(x, by_name) != 0) goto fail;
  if (config_copy(ck, o->out, &config) != 0) goto fail;
  /* Shards first, the index last: a reader that finds the index finds every shard. */
  for (size_t f = 0; f < x->nfiles; f++) {
    if (rename_into_place(o->out, x->files[f].name) != 0) goto fail;
    x->files[f].created = 0;
    keep[nkeep++] = x->files[f].name;
  }
  if (config) {
    if (rename_into_place(o->out, "config.json") != 0) goto fail;
    keep[nkeep++] = "config.json";
  }
  if (x->nfiles > 1) {
    if (rename_into_place(o->out, INDEX_NAME) != 0) goto fail;
    keep[nkeep++] = INDEX_NAME;
  }
  ctl_sigbus_guard("export", NULL);
  remove_stale(o->out, keep, nkeep);
  print_done(x, o, config, clock_s() - t0);
  free(keep);
  free(by_name);
  return CTL_EXIT_OK;

nomem:
  ctl_errorf("export: out of memory");
fail:
  ctl_sigbus_guard("export", NULL);
  if (x->files != NULL) tmp_cleanup(x);
  free(keep);
  free(by_name);
  return CTL_EXIT_FAIL;
}

int cmd_export(int argc, char **argv) {
  struct export_opts o = {.max_shard = DEFAULT_MAX_SHARD};
  struct ctl_plan_args pa = {.cmd = "export"};
  int has_threads = 0;
  for (int i = 1; i < argc; i++) {
    int taken = ctl_plan_arg(&pa, argc, argv, &i);
    if (taken < 0) return CTL_EXIT_USAGE;
    if (taken) continue;
    const char *a = argv[i];
    if (strcmp(a, "--json") == 0) {
      ctl_opts.json = 1;
    } else if (strcmp(a, "--out") == 0 && i + 1 < argc) {
      o.out = argv[++i];
    } else if ((strcmp(a, "--max-shard-bytes") == 0 || strcmp(a, "--threads") == 0) && i + 1 < argc) {
      unsigned long long v;
      int threads = strcmp(a, "--threads") == 0;
      if (ctl_parse_u64(argv[++i], &v) != 0 || v == 0 || (threads && v > MAX_THREADS)) {
        if (threads) ctl_errorf("export: --threads wants a number from 1 to %u, not '%s'", MAX_THREADS, argv[i]);
        else ctl_errorf("export: --max-shard-bytes wants a positive number of bytes, not '%s'", argv[i]);
        return CTL_EXIT_USAGE;
      }
      if (threads) {
        o.threads = v;
        has_threads = 1;
      } else {
        o.max_shard = v;
      }
    } else if (a[0] == '-' && a[1] != '\0') {
      ctl_errorf("export: unknown option '%s'", a);
      return ctl_usage("export");
    } else if (o.path == NULL) {
      o.path = a;
    } else {
      return ctl_usage("export");
    }
  }
  if (o.path == NULL || o.out == NULL) {
    if (o.path != NULL) ctl_errorf("export: --out DIR is required");
    return ctl_usage("export");
  }
  if (!has_threads) {
    unsigned n = usable_cpus();
    o.threads = n < DEFAULT_MAX_THREADS ? n : DEFAULT_MAX_THREADS;
  }
  cJSON *spec = NULL;
  int rc = ctl_plan_spec(&pa, 0, &spec);
  if (rc != 0) return rc;
  struct ctl_local local;
  rc = ctl_local_open(o.path, spec, 1, "export", &local);
  cJSON_Delete(spec);
  if (rc != 0) return rc;
  struct exporter x = {.local = &local, .dir = o.out};
  atomic_init(&x.next, 0);
  atomic_init(&x.stop, 0);
  pthread_mutex_init(&x.lock, NULL);
  rc = export_run(&x, &o);
  for (size_t f = 0; f < x.nfiles; f++) free(x.files[f].tmp);
  free(x.files);
  free(x.data_off);
  free(x.cleanup);
  free(x.jobs);
  pthread_mutex_destroy(&x.lock);
  ctl_local_close(&local);
  return rc;
}
