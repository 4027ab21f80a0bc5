/* reload.c - applying a new configuration to a running daemon (see reload.h). */
#include "reload.h"

#include <string.h>

#include "base/log.h"
#include "transport/server.h"
#include "startup.h"

struct diff {
  const char *keys[64];
  size_t n;
  size_t kept;
};

static void note_change(void *arg, const char *key, bool reloadable) {
  struct diff *df = arg;
  if (!reloadable) {
    log_msg(LOG_WARN, "reload: '%s' changed, but only a restart applies it: the running value is kept", key);
    df->kept++;
    return;
  }
  if (df->n < sizeof df->keys / sizeof df->keys[0]) df->keys[df->n++] = key;
}

static bool changed(const struct diff *df, const char *key) {
  for (size_t i = 0; i < df->n; i++)
    if (strcmp(df->keys[i], key) == 0) return true;
  return false;
}

int reload_apply(struct daemon *d, struct wd_config *next, struct wd_error *err) {
  struct diff df = {0};
  struct wd_device_info devices[64];
  int ndev = d->ndevices < 64 ? d->ndevices : 64;
  for (int i = 0; i < ndev; i++) devices[i] = res_device(d->res, i)->info;
  startup_budgets_cap(next, devices, ndev);
  config_compare(&d->cfg, next, note_change, &df);
  /* Check what can fail before anything changes. */
  int rc = server_config_check(next, err);
  if (rc != 0) return rc;
  if (changed(&df, "model_roots") || changed(&df, "root_sources")) {
    rc = startup_roots_apply(d, next, err);
    if (rc != 0) return rc;
  }
  for (size_t i = 0; i < df.n; i++) {
    rc = config_copy_key(&d->cfg, next, df.keys[i], err);
    if (rc != 0) return rc; /* out of memory: what was copied stays */
    log_msg(LOG_INFO, "reload: '%s' changed", df.keys[i]);
  }
  log_set_level(d->cfg.log_level);
  if (changed(&df, "device_memory_budget")) {
    size_t n = res_device_budget_set(d->res, d->cfg.device_memory_budget);
    if (n > 0) log_msg(LOG_INFO, "reload: evicted %zu unleased set(s) to fit device_memory_budget", n);
  }
  if (changed(&df, "host_pin_budget")) {
    size_t n = reg_pin_budget_set(d->reg, d->cfg.host_pin_budget);
    if (n > 0) log_msg(LOG_INFO, "reload: unpinning %zu checkpoint(s) to fit host_pin_budget", n);
  }
  if (changed(&df, "pin")) reg_pin_mode_set(d->reg, startup_pin_mode(&d->cfg));
  struct reg_limits limits = *reg_limits(d->reg);
  startup_reg_limits(&d->cfg, &limits);
  reg_limits_set(d->reg, &limits);
  log_msg(LOG_INFO, "reload: %zu key(s) applied, %zu kept until a restart", df.n, df.kept);
  return 0;
}
