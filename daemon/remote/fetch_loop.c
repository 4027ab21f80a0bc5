/*
 * fetch_loop.c - the remote client's thread: one libcurl multi handle, the
 * transfers in it, and the callbacks that write their bodies.
 *
 * DESIGN: callers prepare a transfer (struct xfer) on their own thread and
 * queue it (xfer_submit: the queue is guarded by the client's lock, then
 * curl_multi_wakeup). The loop thread alone touches the multi handle: it
 * adds what was queued, runs curl_multi_perform, hands finished transfers
 * back on their call's done list (under the call's lock, with a signal), and
 * sleeps in curl_multi_poll. At each pass it also ends the transfers of
 * aborted calls (a cancel, or another part's failure) and those that
 * delivered no byte for stall_ms, so a call waits at most one pass for
 * either. Bodies are written by the callbacks below, on this thread,
 * straight into the caller's extents (one or several that touch) and never
 * past the bytes it asked for. Counters are atomics any thread may read.
 */
#include "fetch_internal.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "clock.h"

#define LOOP_TICK_MAX_MS 100
#define LOOP_TICK_MIN_MS 10
#define RF_BUFFER_BYTES (128 * 1024)

/* ---- addresses never connected to -------------------------------------------- */

static bool v4_forbidden(const unsigned char *b) {
  if (b[0] == 169 && b[1] == 254) return true;                          /* link-local, cloud metadata */
  return b[0] == 100 && b[1] == 100 && b[2] == 100 && b[3] == 200;      /* Alibaba Cloud metadata */
}

static bool v6_forbidden(const unsigned char *b) {
  static const unsigned char ec2[16] = {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54};
  static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) return true; /* fe80::/10 */
  if (memcmp(b, ec2, 16) == 0) return true;                /* EC2's IPv6 metadata endpoint */
  return memcmp(b, mapped, 12) == 0 && v4_forbidden(b + 12);
}

bool rf_host_forbidden(const char *host) {
  unsigned char b[16];
  if (inet_pton(AF_INET, host, b) == 1) return v4_forbidden(b);
  if (inet_pton(AF_INET6, host, b) == 1) return v6_forbidden(b);
  return false;
}

static bool sockaddr_forbidden(const struct sockaddr *sa, char *text, size_t textlen) {
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &in->sin_addr, text, (socklen_t)textlen);
    return v4_forbidden((const unsigned char *)&in->sin_addr);
  }
  if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
    inet_ntop(AF_INET6, &in6->sin6_addr, text, (socklen_t)textlen);
    return v6_forbidden(in6->sin6_addr.s6_addr);
  }
  return false;
}

/* ---- the transfer's callbacks (loop thread) ---------------------------------- */

static curl_socket_t on_open_socket(void *arg, curlsocktype purpose, struct curl_sockaddr *a) {
  struct xfer *x = arg;
  if (purpose == CURLSOCKTYPE_IPCXN && sockaddr_forbidden(&a->addr, x->forbidden_host, sizeof x->forbidden_host)) {
    x->forbidden_addr = true;
    return CURL_SOCKET_BAD;
  }
  return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

static int on_prereq(void *arg, char *primary_ip, char *local_ip, int primary_port, int local_port) {
  (void)primary_ip, (void)local_ip, (void)primary_port, (void)local_port;
  struct xfer *x = arg;
  x->prereq_ms = x->activity_ms = clock_ms();
  return CURL_PREREQFUNC_OK;
}

/* Copies a header's value (trimmed) into out; cut to fit. */
static void header_value(const char *v, size_t n, char *out, size_t outlen) {
  while (n > 0 && (*v == ' ' || *v == '\t')) v++, n--;
  while (n > 0 && (v[n - 1] == '\r' || v[n - 1] == '\n' || v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
  if (n >= outlen) n = outlen - 1;
  memcpy(out, v, n);
  out[n] = '\0';
}

/* A new response (a status line): forget the previous one's headers. */
static void response_reset(struct xfer *x, const char *line, size_t n) {
  char text[64];
  header_value(line, n, text, sizeof text);
  const char *sp = strchr(text, ' ');
  x->status = sp ? strtol(sp + 1, NULL, 10) : 0;
  x->use = BODY_UNDECIDED;
  x->has_length = false;
  x->content_length = 0;
  x->content_range[0] = x->etag[0] = x->last_modified[0] = '\0';
}

/* What to do with the body of the response whose headers just ended. */
static enum body_use judge_body(const struct xfer *x) {
  if (x->status < 200 || x->status >= 300) return BODY_KEEP;
  if (x->discard_body || x->ext == NULL) return BODY_DISCARD;
  if (x->status == 206) {
    uint64_t first, last, total;
    if (rf_content_range_parse(x->content_range, &first, &last, &total) != 0 || first == UINT64_MAX)
      return BODY_BAD_RANGE;
    if (x->object_size != UINT64_MAX && total != UINT64_MAX && total != x->object_size) return BODY_STALE;
    if (first != x->want_off || last != x->want_off + x->want_len - 1) return BODY_BAD_RANGE;
    return BODY_WRITE;
  }
  if (x->status == 200) {
    bool whole = x->want_off == 0 && x->want_len == x->object_size;
    if (x->ranged && !whole) return BODY_STALE;
    if (x->has_length && x->content_length != x->object_size) return BODY_STALE;
    return BODY_WRITE;
  }
  return BODY_KEEP;
}

static bool is_header(const char *line, size_t n, const char *name, const char **value, size_t *vlen) {
  size_t nl = strlen(name);
  if (n <= nl || line[nl] != ':' || strncasecmp(line, name, nl) != 0) return false;
  *value = line + nl + 1;
  *vlen = n - nl - 1;
  return true;
}

static size_t on_header(char *line, size_t size, size_t count, void *arg) {
  struct xfer *x = arg;
  size_t n = size * count;
  x->activity_ms = clock_ms();
  if (n >= 5 && memcmp(line, "HTTP/", 5) == 0) {
    response_reset(x, line, n);
    return n;
  }
  if ((n == 2 && line[0] == '\r') || (n == 1 && line[0] == '\n')) {
    x->use = judge_body(x);
    return n;
  }
  const char *v;
  size_t vl;
  char num[32];
  if (is_header(line, n, "Content-Length", &v, &vl)) {
    header_value(v, vl, num, sizeof num);
    char *end;
    unsigned long long len = strtoull(num, &end, 10);
    x->has_length = end != num && *end == '\0';
    x->content_length = len;
  } else if (is_header(line, n, "Content-Range", &v, &vl)) {
    header_value(v, vl, x->content_range, sizeof x->content_range);
  } else if (is_header(line, n, "ETag", &v, &vl)) {
    header_value(v, vl, x->etag, sizeof x->etag);
  } else if (is_header(line, n, "Last-Modified", &v, &vl)) {
    header_value(v, vl, x->last_modified, sizeof x->last_modified);
  }
  return n;
}

static size_t on_body(char *p, size_t size, size_t count, void *arg) {
  struct xfer *x = arg;
  size_t n = size * count;
  x->activity_ms = clock_ms();
  switch (x->use) {
  case BODY_WRITE:
    if (n > x->want_len - x->written) {
      x->overflow = true;
      return 0;
    }
    for (size_t done = 0; done < n;) { /* scattered: the part's extents touch, so the body runs on into the next */
      const struct rf_extent *e = &x->ext[x->ei];
      uint64_t at = x->want_off + x->written, room = e->off + e->len - at;
      size_t m = n - done < room ? n - done : (size_t)room;
      memcpy(e->dst + (at - e->off), p + done, m);
      done += m;
      x->written += m;
      if (m == room) x->ei++;
    }
    atomic_fetch_add(&x->client->stats.bytes, n);
    return n;
  case BODY_KEEP:
    if (x->body_len + n >= sizeof x->body) {
      size_t keep = sizeof x->body - 1 - x->body_len;
      memcpy(x->body + x->body_len, p, keep);
      x->body_len += keep;
      x->body[x->body_len] = '\0';
      x->cut = true; /* enough to read a <Code>; the rest is not wanted */
      return 0;
    }
    memcpy(x->body + x->body_len, p, n);
    x->body_len += n;
    x->body[x->body_len] = '\0';
    return n;
  case BODY_DISCARD:
    if (x->discarded + n > RF_BODY_KEEP) {
      x->cut = true; /* more than a byte-0 answer carries: not wanted */
      return 0;
    }
    x->discarded += n; /* consumed, so that the connection stays reusable */
    return n;
  default:
    x->cut = true; /* a body that must not be written (stale, other bytes) */
    return 0;
  }
}

void xfer_arm(struct rf_client *c, struct xfer *x) {
  CURL *e = x->easy;
  x->client = c;
  x->status = 0;
  x->use = BODY_UNDECIDED;
  x->written = 0;
  x->overflow = x->cut = x->forbidden_addr = false;
  x->forbidden_host[0] = '\0';
  x->has_length = false;
  x->content_range[0] = x->etag[0] = x->last_modified[0] = '\0';
  x->body[0] = '\0';
  x->body_len = 0;
  x->discarded = 0;
  x->prereq_ms = x->activity_ms = 0;
  x->curl_msg[0] = '\0';
  free(x->redirect_url);
  x->redirect_url = NULL;
  x->retry_after_s = 0;
  x->stall_ms = c->cfg.stall_ms;
  curl_easy_setopt(e, CURLOPT_PRIVATE, x);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(e, CURLOPT_PROXY, ""); /* no proxy from the environment: every address is checked here */
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)c->cfg.connect_timeout_ms);
  curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_2TLS);
  curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
  curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
  /* A server that trickles (a byte now and then: no stall) is cut too: under 1 KiB/s for the stall time. */
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, (long)(c->cfg.stall_ms + 999) / 1000);
  curl_easy_setopt(e, CURLOPT_BUFFERSIZE, (long)RF_BUFFER_BYTES);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, x->curl_msg);
  if (c->ca_file) curl_easy_setopt(e, CURLOPT_CAINFO, c->ca_file);
  curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(e, CURLOPT_HEADERDATA, x);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
  curl_easy_setopt(e, CURLOPT_PREREQFUNCTION, on_prereq);
  curl_easy_setopt(e, CURLOPT_PREREQDATA, x);
  curl_easy_setopt(e, CURLOPT_OPENSOCKETFUNCTION, on_open_socket);
  curl_easy_setopt(e, CURLOPT_OPENSOCKETDATA, x);
}

/* ---- handing transfers in and back ---------------------------------------- */

void xfer_submit(struct rf_client *c, struct xfer *x) {
  x->next = NULL;
  atomic_fetch_add(&c->stats.in_flight, 1);
  pthread_mutex_lock(&c->lock);
  if (c->queue_tail) c->queue_tail->next = x;
  else c->queue_head = x;
  c->queue_tail = x;
  pthread_mutex_unlock(&c->lock);
  curl_multi_wakeup(c->multi);
}

void loop_wake(struct rf_client *c) { curl_multi_wakeup(c->multi); }

static void active_unlink(struct rf_client *c, struct xfer *x) {
  if (x->act_prev) x->act_prev->act_next = x->act_next;
  else c->active = x->act_next;
  if (x->act_next) x->act_next->act_prev = x->act_prev;
  x->act_prev = x->act_next = NULL;
}

/* Reads what the caller needs of a finished transfer out of libcurl, and counts it. */
static void xfer_collect(struct rf_client *c, struct xfer *x) {
  long code = 0, version = 0, connects = 0;
  curl_off_t retry_after = 0;
  char *redirect = NULL;
  curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &code);
  curl_easy_getinfo(x->easy, CURLINFO_HTTP_VERSION, &version);
  curl_easy_getinfo(x->easy, CURLINFO_NUM_CONNECTS, &connects);
  curl_easy_getinfo(x->easy, CURLINFO_RETRY_AFTER, &retry_after);
  curl_easy_getinfo(x->easy, CURLINFO_REDIRECT_URL, &redirect);
  if (code != 0) x->status = code;
  x->retry_after_s = retry_after > 0 ? (long)retry_after : 0;
  x->redirect_url = redirect ? strdup(redirect) : NULL;
  long cls = x->status >= 100 && x->status < 600 ? x->status / 100 : 0;
  atomic_fetch_add(&c->stats.requests[cls], 1);
  if (connects > 0) atomic_fetch_add(&c->stats.connects, (uint64_t)connects);
  if (version == CURL_HTTP_VERSION_2_0 && x->status != 0) atomic_fetch_add(&c->stats.http2, 1);
}

/* Ends a transfer and puts it on its call's done list; the loop never touches it again. */
static void xfer_hand_back(struct rf_client *c, struct xfer *x, enum xfer_end end, CURLcode result) {
  if (x->added) {
    curl_multi_remove_handle(c->multi, x->easy);
    active_unlink(c, x);
    x->added = false;
  }
  x->end = end;
  x->result = result;
  xfer_collect(c, x);
  if (end == XFER_STALLED) atomic_fetch_add(&c->stats.stalls, 1);
  atomic_fetch_sub(&c->stats.in_flight, 1);
  struct call *k = x->call;
  x->next = NULL;
  pthread_mutex_lock(&k->lock);
  if (k->done_tail) k->done_tail->next = x;
  else k->done_head = x;
  k->done_tail = x;
  pthread_cond_signal(&k->cond);
  pthread_mutex_unlock(&k->lock);
}

/* Adds what callers queued; returns whether the client is stopping. */
static bool take_queue(struct rf_client *c) {
  pthread_mutex_lock(&c->lock);
  struct xfer *x = c->queue_head;
  c->queue_head = c->queue_tail = NULL;
  bool stopping = c->stopping;
  pthread_mutex_unlock(&c->lock);
  while (x != NULL) {
    struct xfer *next = x->next;
    if (stopping) {
      xfer_hand_back(c, x, XFER_SHUTDOWN, CURLE_OK);
    } else if (atomic_load(&x->call->abort)) {
      xfer_hand_back(c, x, XFER_ABORTED, CURLE_OK);
    } else {
      x->activity_ms = 0;
      CURLMcode mc = curl_multi_add_handle(c->multi, x->easy);
      if (mc != CURLM_OK) {
        snprintf(x->curl_msg, sizeof x->curl_msg, "%s", curl_multi_strerror(mc));
        xfer_hand_back(c, x, XFER_COMPLETED, CURLE_FAILED_INIT);
      } else {
        x->added = true;
        x->act_prev = NULL;
        x->act_next = c->active;
        if (c->active) c->active->act_prev = x;
        c->active = x;
      }
    }
    x = next;
  }
  return stopping;
}

/* Ends the transfers of aborted calls and those that stalled. */
static void sweep(struct rf_client *c) {
  uint64_t now = clock_ms();
  struct xfer *x = c->active;
  while (x != NULL) {
    struct xfer *next = x->act_next;
    if (atomic_load(&x->call->abort)) {
      xfer_hand_back(c, x, XFER_ABORTED, CURLE_OK);
    } else if (x->prereq_ms != 0 && x->stall_ms > 0 && now - x->activity_ms >= x->stall_ms) {
      xfer_hand_back(c, x, XFER_STALLED, CURLE_OK);
    }
    x = next;
  }
}

static void reap(struct rf_client *c) {
  CURLMsg *m;
  int left;
  while ((m = curl_multi_info_read(c->multi, &left)) != NULL) {
    if (m->msg != CURLMSG_DONE) continue;
    struct xfer *x = NULL;
    curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
    CURLcode result = m->data.result; /* m is invalid once the handle is removed */
    xfer_hand_back(c, x, XFER_COMPLETED, result);
  }
}

static void *loop_main(void *arg) {
  struct rf_client *c = arg;
  unsigned tick = c->cfg.stall_ms / 4;
  if (tick > LOOP_TICK_MAX_MS) tick = LOOP_TICK_MAX_MS;
  if (tick < LOOP_TICK_MIN_MS) tick = LOOP_TICK_MIN_MS;
  while (!take_queue(c)) {
    int running = 0;
    curl_multi_perform(c->multi, &running);
    reap(c);
    sweep(c);
    curl_multi_poll(c->multi, NULL, 0, (int)tick, NULL);
  }
  while (c->active != NULL) xfer_hand_back(c, c->active, XFER_SHUTDOWN, CURLE_OK);
  return NULL;
}

int loop_start(struct rf_client *c, struct wd_error *err) {
  int rc = pthread_create(&c->thread, NULL, loop_main, c);
  if (rc != 0) return err_set(err, WEIGHTD_E_IO, "remote client: cannot start its thread: %s", strerror(rc));
  c->thread_started = true;
  return 0;
}

void loop_stop(struct rf_client *c) {
  if (!c->thread_started) return;
  pthread_mutex_lock(&c->lock);
  c->stopping = true;
  pthread_mutex_unlock(&c->lock);
  curl_multi_wakeup(c->multi);
  pthread_join(c->thread, NULL);
  c->thread_started = false;
  take_queue(c); /* anything queued after the loop's last pass */
}
