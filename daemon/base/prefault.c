/*
 * prefault.c - destination pages made present before a transfer writes them
 * (see prefault.h).
 */
#include "prefault.h"

#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14's value, for headers older than the kernel */
#endif

int prefault_write(void *p, size_t n) {
  if (n == 0) return 0;
  long page = sysconf(_SC_PAGESIZE);
  uintptr_t a = (uintptr_t)p & ~((uintptr_t)page - 1);
  uintptr_t b = ((uintptr_t)p + n + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
  return madvise((void *)a, b - a, MADV_POPULATE_WRITE) == 0 ? 0 : -errno;
}
