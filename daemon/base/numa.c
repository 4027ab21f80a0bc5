/* numa.c - NUMA nodes and device placement from sysfs (see numa.h). */
#include "numa.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* Reads a small sysfs file into buf (NUL-terminated); 0 or -1. */
static int read_small(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "re");
  if (f == NULL) return -1;
  size_t n = fread(buf, 1, len - 1, f);
  int bad = ferror(f);
  fclose(f);
  if (bad) return -1;
  buf[n] = '\0';
  return 0;
}

static const char *sysroot(const char *root) { return root != NULL && root[0] != '\0' ? root : "/sys"; }

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Reads a decimal CPU number at *p (advancing it); -1 when there is none or it is too large. */
static long cpu_number(const char **p) {
  const char *s = *p;
  if (*s < '0' || *s > '9') return -1;
  long v = 0;
  while (*s >= '0' && *s <= '9') {
    v = v * 10 + (*s - '0');
    if (v > CPU_SETSIZE * 64L) return -1;
    s++;
  }
  *p = s;
  return v;
}

int numa_cpulist_parse(const char *text, int **cpus, size_t *n) {
  *cpus = NULL;
  *n = 0;
  size_t cap = 0, count = 0;
  int *v = NULL;
  const char *p = text;
  while (*p == ' ' || *p == '\t') p++;
  while (*p != '\0' && *p != '\n') {
    long a = cpu_number(&p), b = a;
    if (a < 0) goto bad;
    if (*p == '-') {
      p++;
      b = cpu_number(&p);
      if (b < a) goto bad;
    }
    if (*p == ',') {
      p++;
      if (*p == '\0' || *p == '\n') goto bad;
    } else if (*p != '\0' && *p != '\n') {
      goto bad;
    }
    for (long c = a; c <= b; c++) {
      if (count == cap) {
        size_t ncap = cap ? 2 * cap : 16;
        int *nv = realloc(v, ncap * sizeof *nv);
        if (nv == NULL) goto bad;
        v = nv;
        cap = ncap;
      }
      v[count++] = (int)c;
    }
  }
  if (*p == '\n' && p[1] != '\0') goto bad;
  if (count > 1) qsort(v, count, sizeof *v, cmp_int);
  *cpus = v;
  *n = count;
  return 0;
bad:
  free(v);
  return -1;
}

static int cmp_node(const void *a, const void *b) {
  return cmp_int(&((const struct numa_node *)a)->id, &((const struct numa_node *)b)->id);
}

int numa_read(const char *root, struct numa_map *out) {
  memset(out, 0, sizeof *out);
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/devices/system/node", sysroot(root));
  DIR *d = opendir(dir);
  if (d == NULL) return 0;
  struct dirent *e;
  size_t cap = 0;
  int rc = 0;
  while ((e = readdir(d)) != NULL) {
    const char *num = e->d_name + 4;
    if (strncmp(e->d_name, "node", 4) != 0 || *num < '0' || *num > '9') continue;
    char *end;
    long id = strtol(num, &end, 10);
    if (*end != '\0' || id > INT_MAX) continue;
    char path[PATH_MAX + 32], text[4096];
    snprintf(path, sizeof path, "%s/%s/cpulist", dir, e->d_name);
    int *cpus = NULL;
    size_t ncpus = 0;
    if (read_small(path, text, sizeof text) != 0 || numa_cpulist_parse(text, &cpus, &ncpus) != 0) continue;
    if (ncpus == 0) { /* a memory-only node: no thread runs there */
      free(cpus);
      continue;
    }
    if (out->n == cap) {
      size_t ncap = cap ? 2 * cap : 4;
      struct numa_node *nv = realloc(out->nodes, ncap * sizeof *nv);
      if (nv == NULL) {
        free(cpus);
        rc = -1;
        break;
      }
      out->nodes = nv;
      cap = ncap;
    }
    out->nodes[out->n++] = (struct numa_node){.id = (int)id, .cpus = cpus, .ncpus = ncpus};
  }
  closedir(d);
  if (rc != 0) {
    numa_free(out);
    return rc;
  }
  if (out->n > 1) qsort(out->nodes, out->n, sizeof *out->nodes, cmp_node);
  return 0;
}

void numa_free(struct numa_map *m) {
  if (m == NULL) return;
  for (size_t i = 0; i < m->n; i++) free(m->nodes[i].cpus);
  free(m->nodes);
  memset(m, 0, sizeof *m);
}

int numa_pci_node(const char *root, const char *bus_id) {
  if (bus_id == NULL || bus_id[0] == '\0' || strchr(bus_id, '/') != NULL || strstr(bus_id, "..") != NULL) return -1;
  /* sysfs names the domain with 4 digits; some tools write 8 ("00000000:1b:00.0"). */
  const char *colon = strchr(bus_id, ':');
  if (colon == bus_id + 8 && strncmp(bus_id, "0000", 4) == 0) bus_id += 4;
  char path[PATH_MAX], text[32];
  snprintf(path, sizeof path, "%s/bus/pci/devices/%s/numa_node", sysroot(root), bus_id);
  if (read_small(path, text, sizeof text) != 0) return -1;
  char *end;
  long v = strtol(text, &end, 10);
  if (end == text || (*end != '\0' && *end != '\n') || v < 0 || v > INT_MAX) return -1;
  return (int)v;
}

const struct numa_node *numa_node_find(const struct numa_map *m, int id) {
  for (size_t i = 0; m != NULL && i < m->n; i++)
    if (m->nodes[i].id == id) return &m->nodes[i];
  return NULL;
}

int numa_bind(pthread_t t, const struct numa_node *node) {
  cpu_set_t set;
  CPU_ZERO(&set);
  size_t added = 0;
  for (size_t i = 0; i < node->ncpus; i++)
    if (node->cpus[i] >= 0 && node->cpus[i] < CPU_SETSIZE) {
      CPU_SET(node->cpus[i], &set);
      added++;
    }
  if (added == 0) return EINVAL;
  return pthread_setaffinity_np(t, sizeof set, &set);
}
