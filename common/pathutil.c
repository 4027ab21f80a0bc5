/* pathutil.c - path rules, confinement and non-blocking opens (see pathutil.h). */
#include "pathutil.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int path_rel_is_safe(const char *rel) {
  if (rel == NULL || rel[0] == '\0' || rel[0] == '/') return 0;
  const char *p = rel;
  while (*p != '\0') {
    const char *slash = strchr(p, '/');
    size_t n = slash ? (size_t)(slash - p) : strlen(p);
    if (n == 2 && p[0] == '.' && p[1] == '.') return 0;
    if (slash == NULL) break;
    p = slash + 1;
  }
  return 1;
}

int path_under_roots(const char *resolved, const char *const *roots, size_t nroots) {
  for (size_t i = 0; i < nroots; i++) {
    const char *r = roots[i];
    size_t n = strlen(r);
    while (n > 1 && r[n - 1] == '/') n--;
    if (n == 1 && r[0] == '/') return 1;
    if (strncmp(resolved, r, n) == 0 && (resolved[n] == '\0' || resolved[n] == '/')) return 1;
  }
  return 0;
}

/* ---- resolution ------------------------------------------------------------- */

/* Symbolic links one resolution follows at most (the kernel's own limit). */
#define PATH_MAX_LINKS 40

static int confined(const struct path_roots *roots, const char *p) {
  return roots == NULL || roots->n == 0 || path_under_roots(p, roots->dirs, roots->n);
}

/*
 * The failure of a walk at entry `at` (a resolved directory plus one name):
 * refused as outside the roots when `at` lies outside them, whatever errno
 * said, so that nothing about files outside the roots shows.
 */
static int walk_fail(const struct path_roots *roots, const char *at, int e, const char *label,
                     struct wd_error *err) {
  if (!confined(roots, at))
    return err_set(err, WEIGHTD_E_PATH_DENIED, "%s: leads outside the model roots", label);
  if (e == ENOENT) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s: %s", label, strerror(e));
  if (e == ENOMEM) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  return err_set(err, WEIGHTD_E_IO, "%s: cannot resolve: %s", label, strerror(e));
}

/* Replaces *rest by head + "/" + tail (the target of a link, then what was left). */
static int rest_set(char **rest, const char *head, size_t hl, const char *tail) {
  size_t tl = strlen(tail);
  if (hl + 1 + tl >= 2 * PATH_MAX) return ENAMETOOLONG;
  char *n = malloc(hl + 1 + tl + 1);
  if (n == NULL) return ENOMEM;
  memcpy(n, head, hl);
  n[hl] = '/';
  memcpy(n + hl + 1, tail, tl + 1);
  free(*rest);
  *rest = n;
  return 0;
}

int path_resolve(const char *path, const struct path_roots *roots, const char *label,
                 struct path_resolved *out, struct wd_error *err) {
  return path_resolve_walk(path, roots, label, NULL, NULL, out, err);
}

int path_resolve_walk(const char *path, const struct path_roots *roots, const char *label, path_visit_fn visit,
                      void *arg, struct path_resolved *out, struct wd_error *err) {
  out->real = NULL;
  if (path == NULL || path[0] == '\0') return err_set(err, WEIGHTD_E_NOT_FOUND, "%s: empty path", label);
  char cur[PATH_MAX], at[PATH_MAX];
  size_t cl;
  if (path[0] == '/') {
    cur[0] = '\0'; /* "" stands for "/" while walking */
    cl = 0;
  } else {
    if (getcwd(cur, sizeof cur) == NULL) return walk_fail(NULL, ".", errno, label, err);
    cl = strcmp(cur, "/") == 0 ? 0 : strlen(cur);
    cur[cl] = '\0';
  }
  char *rest = NULL;
  int e = rest_set(&rest, path, strlen(path), "");
  if (e != 0) return walk_fail(NULL, path, e, label, err);
  unsigned links = 0;
  size_t pos = 0;
  int rc = 0;
  for (;;) {
    while (rest[pos] == '/') pos++;
    if (rest[pos] == '\0') break;
    size_t n = strcspn(rest + pos, "/");
    const char *name = rest + pos;
    pos += n;
    if (n == 1 && name[0] == '.') continue;
    if (visit != NULL && (rc = visit(arg, cl ? cur : "/", err)) != 0) goto done;
    if (n == 2 && name[0] == '.' && name[1] == '.') {
      while (cl > 0 && cur[cl - 1] != '/') cl--;
      if (cl > 0) cl--;
      cur[cl] = '\0';
      continue;
    }
    if (cl + 1 + n >= sizeof at) {
      rc = walk_fail(roots, cl ? cur : "/", ENAMETOOLONG, label, err);
      goto done;
    }
    memcpy(at, cur, cl);
    at[cl] = '/';
    memcpy(at + cl + 1, name, n);
    at[cl + 1 + n] = '\0';
    struct stat sb;
    if (lstat(at, &sb) != 0) {
      rc = walk_fail(roots, at, errno, label, err);
      goto done;
    }
    if (S_ISLNK(sb.st_mode)) {
      char target[PATH_MAX];
      ssize_t tl = ++links > PATH_MAX_LINKS ? (errno = ELOOP, -1) : readlink(at, target, sizeof target);
      if (tl <= 0 || (size_t)tl >= sizeof target) {
        rc = walk_fail(roots, at, tl < 0 ? errno : tl == 0 ? ENOENT : ENAMETOOLONG, label, err);
        goto done;
      }
      if ((e = rest_set(&rest, target, (size_t)tl, rest + pos)) != 0) {
        rc = walk_fail(roots, at, e, label, err);
        goto done;
      }
      pos = 0;
      if (target[0] == '/') cl = 0;
      cur[cl] = '\0';
      continue;
    }
    size_t more = pos + strspn(rest + pos, "/");
    if (rest[more] != '\0' && !S_ISDIR(sb.st_mode)) {
      rc = walk_fail(roots, at, ENOTDIR, label, err);
      goto done;
    }
    cl += 1 + n;
    memcpy(cur, at, cl + 1);
  }
  const char *real = cl ? cur : "/";
  if (!confined(roots, real)) {
    rc = err_set(err, WEIGHTD_E_PATH_DENIED, "%s: leads outside the model roots", label);
    goto done;
  }
  if (lstat(real, &out->st) != 0) {
    rc = walk_fail(roots, real, errno, label, err);
    goto done;
  }
  if (path[strlen(path) - 1] == '/' && !S_ISDIR(out->st.st_mode)) {
    rc = walk_fail(roots, real, ENOTDIR, label, err);
    goto done;
  }
  if ((out->real = strdup(real)) == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
done:
  free(rest);
  return rc;
}

/* ---- opening ------------------------------------------------------------------ */

/* Opens a resolved path without following any symbolic link in any component where the kernel can. */
static int open_resolved(const char *real) {
  const int flags = O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;
#ifdef SYS_openat2
  struct open_how how = {.flags = (uint64_t)flags, .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
  long fd = syscall(SYS_openat2, AT_FDCWD, real, &how, sizeof how);
  if (fd >= 0) return (int)fd;
  /* Kernels before 5.6, and seccomp filters that refuse the call: the final component is still not followed. */
  if (errno != ENOSYS && errno != EPERM) return -1;
#endif
  return open(real, flags);
}

int path_open_confined(const char *path, const struct path_roots *roots, const char *label, int *fd,
                       struct path_resolved *out, struct wd_error *err) {
  *fd = -1;
  int rc = path_resolve(path, roots, label, out, err);
  if (rc != 0) return rc;
  if (!S_ISREG(out->st.st_mode)) {
    rc = err_set(err, WEIGHTD_E_INVALID, "%s: not a regular file", label);
    goto fail;
  }
  dev_t dev = out->st.st_dev;
  ino_t ino = out->st.st_ino;
  int f = open_resolved(out->real);
  if (f < 0) {
    int e = errno;
    if (e == ELOOP || e == ENOENT || e == ENOTDIR || e == ENXIO)
      rc = err_set(err, WEIGHTD_E_STALE, "%s: changed while it was being opened", label);
    else
      rc = err_set(err, e == ENOMEM ? WEIGHTD_E_NOMEM : WEIGHTD_E_IO, "%s: cannot open: %s", label, strerror(e));
    goto fail;
  }
  if (fstat(f, &out->st) != 0) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: cannot stat: %s", label, strerror(errno));
    close(f);
    goto fail;
  }
  if (!S_ISREG(out->st.st_mode) || out->st.st_dev != dev || out->st.st_ino != ino) {
    rc = err_set(err, WEIGHTD_E_STALE, "%s: changed while it was being opened", label);
    close(f);
    goto fail;
  }
  int fl = fcntl(f, F_GETFL);
  if (fl >= 0) (void)fcntl(f, F_SETFL, fl & ~O_NONBLOCK);
  *fd = f;
  return 0;
fail:
  free(out->real);
  out->real = NULL;
  return rc;
}

char *path_join(const char *dir, const char *rel) {
  size_t dl = strlen(dir), rl = strlen(rel);
  while (dl > 1 && dir[dl - 1] == '/') dl--;
  char *p = malloc(dl + 1 + rl + 1);
  if (p == NULL) return NULL;
  memcpy(p, dir, dl);
  p[dl] = '/';
  memcpy(p + dl + 1, rel, rl + 1);
  return p;
}

char *path_dirname(const char *path) {
  const char *slash = strrchr(path, '/');
  if (slash == NULL) return strdup(".");
  if (slash == path) return strdup("/");
  return strndup(path, (size_t)(slash - path));
}

int path_read_fd(int fd, size_t max_len, char **out, size_t *len) {
  *out = NULL;
  struct stat sb;
  if (fstat(fd, &sb) != 0) return -errno;
  if (!S_ISREG(sb.st_mode)) return -EINVAL;
  if (sb.st_size < 0 || (uint64_t)sb.st_size > max_len) return -EFBIG;
  size_t n = (size_t)sb.st_size, got = 0;
  char *buf = malloc(n + 1);
  if (buf == NULL) return -ENOMEM;
  while (got < n) {
    ssize_t r = pread(fd, buf + got, n - got, (off_t)got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      free(buf);
      return -e;
    }
    if (r == 0) break; /* the file shrank: what was there */
    got += (size_t)r;
  }
  buf[got] = '\0';
  *out = buf;
  if (len != NULL) *len = got;
  return 0;
}

int path_read_file(const char *path, size_t max_len, char **out, size_t *len) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return -errno;
  int rc = path_read_fd(fd, max_len, out, len);
  close(fd);
  return rc;
}
