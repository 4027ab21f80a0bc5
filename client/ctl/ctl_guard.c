/*
 * ctl_guard.c - Ctrl-C and --timeout for commands that wait on the daemon.
 *
 * DESIGN: libweightd's calls block in the command's thread. While a command
 * talks to the daemon, SIGINT, SIGTERM and SIGUSR1 are blocked in that
 * thread and a watcher thread takes them with sigtimedwait, its timeout
 * being the --timeout deadline. On an interrupt or the deadline it opens its
 * own connection, lists this process's requests in status and cancels each
 * by its daemon-wide id (any connection's request may be canceled by its
 * owner's uid), so that the blocked call returns CANCELED and the command
 * reports why; ctl_guard_reason says what happened. If nothing could be
 * canceled, or the call has not returned GRACE_S later, the watcher reports
 * and exits the process itself; so does a second interrupt. It does so only
 * while the command is in a call to the daemon (ctl_guard_call_begin/end),
 * checked under mu and holding mu until it exits: a command that has left
 * its call reports the outcome itself (ctl_guard_call_end waits for mu, so
 * its output never mixes with the watcher's), and stops before its next
 * request (ctl_request checks ctl_guard_reason). SIGUSR1, sent by
 * ctl_guard_stop, ends the watcher. The state below is shared by the watcher
 * and the command thread under mu.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ctl.h"

#define GRACE_S 5.0
#define CANCEL_TIMEOUT_MS 5000

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  bool running;
  bool stopping;
  pthread_t thread;
  sigset_t old_mask;
  char socket[PATH_MAX];
  double deadline; /* clock_s() at which --timeout passes; 0: none */
  enum ctl_guard_reason reason;
  bool in_call; /* the command thread waits in a call to the daemon */
} g;

void ctl_guard_call_begin(void) {
  pthread_mutex_lock(&mu);
  g.in_call = true;
  pthread_mutex_unlock(&mu);
}

void ctl_guard_call_end(void) {
  pthread_mutex_lock(&mu);
  g.in_call = false;
  pthread_mutex_unlock(&mu);
}

enum ctl_guard_reason ctl_guard_reason(void) {
  pthread_mutex_lock(&mu);
  enum ctl_guard_reason r = g.reason;
  pthread_mutex_unlock(&mu);
  return r;
}

void ctl_guard_socket(const char *path) {
  pthread_mutex_lock(&mu);
  snprintf(g.socket, sizeof g.socket, "%s", path ? path : "");
  pthread_mutex_unlock(&mu);
}

static void watched_signals(sigset_t *set) {
  sigemptyset(set);
  sigaddset(set, SIGINT);
  sigaddset(set, SIGTERM);
  sigaddset(set, SIGUSR1);
}

/* Waits for a watched signal until the clock_s() time `until` (0: forever). Returns it, or 0 when the time came. */
static int wait_signal(double until) {
  sigset_t set;
  watched_signals(&set);
  for (;;) {
    int sig;
    if (until <= 0) {
      sig = sigwaitinfo(&set, NULL);
    } else {
      double left = until - clock_s();
      if (left <= 0) return 0;
      struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
      sig = sigtimedwait(&set, NULL, &ts);
    }
    if (sig > 0) return sig;
    if (errno == EAGAIN) return 0;
  }
}

/*
 * Cancels this process's requests through a connection of the watcher's
 * own; returns how many the daemon canceled.
 */
static int cancel_mine(void) {
  char path[PATH_MAX];
  pthread_mutex_lock(&mu);
  snprintf(path, sizeof path, "%s", g.socket);
  pthread_mutex_unlock(&mu);
  if (path[0] == '\0') return 0; /* not connected yet: nothing was started */
  struct weightd_connect_options o = {.struct_size = sizeof o, .socket_path = path, .client_name = "weightctl (canceling)"};
  weightd_client *c = NULL;
  if (weightd_connect_opts(&o, &c) != 0) {
    weightd_close(c);
    return 0;
  }
  weightd_set_timeout(c, CANCEL_TIMEOUT_MS);
  char *text = NULL;
  int n = 0;
  if (weightd_request(c, "{\"op\":\"status\"}", &text, NULL, NULL) == 0) {
    cJSON *st = cJSON_Parse(text);
    const cJSON *r;
    cJSON_ArrayForEach(r, cJSON_GetObjectItemCaseSensitive(st, "requests")) {
      if (ctl_u64(r, "pid") != (uint64_t)getpid()) continue;
      char req[96], *reply = NULL;
      snprintf(req, sizeof req, "{\"op\":\"cancel\",\"request\":\"%.40s\"}", ctl_str(r, "request"));
      if (weightd_request(c, req, &reply, NULL, NULL) == 0) {
        cJSON *rep = cJSON_Parse(reply);
        n += cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(rep, "canceled"));
        cJSON_Delete(rep);
      }
      weightd_free(reply);
    }
    cJSON_Delete(st);
  }
  weightd_free(text);
  weightd_close(c);
  return n;
}

/*
 * The command's call did not end in time (or could not be canceled): say why
 * and exit. Called with mu held, which it keeps (the command thread blocks in
 * ctl_guard_call_end rather than report too).
 */
static void bail(enum ctl_guard_reason why) {
  int code = why == CTL_GUARD_TIMEOUT ? CTL_EXIT_TIMEOUT : CTL_EXIT_FAIL;
  if (why == CTL_GUARD_TIMEOUT)
    ctl_errorx("TIMEOUT", "%s: did not finish within %g s (--timeout)", ctl_opts.cmd ? ctl_opts.cmd : "weightctl",
               ctl_opts.timeout_s);
  else
    ctl_errorx("CANCELED", "%s: interrupted", ctl_opts.cmd ? ctl_opts.cmd : "weightctl");
  ctl_json_finish(code);
  fflush(NULL);
  _exit(code);
}

static void *watch(void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  double deadline = g.deadline;
  pthread_mutex_unlock(&mu);
  int sig = wait_signal(deadline);
  if (sig == SIGUSR1) return NULL;
  enum ctl_guard_reason why = sig == 0 ? CTL_GUARD_TIMEOUT : CTL_GUARD_INTERRUPTED;
  pthread_mutex_lock(&mu);
  g.reason = why;
  bool stopping = g.stopping;
  pthread_mutex_unlock(&mu);
  if (stopping) return NULL;
  sig = 0;
  /* A canceled call now returns CANCELED: give the command a moment to report it. */
  if (cancel_mine() > 0) sig = wait_signal(clock_s() + GRACE_S);
  for (;;) {
    if (sig == SIGUSR1) return NULL;
    pthread_mutex_lock(&mu);
    if (g.stopping) {
      pthread_mutex_unlock(&mu);
      return NULL;
    }
    if (g.in_call || sig != 0) bail(why); /* still waiting on the daemon, or a second interrupt */
    pthread_mutex_unlock(&mu);
    /* Between calls: the command reports, or stops before its next request. A second interrupt exits. */
    sig = wait_signal(0);
  }
}

void ctl_guard_start(void) {
  pthread_mutex_lock(&mu);
  bool running = g.running;
  if (!running && ctl_opts.timeout_s > 0 && g.deadline == 0) g.deadline = clock_s() + ctl_opts.timeout_s;
  pthread_mutex_unlock(&mu);
  if (running) return;
  sigset_t set;
  watched_signals(&set);
  pthread_sigmask(SIG_BLOCK, &set, &g.old_mask);
  pthread_mutex_lock(&mu);
  g.stopping = false;
  g.running = pthread_create(&g.thread, NULL, watch, NULL) == 0;
  pthread_mutex_unlock(&mu);
  if (!g.running) pthread_sigmask(SIG_SETMASK, &g.old_mask, NULL);
}

void ctl_guard_stop(void) {
  pthread_mutex_lock(&mu);
  bool running = g.running;
  g.running = false;
  g.stopping = true;
  pthread_mutex_unlock(&mu);
  if (!running) return;
  pthread_kill(g.thread, SIGUSR1);
  pthread_join(g.thread, NULL);
  /* A SIGUSR1 the watcher did not take (it had ended) must not reach the default action. */
  sigset_t usr1, pending;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  sigpending(&pending);
  if (sigismember(&pending, SIGUSR1)) {
    struct timespec zero = {0, 0};
    sigtimedwait(&usr1, NULL, &zero);
  }
  pthread_sigmask(SIG_SETMASK, &g.old_mask, NULL);
}
