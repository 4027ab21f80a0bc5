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
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon.h"
#include "fault.h"
#include "log.h"

struct daemon *wd;
static uv_timer_t stop_timer;
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
  if (jobs_outstanding(wd->control_pool) > 0 || jobs_outstanding(wd->job_pool) > 0) return;
  uv_timer_stop(t);
  uv_close((uv_handle_t *)t, handle_closed);
  server_close_all();
  res_shutdown();
  reg_shutdown();
  jobs_stop(wd->job_pool); /* may still free slabs: before the quick pool, which it does not use */
  wd->job_pool = NULL;
  jobs_stop(wd->control_pool);
  wd->control_pool = NULL;
  uv_close((uv_handle_t *)&wd->sigterm, handle_closed);
  uv_close((uv_handle_t *)&wd->sigint, handle_closed);
}

void daemon_request_stop(void) {
  if (wd->stopping) return;
  wd->stopping = true;
  atomic_store(&wd->stop_requested, true);
  log_msg(LOG_INFO, "stopping: canceling loads and prefetches, closing connections");
  res_cancel_all();
  server_stop();
  uv_timer_init(wd->loop, &stop_timer);
  uv_timer_start(&stop_timer, on_stop_tick, 0, 20);
}

static void on_signal(uv_signal_t *s, int signum) {
  (void)s;
  log_msg(LOG_INFO, "signal %d", signum);
  daemon_request_stop();
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

static int pick_backend(struct wd_error *err) {
  const char *want = wd->cfg.backend;
  if (strcmp(want, "host") == 0) {
    wd->backend_name = "host";
    return backend_host_create(&wd->backend, err);
  }
  if (strcmp(want, "cuda") != 0 && strcmp(want, "auto") != 0)
    return err_set(err, WEIGHTD_E_INVALID, "backend must be auto, cuda or host, not '%s'", want);
  struct wd_error cerr = {0};
  if (backend_cuda_create(&wd->backend, &cerr) == 0) {
    wd->backend_name = "cuda";
    return 0;
  }
  if (strcmp(want, "cuda") == 0) {
    *err = cerr;
    return cerr.code;
  }
  log_msg(LOG_INFO, "cuda backend unavailable (%s): using the host backend", cerr.msg);
  wd->backend_name = "host";
  return backend_host_create(&wd->backend, err);
}

static int setup_devices(struct wd_error *err) {
  int n = wd->backend.ops->device_count(wd->backend.ctx);
  if (n <= 0) return err_set(err, WEIGHTD_E_DEVICE, "the %s backend has no devices", wd->backend_name);
  wd->devices = calloc((size_t)n, sizeof *wd->devices);
  if (wd->devices == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  wd->ndevices = n;
  for (int i = 0; i < n; i++) {
    int rc = wd->backend.ops->device_info(wd->backend.ctx, i, &wd->devices[i].info, err);
    if (rc != 0) return rc;
    log_msg(LOG_INFO, "device %d: %s %s, %llu MiB", i, wd->devices[i].info.name, wd->devices[i].info.uuid,
            (unsigned long long)(wd->devices[i].info.memory_total >> 20));
  }
  return 0;
}

static int resolve_roots(struct wd_error *err) {
  wd->roots = calloc(wd->cfg.n_model_roots ? wd->cfg.n_model_roots : 1, sizeof *wd->roots);
  if (wd->roots == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (size_t i = 0; i < wd->cfg.n_model_roots; i++) {
    char *r = realpath(wd->cfg.model_roots[i], NULL);
    if (r == NULL)
      return err_set(err, WEIGHTD_E_INVALID, "model root %s: %s", wd->cfg.model_roots[i], strerror(errno));
    wd->roots[wd->nroots++] = r;
    log_msg(LOG_INFO, "model root %s", r);
  }
  if (wd->nroots == 0) log_msg(LOG_WARN, "no model roots configured: any readable path may be loaded");
  return 0;
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

static void daemon_free(void) {
  if (wd->backend.ops != NULL) ld_shutdown();
  backend_destroy(&wd->backend);
  fill_stop(wd->fill);
  for (size_t i = 0; i < wd->nroots; i++) free(wd->roots[i]);
  free(wd->roots);
  free(wd->devices);
  free(wd->socket_path);
  config_free(&wd->cfg);
}

int main(int argc, char **argv) {
  static struct daemon d;
  wd = &d;
  d.listen_fd = -1;
  struct wd_error err = {0};
  int foreground = 0;
  const char *config_file = NULL;
  if (getenv("JOURNAL_STREAM") != NULL) log_set_timestamps(0);
  if (config_defaults(&d.cfg, &err) != 0) goto fail;
  /* The config file first, then flags on top of it. */
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) config_file = argv[i + 1];
  if (config_file != NULL && config_load_file(&d.cfg, config_file, &err) != 0) goto fail;
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
      rc = config_set(&d.cfg, "socket", v, &err);
    } else if (strcmp(a, "--backend") == 0) {
      rc = config_set(&d.cfg, "backend", v, &err);
    } else if (strcmp(a, "--model-root") == 0) {
      rc = config_add_model_root(&d.cfg, v, &err);
    } else if (strcmp(a, "--log-level") == 0) {
      rc = config_set(&d.cfg, "log_level", v, &err);
    } else if (strcmp(a, "--set") == 0) {
      char *eq = strchr(v, '=');
      if (eq == NULL) {
        fprintf(stderr, "weightd: --set needs KEY=VALUE\n");
        return 2;
      }
      char key[64];
      snprintf(key, sizeof key, "%.*s", (int)(eq - v), v);
      rc = config_set(&d.cfg, key, eq + 1, &err);
    } else {
      fprintf(stderr, "weightd: unknown flag %s\n", a);
      usage(stderr);
      return 2;
    }
    if (rc != 0) goto fail;
    i++;
  }
  enum log_level lvl;
  if (log_level_from_name(d.cfg.log_level, &lvl) != 0) {
    err_set(&err, WEIGHTD_E_INVALID, "log_level must be error, warn, info or debug");
    goto fail;
  }
  log_set_level(lvl);
  d.socket_path = d.cfg.socket[0] ? strdup(d.cfg.socket) : default_socket();
  if (d.socket_path == NULL) {
    err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  if (!foreground) detach_from_terminal();
  if (fault_install() != 0) {
    err_set(&err, WEIGHTD_E_INTERNAL, "cannot install the SIGBUS handler");
    goto fail;
  }
  if (resolve_roots(&err) != 0 || pick_backend(&err) != 0 || setup_devices(&err) != 0 || ld_init(&err) != 0)
    goto fail;
  d.pin_budget = d.cfg.host_pin_budget;
  if (d.pin_budget == 0) d.pin_budget = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 2;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned fill = d.cfg.fill_threads ? (unsigned)d.cfg.fill_threads : (unsigned)(ncpu > 0 ? ncpu : 1);
  /* fill_run's caller helps, so the pool has one thread fewer than asked. */
  if (fill_start(fill > 1 ? fill - 1 : 0, &d.fill) != 0) {
    err_set(&err, WEIGHTD_E_NOMEM, "cannot start fill threads");
    goto fail;
  }
  d.loop = uv_default_loop();
  if (jobs_start(d.loop, (unsigned)d.cfg.control_threads, &d.control_pool, &err) != 0 ||
      jobs_start(d.loop, (unsigned)d.cfg.job_threads, &d.job_pool, &err) != 0)
    goto fail;
  if (server_start(&err) != 0) goto fail;
  uv_signal_init(d.loop, &d.sigterm);
  uv_signal_init(d.loop, &d.sigint);
  uv_signal_start(&d.sigterm, on_signal, SIGTERM);
  uv_signal_start(&d.sigint, on_signal, SIGINT);
  signal(SIGPIPE, SIG_IGN);
  d.started_ms = clock_ms();
  log_msg(LOG_INFO, "weightd %s: %s backend, %d device(s), %u fill threads, listening on %s",
          weightd_version_string(), d.backend_name, d.ndevices, fill, d.socket_path);
  fprintf(stderr, "weightd: listening on %s\n", d.socket_path);
  tell_parent(1);
  uv_run(d.loop, UV_RUN_DEFAULT);
  uv_loop_close(d.loop);
  log_msg(LOG_INFO, "stopped");
  daemon_free();
  return d.exit_code;
fail:
  fprintf(stderr, "weightd: %s\n", err.msg[0] ? err.msg : "start-up failed");
  tell_parent(0);
  if (d.control_pool != NULL || d.job_pool != NULL) {
    if (d.control_pool != NULL) jobs_stop(d.control_pool);
    if (d.job_pool != NULL) jobs_stop(d.job_pool);
    uv_run(d.loop, UV_RUN_DEFAULT);
  }
  daemon_free();
  return 1;
}
