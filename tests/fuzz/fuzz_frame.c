/*
 * fuzz_frame.c - libFuzzer target: the frame readers on a real Unix stream
 * socket pair. Input: one control byte, then the stream. The daemon's
 * nonblocking reader takes the stream chunk by chunk, as a slow or hostile
 * peer would send it, and frames are drained after every fill: chunk i is 1
 * to 8 bytes long when bit i % 6 of the control byte is set, else 509 (the
 * first MAX_CHUNKS chunks; the rest of the stream goes at once); bit 6 attaches
 * a descriptor to every other chunk; bit 7 sets a max_frame of 64. Then the
 * client's blocking wire_recv_frame reads the same bytes.
 *
 * Oracles besides the sanitizers: a frame's body is exactly its length
 * prefix's worth of the stream, the reader never holds more than a frame and
 * its prefix, and no descriptor leaks (the next descriptor number after a run
 * is the one before it).
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int devnull = -1;

/* Sends buf[0..n) on sock, with a descriptor when fd >= 0. 0, or -1 when the socket is full. */
static int send_chunk(int sock, const uint8_t *buf, size_t n, int fd) {
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = n};
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  return sendmsg(sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
}

/* The bytes the reader has taken as frames so far: each must be the next prefix and body of the stream. */
struct taken {
  const uint8_t *stream;
  size_t n, used;
};

/* Checks frame f against the stream it was read from, and moves past it. */
static void check_frame(struct taken *t, const struct wire_frame *f) {
  if (f->len == 0 || f->len > WIRE_MAX_FRAME || f->json[f->len] != '\0' || f->nfds > WIRE_MAX_FDS) abort();
  if (t->n - t->used < WIRE_HEADER + f->len) abort();
  const uint8_t *p = t->stream + t->used;
  uint32_t len = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  if (len != f->len || memcmp(p + WIRE_HEADER, f->json, f->len) != 0) abort();
  t->used += WIRE_HEADER + f->len;
}

/* Takes every complete frame out of r and checks it. Returns how many, or the sticky error. */
static int drain(struct wire_reader *r, struct taken *t) {
  for (int n = 0;; n++) {
    struct wire_frame f;
    struct wd_error err;
    int rc = wire_reader_next(r, &f, &err);
    if (rc <= 0) return rc < 0 ? rc : n;
    check_frame(t, &f);
    wire_frame_clear(&f);
  }
}

/* Chunks sent one by one before the rest of the stream goes at once (bounds the syscalls per input). */
#define MAX_CHUNKS 128

/* The length of chunk k: small (1 to 8 bytes, varying) or 509, by the control byte's bits. */
static size_t chunk_len(unsigned control, size_t k, size_t left) {
  if (k >= MAX_CHUNKS) return left;
  size_t n = (control >> (k % 6)) & 1 ? 1 + (k * 5 + control) % 8 : 509;
  return n < left ? n : left;
}

static void daemon_reader(const uint8_t *stream, size_t n, unsigned control, int with_fds, uint32_t max_frame) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
  struct wire_reader r;
  wire_reader_init(&r);
  r.max_frame = max_frame;
  size_t off = 0, k = 0;
  int failed = 0;
  struct taken t = {stream, n, 0};
  while (off < n && !failed) {
    size_t m = chunk_len(control, k, n - off);
    if (send_chunk(sv[0], stream + off, m, with_fds && k % 2 == 0 ? devnull : -1) != 0) break;
    off += m;
    k++;
    for (;;) {
      int got = wire_reader_fill(&r, sv[1]);
      if (got == WIRE_AGAIN || got == 0) break;
      if (got < 0 && got != WEIGHTD_E_BUSY) {
        failed = 1;
        break;
      }
      if (r.cap > WIRE_HEADER + WIRE_MAX_FRAME || r.end > r.cap) abort();
      int taken = drain(&r, &t);
      if (taken < 0) {
        failed = 1;
        break;
      }
      if (got == WEIGHTD_E_BUSY && taken == 0) abort(); /* full, yet no frame to take: a livelock */
    }
  }
  wire_reader_free(&r);
  close(sv[0]);
  close(sv[1]);
}

static void client_reader(const uint8_t *stream, size_t n) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
  if (n > 0 && send(sv[0], stream, n, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)n) {
    close(sv[0]);
    close(sv[1]);
    return;
  }
  shutdown(sv[0], SHUT_WR);
  struct taken t = {stream, n, 0};
  for (;;) {
    struct wire_frame f;
    struct wd_error err;
    if (wire_recv_frame(sv[1], 0, &f, &err) != 0) break;
    check_frame(&t, &f);
    wire_frame_clear(&f);
  }
  close(sv[0]);
  close(sv[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  if (devnull < 0 && (devnull = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0) abort();
  int probe = dup(devnull);
  close(probe);
  daemon_reader(data + 1, size - 1, data[0] & 63u, (data[0] >> 6) & 1, (data[0] & 0x80) ? 64 : 0);
  client_reader(data + 1, size - 1);
  int after = dup(devnull);
  close(after);
  if (after != probe) abort(); /* a descriptor leaked */
  return 0;
}
