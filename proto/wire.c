/* wire.c - framing and descriptor passing (see wire.h for the rules). */
#include "wire.h"

#include <inttypes.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"

/* WIRE_AGAIN must lie outside the error table: no code is that far down. */
#define WIRE_XX_(name, num, msg) _Static_assert(-(num) > WIRE_AGAIN, "WIRE_AGAIN collides with WEIGHTD_E_" #name);
WEIGHTD_ERRNO_MAP(WIRE_XX_)
#undef WIRE_XX_

/* iovecs gathered into one sendmsg() by the writer. */
#define WRITER_IOV_MAX 64
/*
 * Room for WIRE_MAX_FDS descriptors plus credentials, should the socket have
 * SO_PASSCRED set. A peer that sends more descriptors than fit is seen as
 * MSG_CTRUNC; one that sends up to RECV_FDS_MAX is refused per frame.
 */
#define CONTROL_BYTES (CMSG_SPACE(sizeof(int) * WIRE_MAX_FDS) + CMSG_SPACE(3 * sizeof(int)))
#define RECV_FDS_MAX  (CONTROL_BYTES / sizeof(int))

union control {
  char buf[CONTROL_BYTES];
  struct cmsghdr align;
};

/* ---- small helpers ----------------------------------------------------- */

static void put_le32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)(v & 0xFF);
  p[1] = (unsigned char)((v >> 8) & 0xFF);
  p[2] = (unsigned char)((v >> 16) & 0xFF);
  p[3] = (unsigned char)((v >> 24) & 0xFF);
}

static uint32_t get_le32(const void *q) {
  const unsigned char *p = q;
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void close_fds(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (fds[i] >= 0) close(fds[i]);
    fds[i] = -1;
  }
}

/*
 * Copies the SCM_RIGHTS descriptors of a received message into fds (room for
 * RECV_FDS_MAX) and returns how many there were.
 */
static size_t take_rights(struct msghdr *mh, int *fds) {
  size_t n = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c != NULL; c = CMSG_NXTHDR(mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(c);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof(int), sizeof fd);
      if (n < RECV_FDS_MAX)
        fds[n++] = fd;
      else
        close(fd);
    }
  }
  return n;
}

/* Points mh's control data at ctl holding fds[0..nfds). */
static void put_rights(struct msghdr *mh, union control *ctl, const int *fds, size_t nfds) {
  memset(ctl, 0, sizeof *ctl);
  mh->msg_control = ctl->buf;
  mh->msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
  struct cmsghdr *c = CMSG_FIRSTHDR(mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
  memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
}

static int send_errno_code(int e) {
  switch (e) {
  case EPIPE:
  case ECONNRESET:
  case ENOTCONN: return WEIGHTD_E_CLOSED;
  case ETOOMANYREFS: return WEIGHTD_E_LIMIT;
  case ENOMEM:
  case ENOBUFS: return WEIGHTD_E_NOMEM;
  default: return WEIGHTD_E_IO;
  }
}

static int recv_errno_code(int e) {
  switch (e) {
  case ECONNRESET:
  case ENOTCONN: return WEIGHTD_E_CLOSED;
  case ENOMEM:
  case ENOBUFS: return WEIGHTD_E_NOMEM;
  default: return WEIGHTD_E_IO;
  }
}

static int check_outgoing(size_t len, size_t nfds, struct wd_error *err) {
  if (len == 0) return err_set(err, WEIGHTD_E_INVALID, "a frame cannot be empty");
  if (len > WIRE_MAX_FRAME)
    return err_set(err, WEIGHTD_E_LIMIT, "frame of %zu bytes exceeds the limit of %u bytes", len,
                   WIRE_MAX_FRAME);
  if (nfds > WIRE_MAX_FDS)
    return err_set(err, WEIGHTD_E_LIMIT, "%zu file descriptors exceed the limit of %d per frame",
                   nfds, WIRE_MAX_FDS);
  return 0;
}

void wire_frame_clear(struct wire_frame *f) {
  if (f == NULL) return;
  free(f->json);
  close_fds(f->fds, f->nfds);
  f->json = NULL;
  f->len = 0;
  f->nfds = 0;
}

static void frame_init(struct wire_frame *f) {
  f->json = NULL;
  f->len = 0;
  f->nfds = 0;
  for (size_t i = 0; i < WIRE_MAX_FDS; i++) f->fds[i] = -1;
}

/* ---- reader ------------------------------------------------------------ */

void wire_reader_init(struct wire_reader *r) { memset(r, 0, sizeof *r); }

static int reader_fail(struct wire_reader *r, int code) {
  r->failed = code;
  r->err.code = code;
  return code;
}

/* Moves the unconsumed bytes to the front and sizes the buffer for the frame they begin. */
static uint32_t reader_limit(const struct wire_reader *r) {
  return r->max_frame > 0 && r->max_frame < WIRE_MAX_FRAME ? r->max_frame : WIRE_MAX_FRAME;
}

uint32_t wire_reader_next_len(const struct wire_reader *r) {
  return r->end - r->start >= WIRE_HEADER ? get_le32(r->buf + r->start) : 0;
}

static int reader_make_room(struct wire_reader *r) {
  if (r->start == r->end) {
    r->base += r->end;
    r->start = r->end = 0;
  } else if (r->start > 0) {
    memmove(r->buf, r->buf + r->start, r->end - r->start);
    r->base += r->start;
    r->end -= r->start;
    r->start = 0;
  }
  size_t want = WIRE_READER_BUF;
  if (r->end >= WIRE_HEADER) {
    uint32_t len = get_le32(r->buf);
    if (len > 0 && len <= reader_limit(r) && WIRE_HEADER + (size_t)len > want)
      want = WIRE_HEADER + (size_t)len;
  }
  if (r->cap < want) {
    char *nb = realloc(r->buf, want);
    if (nb == NULL) {
      err_set(&r->err, WEIGHTD_E_NOMEM, "cannot grow the receive buffer to %zu bytes", want);
      return WEIGHTD_E_NOMEM;
    }
    r->buf = nb;
    r->cap = want;
  } else if (r->cap > want && r->cap > WIRE_READER_BUF && r->end < want) {
    /* A large frame is done: give the memory back (failing to is harmless). */
    char *nb = realloc(r->buf, want);
    if (nb != NULL) {
      r->buf = nb;
      r->cap = want;
    }
  }
  if (r->end == r->cap) {
    err_set(&r->err, WEIGHTD_E_BUSY, "receive buffer full of unread frames");
    return WEIGHTD_E_BUSY;
  }
  return 0;
}

/*
 * One nonblocking recvmsg() of up to len bytes into buf, retried on EINTR,
 * taking the descriptors that came with it into fds (room for RECV_FDS_MAX)
 * and their count into *nfds. Returns the bytes read (0 at end of stream),
 * WIRE_AGAIN when nothing is ready, or a negative code with detail in err:
 * WEIGHTD_E_PROTOCOL when the descriptors did not fit (those that arrived
 * are closed), or the recvmsg error's code.
 */
static ssize_t recv_with_rights(int sock, void *buf, size_t len, int *fds, size_t *nfds,
                                struct wd_error *err) {
  struct iovec iov = {.iov_base = buf, .iov_len = len};
  union control ctl;
  struct msghdr mh = {
      .msg_iov = &iov,
      .msg_iovlen = 1,
      .msg_control = ctl.buf,
      .msg_controllen = sizeof ctl.buf,
  };
  ssize_t n;
  *nfds = 0;
  do {
    n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return WIRE_AGAIN;
    int e = errno;
    return err_set(err, recv_errno_code(e), "recvmsg: %s", strerror(e));
  }
  *nfds = take_rights(&mh, fds);
  if (mh.msg_flags & MSG_CTRUNC) {
    close_fds(fds, *nfds);
    *nfds = 0;
    return err_set(err, WEIGHTD_E_PROTOCOL,
                   "a message carried more than %d file descriptors (control data truncated)",
                   WIRE_MAX_FDS);
  }
  return n;
}

int wire_reader_fill(struct wire_reader *r, int sock) {
  if (r->failed) return r->failed;
  int rc = reader_make_room(r);
  if (rc < 0) return rc;

  int got[RECV_FDS_MAX];
  size_t ngot;
  ssize_t n = recv_with_rights(sock, r->buf + r->end, r->cap - r->end, got, &ngot, &r->err);
  if (n == WIRE_AGAIN) return WIRE_AGAIN;
  if (n < 0) return n == WEIGHTD_E_PROTOCOL ? reader_fail(r, WEIGHTD_E_PROTOCOL) : (int)n;
  if (n == 0) {
    close_fds(got, ngot);
    return 0;
  }
  if (ngot > 0) {
    if (r->nfds + ngot > WIRE_READER_MAX_FDS) {
      close_fds(got, ngot);
      err_set(&r->err, WEIGHTD_E_PROTOCOL,
              "more than %d received file descriptors wait for their frames", WIRE_READER_MAX_FDS);
      return reader_fail(r, WEIGHTD_E_PROTOCOL);
    }
    if (r->nfds + ngot > r->fds_cap) {
      size_t ncap = r->fds_cap ? r->fds_cap * 2 : WIRE_MAX_FDS;
      while (ncap < r->nfds + ngot) ncap *= 2;
      struct wire_fd_rec *nf = realloc(r->fds, ncap * sizeof *nf);
      if (nf == NULL) {
        close_fds(got, ngot);
        err_set(&r->err, WEIGHTD_E_NOMEM, "cannot record received file descriptors");
        return reader_fail(r, WEIGHTD_E_NOMEM);
      }
      r->fds = nf;
      r->fds_cap = ncap;
    }
    uint64_t first = r->base + r->end, last = first + (uint64_t)n - 1;
    for (size_t i = 0; i < ngot; i++)
      r->fds[r->nfds++] = (struct wire_fd_rec){.fd = got[i], .first = first, .last = last};
  }
  r->end += (size_t)n;
  return (int)n;
}

static int reader_protocol(struct wire_reader *r, struct wd_error *err) {
  reader_fail(r, WEIGHTD_E_PROTOCOL);
  if (err != NULL) *err = r->err;
  return WEIGHTD_E_PROTOCOL;
}

int wire_reader_next(struct wire_reader *r, struct wire_frame *out, struct wd_error *err) {
  frame_init(out);
  if (r->failed) {
    if (err != NULL) *err = r->err;
    return r->failed;
  }
  size_t avail = r->end - r->start;
  if (avail < WIRE_HEADER) return 0;
  uint32_t len = get_le32(r->buf + r->start);
  uint64_t f = r->base + r->start;
  if (len == 0) {
    err_set(&r->err, WEIGHTD_E_PROTOCOL, "zero-length frame at stream offset %" PRIu64, f);
    return reader_protocol(r, err);
  }
  if (len > reader_limit(r)) {
    err_set(&r->err, WEIGHTD_E_PROTOCOL, "frame of %" PRIu32 " bytes exceeds the limit of %" PRIu32 " bytes",
            len, reader_limit(r));
    return reader_protocol(r, err);
  }
  if (avail < WIRE_HEADER + (size_t)len) return 0;
  uint64_t e = f + WIRE_HEADER + len;

  /* Descriptors belong to the frame that holds the last byte read with them. */
  size_t lo = 0, hi = 0;
  while (lo < r->nfds && r->fds[lo].last < f) lo++;
  hi = lo;
  while (hi < r->nfds && r->fds[hi].last < e) hi++;
  if (hi - lo > WIRE_MAX_FDS) {
    err_set(&r->err, WEIGHTD_E_PROTOCOL, "frame carries %zu file descriptors, more than %d",
            hi - lo, WIRE_MAX_FDS);
    return reader_protocol(r, err);
  }
  for (size_t i = lo; i < hi; i++) {
    if (r->fds[i].first > f) {
      err_set(&r->err, WEIGHTD_E_PROTOCOL,
              "file descriptors attached %" PRIu64
              " bytes into a frame instead of to its first byte",
              r->fds[i].first - f);
      return reader_protocol(r, err);
    }
  }

  char *json = malloc((size_t)len + 1);
  if (json == NULL)
    return err_set(err, WEIGHTD_E_NOMEM, "cannot allocate a frame of %" PRIu32 " bytes", len);
  memcpy(json, r->buf + r->start + WIRE_HEADER, len);
  json[len] = '\0';
  out->json = json;
  out->len = len;
  for (size_t i = lo; i < hi; i++) out->fds[out->nfds++] = r->fds[i].fd;
  /* Records before lo cannot exist for a well-ordered stream; close them if they do. */
  for (size_t i = 0; i < lo; i++) close(r->fds[i].fd);
  if (hi > 0) {
    memmove(r->fds, r->fds + hi, (r->nfds - hi) * sizeof *r->fds);
    r->nfds -= hi;
  }
  r->start += WIRE_HEADER + (size_t)len;
  return 1;
}

bool wire_reader_pending(const struct wire_reader *r) { return r->end > r->start; }

void wire_reader_free(struct wire_reader *r) {
  if (r == NULL) return;
  for (size_t i = 0; i < r->nfds; i++) close(r->fds[i].fd);
  free(r->fds);
  free(r->buf);
  memset(r, 0, sizeof *r);
}

/* ---- writer ------------------------------------------------------------ */

struct wire_out {
  struct wire_out *next;
  size_t len, off; /* bytes in data (prefix included), bytes already sent */
  int fds[WIRE_MAX_FDS];
  size_t nfds; /* descriptors still to send; 0 once the first byte is out */
  unsigned char data[];
};

void wire_writer_init(struct wire_writer *w) { memset(w, 0, sizeof *w); }

int wire_writer_push(struct wire_writer *w, const char *json, size_t len, const int *fds,
                     size_t nfds) {
  int own[WIRE_MAX_FDS];
  int rc = check_outgoing(len, nfds, NULL);
  if (rc < 0) {
    for (size_t i = 0; i < nfds; i++)
      if (fds[i] >= 0) close(fds[i]);
    return rc;
  }
  if (nfds > 0) memcpy(own, fds, nfds * sizeof(int));
  struct wire_out *o = malloc(sizeof *o + WIRE_HEADER + len);
  if (o == NULL) {
    close_fds(own, nfds);
    return WEIGHTD_E_NOMEM;
  }
  o->next = NULL;
  o->len = WIRE_HEADER + len;
  o->off = 0;
  o->nfds = nfds;
  if (nfds > 0) memcpy(o->fds, own, nfds * sizeof(int));
  put_le32(o->data, (uint32_t)len);
  memcpy(o->data + WIRE_HEADER, json, len);
  if (w->tail != NULL)
    w->tail->next = o;
  else
    w->head = o;
  w->tail = o;
  w->bytes += o->len;
  w->frames++;
  w->fds += nfds;
  return 0;
}

static void writer_pop(struct wire_writer *w) {
  struct wire_out *o = w->head;
  w->head = o->next;
  if (w->head == NULL) w->tail = NULL;
  w->frames--;
  w->fds -= o->nfds;
  close_fds(o->fds, o->nfds);
  free(o);
}

int wire_writer_flush(struct wire_writer *w, int sock) {
  while (w->head != NULL) {
    struct iovec iov[WRITER_IOV_MAX];
    int niov = 0;
    union control ctl;
    struct msghdr mh = {.msg_iov = iov};
    struct wire_out *o = w->head;
    if (o->nfds > 0) {
      /* A frame with descriptors goes alone, from its first byte. */
      iov[niov++] = (struct iovec){.iov_base = o->data + o->off, .iov_len = o->len - o->off};
      put_rights(&mh, &ctl, o->fds, o->nfds);
    } else {
      for (; o != NULL && o->nfds == 0 && niov < WRITER_IOV_MAX; o = o->next)
        iov[niov++] = (struct iovec){.iov_base = o->data + o->off, .iov_len = o->len - o->off};
    }
    mh.msg_iovlen = (size_t)niov;
    ssize_t n;
    do {
      n = sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
      return send_errno_code(errno);
    }
    /* The descriptors went with the first buffer of this call. */
    if (w->head->nfds > 0 && n > 0) {
      close_fds(w->head->fds, w->head->nfds);
      w->fds -= w->head->nfds;
      w->head->nfds = 0;
    }
    size_t left = (size_t)n;
    while (left > 0) {
      o = w->head;
      size_t take = o->len - o->off < left ? o->len - o->off : left;
      o->off += take;
      left -= take;
      w->bytes -= take;
      if (o->off == o->len) writer_pop(w);
    }
  }
  return 0;
}

size_t wire_writer_bytes(const struct wire_writer *w) { return w->bytes; }

size_t wire_writer_fds(const struct wire_writer *w) { return w->fds; }

void wire_writer_free(struct wire_writer *w) {
  if (w == NULL) return;
  while (w->head != NULL) writer_pop(w);
  memset(w, 0, sizeof *w);
}

/* ---- blocking client helpers ------------------------------------------- */

/* Waits for events on sock until deadline (-1: none). Returns 1 ready, 0 timed out, <0 error. */
static int wait_for(int sock, short events, int64_t deadline, struct wd_error *err) {
  for (;;) {
    int ms = -1;
    if (deadline >= 0) {
      int64_t left = deadline - (int64_t)clock_ms();
      if (left < 0) left = 0;
      ms = left > 1000000 ? 1000000 : (int)left;
    }
    struct pollfd p = {.fd = sock, .events = events};
    int rc = poll(&p, 1, ms);
    if (rc > 0) return 1;
    if (rc == 0) {
      if (deadline >= 0 && (int64_t)clock_ms() >= deadline) return 0;
      continue;
    }
    if (errno == EINTR) continue;
    int e = errno;
    return err_set(err, WEIGHTD_E_IO, "poll: %s", strerror(e));
  }
}

int wire_send_frame(int sock, const char *json, size_t len, const int *fds, size_t nfds,
                    struct wd_error *err) {
  int rc = check_outgoing(len, nfds, err);
  if (rc < 0) return rc;
  unsigned char hdr[WIRE_HEADER];
  put_le32(hdr, (uint32_t)len);
  size_t total = WIRE_HEADER + len, sent = 0;
  while (sent < total) {
    struct iovec iov[2];
    int niov = 0;
    if (sent < WIRE_HEADER)
      iov[niov++] = (struct iovec){.iov_base = hdr + sent, .iov_len = WIRE_HEADER - sent};
    size_t body_off = sent > WIRE_HEADER ? sent - WIRE_HEADER : 0;
    iov[niov++] = (struct iovec){.iov_base = (char *)json + body_off, .iov_len = len - body_off};
    union control ctl;
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
    if (sent == 0 && nfds > 0) put_rights(&mh, &ctl, fds, nfds);
    ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        rc = wait_for(sock, POLLOUT, -1, err);
        if (rc < 0) return rc;
        continue;
      }
      int e = errno;
      return err_set(err, send_errno_code(e), "sendmsg: %s", strerror(e));
    }
    sent += (size_t)n;
  }
  return 0;
}

struct recv_state {
  int sock;
  int64_t deadline; /* until the first byte: the caller's timeout; after it, the finishing bound */
  int64_t finish_ms; /* how long a begun frame may take, from its first byte; -1: no bound */
  size_t done; /* bytes of this frame consumed so far */
  int fds[WIRE_MAX_FDS];
  size_t nfds;
};

/* Reads exactly n bytes of the current frame into p. */
static int recv_exact(struct recv_state *s, void *p, size_t n, size_t frame_total,
                      struct wd_error *err) {
  size_t got = 0;
  while (got < n) {
    int in[RECV_FDS_MAX];
    size_t nin;
    ssize_t r = recv_with_rights(s->sock, (char *)p + got, n - got, in, &nin, err);
    if (r == WIRE_AGAIN) {
      int rc = wait_for(s->sock, POLLIN, s->deadline, err);
      if (rc < 0) return rc;
      if (rc == 0) {
        if (s->done == 0) return err_set(err, WEIGHTD_E_TIMEOUT, "no reply within the timeout");
        return err_set(err, WEIGHTD_E_PROTOCOL,
                       "stalled inside a frame after %zu bytes for %lld ms; the connection is out of step",
                       s->done, (long long)s->finish_ms);
      }
      continue;
    }
    if (r < 0) return (int)r;
    if (nin > 0) {
      if (s->done > 0) {
        close_fds(in, nin);
        return err_set(
            err, WEIGHTD_E_PROTOCOL,
            "file descriptors attached %zu bytes into a frame instead of to its first byte",
            s->done);
      }
      if (s->nfds + nin > WIRE_MAX_FDS) {
        close_fds(in, nin);
        return err_set(err, WEIGHTD_E_PROTOCOL, "frame carries more than %d file descriptors",
                       WIRE_MAX_FDS);
      }
      memcpy(s->fds + s->nfds, in, nin * sizeof(int));
      s->nfds += nin;
    }
    if (r == 0) {
      if (s->done == 0) return err_set(err, WEIGHTD_E_CLOSED, "connection closed by the peer");
      if (frame_total > 0)
        return err_set(err, WEIGHTD_E_CLOSED,
                       "connection closed inside a frame after %zu of %zu bytes", s->done,
                       frame_total);
      return err_set(err, WEIGHTD_E_CLOSED,
                     "connection closed inside a frame's length prefix after %zu bytes", s->done);
    }
    if (s->done == 0) s->deadline = s->finish_ms < 0 ? -1 : (int64_t)clock_ms() + s->finish_ms;
    got += (size_t)r;
    s->done += (size_t)r;
  }
  return 0;
}

int wire_recv_frame(int sock, int timeout_ms, struct wire_frame *out, struct wd_error *err) {
  return wire_recv_frame_bounded(sock, timeout_ms, WIRE_FINISH_MS, out, err);
}

int wire_recv_frame_bounded(int sock, int timeout_ms, int finish_ms, struct wire_frame *out, struct wd_error *err) {
  frame_init(out);
  struct recv_state s = {
      .sock = sock,
      .deadline = timeout_ms < 0 ? -1 : (int64_t)clock_ms() + timeout_ms,
      .finish_ms = timeout_ms < 0 ? -1 : (int64_t)(finish_ms > timeout_ms ? finish_ms : timeout_ms),
  };
  unsigned char hdr[WIRE_HEADER];
  char *body = NULL;
  int rc = recv_exact(&s, hdr, WIRE_HEADER, 0, err);
  if (rc < 0) goto fail;
  uint32_t len = get_le32(hdr);
  if (len == 0) {
    rc = err_set(err, WEIGHTD_E_PROTOCOL, "zero-length frame");
    goto fail;
  }
  if (len > WIRE_MAX_FRAME) {
    rc = err_set(err, WEIGHTD_E_PROTOCOL,
                 "frame of %" PRIu32 " bytes exceeds the limit of %u bytes", len, WIRE_MAX_FRAME);
    goto fail;
  }
  body = malloc((size_t)len + 1);
  if (body == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "cannot allocate a frame of %" PRIu32 " bytes", len);
    goto fail;
  }
  rc = recv_exact(&s, body, len, WIRE_HEADER + (size_t)len, err);
  if (rc < 0) goto fail;
  body[len] = '\0';
  out->json = body;
  out->len = len;
  memcpy(out->fds, s.fds, s.nfds * sizeof(int));
  out->nfds = s.nfds;
  return 0;

fail:
  free(body);
  close_fds(s.fds, s.nfds);
  return rc;
}
