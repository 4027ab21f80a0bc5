/*
 * startup.h - building the daemon's context from its configuration: the
 * backend, the pools, the state modules, and what a reload re-applies
 * (model roots, budgets). Loop thread only, before and between requests.
 */
#ifndef WD_STARTUP_H
#define WD_STARTUP_H

#include <stdint.h>

#include "daemon.h"
#include "error.h"

/*
 * The socket path of a daemon started without one (sockpath.h): the
 * service's as root, else the per-user socket, whose private directory
 * under /tmp is created or checked here. Returns 0 with *out a new string,
 * or fails with err naming the path (the directory refused, no memory).
 */
int startup_default_socket(char **out, struct wd_error *err);

/* Raises RLIMIT_NOFILE's soft limit to its hard one; returns the soft limit now in force. */
uint64_t startup_raise_fd_limit(void);

/*
 * Chooses and creates the backend. `cuda` must start; `auto` starts cuda when
 * NVIDIA device nodes exist and then refuses to start if CUDA fails (a broken
 * driver is an error, not a reason to serve from host memory); without device
 * nodes it uses the host backend and says so as a warning.
 */
int startup_backend(struct daemon *d, struct wd_error *err);

/* Starts the pools and builds the loader, registry and residency. */
int startup_state(struct daemon *d, struct wd_error *err);

/* Resolves cfg's model roots and hands them to the registry. */
int startup_roots_apply(struct daemon *d, const struct wd_config *cfg, struct wd_error *err);

/* The registry's pin mode for the `pin` setting. */
enum reg_pin_mode startup_pin_mode(const struct wd_config *cfg);

/*
 * The registry's bounds from cfg's checkpoint settings; max_maps (read from
 * /proc/sys/vm/max_map_count at start) is left as *out holds it.
 */
void startup_reg_limits(const struct wd_config *cfg, struct reg_limits *out);

/*
 * Caps cfg's budgets at what the machine has: device_memory_budget at the
 * memory of the smallest of the n devices, host_pin_budget at physical
 * memory. Each cap is logged as a warning with both figures.
 */
void startup_budgets_cap(struct wd_config *cfg, const struct wd_device_info *devices, int n);

/* Frees whatever startup built (NULL-safe parts). */
void startup_free(struct daemon *d);

#endif
