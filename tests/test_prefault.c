/*
 * test_prefault.c - destination pages made present before a transfer writes
 * them (daemon/base/prefault.h): pages untouched before are resident after,
 * with their bytes unchanged, and a mapping the kernel cannot populate for
 * writing (read-only) is refused with an error the caller falls back on,
 * leaving its pages as they were.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/prefault.h"
#include "testutil.h"

#define PAGES 64

/* How many of the n pages at p are resident. */
static size_t resident(void *p, size_t n) {
  long page = sysconf(_SC_PAGESIZE);
  unsigned char vec[PAGES];
  CHECK(mincore(p, n * (size_t)page, vec) == 0);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) k += vec[i] & 1;
  return k;
}

static void test_populates_untouched_pages(void) {
  long page = sysconf(_SC_PAGESIZE);
  size_t len = PAGES * (size_t)page;
  unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(p != MAP_FAILED);
  CHECK_EQ_INT(resident(p, PAGES), 0);
  /* From the middle of the second page to the middle of the last: every page holding one of the bytes. */
  int rc = prefault_write(p + page + 100, len - (size_t)page - 200);
  if (rc == -EINVAL) { /* a kernel before 5.14: nothing to check but the fallback below */
    printf("  skipped: this kernel has no MADV_POPULATE_WRITE\n");
    munmap(p, len);
    return;
  }
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(resident(p, PAGES), PAGES - 1);
  CHECK_EQ_INT(resident(p, 1), 0); /* no byte of the first page was asked for */
  for (size_t i = 0; i < len; i += (size_t)page / 4) CHECK_EQ_INT(p[i], 0);
  CHECK_EQ_INT(prefault_write(p, 0), 0);
  munmap(p, len);
}

static void test_shared_memory_keeps_its_bytes(void) {
  long page = sysconf(_SC_PAGESIZE);
  size_t len = PAGES * (size_t)page;
  unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(p != MAP_FAILED);
  memset(p, 0x5a, (size_t)page * 3); /* written before: populating must not change a byte */
  int rc = prefault_write(p, len);
  if (rc == -EINVAL) {
    printf("  skipped: this kernel has no MADV_POPULATE_WRITE\n");
    munmap(p, len);
    return;
  }
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(resident(p, PAGES), PAGES);
  CHECK_EQ_INT(p[0], 0x5a);
  CHECK_EQ_INT(p[3 * page - 1], 0x5a);
  CHECK_EQ_INT(p[3 * page], 0);
  munmap(p, len);
}

static void test_read_only_mapping_falls_back(void) {
  long page = sysconf(_SC_PAGESIZE);
  size_t len = PAGES * (size_t)page;
  unsigned char *p = mmap(NULL, len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(p != MAP_FAILED);
  int rc = prefault_write(p, len);
  CHECK(rc == -EINVAL || rc == -EFAULT || rc == -EPERM); /* refused, with the kernel's reason */
  CHECK_EQ_INT(resident(p, PAGES), 0);
  munmap(p, len);
}

int main(void) {
  RUN(test_populates_untouched_pages);
  RUN(test_shared_memory_keeps_its_bytes);
  RUN(test_read_only_mapping_falls_back);
  return tu_finish();
}
