/* sealed_memfd.c - immutable bytes in a memfd (see sealed_memfd.h). */
#include "sealed_memfd.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int sealed_memfd_create(const char *name, const void *buf, size_t len, int *out, struct wd_error *err) {
  *out = -1;
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return err_set(err, WEIGHTD_E_NOMEM, "memfd_create for %s: %s", name, strerror(errno));
  int rc = 0;
  const unsigned char *p = buf;
  for (size_t at = 0; rc == 0 && at < len;) {
    ssize_t n = write(fd, p + at, len - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) rc = err_set(err, WEIGHTD_E_NOMEM, "writing %s of %zu bytes: %s", name, len, strerror(errno));
    else at += (size_t)n;
  }
  if (rc == 0 && fcntl(fd, F_ADD_SEALS, SEALED_MEMFD_SEALS) != 0)
    rc = err_set(err, WEIGHTD_E_INTERNAL, "sealing %s: %s", name, strerror(errno));
  if (rc != 0) {
    close(fd);
    return rc;
  }
  *out = fd;
  return 0;
}

int sealed_memfd_map(int fd, const void **map, size_t *len, struct wd_error *err) {
  *map = NULL;
  *len = 0;
  int seals = fcntl(fd, F_GET_SEALS);
  int need = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW;
  if (seals < 0 || (seals & need) != need)
    return err_set(err, WEIGHTD_E_INVALID, "not a memfd sealed against writes, shrinking and growth");
  struct stat st;
  if (fstat(fd, &st) != 0) return err_set(err, WEIGHTD_E_INVALID, "fstat: %s", strerror(errno));
  if (st.st_size == 0) return 0;
  void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) return err_set(err, WEIGHTD_E_INVALID, "mmap of %lld bytes: %s", (long long)st.st_size, strerror(errno));
  *map = p;
  *len = (size_t)st.st_size;
  return 0;
}
