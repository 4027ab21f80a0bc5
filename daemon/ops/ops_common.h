/*
 * ops_common.h - what the op handler files share (ops.c, ops_sets.c,
 * ops_status.c): argument readers and the JSON views of daemon state.
 */
#ifndef WD_OPS_COMMON_H
#define WD_OPS_COMMON_H

#include <stdbool.h>

#include "access.h"
#include "msg.h"
#include "ops.h"

/* Replies (ops.c). Each consumes `reply` (a cJSON object with "id" already set). */
static inline int conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds) {
  return c->ops->send(c, reply, fds, nfds);
}
static inline void req_finish(struct request *r) { r->conn->ops->finish(r); }
static inline struct request *conn_unqueue(struct conn *c, const cJSON *id) { return c->ops->unqueue(c, id); }
/* Frees the parsed request once nothing needs it (a waiting load keeps only its id). */
static inline void req_args_free(struct request *r) { r->conn->ops->drop_args(r); }
/* The final reply: sends it and finishes the request; returns what conn_send did. */
int req_reply(struct request *r, cJSON *reply, const int *fds, size_t nfds);
void req_fail(struct request *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void req_fail_err(struct request *r, const struct wd_error *err);
/* A progress event: dropped, not queued, when the client does not read its replies. */
void req_progress(struct request *r, uint64_t done, uint64_t total);

/* Root, the daemon's own uid, or a member of admin_gids: may evict, release and cancel what others started. */
bool ops_is_admin(const struct conn *c);

/*
 * Whose access the daemon checks what it reads for the connection against
 * (access.h): NULL for root and the daemon's own uid, who could read the
 * files themselves; else the peer's uid, primary gid and every
 * supplementary group (SO_PEERGROUPS at accept; marked unknown when the
 * kernel did not say, which refuses every check), written into buf: a view
 * of the connection's list, which the check copies.
 */
const struct acc_cred *ops_reader(const struct conn *c, struct acc_cred *buf);

struct res_set;
/*
 * Whether r's client may use set s (attach it, scrub it): the set holds what
 * was read from its checkpoint's files, so it is for those who may read those
 * very files, as a load is; once they are gone or replaced, only the set's
 * loader and admins may (no one else's access to what was read can be
 * shown). cb runs on the loop thread with the verdict (reg_check).
 */
void ops_set_check(struct request *r, struct res_set *s, reg_ready_fn cb);

/* The daemon a request belongs to. */
static inline struct daemon *req_daemon(const struct request *r) { return r->conn->d; }

/* The request's root object as an accessor object. */
const struct msg_obj *ops_args(const struct request *r, struct msg_obj *o);
/* Reads a string field; on a malformed one replies with the error and returns false. */
bool ops_str_arg(struct request *r, const char *name, bool required, const char **out);
/* The required "path" field, or NULL after replying with the error. */
const char *ops_path_arg(struct request *r);

/* The request's "source" (auto | mmap | direct), when it names one (*given); 0, or BAD_REQUEST for a bad value. */
int ops_source_arg(struct request *r, bool *given, enum ld_source_choice *out, struct wd_error *err);
/* What a load of ck reads through: the request's source (given), else its directory's (root_sources), else 'source'. */
enum ld_source_choice ops_load_source(const struct daemon *d, const struct reg_ckpt *ck, bool given,
                                      enum ld_source_choice asked);

/* The device named by a request field (an index, as number or text, or a UUID); absent: 0. */
int ops_device_resolve(const struct daemon *d, const cJSON *v, int *device, struct wd_error *err);

/* JSON views (ops_status.c). */
/* Adds a checkpoint's "layout_id" and "content_id" (hex; null until known) to o. */
void ops_ids_add(const struct reg_ckpt *ck, cJSON *o);
cJSON *ops_checkpoint_json(const struct daemon *d, const struct reg_ckpt *ck, uint64_t resident);
cJSON *ops_device_json(const struct daemon *d, int i);
cJSON *ops_set_json(const struct daemon *d, const struct res_set *s);

/*
 * Replies with the checkpoint's description, its page-cache residency
 * measured on a job first; takes the caller's reference to ck.
 */
void ops_reply_checkpoint(struct request *r, struct reg_ckpt *ck);

/* The handlers, by file. */
void op_open(struct request *r);
void op_close(struct request *r);
void op_prefetch(struct request *r);
void op_load(struct request *r);
void op_attach(struct request *r);
void op_evict(struct request *r);
void op_status(struct request *r);
void op_scrub(struct request *r);

/* Cancels a request of this connection that waits in the sets code (load, attach); true if it waited. */
bool ops_sets_cancel(struct request *target);

/* Several devices (ops_multi.c): the load_group op, its cancel and its requester going away. */
void op_load_group(struct request *r);
bool ops_group_cancel(struct request *target);
/* The group request's connection closed: stop waiting (true when r is a group request). */
bool ops_group_gone(struct request *r);
/* Adds a device's NUMA node, link rate and peers to its JSON view. */
void ops_multi_device_fields(const struct daemon *d, int i, cJSON *o);
/* Adds where a ready set's bytes came from ("source", a striped load's "links"), or what a load in flight reads. */
void ops_multi_set_fields(const struct daemon *d, const struct res_set *s, cJSON *o);
/* The status reply's "topology": the multi-device settings, NUMA nodes and fill threads, busy devices. */
cJSON *ops_multi_topology_json(const struct daemon *d);

#endif
