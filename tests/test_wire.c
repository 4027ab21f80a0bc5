/*
 * test_wire.c - framing and descriptor passing over socketpair(AF_UNIX, SOCK_STREAM):
 * the daemon's reader and writer, the client's blocking helpers, the limits,
 * and where descriptors land. Every test checks that it leaves no descriptor open.
 */
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "wire.h"

/* ---- helpers ------------------------------------------------------------ */

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own descriptor */
}

#define FD_BEGIN int fd_base_ = count_fds()
#define FD_END   CHECK_EQ_INT(count_fds(), fd_base_)

static void make_pair(int sv[2]) {
  int rc = socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv);
  CHECK(rc == 0);
}

static void set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int make_memfd(void) { return memfd_create("wire-test", MFD_CLOEXEC); }

static ino_t ino_of(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  return st.st_ino;
}

static size_t unread_bytes(int sock) {
  int n = 0;
  if (ioctl(sock, FIONREAD, &n) != 0) return (size_t)-1;
  return (size_t)n;
}

/* A frame body of n bytes whose content depends on n and seed. */
static char *pattern(size_t n, unsigned seed) {
  char *p = malloc(n + 1);
  for (size_t i = 0; i < n; i++) p[i] = (char)('!' + (i * 7 + seed * 13 + n) % 90);
  p[n] = '\0';
  return p;
}

static void raw_send(int sock, const void *p, size_t n, const int *fds, size_t nfds) {
  struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
  union {
    char buf[CMSG_SPACE(sizeof(int) * 64)];
    struct cmsghdr align;
  } ctl;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds > 0) {
    memset(&ctl, 0, sizeof ctl);
    mh.msg_control = ctl.buf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  ssize_t w = sendmsg(sock, &mh, MSG_NOSIGNAL);
  CHECK(w == (ssize_t)n);
}

static void le32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v;
  p[1] = (unsigned char)(v >> 8);
  p[2] = (unsigned char)(v >> 16);
  p[3] = (unsigned char)(v >> 24);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Fills r from sock until the socket is empty; collects complete frames into out. */
static size_t drain(struct wire_reader *r, int sock, struct wire_frame *out, size_t max) {
  size_t got = 0;
  for (;;) {
    struct wire_frame f;
    int rc;
    while ((rc = wire_reader_next(r, &f, NULL)) == 1) {
      if (got < max)
        out[got++] = f;
      else
        wire_frame_clear(&f);
    }
    CHECK_EQ_INT(rc, 0);
    int n = wire_reader_fill(r, sock);
    if (n == WIRE_AGAIN || n <= 0) {
      CHECK(n == WIRE_AGAIN);
      break;
    }
  }
  return got;
}

/* ---- sizes -------------------------------------------------------------- */

static const size_t sizes[] = {
    1,     2,     3,     4,     5,     100,    4095,     4096,           4097,
    65531, 65532, 65535, 65536, 65537, 200000, 1u << 20, (1u << 20) + 3, 3u << 20};
#define NSIZES (sizeof sizes / sizeof sizes[0])

static void test_sizes_writer_reader(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  struct wire_writer w;
  struct wire_reader r;
  wire_writer_init(&w);
  wire_reader_init(&r);
  char *bodies[NSIZES];
  size_t total = 0;
  for (size_t i = 0; i < NSIZES; i++) {
    bodies[i] = pattern(sizes[i], (unsigned)i);
    CHECK_EQ_INT(wire_writer_push(&w, bodies[i], sizes[i], NULL, 0), 0);
    total += WIRE_HEADER + sizes[i];
  }
  CHECK_EQ_INT(wire_writer_bytes(&w), total);
  struct wire_frame frames[NSIZES];
  size_t got = 0;
  int rounds = 0;
  for (;;) {
    int fl = wire_writer_flush(&w, sv[0]);
    CHECK(fl == 0 || fl == 1);
    got += drain(&r, sv[1], frames + got, NSIZES - got);
    CHECK(r.cap <= WIRE_HEADER + WIRE_MAX_FRAME);
    if (fl == 0 && got == NSIZES) break;
    if (++rounds > 100000) break;
  }
  CHECK_EQ_INT(got, NSIZES);
  CHECK_EQ_INT(wire_writer_bytes(&w), 0);
  CHECK(!wire_reader_pending(&r));
  for (size_t i = 0; i < got; i++) {
    CHECK_EQ_INT(frames[i].len, sizes[i]);
    CHECK(memcmp(frames[i].json, bodies[i], sizes[i]) == 0);
    CHECK_EQ_INT(frames[i].json[sizes[i]], 0);
    CHECK_EQ_INT(frames[i].nfds, 0);
    wire_frame_clear(&frames[i]);
  }
  for (size_t i = 0; i < NSIZES; i++) free(bodies[i]);
  wire_writer_free(&w);
  wire_reader_free(&r);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

struct sender_job {
  int sock;
  const size_t *sizes;
  size_t n;
  int rc;
};

static void *sender_main(void *arg) {
  struct sender_job *j = arg;
  j->rc = 0;
  for (size_t i = 0; i < j->n && j->rc == 0; i++) {
    char *b = pattern(j->sizes[i], (unsigned)i);
    j->rc = wire_send_frame(j->sock, b, j->sizes[i], NULL, 0, NULL);
    free(b);
  }
  return NULL;
}

static void test_sizes_blocking(void) {
  FD_BEGIN;
  static const size_t bsizes[] = {1, 4, 5, 4096, 65536, 65537, 1u << 20, WIRE_MAX_FRAME};
  size_t n = sizeof bsizes / sizeof bsizes[0];
  int sv[2];
  make_pair(sv);
  struct sender_job job = {.sock = sv[0], .sizes = bsizes, .n = n};
  pthread_t t;
  pthread_create(&t, NULL, sender_main, &job);
  for (size_t i = 0; i < n; i++) {
    struct wire_frame f;
    struct wd_error err = {0};
    int rc = wire_recv_frame(sv[1], 20000, &f, &err);
    CHECK_EQ_INT(rc, 0);
    if (rc != 0) {
      fprintf(stderr, "  recv: %s\n", err.msg);
      break;
    }
    char *want = pattern(bsizes[i], (unsigned)i);
    CHECK_EQ_INT(f.len, bsizes[i]);
    CHECK(memcmp(f.json, want, bsizes[i]) == 0);
    free(want);
    wire_frame_clear(&f);
  }
  pthread_join(t, NULL);
  CHECK_EQ_INT(job.rc, 0);
  CHECK_EQ_INT(unread_bytes(sv[1]), 0);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

/* The exact bytes of the example in docs/protocol-framing.md. */
static void test_frame_bytes(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  const char *body = "{\"id\":1,\"op\":\"hello\",\"protocol\":1}";
  static const unsigned char want[] = {0x22, 0x00, 0x00, 0x00, '{', '"', 'i', 'd', '"', ':',
                                       '1',  ',',  '"',  'o',  'p', '"', ':', '"', 'h', 'e',
                                       'l',  'l',  'o',  '"',  ',', '"', 'p', 'r', 'o', 't',
                                       'o',  'c',  'o',  'l',  '"', ':', '1', '}'};
  CHECK_EQ_INT(wire_send_frame(sv[0], body, strlen(body), NULL, 0, NULL), 0);
  struct wire_writer w;
  wire_writer_init(&w);
  CHECK_EQ_INT(wire_writer_push(&w, body, strlen(body), NULL, 0), 0);
  CHECK_EQ_INT(wire_writer_bytes(&w), sizeof want);
  CHECK_EQ_INT(wire_writer_flush(&w, sv[0]), 0);
  unsigned char got[2 * sizeof want];
  ssize_t n = recv(sv[1], got, sizeof got, MSG_WAITALL);
  CHECK_EQ_INT(n, 2 * sizeof want);
  CHECK(memcmp(got, want, sizeof want) == 0);
  CHECK(memcmp(got + sizeof want, want, sizeof want) == 0);
  wire_writer_free(&w);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

/* ---- fragmentation and batching ----------------------------------------- */

static const char hello[] = "{\"op\":\"hello\",\"protocol\":1}";

static void test_one_byte_at_a_time(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  size_t blen = sizeof hello - 1, total = WIRE_HEADER + blen;
  unsigned char raw[64];
  le32(raw, (uint32_t)blen);
  memcpy(raw + WIRE_HEADER, hello, blen);
  int mfd = make_memfd();
  ino_t ino = ino_of(mfd);
  struct wire_reader r;
  wire_reader_init(&r);
  struct wire_frame f;
  for (size_t i = 0; i < total; i++) {
    if (i == 0)
      raw_send(sv[0], raw, 1, &mfd, 1);
    else
      raw_send(sv[0], raw + i, 1, NULL, 0);
    CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 1);
    int rc = wire_reader_next(&r, &f, NULL);
    if (i + 1 < total) {
      CHECK_EQ_INT(rc, 0);
      CHECK(wire_reader_pending(&r));
    } else {
      CHECK_EQ_INT(rc, 1);
    }
  }
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), WIRE_AGAIN);
  CHECK(!wire_reader_pending(&r));
  CHECK_EQ_INT(f.len, blen);
  CHECK(strcmp(f.json, hello) == 0);
  CHECK_EQ_INT(f.nfds, 1);
  CHECK(ino_of(f.fds[0]) == ino);
  CHECK(f.fds[0] != mfd);
  int fdflags = fcntl(f.fds[0], F_GETFD);
  CHECK(fdflags >= 0 && (fdflags & FD_CLOEXEC));
  wire_frame_clear(&f);
  CHECK(f.json == NULL && f.nfds == 0);
  wire_reader_free(&r);
  close(mfd);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

struct trickle_job {
  int sock, fd;
  const unsigned char *raw;
  size_t n;
};

static void *trickle_main(void *arg) {
  struct trickle_job *j = arg;
  for (size_t i = 0; i < j->n; i++) {
    if (i == 0)
      raw_send(j->sock, j->raw, 1, &j->fd, 1);
    else
      raw_send(j->sock, j->raw + i, 1, NULL, 0);
    usleep(500);
  }
  return NULL;
}

static void test_one_byte_at_a_time_blocking(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  size_t blen = sizeof hello - 1;
  unsigned char raw[64 + 8];
  le32(raw, (uint32_t)blen);
  memcpy(raw + WIRE_HEADER, hello, blen);
  /* A second frame follows; the blocking reader must leave it in the socket. */
  le32(raw + WIRE_HEADER + blen, 2);
  memcpy(raw + 2 * WIRE_HEADER + blen, "{}", 2);
  struct trickle_job job = {
      .sock = sv[0], .fd = make_memfd(), .raw = raw, .n = 2 * WIRE_HEADER + blen + 2};
  ino_t ino = ino_of(job.fd);
  pthread_t t;
  pthread_create(&t, NULL, trickle_main, &job);
  struct wire_frame f;
  struct wd_error err = {0};
  CHECK_EQ_INT(wire_recv_frame(sv[1], 10000, &f, &err), 0);
  CHECK(f.len == blen && strcmp(f.json, hello) == 0);
  CHECK_EQ_INT(f.nfds, 1);
  CHECK(f.nfds == 1 && ino_of(f.fds[0]) == ino);
  wire_frame_clear(&f);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 10000, &f, &err), 0);
  CHECK(f.len == 2 && strcmp(f.json, "{}") == 0);
  CHECK_EQ_INT(f.nfds, 0);
  wire_frame_clear(&f);
  pthread_join(t, NULL);
  close(job.fd);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

static void test_two_frames_one_write(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  unsigned char raw[64];
  le32(raw, 7);
  memcpy(raw + 4, "{\"a\":1}", 7);
  le32(raw + 11, 2);
  memcpy(raw + 15, "[]", 2);
  raw_send(sv[0], raw, 17, NULL, 0);
  raw_send(sv[0], raw, 17, NULL, 0);

  /* The daemon's reader takes both frames from one recvmsg. */
  struct wire_reader r;
  wire_reader_init(&r);
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 34);
  struct wire_frame f;
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 1);
  CHECK(f.len == 7 && memcmp(f.json, "{\"a\":1}", 8) == 0);
  wire_frame_clear(&f);
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 1);
  CHECK(f.len == 2 && strcmp(f.json, "[]") == 0);
  wire_frame_clear(&f);
  CHECK(wire_reader_pending(&r));
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 1);
  wire_frame_clear(&f);
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 1);
  wire_frame_clear(&f);
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 0);
  CHECK(!wire_reader_pending(&r));
  wire_reader_free(&r);

  /* The client's reader consumes exactly one frame per call. */
  raw_send(sv[0], raw, 17, NULL, 0);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, NULL), 0);
  CHECK(f.len == 7 && strcmp(f.json, "{\"a\":1}") == 0);
  wire_frame_clear(&f);
  CHECK_EQ_INT(unread_bytes(sv[1]), 6);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, NULL), 0);
  CHECK(f.len == 2 && strcmp(f.json, "[]") == 0);
  wire_frame_clear(&f);
  CHECK_EQ_INT(unread_bytes(sv[1]), 0);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

/* ---- where descriptors land --------------------------------------------- */

/*
 * Four frames; descriptors on the 2nd (a memfd and a pipe end), none on the
 * 1st and 3rd, one on the 4th, all queued before the reader reads anything.
 */
static void check_fd_frames(struct wire_frame *f, size_t n, ino_t m1, ino_t p0, ino_t m2) {
  CHECK_EQ_INT(n, 4);
  if (n != 4) return;
  CHECK_EQ_INT(f[0].nfds, 0);
  CHECK(f[0].len == 7 && strcmp(f[0].json, "{\"n\":1}") == 0);
  CHECK_EQ_INT(f[1].nfds, 2);
  CHECK(strcmp(f[1].json, "{\"n\":2}") == 0);
  CHECK(f[1].nfds == 2 && ino_of(f[1].fds[0]) == m1 && ino_of(f[1].fds[1]) == p0);
  CHECK_EQ_INT(f[2].nfds, 0);
  CHECK(strcmp(f[2].json, "{\"n\":3}") == 0);
  CHECK_EQ_INT(f[3].nfds, 1);
  CHECK(f[3].nfds == 1 && ino_of(f[3].fds[0]) == m2);
}

static void test_fds_land_on_their_frame(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  int m1 = make_memfd(), m2 = make_memfd(), pp[2];
  CHECK(pipe2(pp, O_CLOEXEC) == 0);
  ino_t im1 = ino_of(m1), im2 = ino_of(m2), ip0 = ino_of(pp[0]);
  struct wire_writer w;
  wire_writer_init(&w);
  int give2[2] = {dup(m1), dup(pp[0])}, give4[1] = {dup(m2)};
  CHECK_EQ_INT(wire_writer_push(&w, "{\"n\":1}", 7, NULL, 0), 0);
  CHECK_EQ_INT(wire_writer_push(&w, "{\"n\":2}", 7, give2, 2), 0);
  CHECK_EQ_INT(wire_writer_push(&w, "{\"n\":3}", 7, NULL, 0), 0);
  CHECK_EQ_INT(wire_writer_push(&w, "{\"n\":4}", 7, give4, 1), 0);
  CHECK_EQ_INT(wire_writer_flush(&w, sv[0]), 0);
  CHECK_EQ_INT(wire_writer_bytes(&w), 0);

  /*
   * The kernel returns frame 1's bytes together with frame 2's and its
   * descriptors in one recvmsg (unix(7): ancillary data is a barrier that
   * ends the read). Attributing them by the first byte read would be wrong.
   */
  struct wire_reader r;
  wire_reader_init(&r);
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 22);
  struct wire_frame f[8];
  size_t n = 0;
  while (n < 8 && wire_reader_next(&r, &f[n], NULL) == 1) n++;
  n += drain(&r, sv[1], f + n, 8 - n);
  check_fd_frames(f, n, im1, ip0, im2);
  for (size_t i = 0; i < n; i++) wire_frame_clear(&f[i]);
  wire_reader_free(&r);

  /* The same four frames through the blocking helpers. */
  CHECK_EQ_INT(wire_send_frame(sv[0], "{\"n\":1}", 7, NULL, 0, NULL), 0);
  int keep2[2] = {m1, pp[0]};
  CHECK_EQ_INT(wire_send_frame(sv[0], "{\"n\":2}", 7, keep2, 2, NULL), 0);
  CHECK_EQ_INT(wire_send_frame(sv[0], "{\"n\":3}", 7, NULL, 0, NULL), 0);
  CHECK_EQ_INT(wire_send_frame(sv[0], "{\"n\":4}", 7, &m2, 1, NULL), 0);
  for (n = 0; n < 4; n++) CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f[n], NULL), 0);
  check_fd_frames(f, n, im1, ip0, im2);
  for (size_t i = 0; i < n; i++) wire_frame_clear(&f[i]);

  /* A frame may take one descriptor and leave the rest to wire_frame_clear. */
  CHECK_EQ_INT(wire_send_frame(sv[0], "{\"n\":2}", 7, keep2, 2, NULL), 0);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f[0], NULL), 0);
  int kept = f[0].fds[0];
  f[0].fds[0] = -1;
  wire_frame_clear(&f[0]);
  CHECK(ino_of(kept) == im1);
  close(kept);

  close(m1);
  close(m2);
  close(pp[0]);
  close(pp[1]);
  wire_writer_free(&w);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

static void test_fd_limits(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  int m[40];
  ino_t ino[40];
  for (int i = 0; i < 40; i++) {
    m[i] = make_memfd();
    ino[i] = ino_of(m[i]);
  }
  struct wire_frame f;
  struct wd_error err = {0};

  /* 16 is the limit: all arrive, in order. */
  CHECK_EQ_INT(wire_send_frame(sv[0], "{}", 2, m, 16, &err), 0);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, &err), 0);
  CHECK_EQ_INT(f.nfds, 16);
  for (size_t i = 0; i < f.nfds; i++) CHECK(ino_of(f.fds[i]) == ino[i]);
  wire_frame_clear(&f);

  struct wire_writer w;
  wire_writer_init(&w);
  int d[17];
  for (int i = 0; i < 16; i++) d[i] = dup(m[i]);
  CHECK_EQ_INT(wire_writer_push(&w, "{}", 2, d, 16), 0);
  CHECK_EQ_INT(wire_writer_flush(&w, sv[0]), 0);
  struct wire_reader r;
  wire_reader_init(&r);
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 6);
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 1);
  CHECK_EQ_INT(f.nfds, 16);
  for (size_t i = 0; i < f.nfds; i++) CHECK(ino_of(f.fds[i]) == ino[i]);
  wire_frame_clear(&f);
  wire_reader_free(&r);

  /* 17 are refused before anything is sent; the writer closes what it was given. */
  CHECK_EQ_INT(wire_send_frame(sv[0], "{}", 2, m, 17, &err), WEIGHTD_E_LIMIT);
  CHECK_STR_CONTAINS(err.msg, "17 file descriptors");
  CHECK_EQ_INT(unread_bytes(sv[1]), 0);
  for (int i = 0; i < 17; i++) d[i] = dup(m[i]);
  int before = count_fds();
  CHECK_EQ_INT(wire_writer_push(&w, "{}", 2, d, 17), WEIGHTD_E_LIMIT);
  CHECK_EQ_INT(count_fds(), before - 17);
  CHECK_EQ_INT(wire_writer_bytes(&w), 0);

  /* A peer that sends 17 or 40 anyway is refused by both readers. */
  unsigned char raw[6];
  le32(raw, 2);
  memcpy(raw + 4, "{}", 2);
  static const size_t counts[] = {17, 40};
  for (size_t c = 0; c < 2; c++) {
    raw_send(sv[0], raw, 6, m, counts[c]);
    wire_reader_init(&r);
    int rc = wire_reader_fill(&r, sv[1]);
    if (rc > 0) rc = wire_reader_next(&r, &f, &err);
    CHECK_EQ_INT(rc, WEIGHTD_E_PROTOCOL);
    CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), WEIGHTD_E_PROTOCOL);
    wire_reader_free(&r);

    raw_send(sv[0], raw, 6, m, counts[c]);
    CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, &err), WEIGHTD_E_PROTOCOL);
    CHECK_STR_CONTAINS(err.msg, "file descriptors");
    /* Drain whatever of the refused frame the failing call left. */
    char sink[16];
    while (recv(sv[1], sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
  }

  for (int i = 0; i < 40; i++) close(m[i]);
  wire_writer_free(&w);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

static void test_fds_mid_frame_refused(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  int mfd = make_memfd();
  unsigned char raw[32];
  le32(raw, 16);
  memcpy(raw + 4, "{\"x\":\"abcdefgh\"}", 16);
  struct wd_error err = {0};
  struct wire_frame f;

  /* The daemon's reader sees the descriptors arrive 10 bytes into the frame. */
  struct wire_reader r;
  wire_reader_init(&r);
  raw_send(sv[0], raw, 10, NULL, 0);
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 10);
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 0);
  raw_send(sv[0], raw + 10, 10, &mfd, 1);
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 10);
  CHECK_EQ_INT(wire_reader_next(&r, &f, &err), WEIGHTD_E_PROTOCOL);
  CHECK_STR_CONTAINS(err.msg, "10 bytes into a frame");
  wire_reader_free(&r);

  /* The client's reader reads the prefix first, so it always notices. */
  raw_send(sv[0], raw, 10, NULL, 0);
  raw_send(sv[0], raw + 10, 10, &mfd, 1);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, &err), WEIGHTD_E_PROTOCOL);
  CHECK_STR_CONTAINS(err.msg, "into a frame");

  close(mfd);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

/* ---- bad prefixes, timeouts, end of stream ------------------------------ */

static void test_bad_prefix(void) {
  FD_BEGIN;
  static const uint32_t bad[] = {0, WIRE_MAX_FRAME + 1, 0xFFFFFFFFu};
  for (size_t i = 0; i < 3; i++) {
    int sv[2];
    make_pair(sv);
    unsigned char raw[4];
    le32(raw, bad[i]);
    struct wire_reader r;
    wire_reader_init(&r);
    struct wire_frame f;
    struct wd_error err = {0};
    /* Three bytes: not yet decidable. */
    raw_send(sv[0], raw, 3, NULL, 0);
    CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 3);
    CHECK_EQ_INT(wire_reader_next(&r, &f, &err), 0);
    /* The fourth byte decides, with no body buffered or allocated. */
    raw_send(sv[0], raw + 3, 1, NULL, 0);
    CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 1);
    CHECK_EQ_INT(wire_reader_next(&r, &f, &err), WEIGHTD_E_PROTOCOL);
    CHECK_STR_CONTAINS(err.msg, bad[i] == 0 ? "zero-length" : "exceeds the limit");
    CHECK(r.cap <= WIRE_READER_BUF);
    CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), WEIGHTD_E_PROTOCOL);
    CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), WEIGHTD_E_PROTOCOL);
    wire_reader_free(&r);

    raw_send(sv[0], raw, 4, NULL, 0);
    CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, &err), WEIGHTD_E_PROTOCOL);
    CHECK_STR_CONTAINS(err.msg, bad[i] == 0 ? "zero-length" : "exceeds the limit");
    close(sv[0]);
    close(sv[1]);
  }
  /* The largest legal prefix is accepted and waits for its body. */
  int sv[2];
  make_pair(sv);
  unsigned char raw[4];
  le32(raw, WIRE_MAX_FRAME);
  raw_send(sv[0], raw, 4, NULL, 0);
  struct wire_reader r;
  wire_reader_init(&r);
  struct wire_frame f;
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 4);
  CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 0);
  CHECK(wire_reader_pending(&r));
  wire_reader_free(&r);
  close(sv[0]);
  close(sv[1]);

  /* Outgoing limits. */
  struct wd_error err = {0};
  CHECK_EQ_INT(wire_send_frame(-1, "", 0, NULL, 0, &err), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(wire_send_frame(-1, "x", WIRE_MAX_FRAME + 1, NULL, 0, &err), WEIGHTD_E_LIMIT);
  struct wire_writer w;
  wire_writer_init(&w);
  CHECK_EQ_INT(wire_writer_push(&w, "", 0, NULL, 0), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(wire_writer_push(&w, "x", WIRE_MAX_FRAME + 1, NULL, 0), WEIGHTD_E_LIMIT);
  wire_writer_free(&w);
  FD_END;
}

static void test_recv_timeout(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  struct wire_frame f;
  struct wd_error err = {0};
  double t0 = now_s();
  CHECK_EQ_INT(wire_recv_frame(sv[1], 100, &f, &err), WEIGHTD_E_TIMEOUT);
  double dt = now_s() - t0;
  CHECK(dt >= 0.095 && dt < 5.0);
  CHECK(f.json == NULL && f.nfds == 0);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 0, &f, &err), WEIGHTD_E_TIMEOUT);
  /* Nothing was consumed: the connection is still in step. */
  CHECK_EQ_INT(wire_send_frame(sv[0], "{}", 2, NULL, 0, &err), 0);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 0, &f, &err), 0);
  CHECK(f.len == 2 && strcmp(f.json, "{}") == 0);
  wire_frame_clear(&f);

  close(sv[0]);
  close(sv[1]);
  FD_END;
}

struct late_job {
  int sock;
  const unsigned char *raw;
  size_t n;
};

/* Sends the rest of a frame once the reader's 1 ms timeout has long passed. */
static void *late_main(void *p) {
  struct late_job *j = p;
  usleep(200 * 1000);
  raw_send(j->sock, j->raw, j->n, NULL, 0);
  return NULL;
}

/*
 * The timeout bounds the wait for a frame's first byte only: a frame that has
 * begun is finished even when its bytes come after the timeout (a 1 ms
 * timeout, as a cancel sets, must not put the stream out of step). A frame
 * that stalls past the finishing bound is a protocol error.
 */
static void test_recv_timeout_inside_frame(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  unsigned char raw[16];
  le32(raw, 8);
  memcpy(raw + 4, "{\"a\":12}", 8);
  raw_send(sv[0], raw, 6, NULL, 0);
  struct late_job job = {.sock = sv[0], .raw = raw + 6, .n = 6};
  pthread_t t;
  pthread_create(&t, NULL, late_main, &job);
  struct wire_frame f;
  struct wd_error err = {0};
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1, &f, &err), 0);
  CHECK(f.len == 8 && f.json != NULL && strcmp(f.json, "{\"a\":12}") == 0);
  wire_frame_clear(&f);
  pthread_join(t, NULL);
  /* In step: the next frame is read whole, and an absent one is a plain timeout. */
  CHECK_EQ_INT(wire_send_frame(sv[0], "{}", 2, NULL, 0, &err), 0);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1, &f, &err), 0);
  CHECK(f.len == 2 && strcmp(f.json, "{}") == 0);
  wire_frame_clear(&f);
  CHECK_EQ_INT(wire_recv_frame(sv[1], 1, &f, &err), WEIGHTD_E_TIMEOUT);

  /* A frame that stops halfway past the finishing bound is a protocol error, not a retryable timeout. */
  raw_send(sv[0], raw, 6, NULL, 0);
  CHECK_EQ_INT(wire_recv_frame_bounded(sv[1], 1, 50, &f, &err), WEIGHTD_E_PROTOCOL);
  CHECK_STR_CONTAINS(err.msg, "stalled inside a frame after 6 bytes");
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

static void test_eof(void) {
  FD_BEGIN;
  unsigned char raw[32];
  le32(raw, 16);
  memcpy(raw + 4, "{\"x\":\"abcdefgh\"}", 16);
  static const size_t cut[] = {0, 2, 4, 12};
  for (size_t c = 0; c < 4; c++) {
    int sv[2];
    make_pair(sv);
    int mfd = make_memfd();
    if (cut[c] > 0) raw_send(sv[0], raw, cut[c], &mfd, 1);
    shutdown(sv[0], SHUT_WR);
    struct wire_reader r;
    wire_reader_init(&r);
    struct wire_frame f;
    if (cut[c] > 0) CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), (int)cut[c]);
    CHECK_EQ_INT(wire_reader_next(&r, &f, NULL), 0);
    CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), 0);
    CHECK(wire_reader_pending(&r) == (cut[c] > 0));
    wire_reader_free(&r); /* closes the descriptor of the unfinished frame */
    close(sv[0]);
    close(sv[1]);

    make_pair(sv);
    if (cut[c] > 0) raw_send(sv[0], raw, cut[c], &mfd, 1);
    close(sv[0]);
    struct wd_error err = {0};
    CHECK_EQ_INT(wire_recv_frame(sv[1], 1000, &f, &err), WEIGHTD_E_CLOSED);
    CHECK_STR_CONTAINS(err.msg, cut[c] == 0 ? "closed by the peer" : "inside a frame");
    close(sv[1]);
    close(mfd);
  }
  FD_END;
}

static void test_writer_peer_gone(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  close(sv[1]);
  struct wire_writer w;
  wire_writer_init(&w);
  int d = make_memfd();
  CHECK_EQ_INT(wire_writer_push(&w, "{}", 2, &d, 1), 0);
  /* MSG_NOSIGNAL: a SIGPIPE would end this process here. */
  CHECK_EQ_INT(wire_writer_flush(&w, sv[0]), WEIGHTD_E_CLOSED);
  CHECK_EQ_INT(wire_send_frame(sv[0], "{}", 2, NULL, 0, NULL), WEIGHTD_E_CLOSED);
  wire_writer_free(&w); /* closes the memfd it still owns */
  close(sv[0]);
  FD_END;
}

/* ---- a slow reader ------------------------------------------------------ */

#define BIG (4u << 20)

/*
 * Queues frames mixing large and small bodies with and without descriptors
 * behind a tiny send buffer, so every frame goes out in many partial writes
 * and descriptor frames start in the middle of a flush.
 */
struct mix {
  size_t len;
  int with_fd;
};
static const struct mix mixes[] = {{BIG, 1}, {1000, 0}, {5, 1}, {BIG - 17, 0}, {70000, 1}, {3, 0}};
#define NMIX (sizeof mixes / sizeof mixes[0])

static void push_mix(struct wire_writer *w, char **bodies, int *mf, ino_t *ino) {
  for (size_t i = 0; i < NMIX; i++) {
    bodies[i] = pattern(mixes[i].len, (unsigned)i + 100);
    if (mixes[i].with_fd) {
      mf[i] = make_memfd();
      ino[i] = ino_of(mf[i]);
      int give = dup(mf[i]);
      CHECK_EQ_INT(wire_writer_push(w, bodies[i], mixes[i].len, &give, 1), 0);
    } else {
      mf[i] = -1;
      CHECK_EQ_INT(wire_writer_push(w, bodies[i], mixes[i].len, NULL, 0), 0);
    }
  }
}

static void check_mix(struct wire_frame *f, size_t n, char **bodies, const ino_t *ino) {
  CHECK_EQ_INT(n, NMIX);
  for (size_t i = 0; i < n && i < NMIX; i++) {
    CHECK_EQ_INT(f[i].len, mixes[i].len);
    CHECK(f[i].len == mixes[i].len && memcmp(f[i].json, bodies[i], f[i].len) == 0);
    CHECK_EQ_INT(f[i].nfds, mixes[i].with_fd ? 1 : 0);
    if (mixes[i].with_fd && f[i].nfds == 1) CHECK(ino_of(f[i].fds[0]) == ino[i]);
  }
}

static void small_sndbuf(int sock) {
  int sz = 4096;
  CHECK(setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz) == 0);
}

static void test_writer_tiny_sndbuf(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  small_sndbuf(sv[0]);
  struct wire_writer w;
  wire_writer_init(&w);
  struct wire_reader r;
  wire_reader_init(&r);
  char *bodies[NMIX];
  int mf[NMIX];
  ino_t ino[NMIX];
  push_mix(&w, bodies, mf, ino);
  struct wire_frame f[NMIX + 1];
  size_t n = 0;
  int flushes = 0, rc;
  size_t last_bytes = wire_writer_bytes(&w);
  while ((rc = wire_writer_flush(&w, sv[0])) == 1) {
    flushes++;
    CHECK(wire_writer_bytes(&w) <= last_bytes);
    last_bytes = wire_writer_bytes(&w);
    n += drain(&r, sv[1], f + n, NMIX + 1 - n);
    CHECK(r.cap <= WIRE_HEADER + WIRE_MAX_FRAME);
    if (flushes > 1000000) break;
  }
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(wire_writer_bytes(&w), 0);
  n += drain(&r, sv[1], f + n, NMIX + 1 - n);
  CHECK(flushes > 100);
  check_mix(f, n, bodies, ino);
  /* The big buffer is given back once it empties. */
  CHECK_EQ_INT(wire_reader_fill(&r, sv[1]), WIRE_AGAIN);
  CHECK(r.cap <= WIRE_READER_BUF);
  for (size_t i = 0; i < n; i++) wire_frame_clear(&f[i]);
  for (size_t i = 0; i < NMIX; i++) {
    free(bodies[i]);
    if (mf[i] >= 0) close(mf[i]);
  }
  wire_writer_free(&w);
  wire_reader_free(&r);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

struct reader_job {
  int sock;
  struct wire_frame f[NMIX];
  size_t n;
  int rc;
};

static void *reader_main(void *arg) {
  struct reader_job *j = arg;
  j->n = 0;
  j->rc = 0;
  while (j->n < NMIX) {
    j->rc = wire_recv_frame(j->sock, 20000, &j->f[j->n], NULL);
    if (j->rc != 0) break;
    j->n++;
  }
  return NULL;
}

static void test_writer_tiny_sndbuf_threaded(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  small_sndbuf(sv[0]);
  set_nonblock(sv[0]);
  struct wire_writer w;
  wire_writer_init(&w);
  char *bodies[NMIX];
  int mf[NMIX];
  ino_t ino[NMIX];
  push_mix(&w, bodies, mf, ino);
  struct reader_job job = {.sock = sv[1]};
  pthread_t t;
  pthread_create(&t, NULL, reader_main, &job);
  int rc, flushes = 0;
  while ((rc = wire_writer_flush(&w, sv[0])) == 1) {
    flushes++;
    struct pollfd p = {.fd = sv[0], .events = POLLOUT};
    poll(&p, 1, 5000);
  }
  CHECK_EQ_INT(rc, 0);
  pthread_join(t, NULL);
  CHECK_EQ_INT(job.rc, 0);
  CHECK(flushes > 100);
  check_mix(job.f, job.n, bodies, ino);
  for (size_t i = 0; i < job.n; i++) wire_frame_clear(&job.f[i]);
  for (size_t i = 0; i < NMIX; i++) {
    free(bodies[i]);
    if (mf[i] >= 0) close(mf[i]);
  }
  wire_writer_free(&w);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

static void test_reader_full_of_frames(void) {
  FD_BEGIN;
  int sv[2];
  make_pair(sv);
  /* Small frames read without draining them: the buffer fills up. */
  unsigned char raw[6 * 100];
  for (int i = 0; i < 100; i++) {
    le32(raw + 6 * i, 2);
    memcpy(raw + 6 * i + 4, "{}", 2);
  }
  struct wire_reader r;
  wire_reader_init(&r);
  int rc = 0;
  size_t sent = 0, got = 0;
  for (int round = 0; round < 200; round++) {
    raw_send(sv[0], raw, sizeof raw, NULL, 0);
    sent += 100;
    while ((rc = wire_reader_fill(&r, sv[1])) > 0) {
    }
    if (rc == WEIGHTD_E_BUSY) break;
  }
  CHECK_EQ_INT(rc, WEIGHTD_E_BUSY);
  CHECK_STR_CONTAINS(r.err.msg, "buffer full");
  CHECK(r.cap <= WIRE_READER_BUF);
  /* Draining makes room again and every frame arrives. */
  struct wire_frame f;
  for (;;) {
    while (wire_reader_next(&r, &f, NULL) == 1) {
      CHECK(f.len == 2 && strcmp(f.json, "{}") == 0);
      wire_frame_clear(&f);
      got++;
    }
    rc = wire_reader_fill(&r, sv[1]);
    if (rc <= 0) break;
  }
  CHECK_EQ_INT(rc, WIRE_AGAIN);
  CHECK_EQ_INT(got, sent);
  wire_reader_free(&r);
  close(sv[0]);
  close(sv[1]);
  FD_END;
}

int main(void) {
  RUN(test_sizes_writer_reader);
  RUN(test_sizes_blocking);
  RUN(test_frame_bytes);
  RUN(test_one_byte_at_a_time);
  RUN(test_one_byte_at_a_time_blocking);
  RUN(test_two_frames_one_write);
  RUN(test_fds_land_on_their_frame);
  RUN(test_fd_limits);
  RUN(test_fds_mid_frame_refused);
  RUN(test_bad_prefix);
  RUN(test_recv_timeout);
  RUN(test_recv_timeout_inside_frame);
  RUN(test_eof);
  RUN(test_writer_peer_gone);
  RUN(test_writer_tiny_sndbuf);
  RUN(test_writer_tiny_sndbuf_threaded);
  RUN(test_reader_full_of_frames);
  return tu_finish();
}
