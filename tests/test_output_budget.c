/*
 * test_output_budget.c - the rules for reply bytes queued for clients that do
 * not read (daemon/transport/output_budget.h), figure by figure: when a
 * connection stops being read, which limit a reply or a LIMIT answer breaks,
 * when an event is dropped, whether room can be made and who goes first, the
 * uid share's default and exemption, and the uid table's references.
 */
#include <stdint.h>
#include <string.h>

#include "testutil.h"
#include "transport/output_budget.h"

#define MiB (1ull << 20)

/* Limits of 8 MiB per connection, 16 descriptors, a 32 MiB share and a 100 MiB total; frames of 4 MiB. */
static const struct ob_limits L = {.frame = 4 * MiB, .conn = 8 * MiB, .fds = 16, .uid = 32 * MiB, .total = 100 * MiB};

static struct ob_limits exempt(void) {
  struct ob_limits l = L;
  l.uid = OB_EXEMPT;
  return l;
}

static void test_limits_of_config(void) {
  struct wd_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.max_queued_output = 64 * MiB;
  cfg.max_queued_fds = 64;
  cfg.max_total_queued_output = 1024 * MiB;
  struct ob_limits l = ob_limits_of(&cfg, 16 * MiB, false);
  CHECK_EQ_INT(l.uid, 256 * MiB); /* 0: a quarter of the total */
  CHECK_EQ_INT(l.conn, 64 * MiB);
  CHECK_EQ_INT(l.fds, 64);
  CHECK_EQ_INT(l.total, 1024 * MiB);
  CHECK_EQ_INT(l.frame, 16 * MiB);
  cfg.max_uid_queued_output = 10 * MiB;
  CHECK_EQ_INT(ob_limits_of(&cfg, 16 * MiB, false).uid, 10 * MiB);
  CHECK(ob_limits_of(&cfg, 16 * MiB, true).uid == OB_EXEMPT); /* root and the daemon's uid */
  CHECK_EQ_INT(ob_limits_of(&cfg, 16 * MiB, true).total, 1024 * MiB); /* never exempt from the total */
}

static void test_backlogged_by_the_connections_own_limits(void) {
  struct ob_held h = {.conn = 4 * MiB, .uid = 4 * MiB, .total = 4 * MiB};
  CHECK(!ob_backlogged(&h, &L)); /* half, not past it */
  h.conn = h.uid = h.total = 4 * MiB + 1;
  CHECK(ob_backlogged(&h, &L));
  struct ob_held f = {.conn_fds = 9};
  CHECK(ob_backlogged(&f, &L));
  f.conn_fds = 8;
  CHECK(!ob_backlogged(&f, &L));
}

static void test_backlogged_by_shared_limits_only_while_holding(void) {
  /* Past half of the uid's share: its connections holding unsent replies stop; one holding none goes on. */
  struct ob_held h = {.conn = 1, .uid = 16 * MiB + 1, .total = 16 * MiB + 1};
  CHECK(ob_backlogged(&h, &L));
  h.conn = 0;
  CHECK(!ob_backlogged(&h, &L));
  /* Exempt from the share. */
  struct ob_limits ex = exempt();
  h.conn = 1;
  CHECK(!ob_backlogged(&h, &ex));
  /* Past half of the total: for everyone holding, exempt or not. */
  struct ob_held t = {.conn = 1, .uid = 1, .total = 50 * MiB + 1};
  CHECK(ob_backlogged(&t, &L));
  CHECK(ob_backlogged(&t, &ex));
  t.conn = 0;
  CHECK(!ob_backlogged(&t, &ex));
  t.conn = 1;
  t.total = 50 * MiB;
  CHECK(!ob_backlogged(&t, &L));
}

static void test_reply_breaks_in_order(void) {
  struct ob_held h = {0};
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 4 * MiB, 0), OB_NONE);
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 4 * MiB + 1, 0), OB_FRAME);
  h = (struct ob_held){.conn = 5 * MiB, .uid = 5 * MiB, .total = 5 * MiB};
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 3 * MiB, 0), OB_NONE); /* exactly the connection's limit */
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 3 * MiB + 1, 0), OB_CONN);
  h.conn_fds = 15;
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 1, 1), OB_NONE);
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 1, 2), OB_FDS);
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 1, 0), OB_NONE); /* descriptors count only when there are some */
  /* The uid's share: a small connection of a uid that holds much. */
  h = (struct ob_held){.conn = 0, .uid = 31 * MiB, .total = 31 * MiB};
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 1 * MiB, 0), OB_NONE);
  CHECK_EQ_INT(ob_reply_breaks(&h, &L, 1 * MiB + 1, 0), OB_UID);
  struct ob_limits ex = exempt();
  CHECK_EQ_INT(ob_reply_breaks(&h, &ex, 1 * MiB + 1, 0), OB_NONE);
  /* The total breaks a reply only when the connection's own replies and it would pass it. */
  h = (struct ob_held){.conn = 1, .uid = 1, .total = 99 * MiB};
  CHECK_EQ_INT(ob_reply_breaks(&h, &ex, 4 * MiB, 0), OB_NONE); /* room is made for it */
  struct ob_limits small = ex;
  small.total = 4 * MiB;
  small.conn = 64 * MiB;
  CHECK_EQ_INT(ob_reply_breaks(&h, &small, 4 * MiB, 0), OB_TOTAL);
  CHECK_EQ_INT(ob_reply_breaks(&h, &small, 4 * MiB - 1, 0), OB_NONE);
}

static void test_answer_breaks_at_twice(void) {
  struct ob_held h = {.conn = 16 * MiB - 100, .uid = 16 * MiB - 100, .total = 16 * MiB};
  CHECK_EQ_INT(ob_answer_breaks(&h, &L, 100), OB_NONE);
  CHECK_EQ_INT(ob_answer_breaks(&h, &L, 101), OB_CONN);
  h = (struct ob_held){.conn = 1, .uid = 64 * MiB - 100, .total = 64 * MiB};
  CHECK_EQ_INT(ob_answer_breaks(&h, &L, 100), OB_NONE);
  CHECK_EQ_INT(ob_answer_breaks(&h, &L, 101), OB_UID);
  struct ob_limits ex = exempt();
  CHECK_EQ_INT(ob_answer_breaks(&h, &ex, 101), OB_NONE);
}

static void test_events_are_dropped_never_given_room(void) {
  struct ob_held h = {0};
  CHECK(!ob_event_dropped(&h, &L, 100));
  CHECK(ob_event_dropped(&h, &L, 4 * MiB + 1));
  h.total = 100 * MiB - 99; /* no room is made for an event */
  CHECK(ob_event_dropped(&h, &L, 100));
  h = (struct ob_held){.conn = 0, .uid = 32 * MiB - 99, .total = 32 * MiB};
  CHECK(ob_event_dropped(&h, &L, 100));
  struct ob_limits ex = exempt();
  CHECK(!ob_event_dropped(&h, &ex, 100));
  h = (struct ob_held){.conn = 4 * MiB + 1, .uid = 4 * MiB + 1, .total = 4 * MiB + 1};
  CHECK(ob_event_dropped(&h, &L, 1)); /* backlogged */
}

static void test_room_and_who_goes_first(void) {
  /* 90 queued, 60 of them by connections holding more than the asker: 10 more fit within 40 after closing them. */
  CHECK(ob_room_possible(90, 60, 10, 40));
  CHECK(!ob_room_possible(90, 60, 11, 40));
  CHECK(!ob_room_possible(90, 0, 1, 40)); /* the asker holds the most: nobody may be closed for it */
  CHECK(ob_room_possible(0, 0, 40, 40));
  CHECK(!ob_room_possible(0, 0, 41, 40));
  CHECK(!ob_room_possible(UINT64_MAX, 0, UINT64_MAX, 40)); /* no overflow */
  /* Largest first, and only holders of more than the asker. */
  CHECK(ob_closes_before(10, 5, 0));
  CHECK(!ob_closes_before(5, 5, 0)); /* as much as the asker: never closed for it */
  CHECK(!ob_closes_before(10, 5, 10)); /* the first of equals stays the candidate */
  CHECK(ob_closes_before(11, 5, 10));
}

static void test_uid_table_counts_references(void) {
  struct ob_uid *list = NULL;
  struct ob_uid *a = ob_uid_ref(&list, 1000), *b = ob_uid_ref(&list, 1001), *a2 = ob_uid_ref(&list, 1000);
  CHECK(a != NULL && b != NULL && a == a2 && a != b);
  CHECK_EQ_INT(a->conns, 2);
  a->bytes = 7;
  ob_uid_unref(&list, a);
  CHECK(ob_uid_ref(&list, 1000) == a && a->bytes == 7); /* kept while a connection holds it */
  ob_uid_unref(&list, a);
  ob_uid_unref(&list, a2);
  CHECK(list == b && b->next == NULL); /* freed with its last reference */
  ob_uid_unref(&list, b);
  CHECK(list == NULL);
  ob_uid_unref(&list, NULL);
}

int main(void) {
  RUN(test_limits_of_config);
  RUN(test_backlogged_by_the_connections_own_limits);
  RUN(test_backlogged_by_shared_limits_only_while_holding);
  RUN(test_reply_breaks_in_order);
  RUN(test_answer_breaks_at_twice);
  RUN(test_events_are_dropped_never_given_room);
  RUN(test_room_and_who_goes_first);
  RUN(test_uid_table_counts_references);
  return tu_finish();
}
