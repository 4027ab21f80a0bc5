/* pathutil.c - path checks shared by the checkpoint reader and the daemon. */
#include "pathutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

int path_read_file(const char *path, size_t max_len, char **out, size_t *len) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -errno;
  struct stat sb;
  int rc = 0;
  char *buf = NULL;
  if (fstat(fd, &sb) != 0) {
    rc = -errno;
    goto fail;
  }
  if (!S_ISREG(sb.st_mode)) {
    rc = -EINVAL;
    goto fail;
  }
  if ((uint64_t)sb.st_size > max_len) {
    rc = -EFBIG;
    goto fail;
  }
  size_t n = (size_t)sb.st_size, got = 0;
  buf = malloc(n + 1);
  if (buf == NULL) {
    rc = -ENOMEM;
    goto fail;
  }
  while (got < n) {
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      rc = -errno;
      goto fail;
    }
    if (r == 0) break;
    got += (size_t)r;
  }
  buf[got] = '\0';
  close(fd);
  *out = buf;
  if (len != NULL) *len = got;
  return 0;
fail:
  free(buf);
  close(fd);
  return rc;
}
