/*
 * ops_common.c - what every op handler uses: replies and errors, argument
 * readers, and device names.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops_common.h"

/* ---- replies -------------------------------------------------------------------------- */

int req_reply(struct request *r, cJSON *reply, const int *fds, size_t nfds) {
  r->done = true;
  int rc = conn_send(r->conn, reply, fds, nfds);
  req_finish(r);
  return rc;
}

void req_fail(struct request *r, int code, const char *fmt, ...) {
  char msg[WD_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  daemon_count_error(r->conn->d, code);
  req_reply(r, msg_reply_error(r->id, code, msg), NULL, 0);
}

void req_fail_err(struct request *r, const struct wd_error *err) {
  daemon_count_error(r->conn->d, err->code ? err->code : WEIGHTD_E_INTERNAL);
  req_reply(r, msg_reply_error(r->id, err->code ? err->code : WEIGHTD_E_INTERNAL, err->msg), NULL, 0);
}

void req_progress(struct request *r, uint64_t done, uint64_t total) {
  if (r->conn->closed) return;
  r->conn->ops->send_event(r->conn, msg_event_progress(r->id, done, total));
}

/* ---- arguments ------------------------------------------------------------------------ */

const struct msg_obj *ops_args(const struct request *r, struct msg_obj *o) {
  o->json = r->root;
  o->path[0] = '\0';
  return o;
}

bool ops_str_arg(struct request *r, const char *name, bool required, const char **out) {
  struct msg_obj o;
  struct wd_error err = {0};
  *out = NULL;
  if (msg_get_string(ops_args(r, &o), name, required, out, &err) < 0) {
    req_fail_err(r, &err);
    return false;
  }
  return true;
}

const char *ops_path_arg(struct request *r) {
  const char *path;
  return ops_str_arg(r, "path", true, &path) ? path : NULL;
}

int ops_device_resolve(const struct daemon *d, const cJSON *v, int *device, struct wd_error *err) {
  if (v == NULL || cJSON_IsNull(v)) {
    *device = 0;
    return 0;
  }
  if (cJSON_IsNumber(v)) {
    double x = v->valuedouble;
    if (!(x >= 0 && x <= 9007199254740991.0) || x != floor(x)) /* range first: no out-of-range cast */
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'device' must be a non-negative integer index or a UUID");
    if (x >= d->ndevices) return err_set(err, WEIGHTD_E_NOT_FOUND, "no device %g (this daemon has %d)", x, d->ndevices);
    *device = (int)x;
    return 0;
  }
  if (!cJSON_IsString(v)) return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'device' must be a device index or UUID");
  const char *s = v->valuestring;
  if ((s[0] >= '0' && s[0] <= '9') || s[0] == '-' || s[0] == '+') {
    /* An index as text: digits only. */
    char *end;
    errno = 0;
    unsigned long n = strtoul(s, &end, 10);
    if (*end != '\0' || errno != 0 || s[0] == '-' || s[0] == '+')
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'device': '%.40s' is neither an index nor a UUID", s);
    if (n >= (unsigned long)d->ndevices)
      return err_set(err, WEIGHTD_E_NOT_FOUND, "no device %lu (this daemon has %d)", n, d->ndevices);
    *device = (int)n;
    return 0;
  }
  for (int i = 0; i < d->ndevices; i++)
    if (strcmp(res_device(d->res, i)->info.uuid, s) == 0) {
      *device = i;
      return 0;
    }
  return err_set(err, WEIGHTD_E_NOT_FOUND, "no device '%.80s' (give an index below %d or a UUID)", s, d->ndevices);
}

/* The request's "source" (auto | mmap | direct), when it names one (*given); 0, or BAD_REQUEST for a bad value. */
int ops_source_arg(struct request *r, bool *given, enum ld_source_choice *out, struct wd_error *err) {
  struct msg_obj o;
  const char *name = NULL;
  *given = false;
  if (msg_get_string(ops_args(r, &o), "source", false, &name, err) < 0) return err->code;
  if (name == NULL) return 0;
  if (ld_source_choice_parse(name, out) != 0)
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'source': '%.32s' is not one of auto, mmap, direct", name);
  *given = true;
  return 0;
}

enum ld_source_choice ops_load_source(const struct daemon *d, const struct reg_ckpt *ck, bool given,
                                      enum ld_source_choice asked) {
  enum ld_source_choice c;
  if (given) return asked;
  if (reg_source_for(d->reg, ck->path, &c)) return c;
  return (enum ld_source_choice)d->cfg.source;
}


bool ops_is_admin(const struct conn *c) {
  if (conn_is_privileged(c)) return true;
  const struct wd_config *cfg = &c->d->cfg;
  for (size_t i = 0; i < cfg->n_admin_gids; i++)
    if (conn_in_group(c, (gid_t)cfg->admin_gids[i])) return true;
  return false;
}

void ops_set_check(struct request *r, struct res_set *s, reg_ready_fn cb) {
  struct daemon *d = req_daemon(r);
  struct acc_cred who;
  char label[96];
  snprintf(label, sizeof label, "set %s", s->id);
  bool vouched = s->loader_uid == r->conn->uid || ops_is_admin(r->conn);
  reg_check(d->reg, s->ck, ops_reader(r->conn, &who), label, vouched ? REG_CHECK_SAME_OR_GONE : REG_CHECK_SAME_FILES,
            cb, r);
}

const struct acc_cred *ops_reader(const struct conn *c, struct acc_cred *buf) {
  if (conn_is_privileged(c)) return NULL;
  *buf = (struct acc_cred){.uid = c->uid,
                           .gid = c->gid,
                           .ngroups = c->ngroups > 0 ? (size_t)c->ngroups : 0,
                           .groups = c->ngroups > 0 ? c->groups : NULL,
                           .groups_unknown = c->ngroups < 0};
  return buf;
}
