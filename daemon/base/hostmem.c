/* hostmem.c - the memory the daemon may use (see hostmem.h). */
#include "hostmem.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Values from this up mean "no limit" in cgroup v1 (the kernel prints a page-rounded LONG_MAX). */
#define V1_UNLIMITED (1ull << 62)

/* Reads the first line of a small file into buf; 0, or -1. */
static int read_line(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "re");
  if (f == NULL) return -1;
  char *ok = fgets(buf, (int)len, f);
  fclose(f);
  if (ok == NULL) return -1;
  buf[strcspn(buf, "\n")] = '\0';
  return 0;
}

static uint64_t read_memtotal(const char *proc) {
  char path[PATH_MAX], line[256];
  snprintf(path, sizeof path, "%s/meminfo", proc);
  FILE *f = fopen(path, "re");
  if (f == NULL) return 0;
  uint64_t v = 0;
  while (fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "MemTotal:", 9) == 0) {
      v = strtoull(line + 9, NULL, 10) * 1024;
      break;
    }
  fclose(f);
  return v;
}

/*
 * The daemon's cgroup path in the hierarchy holding the memory controller:
 * v2 ("0::/path") or v1 ("N:...memory...:/path"). Returns 2, 1, or 0 when
 * neither is listed.
 */
static int cgroup_path(const char *proc, char *out, size_t len) {
  char path[PATH_MAX], line[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/self/cgroup", proc);
  FILE *f = fopen(path, "re");
  if (f == NULL) return 0;
  int version = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    line[strcspn(line, "\n")] = '\0';
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (c2 == NULL) continue;
    *c1 = '\0';
    *c2 = '\0';
    const char *controllers = c1 + 1, *p = c2 + 1;
    if (strcmp(line, "0") == 0 && controllers[0] == '\0') {
      if (version == 0) { /* v2, unless a v1 memory hierarchy says otherwise */
        snprintf(out, len, "%s", p);
        version = 2;
      }
      continue;
    }
    char list[256];
    snprintf(list, sizeof list, "%s", controllers);
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save))
      if (strcmp(tok, "memory") == 0) {
        snprintf(out, len, "%s", p);
        version = 1;
      }
  }
  fclose(f);
  return version;
}

/* The lowest limit from dir up to the root: v2 memory.max ("max": none), v1 memory.limit_in_bytes. */
static uint64_t cgroup_limit(const char *root, int version, const char *dir) {
  char d[PATH_MAX], path[PATH_MAX * 2], line[64];
  snprintf(d, sizeof d, "%s", dir);
  uint64_t lim = UINT64_MAX;
  for (;;) {
    size_t n = strlen(d);
    while (n > 1 && d[n - 1] == '/') d[--n] = '\0';
    if (version == 2) snprintf(path, sizeof path, "%s%s/memory.max", root, strcmp(d, "/") == 0 ? "" : d);
    else snprintf(path, sizeof path, "%s/memory%s/memory.limit_in_bytes", root, strcmp(d, "/") == 0 ? "" : d);
    if (read_line(path, line, sizeof line) == 0 && line[0] >= '0' && line[0] <= '9') {
      uint64_t v = strtoull(line, NULL, 10);
      if (!(version == 1 && v >= V1_UNLIMITED) && v < lim) lim = v;
    }
    if (strcmp(d, "/") == 0 || d[0] == '\0') break;
    char *slash = strrchr(d, '/');
    if (slash == NULL) break;
    if (slash == d) d[1] = '\0';
    else *slash = '\0';
  }
  return lim;
}

void hostmem_read_at(const char *proc, const char *cgroup, struct hostmem *out) {
  char dir[PATH_MAX] = "/";
  out->memtotal = read_memtotal(proc);
  int version = cgroup_path(proc, dir, sizeof dir);
  out->cgroup_limit = version ? cgroup_limit(cgroup, version, dir[0] == '/' ? dir : "/") : UINT64_MAX;
  uint64_t mt = out->memtotal ? out->memtotal : UINT64_MAX;
  out->limit = mt < out->cgroup_limit ? mt : out->cgroup_limit;
  out->source = out->limit == UINT64_MAX ? "unknown" : out->cgroup_limit < mt ? "cgroup" : "MemTotal";
}

void hostmem_read(struct hostmem *out) { hostmem_read_at("/proc", "/sys/fs/cgroup", out); }
