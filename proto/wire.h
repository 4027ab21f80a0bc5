/*
 * wire.h - framing and file-descriptor passing on the daemon's Unix stream socket.
 *
 * A frame is a 4-byte little-endian length L followed by L bytes of UTF-8
 * JSON, 1 <= L <= WIRE_MAX_FRAME. A frame may carry up to WIRE_MAX_FDS file
 * descriptors as SCM_RIGHTS ancillary data.
 *
 * Where the descriptors travel. A sender attaches a frame's descriptors to
 * the sendmsg() that starts at the frame's first byte (its length prefix),
 * and that sendmsg() carries no byte of any other frame. If the kernel takes
 * only part of the frame, the rest follows without descriptors.
 *
 * How the receiver attributes them. On a Linux stream socket the descriptors
 * sent with a sendmsg() are attached to that call's first buffer, and a
 * recvmsg() that reaches such a buffer may already hold bytes that carried no
 * descriptors (unix(7): "ancillary data forms a kind of barrier"). The call
 * then returns those bytes with the descriptors and stops at the end of the
 * buffer that carried them, or sooner when the caller's space runs out. So
 * the *last* byte a recvmsg() returns lies in the buffer that carried the
 * descriptors and therefore in their frame; the first byte may belong to an
 * earlier frame. Both readers below attribute descriptors to the frame that
 * holds the last byte returned with them, and refuse descriptors that arrive
 * with a recvmsg() that started after their frame's first byte (a peer that
 * attached them in the middle of a frame).
 *
 * Two readers: the daemon's nonblocking struct wire_reader, which reads as
 * much as it has room for and can hold several frames; and the client's
 * blocking wire_recv_frame(), which keeps no state between calls and never
 * asks the kernel for a byte beyond the frame it is reading, so whatever
 * follows (and the descriptors of the next frame) stays in the socket.
 */
#ifndef WD_WIRE_H
#define WD_WIRE_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

/* The protocol version a "hello" exchange carries is WEIGHTD_PROTOCOL_VERSION (weightd.h). */
/* The largest frame body in bytes; a longer length prefix is a protocol error. */
#define WIRE_MAX_FRAME (16u * 1024u * 1024u)
/* Bytes of the length prefix. */
#define WIRE_HEADER 4u
/* The most file descriptors one frame may carry. */
#define WIRE_MAX_FDS 16
/*
 * wire_reader_fill's "nothing to read now": a value outside the error table
 * (which wire.c asserts), so that it can never be mistaken for a failure.
 */
#define WIRE_AGAIN (-1000)

/*
 * Whether a request's "path" names a checkpoint by URL (s3://, http://,
 * https://, the scheme in any case) rather than a file: clients send a URL
 * as it is (a path they make absolute), and the daemon fetches it from its
 * remote roots.
 */
static inline bool wire_path_is_url(const char *path) {
  static const char *const schemes[] = {"s3://", "http://", "https://"};
  for (size_t i = 0; i < sizeof schemes / sizeof *schemes; i++) {
    size_t k = 0;
    while (schemes[i][k] != '\0' && path[k] != '\0' &&
           (path[k] == schemes[i][k] || (path[k] >= 'A' && path[k] <= 'Z' && path[k] - 'A' + 'a' == schemes[i][k])))
      k++;
    if (schemes[i][k] == '\0') return true;
  }
  return false;
}

/* One received frame: a NUL-terminated copy of the body and its descriptors. */
struct wire_frame {
  char *json; /* len bytes plus a terminating NUL (the body itself may hold NULs) */
  size_t len;
  int fds[WIRE_MAX_FDS]; /* a caller that keeps one sets its slot to -1 */
  size_t nfds;
};

/* Frees the body and closes every descriptor that is not -1. Safe on a zeroed frame. */
void wire_frame_clear(struct wire_frame *f);

/* ---- the daemon's nonblocking reader ---------------------------------- */

/* A received descriptor and the stream offsets of the recvmsg() it came with. */
struct wire_fd_rec {
  int fd;
  uint64_t first; /* offset of the first byte that recvmsg() returned */
  uint64_t last;  /* offset of the last byte that recvmsg() returned */
};

/*
 * Buffers the stream and splits it into frames. Memory is bounded: the buffer
 * never exceeds WIRE_HEADER + WIRE_MAX_FRAME bytes, grows only to hold the
 * frame being assembled, shrinks back to WIRE_READER_BUF in the first fill
 * after that frame is taken, and at most WIRE_READER_MAX_FDS descriptors wait in it.
 * Zero it (or call wire_reader_init) before use.
 */
struct wire_reader {
  char *buf;
  size_t cap;              /* allocated bytes */
  size_t start;            /* first unconsumed byte in buf */
  size_t end;              /* one past the last buffered byte */
  uint64_t base;           /* stream offset of buf[0] */
  struct wire_fd_rec *fds; /* received descriptors not yet given to a frame, in order */
  size_t nfds, fds_cap;
  int failed;          /* a sticky protocol error, or 0 */
  struct wd_error err; /* detail for the last error fill or next returned */
  uint32_t max_frame;  /* the largest frame accepted; 0 means WIRE_MAX_FRAME */
};

/* The reader's buffer size while no frame larger than it is being assembled. */
#define WIRE_READER_BUF (16u * 1024u)
/* Descriptors that may wait in a reader before wire_reader_fill refuses more. */
#define WIRE_READER_MAX_FDS (4 * WIRE_MAX_FDS)

/* Initializes an empty reader (equivalent to zeroing it). */
void wire_reader_init(struct wire_reader *r);

/*
 * Does one nonblocking recvmsg() on sock into the buffer. Returns the number
 * of bytes read (> 0), 0 at end of stream, WIRE_AGAIN when nothing is ready,
 * or a negative WEIGHTD_E code with detail in r->err: WEIGHTD_E_PROTOCOL for
 * descriptors that did not fit (MSG_CTRUNC: the ones that arrived are closed)
 * or too many descriptors waiting, WEIGHTD_E_BUSY when the buffer is full of
 * complete frames (drain them with wire_reader_next first), WEIGHTD_E_NOMEM,
 * WEIGHTD_E_CLOSED (connection reset) or WEIGHTD_E_IO. Call wire_reader_next
 * until it returns 0 after every successful fill.
 */
int wire_reader_fill(struct wire_reader *r, int sock);

/*
 * Takes the next complete frame out of the buffer. Returns 1 and fills out
 * (which the caller clears with wire_frame_clear), 0 when more bytes are
 * needed, or WEIGHTD_E_PROTOCOL (sticky: every later call returns it too) for
 * a zero or oversized length prefix, which is reported as soon as the four
 * prefix bytes are in, for more than WIRE_MAX_FDS descriptors, or for
 * descriptors attached in the middle of a frame. WEIGHTD_E_NOMEM when the
 * copy cannot be allocated. Detail goes to err (when not NULL) and r->err.
 */
int wire_reader_next(struct wire_reader *r, struct wire_frame *out, struct wd_error *err);

/* True when bytes of an incomplete frame are buffered. */
bool wire_reader_pending(const struct wire_reader *r);

/* The declared length of the next frame once its prefix is in, else 0. */
uint32_t wire_reader_next_len(const struct wire_reader *r);

/* Frees the buffer and closes every descriptor no frame took. */
void wire_reader_free(struct wire_reader *r);

/* ---- the daemon's nonblocking writer ---------------------------------- */

struct wire_out;

/* A queue of outgoing frames. Zero it (or call wire_writer_init) before use. */
struct wire_writer {
  struct wire_out *head, *tail;
  size_t bytes; /* unsent bytes, prefixes included */
  size_t frames;
  size_t fds;   /* descriptors held for frames not yet sent */
};

/* Initializes an empty writer (equivalent to zeroing it). */
void wire_writer_init(struct wire_writer *w);

/*
 * Queues one frame: copies json[0..len) behind its length prefix and takes
 * ownership of fds[0..nfds), which are closed once sent or when the writer is
 * freed. Ownership passes even when the call fails: the descriptors are then
 * closed at once. Returns 0, WEIGHTD_E_INVALID for len 0, WEIGHTD_E_LIMIT for
 * len > WIRE_MAX_FRAME or nfds > WIRE_MAX_FDS, or WEIGHTD_E_NOMEM.
 */
int wire_writer_push(struct wire_writer *w, const char *json, size_t len, const int *fds,
                     size_t nfds);

/*
 * Sends as much of the queue as sock takes without blocking. Returns 0 when
 * the queue is empty, 1 when bytes remain (wait for POLLOUT and call again),
 * WEIGHTD_E_CLOSED when the peer is gone (no SIGPIPE is raised), WEIGHTD_E_LIMIT
 * when the kernel refuses more descriptors in flight, or WEIGHTD_E_IO.
 */
int wire_writer_flush(struct wire_writer *w, int sock);

/* Bytes queued and not yet sent. */
size_t wire_writer_bytes(const struct wire_writer *w);

/* Descriptors queued with frames not yet sent. */
size_t wire_writer_fds(const struct wire_writer *w);

/* Frees the queue and closes the descriptors of frames that were not sent. */
void wire_writer_free(struct wire_writer *w);

/* ---- blocking helpers for the client library -------------------------- */

/*
 * Sends one frame, waiting (poll) while the socket is full; sock may be
 * blocking or not. The descriptors stay the caller's (they are duplicated in
 * flight by the kernel). Returns 0, WEIGHTD_E_INVALID / WEIGHTD_E_LIMIT for a
 * frame that breaks the limits (nothing is sent), WEIGHTD_E_CLOSED when the
 * peer is gone, or WEIGHTD_E_IO.
 */
int wire_send_frame(int sock, const char *json, size_t len, const int *fds, size_t nfds,
                    struct wd_error *err);

/*
 * How long a frame that has begun may take to finish, from its first byte,
 * when the caller's timeout is shorter (wire_recv_frame).
 */
#define WIRE_FINISH_MS 30000

/*
 * Receives exactly one frame, reading no byte beyond it. timeout_ms bounds
 * the wait for the frame's first byte (-1: wait forever). A frame that has
 * begun is finished, however short timeout_ms was: its remaining bytes may
 * take max(timeout_ms, WIRE_FINISH_MS) from its first byte (no bound when
 * timeout_ms is -1), so a timeout, even 1 ms, never leaves half a frame in
 * the socket. Returns 0 and fills out (clear it with wire_frame_clear),
 * WEIGHTD_E_TIMEOUT when no byte arrived in time (nothing was consumed: the
 * connection stays usable), WEIGHTD_E_CLOSED at end of stream (before or
 * inside a frame), WEIGHTD_E_PROTOCOL for a bad prefix, bad descriptors or a
 * frame that stalled past the finishing bound, or WEIGHTD_E_IO /
 * WEIGHTD_E_NOMEM. After any error but WEIGHTD_E_TIMEOUT the stream is out
 * of step and the connection must be closed.
 */
int wire_recv_frame(int sock, int timeout_ms, struct wire_frame *out, struct wd_error *err);

/* wire_recv_frame with finish_ms in place of WIRE_FINISH_MS (the tests use a short one). */
int wire_recv_frame_bounded(int sock, int timeout_ms, int finish_ms, struct wire_frame *out, struct wd_error *err);

#endif
