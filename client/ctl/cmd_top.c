/*
 * cmd_top.c - `weightctl top [--interval DURATION] [--once]`: what a node is
 * doing, live. Each frame is one `status` request: loads in flight (bytes,
 * share, rate between two frames, what they read from), prefetches, sets
 * with their leases and holders, checkpoints with what the page cache and
 * the pinned tier hold, and the budgets (device memory per device, the
 * pinned tier, open checkpoints against their bounds).
 *
 * On a terminal the frame is drawn on the alternate screen, fitted to the
 * terminal's size (TIOCGWINSZ, drawn again on SIGWINCH) and refreshed every
 * interval until q, Ctrl-C or SIGTERM; the terminal's mode and screen are
 * restored on every way out. A daemon that goes away is shown as such and
 * asked again at the next interval. Not on a terminal, or with --once, one
 * frame is printed and the command exits (1 when the daemon cannot be
 * reached).
 *
 * Terminal handling is written here (ANSI escapes, termios), not with
 * ncurses: a frame is a list of lines drawn top to bottom, which needs no
 * more, and weightctl links nothing it does not need.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "ctl.h"

/* ---- a frame: lines fitted to the terminal ---------------------------------------------- */

struct frame {
  char **lines;
  size_t n, cap;
};

static void frame_add(struct frame *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void frame_add(struct frame *f, const char *fmt, ...) {
  if (f->n == f->cap) {
    size_t cap = f->cap ? 2 * f->cap : 64;
    char **l = realloc(f->lines, cap * sizeof *l);
    if (l == NULL) return;
    f->lines = l;
    f->cap = cap;
  }
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  if (vasprintf(&s, fmt, ap) >= 0) f->lines[f->n++] = s;
  va_end(ap);
}

static void frame_free(struct frame *f) {
  for (size_t i = 0; i < f->n; i++) free(f->lines[i]);
  free(f->lines);
  memset(f, 0, sizeof *f);
}

/* ---- rates: bytes done per set between frames ----------------------------------------------- */

#define RATE_SLOTS 64
struct rate_seen {
  char set[24];
  uint64_t bytes;
  double at;
};
static struct rate_seen seen[RATE_SLOTS];

/* Bytes per second of set `id` since the last frame that saw it (0 the first time), remembering this sample. */
static double rate_of(const char *id, uint64_t bytes, double now) {
  struct rate_seen *slot = NULL, *oldest = &seen[0];
  for (size_t i = 0; i < RATE_SLOTS; i++) {
    if (strcmp(seen[i].set, id) == 0) slot = &seen[i];
    if (seen[i].at < oldest->at) oldest = &seen[i];
  }
  double r = 0;
  if (slot != NULL && now > slot->at && bytes >= slot->bytes) r = (double)(bytes - slot->bytes) / (now - slot->at);
  if (slot == NULL) slot = oldest;
  snprintf(slot->set, sizeof slot->set, "%s", id);
  slot->bytes = bytes;
  slot->at = now;
  return r;
}

/* ---- what a frame shows ------------------------------------------------------------------- */

static void bytes_text(uint64_t b, char *buf, size_t len) { ctl_human_bytes(b, buf, len); }

/*
 * Where a load in flight reads from, into buf: "from host mmap" (the kind of
 * source), "from peer:<uuid>", or "source not chosen yet"; with the file
 * bytes each leaf source has read so far when the load reads through several.
 */
static void source_text(const cJSON *set, char *buf, size_t len) {
  const cJSON *src = cJSON_GetObjectItemCaseSensitive(set, "source");
  if (!cJSON_IsString(src)) {
    snprintf(buf, len, "source not chosen yet");
    return;
  }
  const cJSON *reading = cJSON_GetObjectItemCaseSensitive(set, "reading");
  int n = snprintf(buf, len, "from %s%s%s", src->valuestring, cJSON_IsString(reading) ? " " : "",
                   cJSON_IsString(reading) ? reading->valuestring : "");
  const cJSON *rb = cJSON_GetObjectItemCaseSensitive(set, "read_bytes"), *k;
  if (n < 0 || cJSON_GetArraySize(rb) < 2) return;
  cJSON_ArrayForEach(k, rb) {
    char h[32];
    ctl_human_bytes(cJSON_IsNumber(k) ? (uint64_t)k->valuedouble : 0, h, sizeof h);
    int w = snprintf(buf + n, len - (size_t)n, " %s %s", k->string, h);
    if (w < 0 || (size_t)w >= len - (size_t)n) return;
    n += w;
  }
}

static void build_frame(struct frame *f, const cJSON *r, double now) {
  const cJSON *d = cJSON_GetObjectItemCaseSensitive(r, "daemon"), *x;
  char a[32], b[32], c[32];
  time_t t = time(NULL);
  struct tm tm;
  localtime_r(&t, &tm);
  frame_add(f, "weightd %s  pid %" PRIu64 "  backend %s  up %.0f s  %" PRIu64 " connection(s)  %02d:%02d:%02d",
            ctl_str(d, "version"), ctl_u64(d, "pid"), ctl_str(d, "backend"), ctl_num(d, "uptime_s"),
            ctl_u64(d, "connections"), tm.tm_hour, tm.tm_min, tm.tm_sec);

  frame_add(f, "%s", "");
  frame_add(f, "BUDGETS");
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "devices")) {
    bytes_text(ctl_u64(x, "used"), a, sizeof a);
    if (ctl_u64(x, "budget") > 0) bytes_text(ctl_u64(x, "budget"), b, sizeof b);
    else snprintf(b, sizeof b, "no budget");
    bytes_text(ctl_u64(x, "memory_free"), c, sizeof c);
    frame_add(f, "  device %" PRIu64 " %-24.24s sets %s of %s, free %s", ctl_u64(x, "index"), ctl_str(x, "name"), a,
              b, c);
  }
  bytes_text(ctl_u64(d, "pinned_bytes"), a, sizeof a);
  bytes_text(ctl_u64(d, "host_pin_budget"), b, sizeof b);
  frame_add(f, "  pinned tier %s of %s (%s)", a, b, ctl_str(d, "host_pin_budget_from"));
  const cJSON *cb = cJSON_GetObjectItemCaseSensitive(d, "checkpoints");
  if (cb != NULL) {
    bytes_text(ctl_u64(cb, "charged_bytes"), a, sizeof a);
    bytes_text(ctl_u64(cb, "memory"), b, sizeof b);
    frame_add(f, "  open checkpoints %" PRIu64 " of %" PRIu64 ", %s of %s charged, %" PRIu64 " of %" PRIu64 " mappings",
              ctl_u64(cb, "open"), ctl_u64(cb, "max_open"), a, b, ctl_u64(cb, "mappings"), ctl_u64(cb, "max_mappings"));
  }

  frame_add(f, "%s", "");
  frame_add(f, "LOADS IN FLIGHT");
  size_t loading = 0;
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "sets")) {
    if (strcmp(ctl_str(x, "state"), "loading") != 0) continue;
    uint64_t done = ctl_u64(x, "bytes_done"), total = ctl_u64(x, "bytes");
    double rate = rate_of(ctl_str(x, "set"), done, now);
    char from[96];
    source_text(x, from, sizeof from);
    bytes_text(done, a, sizeof a);
    bytes_text(total, b, sizeof b);
    frame_add(f, "  %-6s %s  %s of %s (%3.0f%%)  %.2f GiB/s  on %s  %s", ctl_str(x, "set"), ctl_str(x, "path"), a, b,
              total ? 100.0 * (double)done / (double)total : 0.0, rate / (double)(1ull << 30), ctl_str(x, "device"),
              from);
    loading++;
  }
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "requests")) {
    if (strcmp(ctl_str(x, "state"), "queued") == 0) {
      frame_add(f, "  %-6s %s queued  %s", ctl_str(x, "request"), ctl_str(x, "op"), ctl_str(x, "path"));
      loading++;
    } else if (strcmp(ctl_str(x, "op"), "prefetch") == 0 && cJSON_GetObjectItemCaseSensitive(x, "bytes_total")) {
      /* A prefetch moves file bytes into the page cache (and the pinned tier): its progress is the request's. */
      uint64_t done = ctl_u64(x, "bytes_done"), total = ctl_u64(x, "bytes_total");
      double rate = rate_of(ctl_str(x, "request"), done, now);
      bytes_text(done, a, sizeof a);
      bytes_text(total, b, sizeof b);
      frame_add(f, "  %-6s %s  %s of %s (%3.0f%%)  %.2f GiB/s  prefetch into host memory", ctl_str(x, "request"),
                ctl_str(x, "path"), a, b, total ? 100.0 * (double)done / (double)total : 0.0,
                rate / (double)(1ull << 30));
      loading++;
    }
  }
  if (loading == 0) frame_add(f, "  none");

  frame_add(f, "%s", "");
  frame_add(f, "SETS");
  size_t nsets = 0;
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "sets")) {
    if (strcmp(ctl_str(x, "state"), "loading") == 0) continue;
    bytes_text(ctl_u64(x, "bytes"), a, sizeof a);
    const cJSON *secs = cJSON_GetObjectItemCaseSensitive(x, "seconds");
    char how[80] = "";
    const char *from = cJSON_GetObjectItemCaseSensitive(x, "read_from") ? ctl_str(x, "read_from") : ctl_str(x, "source");
    if (cJSON_IsNumber(secs))
      snprintf(how, sizeof how, "  %s from %s in %.3f s", ctl_str(x, "method"), from, secs->valuedouble);
    frame_add(f, "  %-6s %-8s %10s  %" PRIu64 " lease(s)  on %s  %s%s", ctl_str(x, "set"), ctl_str(x, "state"), a,
              ctl_u64(x, "leases"), ctl_str(x, "device"), ctl_str(x, "path"), how);
    const cJSON *l;
    cJSON_ArrayForEach(l, cJSON_GetObjectItemCaseSensitive(r, "leases")) {
      if (strcmp(ctl_str(l, "set"), ctl_str(x, "set")) != 0) continue;
      const char *name = ctl_str(l, "client_name");
      frame_add(f, "           lease %s held by pid %" PRIu64 " uid %" PRIu64 "%s%s%s for %.0f s", ctl_str(l, "lease"),
                ctl_u64(l, "pid"), ctl_u64(l, "uid"), name[0] && strcmp(name, "?") ? " '" : "",
                name[0] && strcmp(name, "?") ? name : "", name[0] && strcmp(name, "?") ? "'" : "", ctl_num(l, "age_s"));
    }
    nsets++;
  }
  if (nsets == 0) frame_add(f, "  none");

  frame_add(f, "%s", "");
  frame_add(f, "CHECKPOINTS");
  size_t ncks = 0;
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "checkpoints")) {
    bytes_text(ctl_u64(x, "bytes"), a, sizeof a);
    bytes_text(ctl_u64(x, "resident_bytes"), b, sizeof b);
    bytes_text(ctl_u64(x, "pinned_bytes"), c, sizeof c);
    frame_add(f, "  %s  %s, %s in the page cache, %s pinned%s, %" PRIu64 " set(s)", ctl_str(x, "path"), a, b, c,
              cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(x, "pinned")) ? " (whole)" : "", ctl_u64(x, "sets"));
    ncks++;
  }
  if (ncks == 0) frame_add(f, "  none");
}

/* ---- the terminal -------------------------------------------------------------------------- */

static volatile sig_atomic_t got_quit, got_resize;
static struct termios saved_tio;
static bool tio_saved;

static void on_quit(int sig) {
  (void)sig;
  got_quit = 1;
}
static void on_resize(int sig) {
  (void)sig;
  got_resize = 1;
}

static void term_enter(void) {
  if (tcgetattr(STDIN_FILENO, &saved_tio) == 0) {
    struct termios raw = saved_tio;
    raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    tio_saved = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
  }
  fputs("\x1b[?1049h\x1b[?25l", stdout); /* the alternate screen, no cursor */
  fflush(stdout);
}

static void term_leave(void) {
  fputs("\x1b[?25h\x1b[?1049l", stdout);
  fflush(stdout);
  if (tio_saved) tcsetattr(STDIN_FILENO, TCSANOW, &saved_tio);
  tio_saved = false;
}

static void term_size(int *rows, int *cols) {
  struct winsize ws;
  *rows = 24;
  *cols = 80;
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 && ws.ws_col > 0) {
    *rows = ws.ws_row;
    *cols = ws.ws_col;
  }
}

/* Draws f from the top left, each line cut at the width, the last row saying how many lines did not fit. */
static void frame_draw(const struct frame *f, bool screen) {
  int rows = 0, cols = 0;
  if (screen) term_size(&rows, &cols);
  if (screen) fputs("\x1b[H", stdout);
  size_t fit = screen && (size_t)rows < f->n ? (size_t)(rows > 1 ? rows - 1 : 0) : f->n;
  for (size_t i = 0; i < fit; i++) {
    if (screen) printf("%.*s\x1b[K\r\n", cols, f->lines[i]);
    else printf("%s\n", f->lines[i]);
  }
  if (fit < f->n) printf("  ... %zu more line(s): a taller terminal shows them\x1b[K", f->n - fit);
  if (screen) fputs("\x1b[J", stdout); /* clear what the last frame left below */
  fflush(stdout);
}

/* ---- the command ----------------------------------------------------------------------------- */

/* One frame of the daemon's status into f: 0, or the connection's error (f then says so). */
static int frame_get(weightd_client **c, struct frame *f, double now) {
  int rc = 0;
  if (*c == NULL) {
    char name[] = "weightctl top";
    struct weightd_connect_options o = {.struct_size = sizeof o, .socket_path = ctl_opts.socket, .client_name = name};
    rc = weightd_connect_opts(&o, c);
    if (rc != 0) {
      frame_add(f, "daemon unreachable: %s", *c ? weightd_last_error(*c) : weightd_strerror(rc));
      weightd_close(*c);
      *c = NULL;
      return rc;
    }
  }
  char *text = NULL;
  rc = weightd_request(*c, "{\"op\": \"status\"}", &text, NULL, NULL);
  cJSON *r = text != NULL ? cJSON_Parse(text) : NULL;
  if (rc == 0 && r != NULL) {
    build_frame(f, r, now);
  } else {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(r, "error");
    frame_add(f, "status failed: %s", e ? ctl_str(e, "message") : weightd_strerror(rc));
    weightd_close(*c); /* a daemon that went away: connect again next time */
    *c = NULL;
    if (rc == 0) rc = WEIGHTD_E_PROTOCOL;
  }
  cJSON_Delete(r);
  weightd_free(text);
  return rc;
}

static const struct optab_opt top_opts[] = {
    {CTL_OPT_INTERVAL, "interval", 0, OPTAB_VALUE, "DURATION",
     "Time between frames (seconds, or 500ms, 2s; 0.1 s to 1 h; default 1 s).", 0, NULL},
    {CTL_OPT_ONCE, "once", 0, OPTAB_SWITCH, NULL, "Print one frame and exit, also on a terminal.", 0, NULL},
};

static int run_top(const struct ctl_args *a) {
  double interval = 1.0;
  const char *v = ctl_val(a, CTL_OPT_INTERVAL);
  if (v != NULL && (ctl_parse_duration(v, &interval) != 0 || interval < 0.1 || interval > 3600))
    return ctl_usage_error("--interval wants a duration from 0.1 s to 1 h, not '%s'", v);
  bool live = !ctl_has(a, CTL_OPT_ONCE) && isatty(STDOUT_FILENO) && isatty(STDIN_FILENO) && !ctl_opts.json;
  weightd_client *c = NULL;
  if (!live) {
    struct frame f = {0};
    int rc = frame_get(&c, &f, clock_s());
    if (rc != 0) {
      ctl_errorc(weightd_err_name(rc), "top: %s", f.n ? f.lines[0] : "the daemon cannot be reached");
    } else {
      frame_draw(&f, false);
    }
    frame_free(&f);
    weightd_close(c);
    return rc == 0 ? CTL_EXIT_OK : ctl_exit_for(rc);
  }
  struct sigaction sq = {.sa_handler = on_quit}, sr = {.sa_handler = on_resize}, old_int, old_term, old_winch;
  sigemptyset(&sq.sa_mask);
  sigemptyset(&sr.sa_mask);
  sigaction(SIGINT, &sq, &old_int);
  sigaction(SIGTERM, &sq, &old_term);
  sigaction(SIGWINCH, &sr, &old_winch);
  term_enter();
  struct frame f = {0};
  while (!got_quit) {
    frame_free(&f);
    if (frame_get(&c, &f, clock_s()) != 0) frame_add(&f, "(asking again every %g s; q quits)", interval);
    fputs("\x1b[2J", stdout); /* a full redraw each frame: lines that shrank leave nothing behind */
    frame_draw(&f, true);
    double until = clock_s() + interval;
    while (!got_quit) {
      double left = until - clock_s();
      if (left <= 0) break;
      struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
      int n = poll(&p, 1, (int)(left * 1000) + 1);
      if (n < 0 && errno == EINTR) {
        if (got_resize) {
          got_resize = 0;
          fputs("\x1b[2J", stdout);
          frame_draw(&f, true);
        }
        continue;
      }
      if (n > 0) {
        char ch;
        ssize_t k = read(STDIN_FILENO, &ch, 1);
        if (k == 1 && (ch == 'q' || ch == 'Q')) got_quit = 1;
        if (k == 0) got_quit = 1; /* the terminal went away */
      }
    }
  }
  frame_free(&f);
  term_leave();
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGWINCH, &old_winch, NULL);
  weightd_close(c);
  return CTL_EXIT_OK;
}

const struct ctl_cmd ctl_cmd_top = {
    .name = "top",
    .args = "",
    .min_args = 0,
    .max_args = 0,
    .summary = "show live what the daemon is doing: loads in flight, sets and their holders, budgets",
    .description =
        "Draws the daemon's state every --interval on the terminal's alternate screen, fitted to its size: "
        "the budgets (device memory used by sets per device, the pinned tier, open checkpoints), loads in "
        "flight with bytes done, share, rate since the last frame and where they read from (host memory "
        "through which kind of source, or a peer's copy), prefetches in flight, the sets with their leases and "
        "holders (pid, uid, the client name they gave), and the checkpoints with what the page cache and the "
        "pinned tier hold. q or "
        "Ctrl-C quits and restores the terminal. A daemon that goes away is shown as unreachable and asked "
        "again at the next interval. Not on a terminal, or with --once, prints one frame and exits.",
    .opts = CTL_OPTS(top_opts),
    .flags = CTL_CMD_DAEMON,
    .run = run_top,
};
