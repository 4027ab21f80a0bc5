/*
 * main.c - weightd: flags, the configuration, start-up, the service
 * manager's protocol (readiness, status, watchdog, reload, stopping),
 * signals and the orderly stop.
 *
 * weightd [--config FILE] [--socket PATH] [--backend auto|cuda|host]
 *         [--model-root DIR]... [--foreground] [--log-level L] [--set KEY=VALUE]...
 * (the flag table below; --opt=value and --opt value alike)
 *
 * DESIGN: everything here runs on the loop thread; signals arrive as libuv
 * signal handles. Under a service manager (NOTIFY_SOCKET set) the daemon never
 * forks and says READY=1 once it listens and its backend is up; detached by
 * hand it forks once, the parent exits when the child listens, and the child
 * lets go of the terminal.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "base/fault.h"
#include "remote/rroots.h"
#include "service/http.h"
#include "base/log.h"
#include "optab.h"
#include "service/reload.h"
#include "transport/server.h"
#include "service/service.h"
#include "service/startup.h"
#include "service/survive.h"
#include "state/scrub.h"
#include "ops/telemetry.h"

/* How often the STATUS= line is refreshed (only sent when it changed). */
#define STATUS_INTERVAL_MS 2000

/* The daemon and its loop-owned handles (loop thread only). */
static struct daemon the_daemon;
static uv_timer_t stop_timer, watchdog_timer, status_timer;
static uv_signal_t sigterm_handle, sigint_handle, sighup_handle;
static int ready_fd = -1;
/* What the configuration was made of, for reloads: the file, then the flags again. */
static const char *config_file;
static int saved_argc;
static char **saved_argv;
static bool foreground;
static char last_status[256];
static uint64_t start_ns; /* when main began: restart-to-READY is measured from here */

/* ---- the flags ------------------------------------------------------------------------ */

enum flag_id { FLAG_CONFIG = 1, FLAG_SOCKET, FLAG_BACKEND, FLAG_MODEL_ROOT, FLAG_REMOTE_ROOT, FLAG_FOREGROUND, FLAG_LOG_LEVEL,
               FLAG_SET, FLAG_HELP, FLAG_VERSION, FLAG_GENERATE_MAN };

/* The flags: parsing, --help and the man page come from this table. */
static const struct optab_opt flag_table[] = {
    {FLAG_CONFIG, "config", 'c', OPTAB_VALUE, "FILE",
     "Read the configuration from FILE, a JSON object of the keys below; flags override it. SIGHUP reads it "
     "again.", 0, "@file"},
    {FLAG_SOCKET, "socket", 0, OPTAB_VALUE, "PATH", "Listen on PATH (the key socket).", 0, "@file"},
    {FLAG_BACKEND, "backend", 0, OPTAB_VALUE, "NAME",
     "auto (the GPUs when CUDA starts, else host memory), cuda or host (the key backend).", 0, "auto cuda host"},
    {FLAG_MODEL_ROOT, "model-root", 0, OPTAB_VALUE, "DIR",
     "Serve checkpoints that resolve into DIR; repeat for several (the key model_roots).", OPTAB_REPEAT, "@dir"},
    {FLAG_REMOTE_ROOT, "remote-root", 0, OPTAB_VALUE, "URL",
     "Fetch checkpoints named by URLs within URL (s3://BUCKET[/PREFIX] or http(s)://HOST[/PREFIX]); repeat for "
     "several (the key remote_roots).", OPTAB_REPEAT, NULL},
    {FLAG_FOREGROUND, "foreground", 'f', OPTAB_SWITCH, NULL,
     "Stay in the foreground and log to stderr. Without it weightd detaches once it listens (never under a "
     "service manager's NOTIFY_SOCKET).", 0, NULL},
    {FLAG_LOG_LEVEL, "log-level", 0, OPTAB_VALUE, "LEVEL", "error, warn, info or debug (the key log_level).", 0,
     "error warn info debug"},
    {FLAG_SET, "set", 0, OPTAB_VALUE, "KEY=VALUE", "Set any key of the configuration; repeat for several.",
     OPTAB_REPEAT, NULL},
    {FLAG_HELP, "help", 'h', OPTAB_SWITCH, NULL, "Print this help and exit.", 0, NULL},
    {FLAG_VERSION, "version", 0, OPTAB_SWITCH, NULL, "Print the version and exit.", 0, NULL},
    {FLAG_GENERATE_MAN, "generate-man", 0, OPTAB_SWITCH, NULL, "Write the man page weightd(8) to stdout.",
     OPTAB_HIDDEN, NULL},
};
static const struct optab_list flag_list = {flag_table, sizeof flag_table / sizeof flag_table[0]};

static void usage(FILE *f) {
  fprintf(f, "usage: weightd [OPTION]...\n\n"
             "The weightd daemon: keeps safetensors checkpoints warm, loads them into device memory and leases\n"
             "them to inference engines over a Unix socket. SIGHUP reloads the config file (keys marked\n"
             "[reloadable]). See docs/operations.md and weightd(8).\n\noptions:\n");
  optab_help(f, &flag_list, 1);
  fprintf(f, "\nexit status: 0 stopped cleanly (or --help), 1 could not start, 2 usage error.\n\n");
  config_print_help(f);
}

static void write_man(FILE *f) {
  fprintf(f, ".TH WEIGHTD 8 \"\" \"weightd %s\" \"System Administration\"\n", weightd_version_string());
  fputs(".SH NAME\nweightd \\- keep model checkpoints resident in device memory and lease them to inference "
        "engines\n.SH SYNOPSIS\n.B weightd\n[\\fIOPTION\\fR]...\n.SH DESCRIPTION\n", f);
  optab_man_text(f, "weightd keeps Hugging Face safetensors checkpoints mapped and warm in the page cache, loads the "
                    "tensors an engine's rank needs into GPU memory (or sealed host memory) when asked over a Unix "
                    "socket, and hands engines handles to that memory. weightctl(1) is its command-line client.\n");
  fputs(".SH OPTIONS\n", f);
  optab_man(f, &flag_list, 1);
  fputs(".SH CONFIGURATION\n", f);
  optab_man_text(f, "A JSON object (--config FILE). Sizes are numbers of bytes or strings such as \"64MiB\". "
                    "Errors name the file, line and column; an unknown key is an error that suggests the closest "
                    "key; a budget above the machine's memory is capped with a warning.\n");
  config_print_man(f);
  fputs(".SH SIGNALS\n.TP\n\\fBSIGTERM\\fR, \\fBSIGINT\\fR\nStop: cancel loads, tell clients, free every set, "
        "remove the socket, exit 0.\n.TP\n\\fBSIGHUP\\fR\nReload the configuration file.\n"
        ".SH EXIT STATUS\n0: stopped cleanly. 1: could not start (the reason is logged and printed). 2: usage "
        "error.\n.SH FILES\n.TP\n\\fI/run/weightd/weightd.sock\\fR\nThe socket when run as root.\n.TP\n"
        "\\fI/etc/weightd/weightd.json\\fR\nThe configuration the service unit reads.\n"
        ".SH SEE ALSO\n\\fBweightctl\\fR(1); docs/operations.md and docs/protocol.md in the documentation.\n",
        f);
}

/*
 * One pass over the flags. The scan pass (cfg NULL) only notes --config and
 * --foreground and finds usage errors; the apply pass sets the values.
 */
struct flag_pass {
  struct wd_config *cfg;
  struct wd_error *err;
  int action; /* FLAG_HELP, FLAG_VERSION, FLAG_GENERATE_MAN or 0 */
  char why[300];
};

static int take_flag(void *arg, const struct optab_opt *o, const char *v) {
  struct flag_pass *p = arg;
  if (o == NULL) {
    snprintf(p->why, sizeof p->why, "unexpected argument '%s' (weightd takes options only)", v);
    return 2;
  }
  if (p->cfg == NULL) { /* the scan pass */
    if (o->id == FLAG_CONFIG) config_file = v;
    else if (o->id == FLAG_FOREGROUND) foreground = true;
    else if (o->id == FLAG_HELP || o->id == FLAG_VERSION || o->id == FLAG_GENERATE_MAN) p->action = o->id;
    else if (o->id == FLAG_SET && strchr(v, '=') == NULL) {
      snprintf(p->why, sizeof p->why, "--set needs KEY=VALUE, not '%s'", v);
      return 2;
    }
    return 0;
  }
  static const char *const keys[] = {[FLAG_SOCKET] = "socket", [FLAG_BACKEND] = "backend",
                                     [FLAG_LOG_LEVEL] = "log_level", [FLAG_MODEL_ROOT] = "model_roots",
                                     [FLAG_REMOTE_ROOT] = "remote_roots"};
  if (o->id == FLAG_SET) {
    const char *eq = strchr(v, '=');
    char key[64];
    snprintf(key, sizeof key, "%.*s", (int)(eq - v), v);
    return config_set(p->cfg, key, eq + 1, p->err);
  }
  if ((size_t)o->id < sizeof keys / sizeof keys[0] && keys[o->id] != NULL) return config_set(p->cfg, keys[o->id], v, p->err);
  return 0;
}

/*
 * Applies the flags on top of cfg (NULL: only scan them). Returns 0, 1 after
 * printing help, the version or the man page (exit 0), 2 for a usage error
 * (printed), or a negative error.
 */
static int apply_flags(struct wd_config *cfg, int argc, char **argv, struct wd_error *err) {
  struct flag_pass p = {.cfg = cfg, .err = err};
  int rc = optab_parse(&flag_list, 1, argc, argv, false, take_flag, &p, NULL, p.why, sizeof p.why);
  if (rc == -1 || rc == 2) {
    fprintf(stderr, "weightd: %s (weightd --help lists the options)\n", p.why);
    return 2;
  }
  if (rc != 0) return rc;
  if (p.action == FLAG_HELP) usage(stdout);
  else if (p.action == FLAG_VERSION) printf("weightd %s\n", weightd_version_string());
  else if (p.action == FLAG_GENERATE_MAN) write_man(stdout);
  return p.action != 0 ? 1 : 0;
}

/* Builds a configuration: defaults, then the file, then the flags. Same return values as apply_flags. */
static int read_config(struct wd_config *cfg, struct wd_error *err) {
  int rc = config_defaults(cfg, err);
  if (rc == 0 && config_file != NULL) rc = config_load_file(cfg, config_file, err);
  if (rc == 0) rc = apply_flags(cfg, saved_argc, saved_argv, err);
  return rc;
}

/* ---- the service manager ------------------------------------------------------------- */

/* A line a person reads in `systemctl status`. */
static void update_status(struct daemon *d) {
  size_t sets = 0, loading = 0;
  uint64_t bytes = 0;
  for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) {
    sets++;
    if (s->state == SET_LOADING) loading++;
    else bytes += s->plan->slab_bytes;
  }
  char line[sizeof last_status];
  snprintf(line, sizeof line, "%zu set(s), %.2f GiB resident, %zu load(s) running, %" PRIu64 " connection(s)", sets,
           (double)bytes / (double)(1ull << 30), loading, d->stats.connections);
  if (strcmp(line, last_status) == 0) return;
  snprintf(last_status, sizeof last_status, "%s", line);
  service_notifyf("STATUS=%s", line);
}

static void on_status_timer(uv_timer_t *t) { update_status(t->data); }

/* Pings at half the watchdog interval: a stuck loop stops the pings, and the manager restarts us. */
static void on_watchdog(uv_timer_t *t) {
  (void)t;
  service_notifyf("WATCHDOG=1");
}

/* ---- reload --------------------------------------------------------------------------- */

/* Serves the metrics endpoints the configuration asks for; a port in use is logged, not fatal. */
static void start_http(struct daemon *d) {
  struct wd_error err = {0};
  if (http_start(d, d->cfg.metrics_address, (unsigned)d->cfg.metrics_connections, d->cfg.metrics_request_timeout_ms,
                 &d->http, &err) != 0)
    log_msg(LOG_ERROR, "%s: metrics and probes are off (the socket is served)", err.msg);
}

static void reload(struct daemon *d) {
  service_notifyf("RELOADING=1\nMONOTONIC_USEC=%" PRIu64, clock_ns() / 1000);
  struct wd_config next;
  struct wd_error err = {0};
  char *old_address = strdup(d->cfg.metrics_address);
  uint64_t old_connections = d->cfg.metrics_connections, old_timeout = d->cfg.metrics_request_timeout_ms;
  int rc = read_config(&next, &err);
  if (rc == 0) rc = reload_apply(d, &next, &err);
  if (rc != 0) log_msg(LOG_WARN, "reload failed, the running configuration is kept: %s", err.msg);
  config_free(&next);
  if (old_address == NULL || strcmp(old_address, d->cfg.metrics_address) != 0 ||
      old_connections != d->cfg.metrics_connections || old_timeout != d->cfg.metrics_request_timeout_ms) {
    http_stop(d->http);
    d->http = NULL;
    start_http(d);
  }
  free(old_address);
  struct wd_error lerr = {0};
  if (log_open(foreground, d->cfg.log_file, d->cfg.syslog_socket, &lerr) != 0)
    log_msg(LOG_WARN, "%s; logging stays where it was (%s)", lerr.msg, log_target_name());
  last_status[0] = '\0';
  update_status(d);
  service_notifyf("READY=1");
}

static void on_sighup(uv_signal_t *s, int signum) {
  (void)signum;
  struct daemon *d = s->data;
  if (d->stopping) return;
  log_msg(LOG_INFO, "SIGHUP: reloading%s%s", config_file ? " " : "", config_file ? config_file : " (no config file: flags and defaults)");
  reload(d);
}

/* ---- stopping --------------------------------------------------------------------- */

static void handle_closed(uv_handle_t *h) { (void)h; }

/* Waits for running jobs (their loads were told to stop), then frees everything. */
static void on_stop_tick(uv_timer_t *t) {
  struct daemon *d = t->data;
  if (jobs_outstanding(d->control_pool) > 0 || jobs_outstanding(d->job_pool) > 0 ||
      (d->remote_pool != NULL && jobs_outstanding(d->remote_pool) > 0))
    return;
  uv_timer_stop(t);
  uv_close((uv_handle_t *)t, handle_closed);
  survive_destroy(d->surv); /* the store keeps the last generation: the next daemon re-adopts it */
  d->surv = NULL;
  server_close_all(d->srv);
  scrub_destroy(d->scrub); /* stopped already: no scrub holds a set now */
  d->scrub = NULL;
  res_destroy(d->res); /* its slabs are freed on the job pool, drained below */
  d->res = NULL;
  reg_destroy(d->reg);
  d->reg = NULL;
  jobs_stop(d->job_pool); /* may still free slabs: before the quick pool, which it does not use */
  d->job_pool = NULL;
  jobs_stop(d->control_pool);
  d->control_pool = NULL;
  if (d->remote_pool != NULL) jobs_stop(d->remote_pool);
  d->remote_pool = NULL;
  struct telemetry *tel = d->tel;
  d->tel = NULL;
  telemetry_destroy(tel);
  uv_close((uv_handle_t *)&sigterm_handle, handle_closed);
  uv_close((uv_handle_t *)&sigint_handle, handle_closed);
  /*
   * The stop is under way and ends with status 0: a second SIGTERM or SIGINT
   * (a supervisor that asks twice) must not kill the process on its way out.
   * Closing the loop's handlers (synchronously) gave the signals back their
   * default action, so they are ignored from here on.
   */
  signal(SIGTERM, SIG_IGN);
  signal(SIGINT, SIG_IGN);
  uv_close((uv_handle_t *)&sighup_handle, handle_closed);
  uv_close((uv_handle_t *)&watchdog_timer, handle_closed);
  uv_close((uv_handle_t *)&status_timer, handle_closed);
}

static void request_stop(struct daemon *d) {
  if (d->stopping) return;
  d->stopping = true;
  survive_freeze(d->surv); /* what follows (leases ending, sets freed) is the stop, not a change to keep */
  service_notifyf("STOPPING=1\nSTATUS=stopping: canceling loads, closing connections");
  log_msg(LOG_INFO, "stopping: canceling loads and prefetches, closing connections");
  uv_timer_stop(&status_timer);
  http_stop(d->http);
  d->http = NULL;
  reg_stop(d->reg);
  rroots_stop(d->remote); /* remote opens and checks stop waiting on slow servers */
  scrub_stop(d->scrub); /* scrubs not done yet are answered CANCELED */
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

/* ---- start-up --------------------------------------------------------------------- */

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

/*
 * A detached daemon lets go of the terminal it was started from: stdin and
 * stdout, and stderr unless the journal or the log is behind it, become
 * /dev/null. Otherwise a caller reading its output (`$(weightd)`, ssh) would
 * wait for it forever, and a stray write could reach a terminal that is
 * gone. stderr is the log only when no syslog socket could be reached
 * (log_fallback): said at start, and better than logging nowhere.
 */
static void release_terminal(void) {
  int null = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null < 0) return;
  dup2(null, 0);
  dup2(null, 1);
  if (strcmp(log_target_name(), "journald") != 0 && strcmp(log_target_name(), "stderr") != 0) dup2(null, 2);
  if (null > 2) close(null);
}

static void tell_parent(int ok) {
  if (ready_fd < 0) return;
  char c = ok ? 0 : 1;
  if (write(ready_fd, &c, 1) != 1) {
  }
  close(ready_fd);
  ready_fd = -1;
}

/* The listening socket the service manager passed (socket activation), or -1. */
static int passed_socket(const struct daemon *d) {
  struct service_fd *f = service_fd_find(d->cfg.socket_fd_name);
  if (f == NULL && service_fd_count() == 1 && service_fd(0)->name[0] == '\0') f = service_fd(0);
  if (f == NULL) return -1;
  int listening = 0, type = 0, domain = 0;
  socklen_t len = sizeof listening;
  getsockopt(f->fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len);
  len = sizeof type;
  getsockopt(f->fd, SOL_SOCKET, SO_TYPE, &type, &len);
  len = sizeof domain;
  getsockopt(f->fd, SOL_SOCKET, SO_DOMAIN, &domain, &len);
  if (!listening || type != SOCK_STREAM || domain != AF_UNIX) {
    log_msg(LOG_WARN, "descriptor %d ('%s') passed at start is not a listening Unix stream socket: ignored", f->fd,
            f->name);
    return -1;
  }
  f->taken = true;
  return f->fd;
}

static void start_handles(struct daemon *d) {
  uv_signal_t *sigs[] = {&sigterm_handle, &sigint_handle, &sighup_handle};
  for (size_t i = 0; i < 3; i++) {
    uv_signal_init(d->loop, sigs[i]);
    sigs[i]->data = d;
  }
  uv_signal_start(&sigterm_handle, on_signal, SIGTERM);
  uv_signal_start(&sigint_handle, on_signal, SIGINT);
  uv_signal_start(&sighup_handle, on_sighup, SIGHUP);
  uv_timer_init(d->loop, &watchdog_timer);
  uv_timer_init(d->loop, &status_timer);
  watchdog_timer.data = status_timer.data = d;
  uint64_t wd_usec = service_watchdog_usec();
  if (wd_usec > 0) {
    uint64_t every = wd_usec / 2000 > 0 ? wd_usec / 2000 : 1;
    uv_timer_start(&watchdog_timer, on_watchdog, every, every);
  }
  if (service_notify_enabled()) uv_timer_start(&status_timer, on_status_timer, STATUS_INTERVAL_MS, STATUS_INTERVAL_MS);
}

static void readopted(void *arg) { *(bool *)arg = true; }

int main(int argc, char **argv) {
  start_ns = clock_ns();
  struct daemon *d = &the_daemon;
  struct wd_error err = {0};
  d->request_stop = request_stop;
  saved_argc = argc;
  saved_argv = argv;
  int frc = apply_flags(NULL, argc, argv, &err); /* --config and --foreground first; usage errors before anything */
  if (frc == 1) return 0;
  if (frc != 0) return 2;
  /* SIGHUP before the loop handles it must not kill a daemon starting up. */
  signal(SIGHUP, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);
  int rc = read_config(&d->cfg, &err);
  if (rc == 1) return 0;
  if (rc == 2) return 2;
  if (rc != 0 || service_init(&err) != 0) {
    fprintf(stderr, "weightd: %s\n", err.msg);
    config_free(&d->cfg);
    return 1;
  }
  bool supervised = service_notify_enabled();
  if (supervised) foreground = true; /* a service manager tracks this process: never fork */
  log_set_level(d->cfg.log_level);
  if (log_open(foreground, d->cfg.log_file, d->cfg.syslog_socket, &err) != 0) {
    fprintf(stderr, "weightd: %s\n", err.msg);
    config_free(&d->cfg);
    return 1;
  }
  if (log_fallback() != NULL) /* said where the starting user sees it, before the daemon detaches */
    fprintf(stderr, "weightd: %s: logging to stderr, which the detached daemon keeps open (set log_file to "
                    "leave it)\n", log_fallback());
  /* A passed socket's path comes from the socket itself (server.c); the default one, with its directory, is
   * only made for a socket this daemon binds. */
  int listen_fd = passed_socket(d);
  if (d->cfg.socket[0] != '\0' || listen_fd >= 0) {
    d->socket_path = strdup(d->cfg.socket);
    if (d->socket_path == NULL) {
      err_set(&err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
  } else if (startup_default_socket(&d->socket_path, &err) != 0) {
    goto fail;
  }
  if (!foreground) detach_from_terminal();
  if (fault_install() != 0) {
    err_set(&err, WEIGHTD_E_INTERNAL, "cannot install the SIGBUS handler");
    goto fail;
  }
  d->stats.fd_limit = startup_raise_fd_limit();
  d->loop = uv_default_loop();
  if (startup_backend(d, &err) != 0) goto fail;
  uint64_t backend_ns = clock_ns();
  log_msg(LOG_INFO, "%s backend ready %.1f ms after start", d->backend_name, (double)(backend_ns - start_ns) / 1e6);
  if (startup_state(d, &err) != 0 || telemetry_create(d, &d->tel, &err) != 0) goto fail;
  /* Sets kept in the service manager's store come back before anything is served. */
  d->surv = survive_create(d);
  bool adopted = false;
  if (survive_start(d->surv, readopted, &adopted))
    while (!adopted) uv_run(d->loop, UV_RUN_ONCE);
  service_fds_close_unclaimed();
  if (server_start(d, listen_fd, &err) != 0) goto fail;
  start_handles(d);
  start_http(d);
  telemetry_refresh(d);
  d->started_ms = clock_ms();
  log_msg(LOG_INFO, "weightd %s: %s backend, %d device(s), %u fill threads, %s %s, logging to %s%s%s%s",
          weightd_version_string(), d->backend_name, d->ndevices, ld_pool_threads(d->fill),
          listen_fd >= 0 ? "serving the socket passed at start," : "listening on", d->socket_path,
          log_target_name(), log_fallback() ? " (" : "", log_fallback() ? log_fallback() : "",
          log_fallback() ? ")" : "");
  /* For a person at a terminal; the journal has the start-up line above, and every line there needs its prefix. */
  if (!supervised && foreground && strcmp(log_target_name(), "journald") != 0)
    fprintf(stderr, "weightd: listening on %s\n", d->socket_path);
  if (ready_fd >= 0) release_terminal();
  tell_parent(1);
  update_status(d);
  service_notifyf("READY=1");
  uint64_t ready_ns = clock_ns();
  log_msg(LOG_INFO, "READY %.1f ms after start, %.1f ms after the backend was ready; %u set(s) re-adopted",
          (double)(ready_ns - start_ns) / 1e6, (double)(ready_ns - backend_ns) / 1e6, survive_adopted(d->surv));
  /*
   * Staging slots after READY: a restart serves its re-adopted sets without
   * waiting for them. They are allocated near each device (the loader's
   * place hook binds this thread), and the loop thread runs anywhere again
   * afterwards.
   */
  cpu_set_t affinity;
  bool restore = pthread_getaffinity_np(pthread_self(), sizeof affinity, &affinity) == 0;
  int staged = ld_staging_start(d->ld, &err);
  if (restore) pthread_setaffinity_np(pthread_self(), sizeof affinity, &affinity);
  if (staged != 0) {
    log_msg(LOG_ERROR, "cannot allocate the staging slots: %s; stopping", err.msg);
    d->exit_code = 1;
    request_stop(d);
  }
  uv_run(d->loop, UV_RUN_DEFAULT);
  uv_loop_close(d->loop);
  log_msg(LOG_INFO, "stopped");
  startup_free(d);
  config_free(&d->cfg);
  return d->exit_code;
fail:
  log_msg(LOG_ERROR, "cannot start: %s", err.msg[0] ? err.msg : "start-up failed");
  if (strcmp(log_target_name(), "stderr") != 0 && strcmp(log_target_name(), "journald") != 0)
    fprintf(stderr, "weightd: %s\n", err.msg[0] ? err.msg : "start-up failed");
  tell_parent(0);
  survive_freeze(d->surv);
  survive_destroy(d->surv);
  d->surv = NULL;
  if (d->srv != NULL) server_stop(d->srv);
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
  telemetry_destroy(d->tel);
  d->tel = NULL;
  if (d->loop != NULL) {
    uv_run(d->loop, UV_RUN_DEFAULT); /* lets the pools' and the server's handles close */
    uv_loop_close(d->loop);
  }
  startup_free(d);
  config_free(&d->cfg);
  return 1;
}
