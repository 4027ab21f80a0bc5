/*
 * topology.h - what the daemon knows about its devices as a group, found
 * once at start: each device's NUMA node (through its PCI bus id), every
 * ordered pair's peer access and link (the backend's peer_query: CUDA's
 * peer queries, NVML where it loads), the machine's NUMA nodes, and each
 * device's host-to-device link rate (configured from a benchmark, or equal
 * and marked unmeasured).
 *
 * Immutable once built: the loop, job threads and fill threads read it
 * without a lock.
 */
#ifndef WD_TOPOLOGY_H
#define WD_TOPOLOGY_H

#include <stdbool.h>

#include "backend/backend.h"
#include "error.h"
#include "numa.h"

struct topo_device {
  int numa_node;      /* -1: unknown (host memory, or sysfs does not say) */
  char pci[32];       /* PCI bus id, "" when the device has none */
  double link_rate;   /* host-to-device GiB/s (link_rates), or 1 when unmeasured */
};

struct topology {
  int ndev;
  struct topo_device *dev;
  struct wd_peer_info *peer; /* ndev * ndev: peer[src * ndev + dst] */
  struct numa_map numa;      /* the machine's nodes with CPUs */
  bool rates_measured;       /* link_rates was configured */
};

/*
 * Builds the topology of the backend's ndev devices. sysroot is where sysfs
 * is read (NULL: /sys). link_rates is the configured text: "" (every link
 * equal, unmeasured) or one rate in GiB/s per device, comma-separated
 * ("51.6,51.6"); anything else, or a count that is not ndev, is INVALID.
 */
int topo_create(const struct wd_backend *b, int ndev, const char *sysroot, const char *link_rates,
                struct topology **out, struct wd_error *err);
void topo_destroy(struct topology *t);

/* The pair src -> dst (never NULL for valid indexes). */
const struct wd_peer_info *topo_peer(const struct topology *t, int src, int dst);

/* The NUMA node of device, or -1. */
int topo_device_node(const struct topology *t, int device);

/* The machine's node called id (NULL: unknown, or the machine has one node and nothing is placed). */
const struct numa_node *topo_node(const struct topology *t, int id);

/* Parses link_rates text into rates[0..n); 0, or INVALID naming what is wrong. */
int topo_rates_parse(const char *text, int n, double *rates, struct wd_error *err);

#endif
