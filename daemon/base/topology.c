/* topology.c - devices as a group, found at start (see topology.h). */
#include "topology.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

int topo_rates_parse(const char *text, int n, double *rates, struct wd_error *err) {
  if (text == NULL || text[0] == '\0') {
    for (int i = 0; i < n; i++) rates[i] = 1.0;
    return 0;
  }
  const char *p = text;
  int k = 0;
  while (*p != '\0') {
    char *end;
    double v = strtod(p, &end);
    if (end == p || !isfinite(v) || v <= 0 || (*end != ',' && *end != '\0'))
      return err_set(err, WEIGHTD_E_INVALID,
                     "link_rates: '%s' is not a comma-separated list of positive rates in GiB/s", text);
    if (k < n) rates[k] = v;
    k++;
    p = *end == ',' ? end + 1 : end;
  }
  if (k != n)
    return err_set(err, WEIGHTD_E_INVALID, "link_rates: %d rate(s) given for %d device(s): give one per device", k, n);
  return 0;
}

int topo_create(const struct wd_backend *b, int ndev, const char *sysroot, const char *link_rates,
                struct topology **out, struct wd_error *err) {
  *out = NULL;
  struct topology *t = calloc(1, sizeof *t);
  if (t != NULL) {
    t->dev = calloc((size_t)ndev, sizeof *t->dev);
    t->peer = calloc((size_t)ndev * (size_t)ndev, sizeof *t->peer);
  }
  double *rates = calloc((size_t)ndev, sizeof *rates);
  int rc = 0;
  if (t == NULL || t->dev == NULL || t->peer == NULL || rates == NULL || numa_read(sysroot, &t->numa) != 0) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  t->ndev = ndev;
  if ((rc = topo_rates_parse(link_rates, ndev, rates, err)) != 0) goto fail;
  t->rates_measured = link_rates != NULL && link_rates[0] != '\0';
  const struct wd_backend_ops *ops = b->ops;
  for (int i = 0; i < ndev; i++) {
    struct topo_device *d = &t->dev[i];
    d->numa_node = -1;
    d->link_rate = rates[i];
    struct wd_error e = {0};
    if (ops->pci_bus_id != NULL && ops->pci_bus_id(b->ctx, i, d->pci, sizeof d->pci, &e) == 0)
      d->numa_node = numa_pci_node(sysroot, d->pci);
    else
      d->pci[0] = '\0';
    for (int j = 0; j < ndev; j++) {
      struct wd_peer_info *p = &t->peer[i * ndev + j];
      p->performance_rank = -1;
      if (ops->peer_query != NULL && ops->peer_query(b->ctx, i, j, p, &e) != 0) {
        log_msg(LOG_WARN, "device %d -> %d: peer query failed: %s (copies between them go through host memory)", i,
                j, e.msg);
        memset(p, 0, sizeof *p);
        p->performance_rank = -1;
      }
      if (ops->copy_peer == NULL) p->access = 0;
    }
  }
  free(rates);
  *out = t;
  return 0;
fail:
  free(rates);
  topo_destroy(t);
  return rc;
}

void topo_destroy(struct topology *t) {
  if (t == NULL) return;
  numa_free(&t->numa);
  free(t->dev);
  free(t->peer);
  free(t);
}

const struct wd_peer_info *topo_peer(const struct topology *t, int src, int dst) { return &t->peer[src * t->ndev + dst]; }

int topo_device_node(const struct topology *t, int device) {
  return device >= 0 && device < t->ndev ? t->dev[device].numa_node : -1;
}

const struct numa_node *topo_node(const struct topology *t, int id) {
  if (t->numa.n < 2) return NULL;
  return numa_node_find(&t->numa, id);
}
