/* output_budget.c - the rules for queued reply bytes and the uid table (see output_budget.h). */
#include "output_budget.h"

#include <stdlib.h>

uint64_t ob_uid_share(const struct wd_config *cfg) {
  return cfg->max_uid_queued_output != 0 ? cfg->max_uid_queued_output : cfg->max_total_queued_output / 4;
}

struct ob_limits ob_limits_of(const struct wd_config *cfg, uint64_t frame, bool exempt) {
  return (struct ob_limits){
      .frame = frame,
      .conn = cfg->max_queued_output,
      .fds = cfg->max_queued_fds,
      .uid = exempt ? OB_EXEMPT : ob_uid_share(cfg),
      .total = cfg->max_total_queued_output,
  };
}

/* Whether len more bytes on top of held pass limit (without overflowing). */
static bool passes(uint64_t held, uint64_t len, uint64_t limit) { return held > limit || len > limit - held; }

bool ob_backlogged(const struct ob_held *h, const struct ob_limits *l) {
  if (h->conn > l->conn / 2 || h->conn_fds > l->fds / 2) return true;
  if (h->conn == 0) return false;
  return (l->uid != OB_EXEMPT && h->uid > l->uid / 2) || h->total > l->total / 2;
}

enum ob_level ob_reply_breaks(const struct ob_held *h, const struct ob_limits *l, uint64_t len, uint64_t nfds) {
  if (len > l->frame) return OB_FRAME;
  if (passes(h->conn, len, l->conn)) return OB_CONN;
  if (nfds > 0 && passes(h->conn_fds, nfds, l->fds)) return OB_FDS;
  if (l->uid != OB_EXEMPT && passes(h->uid, len, l->uid)) return OB_UID;
  if (passes(h->conn, len, l->total)) return OB_TOTAL;
  return OB_NONE;
}

enum ob_level ob_answer_breaks(const struct ob_held *h, const struct ob_limits *l, uint64_t len) {
  if (passes(h->conn, len, 2 * l->conn)) return OB_CONN;
  if (l->uid != OB_EXEMPT && passes(h->uid, len, 2 * l->uid)) return OB_UID;
  return OB_NONE;
}

bool ob_event_dropped(const struct ob_held *h, const struct ob_limits *l, uint64_t len) {
  return ob_backlogged(h, l) || len > l->frame || passes(h->conn, len, l->conn) ||
         (l->uid != OB_EXEMPT && passes(h->uid, len, l->uid)) || passes(h->total, len, l->total);
}

/* ---- the uid table ---------------------------------------------------------------- */

struct ob_uid *ob_uid_ref(struct ob_uid **list, uid_t uid) {
  struct ob_uid *u = *list;
  while (u != NULL && u->uid != uid) u = u->next;
  if (u == NULL) {
    u = calloc(1, sizeof *u);
    if (u == NULL) return NULL;
    u->uid = uid;
    u->next = *list;
    *list = u;
  }
  u->conns++;
  return u;
}

void ob_uid_unref(struct ob_uid **list, struct ob_uid *u) {
  if (u == NULL || --u->conns > 0) return;
  struct ob_uid **pp = list;
  while (*pp != NULL && *pp != u) pp = &(*pp)->next;
  if (*pp == u) *pp = u->next;
  free(u);
}
