/*
 * msg.h - the message catalogue: ops, request parsing, reply builders.
 *
 * A request is one JSON object per frame:
 *   {"op": "load", "id": 7, ...op fields...}
 * "op" names an entry of MSG_OP_MAP. "id" is optional, a string of at most
 * MSG_ID_MAX bytes or an integer of magnitude below 2^53; every reply and
 * event for the request echoes it. Replies are
 *   {"id": 7, "ok": true, ...result fields...}
 *   {"id": 7, "error": {"code": "BAD_REQUEST", "message": "..."}}
 * and a long operation may send events before its reply:
 *   {"id": 7, "event": "progress", "bytes_done": N, "bytes_total": M}
 * A request without "id" gets replies without one.
 *
 * Parsing is strict before cJSON sees the text: the frame must be UTF-8 and
 * RFC 8259 JSON (json_strict), with no duplicate member names and no NUL
 * character (\u0000) in any string, since cJSON would silently cut such a
 * string short. The accessors then read typed fields and name the field in
 * every error ("field 'plan.tp_rank' must be ...").
 */
#ifndef WD_MSG_H
#define WD_MSG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "error.h"

/*
 * Rules an op follows, checked where requests are read (server) and
 * dispatched (ops), never by name:
 *   MSG_OPF_BEFORE_HELLO    may be the first request of a connection
 *   MSG_OPF_WHILE_STOPPING  still served while the daemon shuts down
 *   MSG_OPF_PRIVILEGED      root or the daemon's own uid only
 *   MSG_OPF_SKIPS_QUEUE     served at once, ahead of the connection's queue
 *   MSG_OPF_EVENTS          may send events (progress) before its reply
 *   MSG_OPF_FDS_IN          its request may carry file descriptors
 *   MSG_OPF_FDS_OUT         its reply may carry file descriptors
 */
#define MSG_OPF_BEFORE_HELLO (1u << 0)
#define MSG_OPF_WHILE_STOPPING (1u << 1)
#define MSG_OPF_PRIVILEGED (1u << 2)
#define MSG_OPF_SKIPS_QUEUE (1u << 3)
#define MSG_OPF_EVENTS (1u << 4)
#define MSG_OPF_FDS_IN (1u << 5)
#define MSG_OPF_FDS_OUT (1u << 6)

/* The ops: XX(ENUM, "wire name", flags, "what it does"). */
#define MSG_OP_MAP(XX)                                                                              \
  XX(HELLO, "hello", MSG_OPF_BEFORE_HELLO, "agree on the protocol version")                         \
  XX(OPEN, "open", 0, "validate and map a checkpoint directory")                                    \
  XX(CLOSE, "close", 0, "drop a checkpoint the daemon keeps open")                                  \
  XX(PREFETCH, "prefetch", MSG_OPF_EVENTS, "warm a checkpoint's pages in the page cache")           \
  XX(LOAD, "load", MSG_OPF_EVENTS, "load one rank's tensors into device memory")                    \
  XX(CANCEL, "cancel", MSG_OPF_SKIPS_QUEUE, "cancel a request: this connection's by id, any by daemon-wide id") \
  XX(ATTACH, "attach", MSG_OPF_EVENTS | MSG_OPF_FDS_OUT, "lease a resident set and receive its handles") \
  XX(RELEASE, "release", 0, "end a lease")                                                          \
  XX(EVICT, "evict", 0, "free an unleased resident set")                                            \
  XX(STATUS, "status", MSG_OPF_WHILE_STOPPING, "report checkpoints, resident sets and leases")      \
  XX(SHUTDOWN, "shutdown", MSG_OPF_PRIVILEGED, "stop the daemon")                                   \
  XX(HEALTH, "health", MSG_OPF_WHILE_STOPPING, "say whether the daemon is ready to serve (as /readyz)")    \
  XX(LOAD_GROUP, "load_group", MSG_OPF_EVENTS, "load every rank of a tensor/expert-parallel group, each onto its device") \
  XX(RECLAIM, "reclaim", 0, "take back a lease granted before a daemon restart (same uid and pid)")         \
  XX(SCRUB, "scrub", 0, "hash a resident set's tensors again and name those changed since it was loaded")

enum msg_op {
  MSG_OP_UNKNOWN = -1,
#define MSG_XX_(e, name, flags, help) MSG_OP_##e,
  MSG_OP_MAP(MSG_XX_)
#undef MSG_XX_
  MSG_OP_COUNT
};

/* The op called name, or MSG_OP_UNKNOWN. */
enum msg_op msg_op_from_name(const char *name);
/* The wire name of op, or NULL outside the catalogue. */
const char *msg_op_name(enum msg_op op);
/* The MSG_OPF_* rules of op (0 outside the catalogue). */
unsigned msg_op_flags(enum msg_op op);

/* The longest string id, in bytes. */
#define MSG_ID_MAX 128
/* The largest integer read from or echoed into JSON: 2^53 - 1, exact in a double. */
#define MSG_INT_MAX ((UINT64_C(1) << 53) - 1)
/* Room for a field path in messages ("plan.shards"). */
#define MSG_PATH_MAX 128

/* A JSON object and its path from the request root ("" at the root). */
struct msg_obj {
  const cJSON *json; /* NULL for an optional object that was absent */
  char path[MSG_PATH_MAX];
};

struct msg_request {
  enum msg_op op;
  cJSON *root;         /* the whole request */
  cJSON *id;           /* a detached copy of "id" (string or number), or NULL */
  struct msg_obj args; /* the root object, for the accessors */
};

/*
 * Parses one request frame. Returns 0, WEIGHTD_E_BAD_REQUEST with a message
 * that names the problem (and the field), or WEIGHTD_E_NOMEM. Even on failure
 * out->id holds the request's id when it was read before the failure, so the
 * error reply can echo it; call msg_request_free in every case.
 */
int msg_request_parse(const char *json, size_t len, struct msg_request *out, struct wd_error *err);

/*
 * The "id" of a request frame that is not parsed (one refused before its
 * parse): read by a scan of the top-level object that allocates nothing but
 * the id, which is checked as msg_request_parse checks it. Returns a detached
 * copy, or NULL when the frame has no valid id where the scan finds it (the
 * frame may still be malformed elsewhere).
 */
cJSON *msg_request_peek_id(const char *json, size_t len);

/*
 * True when two request ids are the same id: strings byte for byte, integers
 * by exact value (never a tolerance: 2^52 + 1 and 2^52 + 2 differ).
 */
bool msg_id_equal(const cJSON *a, const cJSON *b);

/* Frees what msg_request_parse allocated; safe on a zeroed or freed request. */
void msg_request_free(struct msg_request *req);

/*
 * Typed field accessors. Each returns 1 when the field is present and valid,
 * 0 when it is absent and optional (the default is stored), or
 * WEIGHTD_E_BAD_REQUEST naming the field. JSON null counts as present (and
 * of the wrong type).
 */

/* A string; *out points into the request (no NUL inside; absent: NULL). */
int msg_get_string(const struct msg_obj *o, const char *name, bool required, const char **out,
                   struct wd_error *err);

/*
 * A non-negative integer no larger than max and MSG_INT_MAX (cJSON keeps a
 * double, which is exact only up to there). Negatives and fractions are
 * refused; a number whose fraction a double cannot hold (1.0,
 * 2.0000000000000001) reads as the integer it rounds to.
 */
int msg_get_u64(const struct msg_obj *o, const char *name, bool required, uint64_t def,
                uint64_t max, uint64_t *out, struct wd_error *err);

/* true or false. */
int msg_get_bool(const struct msg_obj *o, const char *name, bool required, bool def, bool *out,
                 struct wd_error *err);

/* A nested object; out->path becomes "<parent>.<name>" for later messages. */
int msg_get_object(const struct msg_obj *o, const char *name, bool required, struct msg_obj *out,
                   struct wd_error *err);

/*
 * Reply builders. Each returns a new object (free it with cJSON_Delete) or
 * NULL when memory ran out. id is the request's id or NULL.
 */

/* {"id": ..., "ok": true}; add result fields to it. */
cJSON *msg_reply_ok(const cJSON *id);
/* {"id": ..., "error": {"code": "<weightd_err_name(code)>", "message": "..."}} */
cJSON *msg_reply_error(const cJSON *id, int code, const char *message);
/* {"id": ..., "event": "<name>"}; add the event's fields to it (id NULL: unsolicited). */
cJSON *msg_event(const cJSON *id, const char *name);
/* {"id": ..., "event": "progress", "bytes_done": done, "bytes_total": total} */
cJSON *msg_event_progress(const cJSON *id, uint64_t done, uint64_t total);

/* Adds name: s; bytes of s that are not UTF-8 are replaced when the message is serialized. */
int msg_add_string(cJSON *obj, const char *name, const char *s);

/*
 * The unformatted JSON text of j (malloc'd), or NULL when memory ran out.
 * Every frame the daemon sends is made here, so this is the one place where
 * strings that are not UTF-8 (a file name, a symlink's target) are made so:
 * each maximal ill-formed subpart becomes U+FFFD (sj_utf8_replace), in keys
 * and values alike, whichever call added them.
 */
char *msg_serialize(const cJSON *j);

/* Writes 2n lowercase hex digits and a NUL to out (room for 2n + 1). */
void msg_hex_encode(const void *bytes, size_t n, char *out);
/*
 * Decodes exactly 2n lowercase hex digits from the NUL-terminated hex into
 * out[0..n). Returns 0 or WEIGHTD_E_INVALID (wrong length, uppercase or other
 * characters); out may be partly written on failure.
 */
int msg_hex_decode(const char *hex, void *out, size_t n);

#endif
