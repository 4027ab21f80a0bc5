/* startup.c - building the daemon's context (see startup.h). */
#include "startup.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "ops/ops.h"
#include "state/scrub.h"
#include "remote/rroots.h"
#include "sockpath.h"
#include "transport/server.h"
#include "stream_copy.h"
#include "base/topology.h"

int startup_default_socket(char **out, struct wd_error *err) {
  struct sockpath sp;
  if (geteuid() == 0) {
    mkdir("/run/weightd", 0755);
    snprintf(sp.path, sizeof sp.path, "%s", SOCKPATH_SERVICE);
  } else {
    unsigned uid = (unsigned)geteuid();
    int rc = sockpath_user_socket(uid, &sp, err);
    if (rc == 0 && sp.private_dir[0] != '\0') rc = sockpath_dir_check(sp.private_dir, uid, true, err);
    if (rc != 0) return err_prefix(err, "socket %s", sp.path);
  }
  *out = strdup(sp.path);
  return *out != NULL ? 0 : err_set(err, WEIGHTD_E_NOMEM, "out of memory");
}

uint64_t startup_raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_cur;
}


static int remote_start(struct daemon *d, struct wd_error *err);
/* The NVIDIA device node present on this machine, or NULL. */
static const char *nvidia_node(void) {
  static const char *const nodes[] = {"/dev/nvidiactl", "/dev/nvidia0"};
  struct stat st;
  for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++)
    if (stat(nodes[i], &st) == 0 && S_ISCHR(st.st_mode)) return nodes[i];
  return NULL;
}

/* The host backend, with the devices and peers the configuration asks for. */
static int host_backend(struct daemon *d, struct wd_error *err) {
  struct wd_host_options o = {.devices = (int)d->cfg.host_devices,
                              .peers = d->cfg.host_peers,
                              .writable = d->cfg.test_writable_slabs == CFG_ON};
  d->backend_name = "host";
  if (o.writable) log_msg(LOG_WARN, "test_writable_slabs on: clients may write the sets they attach (tests only)");
  return backend_host_create_devices(&d->backend, &o, err);
}

int startup_backend(struct daemon *d, struct wd_error *err) {
  enum cfg_backend want = d->cfg.backend;
  if (want == CFG_BACKEND_HOST) return host_backend(d, err);
  if (d->cfg.test_writable_slabs == CFG_ON)
    return err_set(err, WEIGHTD_E_INVALID, "test_writable_slabs is for tests of the host backend (--backend host) only");
  const char *node = nvidia_node();
  if (want == CFG_BACKEND_AUTO && node == NULL) {
    log_msg(LOG_WARN, "backend auto: no NVIDIA device nodes (/dev/nvidiactl, /dev/nvidia0): using the host backend, "
                      "which serves sets from host memory");
    return host_backend(d, err);
  }
  struct wd_error cerr = {0};
  enum wd_handle_kind handles = d->cfg.cuda_handles == CFG_CUDA_HANDLES_LEGACY ? WD_HANDLE_CUDA_IPC : WD_HANDLE_CUDA_VMM;
  if (backend_cuda_create(&d->backend, handles, &cerr) == 0) {
    d->backend_name = "cuda";
    return 0;
  }
  if (want == CFG_BACKEND_AUTO && cerr.code == WEIGHTD_E_UNSUPPORTED) {
    log_msg(LOG_WARN, "backend auto: %s although %s exists: using the host backend", cerr.msg, node);
    return host_backend(d, err);
  }
  if (want == CFG_BACKEND_AUTO)
    return err_set(err, cerr.code ? cerr.code : WEIGHTD_E_DEVICE,
                   "backend auto: %s exists but CUDA cannot start: %s (fix the driver, or set backend to host "
                   "to serve from host memory)",
                   node, cerr.msg);
  *err = cerr;
  return cerr.code;
}

/* Reads every device's description: *out is a new array of d->ndevices. */
static int query_devices(struct daemon *d, struct wd_device_info **out, struct wd_error *err) {
  int n = d->backend.ops->device_count(d->backend.ctx);
  if (n <= 0) return err_set(err, WEIGHTD_E_DEVICE, "the %s backend has no devices", d->backend_name);
  struct wd_device_info *v = calloc((size_t)n, sizeof *v);
  if (v == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (int i = 0; i < n; i++) {
    int rc = d->backend.ops->device_info(d->backend.ctx, i, &v[i], err);
    if (rc != 0) {
      free(v);
      return rc;
    }
    log_msg(LOG_INFO, "device %d: %s %s, %llu MiB, %s handles", i, v[i].name, v[i].uuid,
            (unsigned long long)(v[i].memory_total >> 20), wd_handle_kind_name(v[i].handles));
    if (v[i].handles_why[0] != '\0')
      log_msg(LOG_WARN, "device %d: cuda_handles is %s, but its sets get %s handles: %s", i,
              config_enum_name(&d->cfg, "cuda_handles"), wd_handle_kind_name(v[i].handles), v[i].handles_why);
  }
  d->ndevices = n;
  *out = v;
  return 0;
}

/* Parses root_sources into resolved directories and choices; 0, or INVALID naming the entry. */
static int sources_parse(const struct wd_config *cfg, char **dirs, enum ld_source_choice *choices,
                         struct wd_error *err) {
  for (size_t i = 0; i < cfg->n_root_sources; i++) {
    const char *e = cfg->root_sources[i], *colon = strchr(e, ':');
    char name[16];
    size_t n = colon != NULL ? (size_t)(colon - e) : 0;
    if (colon == NULL || n >= sizeof name)
      return err_set(err, WEIGHTD_E_INVALID, "root_sources entry %zu ('%s'): not SOURCE:DIR", i, e);
    memcpy(name, e, n);
    name[n] = '\0';
    if (ld_source_choice_parse(name, &choices[i]) != 0)
      return err_set(err, WEIGHTD_E_INVALID, "root_sources entry %zu: '%s' is not one of auto, mmap, direct", i, name);
    if ((dirs[i] = realpath(colon + 1, NULL)) == NULL)
      return err_set(err, WEIGHTD_E_INVALID, "root_sources entry %zu: %s: %s", i, colon + 1, strerror(errno));
  }
  return 0;
}

int startup_roots_apply(struct daemon *d, const struct wd_config *cfg, struct wd_error *err) {
  size_t n = cfg->n_model_roots, ns = cfg->n_root_sources;
  char **dirs = calloc(n ? n : 1, sizeof *dirs);
  char **sdirs = calloc(ns ? ns : 1, sizeof *sdirs);
  enum ld_source_choice *choices = calloc(ns ? ns : 1, sizeof *choices);
  int rc = dirs == NULL || sdirs == NULL || choices == NULL ? err_set(err, WEIGHTD_E_NOMEM, "out of memory") : 0;
  for (size_t k = 0; rc == 0 && k < n; k++) {
    dirs[k] = realpath(cfg->model_roots[k], NULL);
    if (dirs[k] == NULL) rc = err_set(err, WEIGHTD_E_INVALID, "model root %s: %s", cfg->model_roots[k], strerror(errno));
  }
  if (rc == 0) rc = sources_parse(cfg, sdirs, choices, err);
  if (rc == 0) rc = reg_roots_set(d->reg, (const char *const *)dirs, n, err);
  if (rc == 0) rc = reg_sources_set(d->reg, (const char *const *)sdirs, choices, ns, err);
  if (rc == 0) {
    for (size_t i = 0; i < n; i++) log_msg(LOG_INFO, "model root %s", dirs[i]);
    for (size_t i = 0; i < ns; i++)
      log_msg(LOG_INFO, "checkpoints under %s read through source %s", sdirs[i], ld_source_choice_name(choices[i]));
    if (n == 0) log_msg(LOG_WARN, "no model roots configured: any path that both the daemon and the client can read may be loaded");
  }
  for (size_t i = 0; dirs != NULL && i < n; i++) free(dirs[i]);
  for (size_t i = 0; sdirs != NULL && i < ns; i++) free(sdirs[i]);
  free(dirs);
  free(sdirs);
  free(choices);
  return rc;
}

enum reg_pin_mode startup_pin_mode(const struct wd_config *cfg) {
  switch (cfg->pin) {
  case CFG_PIN_AFTER_LOAD: return REG_PIN_AFTER_LOAD;
  case CFG_PIN_ON_OPEN: return REG_PIN_ON_OPEN;
  case CFG_PIN_OFF: return REG_PIN_OFF;
  }
  return REG_PIN_OFF;
}

void startup_reg_limits(const struct wd_config *cfg, struct reg_limits *out) {
  out->max_open = (size_t)cfg->max_open_checkpoints;
  out->max_open_per_uid = (size_t)cfg->max_open_checkpoints_per_uid;
  out->memory = cfg->checkpoint_memory;
  out->memory_per_uid = cfg->checkpoint_memory_per_uid;
  out->idle_ms = cfg->checkpoint_idle_ms;
}

/*
 * The mappings open checkpoints may hold: a quarter of vm.max_map_count (the
 * kernel's default 65530 when it cannot be read), so that shards never take
 * the mappings that slabs, staging memory, thread stacks and malloc need.
 */
static size_t checkpoint_maps(void) {
  unsigned long long v = 0;
  FILE *f = fopen("/proc/sys/vm/max_map_count", "re");
  if (f != NULL) {
    if (fscanf(f, "%llu", &v) != 1) v = 0;
    fclose(f);
  }
  if (v == 0) v = 65530;
  return (size_t)(v / 4);
}

/* staging_writes as the loader takes it: auto is what docs/benchmarks.md measured fastest (plain stores). */
static const enum ld_writes writes_modes[] = {
    [CFG_WRITES_AUTO] = LD_WRITES_CACHED,
    [CFG_WRITES_CACHED] = LD_WRITES_CACHED,
    [CFG_WRITES_STREAMING] = LD_WRITES_STREAMING,
    [CFG_WRITES_WRITE_COMBINED] = LD_WRITES_WRITE_COMBINED,
};
_Static_assert(sizeof writes_modes / sizeof writes_modes[0] == CFG_WRITES_COUNT,
               "every staging_writes choice has its loader mode");

void startup_budgets_cap(struct wd_config *cfg, const struct wd_device_info *devices, int n) {
  const double gib = (double)(1ull << 30);
  int smallest = -1;
  for (int i = 0; i < n; i++)
    if (smallest < 0 || devices[i].memory_total < devices[smallest].memory_total) smallest = i;
  if (smallest >= 0 && cfg->device_memory_budget > devices[smallest].memory_total) {
    log_msg(LOG_WARN,
            "device_memory_budget (%.2f GiB) is more than device %d (%s) has (%.2f GiB): capped at %.2f GiB",
            (double)cfg->device_memory_budget / gib, smallest, devices[smallest].name,
            (double)devices[smallest].memory_total / gib, (double)devices[smallest].memory_total / gib);
    cfg->device_memory_budget = devices[smallest].memory_total;
  }
  uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  if (phys > 0 && cfg->host_pin_budget > phys) {
    log_msg(LOG_WARN, "host_pin_budget (%.2f GiB) is more than this machine's memory (%.2f GiB): capped at %.2f GiB",
            (double)cfg->host_pin_budget / gib, (double)phys / gib, (double)phys / gib);
    cfg->host_pin_budget = phys;
  }
}
_Static_assert((int)CFG_SOURCE_AUTO == (int)LD_CHOOSE_AUTO && (int)CFG_SOURCE_MMAP == (int)LD_CHOOSE_MMAP &&
                   (int)CFG_SOURCE_DIRECT == (int)LD_CHOOSE_DIRECT,
               "source's choices are load/source.h's in order");
_Static_assert((int)CFG_STRIDED_GATHER == (int)PLAN_STRIDED_GATHER && (int)CFG_STRIDED_ROWS == (int)PLAN_STRIDED_ROWS &&
                   (int)CFG_STRIDED_AUTO == (int)PLAN_STRIDED_AUTO,
               "staged_strided's choices are plan_stage.h's modes in order");

/* Binds the starting thread near `device` (ld_params.place): pinned memory allocated now lands on its node. */
static void place_near(void *arg, int device) {
  struct daemon *d = arg;
  if (d->cfg.numa != CFG_SWITCH_AUTO) return;
  const struct numa_node *n = topo_node(d->topo, topo_device_node(d->topo, device));
  if (n != NULL) numa_bind(pthread_self(), n);
}

/* Logs the devices as a group: NUMA nodes, peers and how they connect. */
static void log_topology(const struct daemon *d, unsigned bound) {
  const struct topology *t = d->topo;
  if (t->numa.n > 1)
    log_msg(LOG_INFO, "%zu NUMA nodes: %u fill threads bound to their nodes%s", t->numa.n, bound,
            d->cfg.numa == CFG_SWITCH_AUTO ? "" : " (numa is off)");
  if (t->ndev < 2) return;
  for (int i = 0; i < t->ndev; i++) {
    char peers[256] = "";
    size_t n = 0;
    for (int j = 0; j < t->ndev; j++) {
      const struct wd_peer_info *p = topo_peer(t, i, j);
      if (!p->access) continue;
      int w = snprintf(peers + n, sizeof peers - n, "%s%d (%s)", n ? ", " : "", j, wd_link_name(p->link));
      if (w < 0 || (size_t)w >= sizeof peers - n) break;
      n += (size_t)w;
    }
    log_msg(LOG_INFO, "device %d: NUMA node %d, link rate %.1f%s, peers: %s", i, t->dev[i].numa_node,
            t->dev[i].link_rate, t->rates_measured ? " GiB/s" : " (unmeasured)", n ? peers : "none");
  }
}

int startup_state(struct daemon *d, struct wd_error *err) {
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned fill = d->cfg.fill_threads ? (unsigned)d->cfg.fill_threads : (unsigned)(ncpu > 0 ? ncpu : 1);
  /* ld_pool_run's caller helps, so the pool has one thread fewer than asked. */
  if (ld_pool_start(fill > 1 ? fill - 1 : 0, &d->fill) != 0) return err_set(err, WEIGHTD_E_NOMEM, "cannot start fill threads");
  struct wd_device_info *devices = NULL;
  int rc = query_devices(d, &devices, err);
  if (rc != 0) return rc;
  startup_budgets_cap(&d->cfg, devices, d->ndevices);
  /* With several devices, a load per device (a whole TP group) and two more run at once. */
  unsigned job_threads = (unsigned)d->cfg.job_threads;
  if (d->ndevices > 1 && job_threads < (unsigned)d->ndevices + 2) job_threads = (unsigned)d->ndevices + 2;
  if (jobs_start(d->loop, (unsigned)d->cfg.control_threads, &d->control_pool, err) != 0 ||
      jobs_start(d->loop, job_threads, &d->job_pool, err) != 0 ||
      topo_create(&d->backend, d->ndevices, NULL, d->cfg.link_rates, &d->topo, err) != 0) {
    free(devices);
    return err->code;
  }
  unsigned bound = d->cfg.numa == CFG_SWITCH_AUTO ? ld_pool_bind(d->fill, &d->topo->numa) : 0;
  log_topology(d, bound);
  int *nodes = calloc((size_t)d->ndevices, sizeof *nodes);
  for (int i = 0; nodes != NULL && i < d->ndevices; i++)
    nodes[i] = d->cfg.numa == CFG_SWITCH_AUTO && topo_node(d->topo, topo_device_node(d->topo, i)) != NULL
                   ? topo_device_node(d->topo, i)
                   : -1;
  struct ld_params lp = {.backend = &d->backend,
                         .pool = d->fill,
                         .ndevices = d->ndevices,
                         .staged_only = d->cfg.load_method == CFG_LOAD_STAGED,
                         .strided = (enum plan_strided)d->cfg.staged_strided,
                         .staging_slots = (size_t)d->cfg.staging_slots,
                         .staging_slot_bytes = (size_t)d->cfg.staging_slot_bytes,
                         .writes = writes_modes[d->cfg.staging_writes],
                         .test_load_gate = d->cfg.test_load_gate,
                         .test_refuse_odirect = d->cfg.test_refuse_odirect == CFG_ON,
                         .auto_direct_bytes = d->cfg.auto_direct_bytes,
                         .verify = d->cfg.verify == CFG_VERIFY_ON_LOAD,
                         .digests = d->cfg.scrub == CFG_ON,
                         .topo = d->topo,
                         .replicas = d->cfg.replicas == CFG_SWITCH_AUTO,
                         .striping = d->cfg.striping == CFG_SWITCH_AUTO,
                         .stripe_min_bytes = d->cfg.stripe_min_bytes,
                         .device_nodes = nodes,
                         .place = place_near,
                         .place_arg = d};
  struct reg_params gp = {.backend = &d->backend,
                          .control = d->control_pool,
                          .bulk = d->job_pool,
                          .fill = d->fill,
                          .pin_budget = d->cfg.host_pin_budget,
                          .pin_mode = startup_pin_mode(&d->cfg),
                          .loop = d->loop,
                          .limits = {.max_maps = checkpoint_maps()}};
  startup_reg_limits(&d->cfg, &gp.limits);
  rc = nodes == NULL ? err_set(err, WEIGHTD_E_NOMEM, "out of memory") : 0;
  if (rc == 0) rc = ld_create(&lp, &d->ld, err);
  free(nodes);
  if (rc == 0) rc = reg_create(&gp, &d->reg, err);
  if (rc == 0)
    log_msg(LOG_INFO,
            "checkpoints: at most %zu open (%zu per uid), %llu MiB charged (%llu MiB per uid), %zu shard mappings "
            "(a quarter of vm.max_map_count); unused ones closed after %llu ms (0: never)",
            gp.limits.max_open, gp.limits.max_open_per_uid, (unsigned long long)(gp.limits.memory >> 20),
            (unsigned long long)(gp.limits.memory_per_uid >> 20), gp.limits.max_maps,
            (unsigned long long)gp.limits.idle_ms);
  if (rc == 0 && d->backend.ops->host_register != NULL)
    log_msg(LOG_INFO, "pin %s; host_pin_budget %llu MiB now (from %s); staged_strided %s; staging_writes %s",
            config_enum_name(&d->cfg, "pin"), (unsigned long long)(reg_pin_budget(d->reg) >> 20),
            reg_pin_budget_source(d->reg), config_enum_name(&d->cfg, "staged_strided"),
            config_enum_name(&d->cfg, "staging_writes"));
  if (rc == 0 && d->cfg.staging_writes == CFG_WRITES_STREAMING && !stream_copy_native())
    log_msg(LOG_WARN, "staging_writes streaming: this build has no non-temporal stores (x86-64 only): plain stores");
  if (rc == 0) rc = startup_roots_apply(d, &d->cfg, err);
  if (rc == 0) rc = remote_start(d, err);
  if (rc == 0) {
    struct res_params rp = {.loop = d->loop,
                            .backend = &d->backend,
                            .bulk = d->job_pool,
                            .ld = d->ld,
                            .ndevices = d->ndevices,
                            .devices = devices,
                            .device_budget = d->cfg.device_memory_budget,
                            .replicas = ld_has_peers(d->ld) && d->cfg.replicas == CFG_SWITCH_AUTO};
    rc = res_create(&rp, &d->res, err);
  }
  if (rc == 0) {
    struct scrub_params sp = {.loop = d->loop,
                              .backend = &d->backend,
                              .res = d->res,
                              .off = d->cfg.scrub != CFG_ON,
                              .duty = d->cfg.scrub == CFG_ON ? (unsigned)d->cfg.scrub_duty : 0,
                              .interval_ms = d->cfg.scrub_interval_ms,
                              .batch_bytes = d->backend.ops->caps & WD_CAP_HOST_SLABS ? SCRUB_BATCH_BYTES
                                                                                      : SCRUB_BATCH_BYTES_DEVICE,
                              .on_corrupt = ops_scrub_corrupt,
                              .on_corrupt_arg = d};
    rc = scrub_create(&sp, &d->scrub, err);
    if (rc == 0 && d->cfg.scrub != CFG_ON)
      log_msg(LOG_INFO, "scrub off: sets get no digests and are not scrubbed (scrub: on turns it on)");
    else if (rc == 0 && d->backend.ops->slab_hash == NULL)
      log_msg(LOG_WARN, "the %s backend cannot hash its memory: sets get no digests, scrubs answer UNSUPPORTED",
              d->backend.ops->name);
    else if (rc == 0)
      log_msg(LOG_INFO, "scrub: background duty %llu%%, a set every %llu ms after the last (0%%: off)",
              (unsigned long long)d->cfg.scrub_duty, (unsigned long long)d->cfg.scrub_interval_ms);
  }
  free(devices);
  return rc;
}

/*
 * The remote roots, read once at start (remote/rroots.h); none configured:
 * nothing is fetched. Remote opens and checks wait on the network, so they
 * run on a pool of their own: a slow store never holds up local opens.
 */
#define REMOTE_POOL_THREADS 4
static int remote_start(struct daemon *d, struct wd_error *err) {
  size_t n = d->cfg.n_remote_roots;
  if (n == 0 && d->cfg.n_remote_bearer_token_files > 0)
    return err_set(err, WEIGHTD_E_INVALID, "remote_bearer_token_files names roots, but no remote_roots are configured");
  if (n == 0) return 0;
  struct rroots_opts o = {.urls = (const char *const *)d->cfg.remote_roots,
                           .n = n,
                           .ca_file = d->cfg.remote_ca_file[0] != '\0' ? d->cfg.remote_ca_file : NULL,
                           .token_files = (const char *const *)d->cfg.remote_bearer_token_files,
                           .ntoken_files = d->cfg.n_remote_bearer_token_files};
  int rc = rroots_create(&o, &d->remote, err);
  if (rc == 0) rc = jobs_start(d->loop, REMOTE_POOL_THREADS, &d->remote_pool, err);
  if (rc != 0) return rc;
  reg_remote_set(d->reg, d->remote, d->remote_pool);
  for (size_t i = 0; i < n; i++)
    log_msg(LOG_INFO, "remote root %s%s", rroots_text(d->remote, i),
            rroots_has_token(d->remote, i) ? " (requests carry its bearer token)" : "");
  log_msg(LOG_INFO, "remote roots: s3:// credentials from %s", rroots_creds_source(d->remote));
  return 0;
}

void startup_free(struct daemon *d) {
  scrub_destroy(d->scrub);
  d->scrub = NULL;
  res_destroy(d->res);
  d->res = NULL;
  reg_destroy(d->reg);
  d->reg = NULL;
  if (d->job_pool != NULL) jobs_stop(d->job_pool);
  if (d->control_pool != NULL) jobs_stop(d->control_pool);
  if (d->remote_pool != NULL) jobs_stop(d->remote_pool);
  d->job_pool = d->control_pool = d->remote_pool = NULL;
  if (d->srv != NULL) server_destroy(d->srv);
  d->srv = NULL;
  ld_destroy(d->ld);
  d->ld = NULL;
  topo_destroy(d->topo);
  d->topo = NULL;
  backend_destroy(&d->backend);
  ld_pool_stop(d->fill);
  d->fill = NULL;
  rroots_free(d->remote); /* after every job and fill thread that could read through its client */
  d->remote = NULL;
  free(d->socket_path);
  d->socket_path = NULL;
}
