/*
 * ctl_progress.c - the one progress line of long commands (load, attach,
 * prefetch --wait, prewarm, export, mkcheckpoint): bytes done of the total
 * in GiB, the rate in GiB/s and the time left, redrawn in place on stderr at
 * most ten times a second, only when stdout and stderr are terminals and
 * --json is off.
 *
 * DESIGN: updates come from the command's thread (libweightd's progress
 * callback) or from a watcher thread that polls a counter (the safetensors
 * writer's); one mutex guards the display's state.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ctl.h"

#define BAR_WIDTH 24
#define REDRAW_S 0.1

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  bool active;
  bool drawn;
  char label[24];
  double t0;        /* when the line began */
  double last_draw; /* when it was last drawn */
  uint64_t done, total;
  /* The watcher thread of ctl_progress_watch. */
  bool watching;
  bool stop;
  pthread_t thread;
  void (*get)(void *, uint64_t *, uint64_t *);
  void *arg;
} pg;

bool ctl_progress_enabled(void) { return !ctl_opts.json && isatty(STDOUT_FILENO) && isatty(STDERR_FILENO); }

/* "1:02:03", "2:03" or "3 s". */
static void format_eta(double s, char *buf, size_t len) {
  long t = (long)(s + 0.5);
  if (t >= 3600) snprintf(buf, len, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else if (t >= 60) snprintf(buf, len, "%ld:%02ld", t / 60, t % 60);
  else snprintf(buf, len, "%ld s", t);
}

/* Draws the line (mu held). */
static void draw(double now) {
  const double gib = (double)(1ull << 30);
  uint64_t done = pg.done > pg.total ? pg.total : pg.done;
  double frac = pg.total > 0 ? (double)done / (double)pg.total : 0;
  char bar[BAR_WIDTH + 1];
  int fill = (int)(frac * BAR_WIDTH);
  memset(bar, '#', (size_t)fill);
  memset(bar + fill, '.', (size_t)(BAR_WIDTH - fill));
  bar[BAR_WIDTH] = '\0';
  double elapsed = now - pg.t0;
  char rate[32] = "", eta[32] = "";
  if (elapsed >= 0.2 && done > 0) {
    double r = (double)done / elapsed;
    snprintf(rate, sizeof rate, "  %.2f GiB/s", r / gib);
    if (done < pg.total) {
      char t[16];
      format_eta((double)(pg.total - done) / r, t, sizeof t);
      snprintf(eta, sizeof eta, "  %s left", t);
    }
  }
  fprintf(stderr, "\r%s [%s] %3d%%  %.2f of %.2f GiB%s%s\033[K", pg.label, bar, (int)(frac * 100),
          (double)done / gib, (double)pg.total / gib, rate, eta);
  fflush(stderr);
  pg.drawn = true;
  pg.last_draw = now;
}

void ctl_progress_begin(const char *label) {
  pthread_mutex_lock(&mu);
  pg.active = ctl_progress_enabled();
  pg.drawn = false;
  snprintf(pg.label, sizeof pg.label, "%s", label ? label : "");
  pg.t0 = clock_s();
  pg.last_draw = 0;
  pg.done = pg.total = 0;
  pthread_mutex_unlock(&mu);
}

void ctl_progress_update(uint64_t done, uint64_t total) {
  pthread_mutex_lock(&mu);
  if (!pg.active && !pg.drawn && ctl_progress_enabled() && pg.label[0] == '\0') {
    /* An update without a begin: a line labelled with the command. */
    pg.active = true;
    snprintf(pg.label, sizeof pg.label, "%s", ctl_opts.cmd ? ctl_opts.cmd : "");
    pg.t0 = clock_s();
  }
  if (pg.active && total > 0) {
    pg.done = done;
    pg.total = total;
    double now = clock_s();
    if (now - pg.last_draw >= REDRAW_S || (done >= total && !pg.drawn)) draw(now);
  }
  pthread_mutex_unlock(&mu);
}

void ctl_progress_cb(uint64_t done, uint64_t total, void *arg) {
  (void)arg;
  ctl_progress_update(done, total);
}

static void *watch_main(void *arg) {
  (void)arg;
  for (;;) {
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&mu);
    bool stop = pg.stop;
    void (*get)(void *, uint64_t *, uint64_t *) = pg.get;
    void *garg = pg.arg;
    pthread_mutex_unlock(&mu);
    if (stop) return NULL;
    uint64_t done = 0, total = 0;
    get(garg, &done, &total);
    ctl_progress_update(done, total);
  }
}

void ctl_progress_watch(const char *label, void (*get)(void *arg, uint64_t *done, uint64_t *total), void *arg) {
  if (!ctl_progress_enabled()) return;
  ctl_progress_begin(label);
  pthread_mutex_lock(&mu);
  pg.get = get;
  pg.arg = arg;
  pg.stop = false;
  pg.watching = pthread_create(&pg.thread, NULL, watch_main, NULL) == 0;
  pthread_mutex_unlock(&mu);
}

void ctl_progress_end(void) {
  pthread_mutex_lock(&mu);
  bool watching = pg.watching;
  pg.stop = true;
  pg.watching = false;
  void (*get)(void *, uint64_t *, uint64_t *) = pg.get;
  void *garg = pg.arg;
  pthread_mutex_unlock(&mu);
  if (watching) {
    pthread_join(pg.thread, NULL);
    /* The counter's last value: a write shorter than one poll still shows its line, once, at 100%. */
    uint64_t done = 0, total = 0;
    get(garg, &done, &total);
    ctl_progress_update(done, total);
  }
  pthread_mutex_lock(&mu);
  if (pg.drawn) {
    fputs("\r\033[K", stderr);
    fflush(stderr);
  }
  pg.active = false;
  pg.drawn = false;
  pg.label[0] = '\0';
  pthread_mutex_unlock(&mu);
}
