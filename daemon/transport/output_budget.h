/*
 * output_budget.h - the rules for reply bytes queued for clients that do not
 * read, at three levels: one connection (max_queued_output, and
 * max_queued_fds for descriptors), one uid's connections together
 * (max_uid_queued_output, from which root and the daemon's uid are exempt)
 * and the daemon's (max_total_queued_output); and the table of uids that
 * counts the second level.
 *
 * The same three steps hold at every level: past half of a limit a
 * connection's requests are not read (for the uid and the total only while
 * the connection itself has replies waiting unsent, so that one that reads
 * goes on); a reply that would pass a limit is answered LIMIT; past that,
 * connections are closed. At the total the last step comes first: a reply
 * that does not fit closes the connections holding more unread bytes than
 * its own, largest first (server_send.c), and only when that cannot make
 * room is it answered LIMIT. So the total never passes its limit, and a
 * client that reads its replies, holding little, is never the one closed
 * while a larger holder is open.
 *
 * DESIGN: pure (figures in, verdicts out; no socket, no loop) so that the
 * rules are tested on their own (tests/test_output_budget.c); server_send.c
 * applies them. Loop thread only.
 */
#ifndef WD_OUTPUT_BUDGET_H
#define WD_OUTPUT_BUDGET_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/config.h"

/* What one connection's replies count against, now. */
struct ob_held {
  uint64_t conn;     /* the connection's reply bytes waiting unsent */
  uint64_t conn_fds; /* the descriptors in them */
  uint64_t uid;      /* its uid's connections' together */
  uint64_t total;    /* every connection's */
};

/* The uid limit of a connection of root or the daemon's uid. */
#define OB_EXEMPT UINT64_MAX

/* The limits that apply to one connection. */
struct ob_limits {
  uint64_t frame; /* the largest frame (WIRE_MAX_FRAME) */
  uint64_t conn;  /* max_queued_output */
  uint64_t fds;   /* max_queued_fds */
  uint64_t uid;   /* max_uid_queued_output (or its default), OB_EXEMPT for root and the daemon's uid */
  uint64_t total; /* max_total_queued_output */
};

/* Which limit a reply breaks; the names are those of the LIMIT answers and the log. */
enum ob_level { OB_NONE, OB_FRAME, OB_CONN, OB_FDS, OB_UID, OB_TOTAL };

/* The limits cfg sets for a connection, of an exempt uid (root, the daemon's) or not. */
struct ob_limits ob_limits_of(const struct wd_config *cfg, uint64_t frame, bool exempt);

/* A uid's share as configured: max_uid_queued_output, or when that is 0 a quarter of the total. */
uint64_t ob_uid_share(const struct wd_config *cfg);

/*
 * Whether a connection holding h is not read now: past half of its own
 * limits; or, while it has replies waiting unsent, past half of its uid's
 * share or of the total.
 */
bool ob_backlogged(const struct ob_held *h, const struct ob_limits *l);

/*
 * The first limit a final reply of len bytes with nfds descriptors breaks:
 * the frame limit, the connection's bytes, its descriptors, its uid's share,
 * or the total when the connection's own unsent replies and this one would
 * pass it (closing others could not make room). OB_NONE: it may be queued
 * once the total has room for it (room is made by closing larger holders).
 */
enum ob_level ob_reply_breaks(const struct ob_held *h, const struct ob_limits *l, uint64_t len, uint64_t nfds);

/*
 * For a LIMIT answer of len bytes, which goes in a reply's place: OB_CONN
 * when it would pass twice the connection's limit (the connection is
 * closed), OB_UID when twice its uid's share (the uid's largest holders are
 * closed first), else OB_NONE (room in the total is made as for a reply).
 */
enum ob_level ob_answer_breaks(const struct ob_held *h, const struct ob_limits *l, uint64_t len);

/*
 * Whether an event of len bytes is dropped: events can be lost, so one is
 * never worth room; it is dropped when the connection is backlogged, or
 * when it would pass the frame limit, the connection's limit, its uid's
 * share or the total.
 */
bool ob_event_dropped(const struct ob_held *h, const struct ob_limits *l, uint64_t len);

/*
 * Whether room for len more bytes can be made within limit, where held
 * bytes are queued in the scope (a uid's connections, or all) and larger
 * of them are held by connections holding more than the one that asks:
 * only those may be closed for it.
 */
static inline bool ob_room_possible(uint64_t held, uint64_t larger, uint64_t len, uint64_t limit) {
  return held - larger <= limit && len <= limit - (held - larger);
}

/* Whether a connection holding held goes before the best candidate so far (best) when room is made for one holding self. */
static inline bool ob_closes_before(uint64_t held, uint64_t self, uint64_t best) { return held > self && held > best; }

/* ---- the uid table ---------------------------------------------------------------- */

/*
 * One uid's connections, counted together. The table is a list: it holds
 * one entry per uid that has a connection open, and is searched only when a
 * connection is accepted.
 */
struct ob_uid {
  uid_t uid;
  uint64_t bytes; /* reply bytes waiting unsent on its connections */
  unsigned conns; /* its connections: references to this entry */
  struct ob_uid *next;
};

/* The entry of uid in *list, created when there is none; a reference for one connection. NULL: out of memory. */
struct ob_uid *ob_uid_ref(struct ob_uid **list, uid_t uid);
/* Drops a connection's reference; the entry is freed with its last. NULL-safe. */
void ob_uid_unref(struct ob_uid **list, struct ob_uid *u);

#endif
