/*
 * hostmem.h - how much memory the daemon may use, for the default pin budget.
 *
 * The limit is the lower of MemTotal (/proc/meminfo) and the memory limit of
 * the daemon's cgroup: cgroup v2's memory.max, or v1's
 * memory.limit_in_bytes, the lowest on the way from the daemon's own cgroup
 * up to the root of the hierarchy it sees. It is read whenever it is asked
 * for, never cached: on some GPU hosts MemTotal grows after boot (memory
 * onlined late), and a service's limit may be changed while it runs.
 */
#ifndef WD_HOSTMEM_H
#define WD_HOSTMEM_H

#include <stdint.h>

struct hostmem {
  uint64_t memtotal;     /* bytes; 0 when /proc/meminfo cannot be read */
  uint64_t cgroup_limit; /* bytes; UINT64_MAX when no cgroup limit applies */
  uint64_t limit;        /* the lower of the two (UINT64_MAX when neither is known) */
  const char *source;    /* "MemTotal", "cgroup", or "unknown" */
};

/* Reads the limit from /proc and /sys/fs/cgroup. */
void hostmem_read(struct hostmem *out);

/* The same, under other roots (tests): proc stands for /proc, cgroup for /sys/fs/cgroup. */
void hostmem_read_at(const char *proc, const char *cgroup, struct hostmem *out);

#endif
