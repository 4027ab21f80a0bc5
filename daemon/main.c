/*
 * main.c - weightd: flags, configuration, start-up and orderly shutdown.
 *
 * weightd [--config FILE] [--socket PATH] [--backend auto|cuda|host]
 *         [--model-root DIR]... [--foreground] [--log-level L] [--help]
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "fault.h"
#include "log.h"
#include "server.h"

/* The daemon, for the signal handlers and the stop timer (loop thread only). */
static struct daemon the_daemon;
static uv_timer_t stop_timer;
static uv_signal_t sigterm_handle, sigint_handle, sighup_handle;
static int ready_fd = -1;

static void usage(FILE *f) {
  fprintf(f,
          "usage: weightd [--config FILE] [--socket PATH] [--backend auto|cuda|host]\n"
          "               [--model-root DIR]... [--foreground] [--log-level LEVEL]\n"
          "               [--set KEY=VALUE]... [--help] [--version]\n\n"
          "Flags override the config file. Without --foreground weightd detaches once it\n"
          "listens. See docs/operations.md.\n\n");
  config_print_help(f);
}

/* ---- shutdown ------------------------------------------------------------------- */

static void handle_closed(uv_handle_t *h) { (void)h; }

/* Waits for running jobs (their loads were told to stop), then frees everything. */
static void on_stop_tick(uv_timer_t *t) {
  struct daemon *d = t->data;
  if (jobs_outstanding(d->control_pool) > 0 || jobs_outstanding(d->job_pool) > 0) return;
  uv_timer_stop(t);
  uv_close((uv_handle_t *)t, handle_closed);
  server_close_all(d->srv);
  res_destroy(d->res); /* its slabs are freed on the job pool, drained below */
  d->res = NULL;
  reg_destroy(d->reg);
  d->reg = NULL;
  jobs_stop(d->job_pool); /* may still free slabs: before the quick pool, which it does not use */
  d->job_pool = NULL;
  jobs_stop(d->control_pool);
  d->control_pool = NULL;
  uv_close((uv_handle_t *)&sigterm_handle, handle_closed);
  uv_close((uv_handle_t *)&sigint_handle, handle_closed);
  uv_close((uv_handle_t *)&sighup_handle, handle_closed);
}

static void request_stop(struct daemon *d) {
  if (d->stopping) return;
  d->stopping = true;
  log_msg(LOG_INFO, "stopping: canceling loads and prefetches, closing connections");
  reg_stop(d->reg);
  res_cancel_all(d->res);
  server_stop(d->srv);
  uv_timer_init(d->loop, &stop_timer);
  stop_timer.data = d;
  uv_timer_start(&stop_timer, on_stop_tick, 0, 20);
}

static void on_signal(uv_signal_t *s, int signum) {
  log_msg(LOG_INFO, "signal %d", signum);
  request_stop(s->data);
}

/* SIGHUP never stops the daemon (the shell that started it may go away). */
static void on_sighup(uv_signal_t *s, int signum) {
  (void)s;
  (void)signum;
  log_msg(LOG_INFO, "SIGHUP: ignored");
}

/* Raises the descriptor limit to its hard maximum: every client costs one, every attach reply may hold one. */
static uint64_t raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur < rl.rlim_max) {
    rlim_t want = rl.rlim_max;
    rl.rlim_cur = want;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_cur;
}

/* ---- start-up -------------------------------------------------------------------- */

static char *default_socket(void) {
  char buf[PATH_MAX];
  if (geteuid() == 0) {
    mkdir("/run/weightd", 0755);
    return strdup("/run/weightd/weightd.sock");
  }
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  if (xdg != NULL && xdg[0] == '/') snprintf(buf, sizeof buf, "%s/weightd.sock", xdg);
  else snprintf(buf, sizeof buf, "/tmp/weightd-%d.sock", (int)geteuid());
  return strdup(buf);
}

static int pick_backend(struct daemon *d, struct wd_error *err) {
  enum cfg_backend want = d->cfg.backend;
  if (want == CFG_BACKEND_HOST) {
    d->backend_name = "host";
    return backend_host_create(&d->backend, err);
  }
  struct wd_error cerr = {0};
  if (backend_cuda_create(&d->backend, &cerr) == 0) {
    d->backend_name = "cuda";
    return 0;
  }
  if (want == CFG_BACKEND_CUDA) {
    *err = cerr;
    return cerr.code;
  }
  log_msg(LOG_INFO, "cuda backend unavailable (%s): using the host backend", cerr.msg);
  d->backend_name = "host";
  return backend_host_create(&d->backend, err);
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
    log_msg(LOG_INFO, "device %d: %s %s, %llu MiB", i, v[i].name, v[i].uuid,
            (unsigned long long)(v[i].memory_total >> 20));
  }
  d->ndevices = n;
  *out = v;
  return 0;
}

/* Resolves the configured model roots and hands them to the registry. */
static int apply_roots(struct daemon *d, struct wd_error *err) {
  size_t n = d->cfg.n_model_roots;
  char **dirs = calloc(n ? n : 1, sizeof *dirs);
  if (dirs == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int rc = 0;
  size_t k = 0;
  for (; k < n; k++) {
    dirs[k] = realpath(d->cfg.model_roots[k], NULL);
    if (dirs[k] == NULL) {
      rc = err_set(err, WEIGHTD_E_INVALID, "model root %s: %s", d->cfg.model_roots[k], strerror(errno));
      break;
    }
    log_msg(LOG_INFO, "model root %s", dirs[k]);
  }
  if (rc == 0) rc = reg_roots_set(d->reg, (const char *const *)dirs, n, err);
  if (rc == 0 && n == 0) log_msg(LOG_WARN, "no model roots configured: any readable path may be loaded");
  for (size_t i = 0; i < k; i++) free(dirs[i]);
  free(dirs);
  return rc;
}

/* The pinned tier's budget: configured, or half of physical memory. */
static uint64_t pin_budget(const struct wd_config *cfg) {
  if (cfg->host_pin_budget > 0) return cfg->host_pin_budget;
  return (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 2;
}

/* Builds the state modules over the backend and the pools. */
static int build_state(struct daemon *d, struct wd_error *err) {
  struct wd_device_info *devices = NULL;
  int rc = query_devices(d, &devices, err);
  if (rc != 0) return rc;
  struct ld_params lp = {.backend = &d->backend,
                         .fill = d->fill,
                         .ndevices = d->ndevices,
                         .method = d->cfg.load_method,
                         .staging_slots = (size_t)d->cfg.staging_slots,
                         .staging_slot_bytes = (size_t)d->cfg.staging_slot_bytes};
  struct reg_params gp = {.backend = &d->backend,
                          .control = d->control_pool,
                          .bulk = d->job_pool,
                          .fill = d->fill,
                          .pin_budget = pin_budget(&d->cfg)};
  rc = ld_create(&lp, &d->ld, err);
  if (rc == 0) rc = reg_create(&gp, &d->reg, err);
  if (rc == 0) rc = apply_roots(d, err);
  if (rc == 0) {
    struct res_params rp = {.loop = d->loop,
                            .backend = &d->backend,
                            .bulk = d->job_pool,
                            .ld = d->ld,
                            .ndevices = d->ndevices,
                            .devices = devices,
                            .device_budget = d->cfg.device_memory_budget};
    rc = res_create(&rp, &d->res, err);
  }
  free(devices);
  return rc;
}

/* Forks; the parent waits until the child listens (or fails) and exits with its verdict. */
static void detach_from_terminal(void) {
  int p[2];
  if (pipe(p) != 0) return;
  pid_t pid = fork();
  if (pid < 0) return;
  if (pid > 0) {
    close(p[1]);
    char c = 1;
    ssize_t n = read(p[0], &c, 1);
    _exit(n == 1 && c == 0 ? 0 : 1);
  }
  close(p[0]);
  setsid();
  ready_fd = p[1];
}

static void tell_parent(int ok) {
  if (ready_fd < 0) return;
  char c = ok ? 0 : 1;
  if (write(ready_fd, &c, 1) != 1) {
  }
  close(ready_fd);
  ready_fd = -1;
}

static void daemon_free(struct daemon *d) {
  res_destroy(d->res);
  reg_destroy(d->reg);
  if (d->srv != NULL) server_destroy(d->srv);
  ld_destroy(d->ld);
  backend_destroy(&d->backend);
  fill_stop(d->fill);
  free(d->socket_path);
  config_free(&d->cfg);
}

int main(int argc, char **argv) {
  struct daemon *d = &the_daemon;
  struct wd_error err = {0};
  int foreground = 0;
  const char *config_file = NULL;
  d->request_stop = request_stop;
  if (getenv("JOURNAL_STREAM") != NULL) log_set_timestamps(0);
  if (config_defaults(&d->cfg, &err) != 0) goto fail;
  /* The config file first, then flags on top of it. */
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) config_file = argv[i + 1];
  if (config_file != NULL && config_load_file(&d->cfg, config_file, &err) != 0) goto fail;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    int rc = 0;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--version") == 0) {
      printf("weightd %s\n", weightd_version_string());
      return 0;
    } else if (strcmp(a, "--foreground") == 0 || strcmp(a, "-f") == 0) {
      foreground = 1;
      continue;
    } else if (v == NULL) {
      fprintf(stderr, "weightd: %s needs a value or is unknown\n", a);
      usage(stderr);
      return 2;
    } else if (strcmp(a, "--config") == 0) {
    } else if (strcmp(a, "--socket") == 0) {
      rc = config_set(&d->cfg, "socket", v, &err);
    } else if (strcmp(a, "--backend") == 0) {
      rc = config_set(&d->cfg, "backend", v, &err);
    } else if (strcmp(a, "--model-root") == 0) {
      rc = config_add_model_root(&d->cfg, v, &err);
    } else if (strcmp(a, "--log-level") == 0) {
      rc = config_set(&d->cfg, "log_level", v, &err);
    } else if (strcmp(a, "--set") == 0) {
      char *eq = strchr(v, '=');
      if (eq == NULL) {
        fprintf(stderr, "weightd: --set needs KEY=VALUE\n");
        return 2;
      }
      char key[64];
      snprintf(key, sizeof key, "%.*s", (int)(eq - v), v);
      rc = config_set(&d->cfg, key, eq + 1, &err);
    } else {
      fprintf(stderr, "weightd: unknown flag %s\n", a);
      usage(stderr);
      return 2;
    }
    if (rc != 0) goto fail;
    i++;
  }
  log_set_level(d->cfg.log_level);
  d->socket_path = d->cfg.socket[0] ? strdup(d->cfg.socket) : default_socket();
  if (d->socket_path == NULL) {
    err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  if (!foreground) detach_from_terminal();
  if (fault_install() != 0) {
    err_set(&err, WEIGHTD_E_INTERNAL, "cannot install the SIGBUS handler");
    goto fail;
  }
  d->stats.fd_limit = raise_fd_limit();
  if (pick_backend(d, &err) != 0) goto fail;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned fill = d->cfg.fill_threads ? (unsigned)d->cfg.fill_threads : (unsigned)(ncpu > 0 ? ncpu : 1);
  /* fill_run's caller helps, so the pool has one thread fewer than asked. */
  if (fill_start(fill > 1 ? fill - 1 : 0, &d->fill) != 0) {
    err_set(&err, WEIGHTD_E_NOMEM, "cannot start fill threads");
    goto fail;
  }
  d->loop = uv_default_loop();
  if (jobs_start(d->loop, (unsigned)d->cfg.control_threads, &d->control_pool, &err) != 0 ||
      jobs_start(d->loop, (unsigned)d->cfg.job_threads, &d->job_pool, &err) != 0)
    goto fail;
  if (build_state(d, &err) != 0 || server_start(d, &err) != 0) goto fail;
  uv_signal_init(d->loop, &sigterm_handle);
  uv_signal_init(d->loop, &sigint_handle);
  uv_signal_init(d->loop, &sighup_handle);
  sigterm_handle.data = d;
  sigint_handle.data = d;
  sighup_handle.data = d;
  uv_signal_start(&sigterm_handle, on_signal, SIGTERM);
  uv_signal_start(&sigint_handle, on_signal, SIGINT);
  uv_signal_start(&sighup_handle, on_sighup, SIGHUP);
  signal(SIGPIPE, SIG_IGN);
  d->started_ms = clock_ms();
  log_msg(LOG_INFO, "weightd %s: %s backend, %d device(s), %u fill threads, listening on %s",
          weightd_version_string(), d->backend_name, d->ndevices, fill, d->socket_path);
  fprintf(stderr, "weightd: listening on %s\n", d->socket_path);
  tell_parent(1);
  uv_run(d->loop, UV_RUN_DEFAULT);
  uv_loop_close(d->loop);
  log_msg(LOG_INFO, "stopped");
  daemon_free(d);
  return d->exit_code;
fail:
  fprintf(stderr, "weightd: %s\n", err.msg[0] ? err.msg : "start-up failed");
  tell_parent(0);
  res_destroy(d->res);
  d->res = NULL;
  reg_destroy(d->reg);
  d->reg = NULL;
  if (d->control_pool != NULL || d->job_pool != NULL) {
    if (d->control_pool != NULL) jobs_stop(d->control_pool);
    if (d->job_pool != NULL) jobs_stop(d->job_pool);
    uv_run(d->loop, UV_RUN_DEFAULT);
  }
  daemon_free(d);
  return 1;
}
