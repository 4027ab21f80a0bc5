/*
 * test_hostmem.c - the memory the daemon may use (daemon/base/hostmem.c), the
 * base of the default pin budget, read from fake /proc and /sys/fs/cgroup
 * trees: MemTotal alone, a cgroup v2 limit on a parent with "max" below it,
 * a v1 memory hierarchy beside the unified one, v1's "unlimited" number, a
 * limit above MemTotal, and nothing readable; then the real files, once.
 */
#include <limits.h>
#include <stdbool.h>
#include <sys/stat.h>

#include "testutil.h"

#include "fixture.h"
#include "base/hostmem.h"

/* Writes text to root/rel, creating the directories on the way. */
static void put(const char *root, const char *rel, const char *text) {
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/%s", root, rel);
  for (char *s = p + strlen(root) + 1; (s = strchr(s, '/')) != NULL; s++) {
    *s = '\0';
    mkdir(p, 0755);
    *s = '/';
  }
  FILE *f = fopen(p, "w");
  CHECK(f != NULL);
  if (f == NULL) return;
  fputs(text, f);
  fclose(f);
}

struct tree {
  char *dir;
  char proc[PATH_MAX], cg[PATH_MAX];
};

static void tree_new(struct tree *t, const char *tag, const char *meminfo, const char *self_cgroup) {
  t->dir = fx_tmpdir(tag);
  CHECK(t->dir != NULL);
  snprintf(t->proc, sizeof t->proc, "%s/proc", t->dir);
  snprintf(t->cg, sizeof t->cg, "%s/cgroup", t->dir);
  mkdir(t->proc, 0755);
  mkdir(t->cg, 0755);
  if (meminfo) put(t->proc, "meminfo", meminfo);
  if (self_cgroup) put(t->proc, "self/cgroup", self_cgroup);
}

static void tree_free(struct tree *t) {
  fx_rmtree(t->dir);
  free(t->dir);
}

#define MEMINFO_128G "MemTotal:       134217728 kB\nMemFree:        1000 kB\nMemAvailable:   2000 kB\n"

static void test_memtotal_alone(void) {
  struct tree t;
  struct hostmem h;
  tree_new(&t, "hm-memtotal", MEMINFO_128G, "0::/\n");
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.memtotal, 128ull << 30);
  CHECK(h.cgroup_limit == UINT64_MAX);
  CHECK_EQ_INT(h.limit, 128ull << 30);
  CHECK(strcmp(h.source, "MemTotal") == 0);
  tree_free(&t);
}

static void test_v2_parent_limit(void) {
  struct tree t;
  struct hostmem h;
  tree_new(&t, "hm-v2", MEMINFO_128G, "0::/system.slice/weightd.service\n");
  put(t.cg, "system.slice/weightd.service/memory.max", "max\n");
  put(t.cg, "system.slice/memory.max", "68719476736\n"); /* 64 GiB on the slice */
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.cgroup_limit, 64ull << 30);
  CHECK_EQ_INT(h.limit, 64ull << 30);
  CHECK(strcmp(h.source, "cgroup") == 0);
  /* A lower limit on the service itself wins. */
  put(t.cg, "system.slice/weightd.service/memory.max", "34359738368\n");
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.limit, 32ull << 30);
  /* Read again when asked: MemTotal grown after boot, limits lifted. */
  put(t.cg, "system.slice/weightd.service/memory.max", "max\n");
  put(t.cg, "system.slice/memory.max", "max\n");
  put(t.proc, "meminfo", "MemTotal:       268435456 kB\n");
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.limit, 256ull << 30);
  CHECK(strcmp(h.source, "MemTotal") == 0);
  tree_free(&t);
}

static void test_v1_beside_unified(void) {
  struct tree t;
  struct hostmem h;
  tree_new(&t, "hm-v1", MEMINFO_128G, "9:name=systemd:/\n4:memory:/jobs/a1\n2:cpu,cpuacct:/\n0::/\n");
  put(t.cg, "memory/memory.limit_in_bytes", "9223372036854771712\n"); /* the root: unlimited */
  put(t.cg, "memory/jobs/a1/memory.limit_in_bytes", "17179869184\n");
  put(t.cg, "memory.max", "1024\n"); /* the unified root holds no memory controller here: not read */
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.cgroup_limit, 16ull << 30);
  CHECK_EQ_INT(h.limit, 16ull << 30);
  CHECK(strcmp(h.source, "cgroup") == 0);
  /* v1's unlimited everywhere: MemTotal. */
  put(t.cg, "memory/jobs/a1/memory.limit_in_bytes", "9223372036854771712\n");
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK(h.cgroup_limit == UINT64_MAX);
  CHECK_EQ_INT(h.limit, 128ull << 30);
  tree_free(&t);
}

static void test_limit_above_memtotal(void) {
  struct tree t;
  struct hostmem h;
  tree_new(&t, "hm-above", MEMINFO_128G, "0::/big\n");
  put(t.cg, "big/memory.max", "1099511627776\n");
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.cgroup_limit, 1ull << 40);
  CHECK_EQ_INT(h.limit, 128ull << 30);
  CHECK(strcmp(h.source, "MemTotal") == 0);
  tree_free(&t);
}

static void test_nothing_readable(void) {
  struct tree t;
  struct hostmem h;
  tree_new(&t, "hm-none", NULL, NULL);
  hostmem_read_at(t.proc, t.cg, &h);
  CHECK_EQ_INT(h.memtotal, 0);
  CHECK(h.limit == UINT64_MAX);
  CHECK(strcmp(h.source, "unknown") == 0);
  tree_free(&t);
}

static void test_this_machine(void) {
  struct hostmem h;
  hostmem_read(&h);
  CHECK(h.memtotal > 0);
  CHECK(h.limit > 0 && h.limit <= h.memtotal);
  printf("this machine: MemTotal %llu MiB, cgroup limit %s%llu MiB, limit from %s\n",
         (unsigned long long)(h.memtotal >> 20), h.cgroup_limit == UINT64_MAX ? "none " : "",
         h.cgroup_limit == UINT64_MAX ? 0ull : (unsigned long long)(h.cgroup_limit >> 20), h.source);
}

int main(void) {
  RUN(test_memtotal_alone);
  RUN(test_v2_parent_limit);
  RUN(test_v1_beside_unified);
  RUN(test_limit_above_memtotal);
  RUN(test_nothing_readable);
  RUN(test_this_machine);
  return tu_finish();
}
