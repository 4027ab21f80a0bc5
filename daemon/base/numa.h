/*
 * numa.h - the machine's NUMA nodes and their CPUs, and the node nearest a
 * PCI device, read from sysfs: what places fill threads and pinned buffers
 * near the GPU they feed.
 *
 *   /sys/devices/system/node/node<N>/cpulist   the CPUs of node N ("0-3,8-11")
 *   /sys/bus/pci/devices/<bus id>/numa_node    a device's node (-1: none)
 *
 * Every reader takes the sysfs root as a parameter (NULL: "/sys"), so that
 * tests parse a tree of their own. A machine without the node directory (or
 * with one node) has one node, and nothing is bound.
 */
#ifndef WD_NUMA_H
#define WD_NUMA_H

#include <pthread.h>
#include <stddef.h>

struct numa_node {
  int id;     /* N of node<N> */
  int *cpus;  /* its online CPUs, ascending */
  size_t ncpus;
};

struct numa_map {
  struct numa_node *nodes; /* ascending id */
  size_t n;
};

/*
 * Parses a kernel cpulist ("0-3,8-11,16", "" for none, a trailing newline
 * allowed) into a new ascending array (*cpus, *n). 0, or -1 when the text is
 * malformed (nothing allocated then).
 */
int numa_cpulist_parse(const char *text, int **cpus, size_t *n);

/*
 * Reads every node<N>/cpulist below root's devices/system/node into out
 * (nodes without CPUs are left out). 0 (an absent directory gives n == 0),
 * or -1 when memory ran out.
 */
int numa_read(const char *root, struct numa_map *out);

void numa_free(struct numa_map *m);

/* The NUMA node of PCI device bus_id ("0000:1b:00.0"), or -1 when sysfs does not say. */
int numa_pci_node(const char *root, const char *bus_id);

/* The node of m called id, or NULL. */
const struct numa_node *numa_node_find(const struct numa_map *m, int id);

/* Restricts thread t to node's CPUs; 0 or an errno value. */
int numa_bind(pthread_t t, const struct numa_node *node);

#endif
