/*
 * cmd_manifest.c - `weightctl manifest PATH` writes a checkpoint's manifest
 * (its chunk and tensor digests, manifest.h) beside it; `weightctl verify
 * PATH` checks the files against a manifest and, given a list of SHA-256
 * digests (as sha256sum writes them, or a publisher's), against those. No
 * daemon: the files are read here, with the caller's own rights.
 *
 * Threads: the shards are digested by up to --threads worker threads, each
 * taking the next shard from a shared counter and writing only that shard's
 * digests; the main thread draws the progress line from an atomic count of
 * bytes read.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "ctl.h"
#include "manifest.h"
#include "pathutil.h"
#include "sha256.h"

#define READ_BYTES (16u << 20)
#define MAX_THREADS 16u
#define SHA_LIST_MAX (16u << 20)

/* ---- digesting every shard ---------------------------------------------------------- */

struct digest_run {
  const struct ckpt *c;
  struct mf_manifest *m;
  bool sha256;
  atomic_size_t next;    /* the next shard to take */
  atomic_uint_fast64_t done; /* bytes read, for the progress line */
  atomic_int failed;     /* the first failure's errno (positive), 0 while none */
  atomic_size_t failed_shard;
};

static int digest_shard(struct digest_run *r, size_t i, unsigned char *buf) {
  const struct ckpt_shard *s = &r->c->shards[i];
  struct mf_digester *d = mf_digester_new(r->c, r->m, (uint32_t)i, r->sha256);
  if (d == NULL) return ENOMEM;
  uint64_t off = 0;
  int e = 0;
  while (off < s->size) {
    size_t want = s->size - off < READ_BYTES ? (size_t)(s->size - off) : READ_BYTES;
    ssize_t got = pread(s->fd, buf, want, (off_t)off);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      e = got < 0 ? errno : EIO; /* EIO: the file ends before the size it had at open */
      break;
    }
    mf_digester_feed(d, buf, (size_t)got);
    off += (uint64_t)got;
    atomic_fetch_add(&r->done, (uint64_t)got);
  }
  if (mf_digester_end(d) != 0 && e == 0) e = EIO;
  return e;
}

static void *digest_worker(void *arg) {
  struct digest_run *r = arg;
  unsigned char *buf = malloc(READ_BYTES);
  for (;;) {
    size_t i = atomic_fetch_add(&r->next, 1);
    if (i >= r->c->nshards || atomic_load(&r->failed) != 0) break;
    int e = buf == NULL ? ENOMEM : digest_shard(r, i, buf);
    int zero = 0;
    if (e != 0 && atomic_compare_exchange_strong(&r->failed, &zero, e)) atomic_store(&r->failed_shard, i);
  }
  free(buf);
  return NULL;
}

static void digest_progress(void *arg, uint64_t *done, uint64_t *total) {
  struct digest_run *r = arg;
  *done = atomic_load(&r->done);
  *total = 0;
  for (size_t i = 0; i < r->c->nshards; i++) *total += r->c->shards[i].size;
}

/* The manifest of c's files as they are now (sha256: with each file's SHA-256), or NULL after saying why. */
static struct mf_manifest *digest_files(const struct ckpt *c, unsigned threads, bool sha256, const char *what) {
  struct mf_manifest *m = mf_new(c);
  if (m == NULL) {
    ctl_errorc("NOMEM", "%s: out of memory", what);
    return NULL;
  }
  struct digest_run r = {.c = c, .m = m, .sha256 = sha256};
  if (threads > c->nshards) threads = (unsigned)c->nshards;
  if (threads == 0) threads = 1;
  pthread_t tid[MAX_THREADS];
  unsigned started = 0;
  ctl_progress_watch(what, digest_progress, &r);
  for (; started < threads; started++)
    if (pthread_create(&tid[started], NULL, digest_worker, &r) != 0) break;
  if (started == 0) digest_worker(&r); /* no thread could start: digest here */
  for (unsigned i = 0; i < started; i++) pthread_join(tid[i], NULL);
  ctl_progress_end();
  int e = atomic_load(&r.failed);
  if (e != 0) {
    const struct ckpt_shard *s = &c->shards[atomic_load(&r.failed_shard)];
    ctl_errorc(e == ENOMEM ? "NOMEM" : "IO", "%s: %s: cannot read: %s", what, s->path,
               e == EIO ? "it is shorter than when it was opened, or unreadable" : strerror(e));
    mf_free(m);
    return NULL;
  }
  mf_finish(m);
  return m;
}

/* The checkpoint at path, opened here (no daemon), or NULL after saying why. */
static struct ckpt *open_here(const char *path) {
  struct wd_error err = {0};
  struct ckpt *c = NULL;
  if (ckpt_open(path, NULL, &c, &err) != 0) {
    ctl_errorc(weightd_err_name(err.code), "%s", err.msg);
    return NULL;
  }
  return c;
}

static int threads_arg(const struct ctl_args *a, unsigned *out) {
  const char *v = ctl_val(a, CTL_OPT_THREADS);
  unsigned long long n = 4;
  if (v != NULL && (ctl_parse_u64(v, &n) != 0 || n == 0 || n > MAX_THREADS))
    return ctl_usage_error("--threads wants a number from 1 to %u, not '%s'", MAX_THREADS, v);
  *out = (unsigned)n;
  return 0;
}

/* The manifest's default place: beside the index, for a checkpoint directory; NULL for a bare file. */
static char *default_manifest_path(const struct ckpt *c) {
  return c->layout == CKPT_FILE ? NULL : path_join(c->dir, MF_FILE_NAME);
}

/* ---- manifest --------------------------------------------------------------------------- */

/* Writes text to path through a temporary name and a rename: 0, or errno. */
static int write_atomic(const char *path, const char *text, size_t len) {
  size_t n = strlen(path) + 16;
  char *tmp = malloc(n);
  if (tmp == NULL) return ENOMEM;
  snprintf(tmp, n, "%s.tmp%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  int e = fd < 0 ? errno : 0;
  for (size_t off = 0; e == 0 && off < len;) {
    ssize_t w = write(fd, text + off, len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) e = w < 0 ? errno : EIO;
    else off += (size_t)w;
  }
  if (fd >= 0 && e == 0 && fsync(fd) != 0) e = errno;
  if (fd >= 0 && close(fd) != 0 && e == 0) e = errno;
  if (e == 0 && rename(tmp, path) != 0) e = errno;
  if (e != 0 && fd >= 0) unlink(tmp);
  free(tmp);
  return e;
}

static const struct optab_opt manifest_opts[] = {
    {CTL_OPT_OUT, "out", 0, OPTAB_VALUE, "FILE",
     "Write the manifest to FILE (default: " MF_FILE_NAME " in the checkpoint directory; required for a bare "
     ".safetensors file).",
     0, "@file"},
    {CTL_OPT_THREADS, "threads", 0, OPTAB_VALUE, "N", "Shards digested at once, 1 to 16 (default 4).", 0, NULL},
};

static int run_manifest(const struct ctl_args *a) {
  unsigned threads = 4;
  if (threads_arg(a, &threads) != 0) return CTL_EXIT_USAGE;
  struct ckpt *c = open_here(a->pos[0]);
  if (c == NULL) return CTL_EXIT_FAIL;
  char *out = ctl_val(a, CTL_OPT_OUT) != NULL ? strdup(ctl_val(a, CTL_OPT_OUT)) : default_manifest_path(c);
  int rc = CTL_EXIT_FAIL;
  struct mf_manifest *m = NULL;
  char *text = NULL;
  size_t len = 0;
  if (out == NULL && c->layout == CKPT_FILE) {
    rc = ctl_usage_error("a bare .safetensors file needs --out FILE");
    goto done;
  }
  if (out == NULL) {
    ctl_errorc("NOMEM", "manifest: out of memory");
    goto done;
  }
  if ((m = digest_files(c, threads, false, "manifest")) == NULL) goto done;
  if ((text = mf_write(m, c, &len)) == NULL) {
    ctl_errorc("NOMEM", "manifest: out of memory");
    goto done;
  }
  int e = write_atomic(out, text, len);
  if (e != 0) {
    ctl_errorc("IO", "manifest: %s: cannot write: %s", out, strerror(e));
    goto done;
  }
  char id[2 * CKPT_ID_BYTES + 1];
  mf_hex(m->content_id, CKPT_ID_BYTES, id);
  uint64_t chunks = 0;
  for (size_t i = 0; i < m->nfiles; i++) chunks += m->files[i].nchunks;
  if (ctl_opts.json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "manifest", out);
    cJSON_AddStringToObject(o, "content_id", id);
    cJSON_AddItemToObject(o, "files", json_u64_create(m->nfiles));
    cJSON_AddItemToObject(o, "chunks", json_u64_create(chunks));
    cJSON_AddItemToObject(o, "tensors", json_u64_create(c->ntensors));
    ctl_json_print(o);
  } else {
    printf("wrote %s: %zu file(s), %" PRIu64 " chunk(s), %zu tensor(s); content id %s\n", out, m->nfiles, chunks,
           c->ntensors, id);
  }
  rc = CTL_EXIT_OK;
done:
  free(text);
  mf_free(m);
  free(out);
  ckpt_free(c);
  return rc;
}

const struct ctl_cmd ctl_cmd_manifest = {
    .name = "manifest",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "write a checkpoint's manifest of chunk and tensor digests (no daemon)",
    .description =
        "Reads every shard of the checkpoint at PATH here and writes its manifest: the XXH3-128 digest of each "
        "4 MiB chunk of each file and of each file, each tensor's digest (a tree of 256 KiB leaves), and the "
        "content id they make (docs/checkpoints.md). Stored as " MF_FILE_NAME " beside the index, the daemon checks every load "
        "against it when its `verify` setting is on_load, and `weightctl verify` checks the files against it. "
        "Written under a temporary name and renamed into place.",
    .opts = CTL_OPTS(manifest_opts),
    .run = run_manifest,
    .flags = CTL_CMD_LOCAL,
};

/* ---- verify ----------------------------------------------------------------------------- */

/* Reads the manifest at path for c: the parsed manifest, or NULL after saying why. */
static struct mf_manifest *read_manifest(const struct ckpt *c, const char *path) {
  char *text = NULL;
  size_t len = 0;
  int r = path_read_file(path, MF_MAX_BYTES, &text, &len);
  if (r != 0) {
    ctl_errorc(r == -ENOENT ? "NOT_FOUND" : "IO", "verify: %s: cannot read: %s", path,
               r == -EFBIG ? "larger than 256 MiB" : strerror(-r));
    return NULL;
  }
  struct wd_error err = {0};
  struct mf_manifest *m = NULL;
  if (mf_parse(text, len, c, path, &m, &err) != 0) ctl_errorc(weightd_err_name(err.code), "verify: %s", err.msg);
  free(text);
  return m;
}

static const char *basename_of(const char *p) {
  const char *b = strrchr(p, '/');
  return b != NULL ? b + 1 : p;
}

/*
 * Expected SHA-256s by file name, from text as sha256sum writes it ("HEX  NAME"
 * or "HEX *NAME" per line). A line names the shard whose name in the index
 * it is; failing that, the one shard whose last path component is the line's
 * (a name two shards share in their last component names neither); a name
 * matched exactly wins over one matched by its last component. listed[i] is
 * how shard i was matched (0: not, 1: last component, 2: exactly). 0, or a
 * usage error after saying which line (malformed, or giving one shard two
 * different digests).
 */
static int read_sha_list(const char *path, const struct ckpt *c, unsigned char (*want)[MF_SHA256_BYTES],
                         unsigned char *listed) {
  char *text = NULL;
  size_t len = 0;
  int r = path_read_file(path, SHA_LIST_MAX, &text, &len);
  if (r != 0) {
    ctl_errorc("IO", "verify: --sha256 %s: cannot read: %s", path, r == -EFBIG ? "larger than 16 MiB" : strerror(-r));
    return CTL_EXIT_FAIL;
  }
  int rc = 0;
  size_t lineno = 0;
  for (char *line = text, *next; rc == 0 && line < text + len; line = next) {
    char *nl = memchr(line, '\n', (size_t)(text + len - line));
    next = nl != NULL ? nl + 1 : text + len;
    if (nl != NULL) *nl = '\0';
    lineno++;
    size_t n = strlen(line);
    if (n > 0 && line[n - 1] == '\r') line[--n] = '\0';
    if (n == 0 || line[0] == '#') continue;
    unsigned char d[MF_SHA256_BYTES];
    const char *name = line + 2 * MF_SHA256_BYTES + 2;
    bool ok = n > 2 * MF_SHA256_BYTES + 2 && line[2 * MF_SHA256_BYTES] == ' ' &&
              (line[2 * MF_SHA256_BYTES + 1] == ' ' || line[2 * MF_SHA256_BYTES + 1] == '*');
    if (ok) {
      char hex[2 * MF_SHA256_BYTES + 1];
      memcpy(hex, line, 2 * MF_SHA256_BYTES);
      hex[2 * MF_SHA256_BYTES] = '\0';
      for (size_t i = 0; ok && i < MF_SHA256_BYTES; i++) {
        unsigned v;
        ok = sscanf(hex + 2 * i, "%2x", &v) == 1;
        d[i] = (unsigned char)v;
      }
      for (size_t i = 0; ok && i < 2 * MF_SHA256_BYTES; i++)
        ok = (hex[i] >= '0' && hex[i] <= '9') || (hex[i] >= 'a' && hex[i] <= 'f') || (hex[i] >= 'A' && hex[i] <= 'F');
    }
    if (!ok) {
      ctl_errorc("USAGE", "verify: --sha256 %s: line %zu is not \"<64 hex digits>  <file name>\"", path, lineno);
      rc = CTL_EXIT_USAGE;
      break;
    }
    /* The shard this line names: the one whose index name it is, else the only shard with its last component. */
    size_t hit = c->nshards, same_base = 0, rank = 0;
    for (size_t i = 0; i < c->nshards && rank < 2; i++) {
      if (strcmp(name, c->shards[i].rel) == 0) {
        hit = i;
        rank = 2;
      } else if (strcmp(basename_of(name), basename_of(c->shards[i].rel)) == 0) {
        if (same_base++ == 0) hit = i;
      }
    }
    if (rank == 0 && same_base == 1) rank = 1;
    if (rank == 0) continue; /* a file that is not one of the shards (the list may name the whole repository) */
    if (listed[hit] > rank) continue;
    if (listed[hit] == rank && memcmp(want[hit], d, MF_SHA256_BYTES) != 0) {
      char q[160];
      ctl_errorc("USAGE", "verify: --sha256 %s: line %zu gives %s another SHA-256 than an earlier line", path, lineno,
                 err_quote(c->shards[hit].rel, strlen(c->shards[hit].rel), q, sizeof q));
      rc = CTL_EXIT_USAGE;
      break;
    }
    memcpy(want[hit], d, MF_SHA256_BYTES);
    listed[hit] = (unsigned char)rank;
  }
  free(text);
  return rc;
}

/* The tensors of shard s whose digests differ, overlapping file bytes [lo, hi), as "a, b" (at most 4 named). */
static void tensors_in(const struct ckpt_shard *s, const struct mf_file *w, const struct mf_file *g, uint64_t lo,
                       uint64_t hi, char *out, size_t cap) {
  size_t o = 0, named = 0, more = 0;
  out[0] = '\0';
  for (size_t t = 0; t < s->hdr->ntensors; t++) {
    const struct st_tensor *x = &s->hdr->tensors[t];
    uint64_t b = s->hdr->data_start + x->begin, e = s->hdr->data_start + x->end;
    if (e <= lo || b >= hi || memcmp(w->tensors[t], g->tensors[t], MF_DIGEST_BYTES) == 0) continue;
    char q[96];
    err_quote(x->name, x->name_len, q, sizeof q);
    if (named < 4 && o + strlen(q) + 3 < cap) {
      o += (size_t)snprintf(out + o, cap - o, "%s%s", named ? ", " : "", q);
      named++;
    } else {
      more++;
    }
  }
  if (more > 0 && o + 24 < cap) snprintf(out + o, cap - o, " and %zu more", more);
}

static const struct optab_opt verify_opts[] = {
    {CTL_OPT_MANIFEST, "manifest", 0, OPTAB_VALUE, "FILE",
     "The manifest to check against (default: " MF_FILE_NAME " in the checkpoint directory, when there is one).", 0,
     "@file"},
    {CTL_OPT_SHA256, "sha256", 0, OPTAB_VALUE, "FILE",
     "Also check each shard's SHA-256 against FILE (lines \"<hex>  <name>\", as sha256sum writes them and a "
     "publisher lists them); every shard must be listed.",
     0, "@file"},
    {CTL_OPT_THREADS, "threads", 0, OPTAB_VALUE, "N", "Shards digested at once, 1 to 16 (default 4).", 0, NULL},
};

static int run_verify(const struct ctl_args *a) {
  unsigned threads = 4;
  if (threads_arg(a, &threads) != 0) return CTL_EXIT_USAGE;
  struct ckpt *c = open_here(a->pos[0]);
  if (c == NULL) return CTL_EXIT_FAIL;
  int rc = CTL_EXIT_FAIL;
  struct mf_manifest *want = NULL, *got = NULL;
  unsigned char (*sha_want)[MF_SHA256_BYTES] = NULL;
  unsigned char *listed = NULL;
  cJSON *files = NULL;
  char *mpath = ctl_val(a, CTL_OPT_MANIFEST) != NULL ? strdup(ctl_val(a, CTL_OPT_MANIFEST)) : default_manifest_path(c);
  const char *shalist = ctl_val(a, CTL_OPT_SHA256);
  struct stat st;
  if (ctl_val(a, CTL_OPT_MANIFEST) == NULL && mpath != NULL && stat(mpath, &st) != 0 && errno == ENOENT) {
    free(mpath); /* no manifest beside it: only the SHA-256s, when given */
    mpath = NULL;
  }
  if (mpath == NULL && shalist == NULL) {
    rc = ctl_usage_error("%s has no %s: give --manifest FILE or --sha256 FILE (weightctl manifest writes one)",
                         a->pos[0], MF_FILE_NAME);
    goto done;
  }
  if (mpath != NULL && (want = read_manifest(c, mpath)) == NULL) goto done;
  if (shalist != NULL) {
    sha_want = calloc(c->nshards ? c->nshards : 1, sizeof *sha_want);
    listed = calloc(c->nshards ? c->nshards : 1, sizeof *listed);
    if (sha_want == NULL || listed == NULL) {
      ctl_errorc("NOMEM", "verify: out of memory");
      goto done;
    }
    int r = read_sha_list(shalist, c, sha_want, listed);
    if (r != 0) {
      rc = r;
      goto done;
    }
  }
  if ((got = digest_files(c, threads, shalist != NULL, "verify")) == NULL) goto done;

  uint64_t bad_chunks = 0, bad_files = 0, chunks = 0;
  files = cJSON_CreateArray();
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    cJSON *fo = cJSON_CreateObject(), *cl = cJSON_CreateArray();
    cJSON_AddStringToObject(fo, "name", s->rel);
    cJSON_AddItemToObject(fo, "chunks_differ", cl);
    cJSON_AddItemToArray(files, fo);
    bool bad = false;
    chunks += got->files[i].nchunks;
    if (want != NULL) {
      for (uint64_t k = 0; k < got->files[i].nchunks; k++) {
        if (memcmp(want->files[i].chunks[k], got->files[i].chunks[k], MF_DIGEST_BYTES) == 0) continue;
        uint64_t lo = k * MF_CHUNK_BYTES, hi = lo + MF_CHUNK_BYTES < s->size ? lo + MF_CHUNK_BYTES : s->size;
        char names[512];
        tensors_in(s, &want->files[i], &got->files[i], lo, hi, names, sizeof names);
        if (!ctl_opts.json)
          fprintf(stderr, "weightctl: verify: %s: bytes %" PRIu64 "-%" PRIu64 " differ from the manifest%s%s%s\n",
                  s->path, lo, hi - 1, names[0] ? " (tensors: " : "", names, names[0] ? ")" : "");
        cJSON_AddItemToArray(cl, json_u64_create(lo));
        bad_chunks++;
        bad = true;
      }
    }
    if (shalist != NULL) {
      const char *verdict = !listed[i] ? "not listed"
                            : memcmp(sha_want[i], got->files[i].sha256, MF_SHA256_BYTES) == 0 ? "ok" : "differs";
      cJSON_AddStringToObject(fo, "sha256", verdict);
      if (strcmp(verdict, "ok") != 0) {
        bad = true;
        if (!ctl_opts.json)
          fprintf(stderr, "weightctl: verify: %s: SHA-256 %s\n", s->path,
                  listed[i] ? "differs from the list" : "is not in the list (every shard must be)");
      }
    }
    bad_files += bad;
  }
  if (ctl_opts.json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "path", a->pos[0]);
    if (mpath != NULL) cJSON_AddStringToObject(o, "manifest", mpath);
    cJSON_AddBoolToObject(o, "ok", bad_files == 0);
    if (want != NULL) {
      cJSON_AddItemToObject(o, "chunks", json_u64_create(chunks));
      cJSON_AddItemToObject(o, "chunks_differing", json_u64_create(bad_chunks));
    }
    cJSON_AddItemToObject(o, "files", files);
    files = NULL;
    if (bad_files != 0) { /* one object for the outcome: the failure with what differs */
      cJSON *e = cJSON_AddObjectToObject(o, "error");
      char msg[256];
      snprintf(msg, sizeof msg, "verify: %s: %" PRIu64 " of %zu file(s) differ (%" PRIu64 " of %" PRIu64 " chunks)",
               a->pos[0], bad_files, c->nshards, bad_chunks, chunks);
      cJSON_AddStringToObject(e, "code", "BAD_CHECKSUM");
      cJSON_AddStringToObject(e, "message", msg);
    }
    ctl_json_print(o);
  }
  if (bad_files != 0) {
    if (!ctl_opts.json)
      ctl_errorc("BAD_CHECKSUM", "verify: %s: %" PRIu64 " of %zu file(s) differ (%" PRIu64 " of %" PRIu64 " chunks)",
                 a->pos[0], bad_files, c->nshards, bad_chunks, chunks);
    goto done;
  }
  if (!ctl_opts.json && want != NULL)
    printf("%s: %zu file(s), %" PRIu64 " chunk(s) and %zu tensor(s) match the manifest%s\n", a->pos[0], c->nshards,
           chunks, c->ntensors, shalist != NULL ? ", and every file the SHA-256 list" : "");
  else if (!ctl_opts.json)
    printf("%s: %zu file(s) match the SHA-256 list\n", a->pos[0], c->nshards);
  rc = CTL_EXIT_OK;
done:
  cJSON_Delete(files);
  free(sha_want);
  free(listed);
  mf_free(want);
  mf_free(got);
  free(mpath);
  ckpt_free(c);
  return rc;
}

const struct ctl_cmd ctl_cmd_verify = {
    .name = "verify",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "check a checkpoint's files against its manifest and SHA-256 list (no daemon)",
    .description =
        "Reads every shard of the checkpoint at PATH here and checks its bytes against the manifest (--manifest "
        "FILE, or the " MF_FILE_NAME " beside the index) and, with --sha256 FILE, each file's SHA-256 against "
        "the list (what a publisher gives: a Hugging Face repository's LFS pointers carry each large file's "
        "SHA-256). Every 4 MiB range that differs is named with the tensors in it; exit status 1 "
        "(BAD_CHECKSUM) when any file differs.",
    .opts = CTL_OPTS(verify_opts),
    .run = run_verify,
    .flags = CTL_CMD_LOCAL,
};
