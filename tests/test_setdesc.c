/*
 * test_setdesc.c - the set description (daemon/service/setdesc.h): a round trip of
 * sets and leases with every field compared, the writer's refusals, and the
 * reader's rejection of every truncation, a bad magic, an unknown version, a
 * flipped byte (checksum), a bad table, a lease naming no set, and ids and
 * generations past the counters the daemon takes them into.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "service/setdesc.h"
#include "tensor_table.h"
#include "testutil.h"

static const uint64_t SHAPE_A[2] = {4, 8}, SHAPE_B[1] = {3};

static void get_tensor(void *arg, size_t i, struct ttab_tensor *t) {
  (void)arg;
  static const char *const names[] = {"model.embed.weight", "lm_head.bias"};
  t->name = names[i];
  t->name_len = strlen(names[i]);
  t->dtype = i == 0 ? "BF16" : "F32";
  t->ndim = i == 0 ? 2 : 1;
  t->shape = i == 0 ? SHAPE_A : SHAPE_B;
  t->offset = i == 0 ? 0 : 256;
  t->nbytes = i == 0 ? 64 : 12;
}

static unsigned char *table;
static size_t table_len;

static struct setdesc_shard shards[2] = {
    {.name = "model-00001-of-00002.safetensors", .dev = 2049, .ino = 77, .size = 1000, .mtime_ns = 1700000000123456789},
    {.name = "model-00002-of-00002.safetensors", .dev = 2049, .ino = 78, .size = 2000, .mtime_ns = -5},
};

/* A description of two sets and three leases. */
static void sample(struct setdesc *d, struct setdesc_set sets[2], struct setdesc_lease leases[3]) {
  memset(sets, 0, 2 * sizeof *sets);
  for (int i = 0; i < 2; i++) {
    sets[i].id = i == 0 ? "s3" : "s12";
    sets[i].path = i == 0 ? "/models/a" : "/models/b/model.safetensors";
    sets[i].uuid = i == 0 ? "host-0123" : "GPU-8f0e1c2d-0000-1111-2222-333344445555";
    sets[i].handle_kind = i == 0 ? WD_HANDLE_FD : WD_HANDLE_CUDA_VMM;
    sets[i].slab_bytes = 268;
    sets[i].alloc_bytes = i == 0 ? 268 : 2u << 20;
    memset(sets[i].alloc_id, 0xa0 + i, WD_ALLOC_ID_BYTES);
    sets[i].fdname = i == 0 ? "wd-slab-s3" : "wd-slab-s12";
    sets[i].plan_key = i == 0 ? "{\"preset\":\"whole\"}" : "{\"outputs\":2,\"sha256\":\"ab\"}";
    sets[i].has_ids = true;
    memset(sets[i].layout_id, 0x30 + i, SETDESC_ID_BYTES);
    sets[i].content_known = i == 0; /* the second set's content id is not known yet */
    if (i == 0) memset(sets[i].content_id, 0xc7, SETDESC_ID_BYTES);
    sets[i].nshards = i == 0 ? 2 : 1;
    sets[i].shards = shards;
    sets[i].table = table; /* versions 1 and 2 carry it inline */
    sets[i].table_len = table_len;
    sets[i].table_fdname = i == 0 ? "wd-table-s3" : "wd-table-s12"; /* version 3 names it */
    sets[i].table_sum = ttab_xxh64(table, table_len);
  }
  leases[0] = (struct setdesc_lease){.id = "l4", .set_id = "s3", .uid = 1000, .pid = 4242, .client = "vllm"};
  leases[1] = (struct setdesc_lease){.id = "l5", .set_id = "s3", .uid = 0, .pid = 1, .client = ""};
  leases[2] = (struct setdesc_lease){.id = "l13", .set_id = "s12", .uid = 65534, .pid = 99999, .client = "x"};
  *d = (struct setdesc){.generation = 7, .nsets = 2, .sets = sets, .nleases = 3, .leases = leases};
}

static void write_sample(unsigned char **buf, size_t *len) {
  struct setdesc d;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  sample(&d, sets, leases);
  struct wd_error err = {0};
  CHECK_EQ_INT(setdesc_write(&d, buf, len, &err), 0);
}

/* Rejects buf[0..len) (copied to aligned memory), with msg naming the rule. */
static void expect_rejected(const unsigned char *buf, size_t len, const char *msg) {
  unsigned char *copy = malloc(len ? len : 1);
  memcpy(copy, buf, len);
  struct setdesc d;
  struct wd_error err = {0};
  int rc = setdesc_read(copy, len, &d, &err);
  CHECK_EQ_INT(rc, WEIGHTD_E_INVALID);
  if (msg != NULL) CHECK_STR_CONTAINS(err.msg, msg);
  CHECK(d.sets == NULL && d.nsets == 0 && d.leases == NULL);
  free(copy);
}

static void test_round_trip(void) {
  unsigned char *buf;
  size_t len;
  write_sample(&buf, &len);
  struct setdesc in, out;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  sample(&in, sets, leases);
  struct wd_error err = {0};
  CHECK_EQ_INT(setdesc_read(buf, len, &out, &err), 0);
  CHECK_EQ_INT(out.generation, 7);
  CHECK_EQ_INT(out.version, SETDESC_VERSION);
  CHECK_EQ_INT(out.nsets, 2);
  CHECK_EQ_INT(out.nleases, 3);
  for (size_t i = 0; i < 2 && out.nsets == 2; i++) {
    const struct setdesc_set *a = &in.sets[i], *b = &out.sets[i];
    CHECK(strcmp(a->id, b->id) == 0 && strcmp(a->path, b->path) == 0 && strcmp(a->uuid, b->uuid) == 0);
    CHECK(strcmp(a->fdname, b->fdname) == 0 && strcmp(a->plan_key, b->plan_key) == 0);
    CHECK_EQ_INT(b->handle_kind, a->handle_kind);
    CHECK_EQ_INT(b->slab_bytes, a->slab_bytes);
    CHECK_EQ_INT(b->alloc_bytes, a->alloc_bytes);
    CHECK(memcmp(a->alloc_id, b->alloc_id, WD_ALLOC_ID_BYTES) == 0);
    CHECK(b->has_ids && memcmp(a->layout_id, b->layout_id, SETDESC_ID_BYTES) == 0);
    CHECK_EQ_INT(b->content_known, a->content_known);
    if (a->content_known) CHECK(memcmp(a->content_id, b->content_id, SETDESC_ID_BYTES) == 0);
    CHECK_EQ_INT(b->nshards, a->nshards);
    for (size_t k = 0; k < a->nshards && b->nshards == a->nshards; k++) {
      CHECK(strcmp(a->shards[k].name, b->shards[k].name) == 0);
      CHECK(a->shards[k].dev == b->shards[k].dev && a->shards[k].ino == b->shards[k].ino);
      CHECK(a->shards[k].size == b->shards[k].size && a->shards[k].mtime_ns == b->shards[k].mtime_ns);
    }
    /* Version 3 names the table; the daemon checks the stored one against it. */
    CHECK(b->table == NULL && b->table_fdname != NULL && strcmp(b->table_fdname, a->table_fdname) == 0);
    CHECK_EQ_INT(b->table_len, table_len);
    CHECK_EQ_INT(b->table_sum, a->table_sum);
    struct setdesc_set *m = &out.sets[i];
    CHECK_EQ_INT(setdesc_table_check(m, table, table_len, &err), 0);
    CHECK(m->table == table);
    unsigned char *bad = malloc(table_len);
    memcpy(bad, table, table_len);
    bad[table_len / 2] ^= 1;
    m->table = NULL;
    CHECK_EQ_INT(setdesc_table_check(m, bad, table_len, &err), WEIGHTD_E_INVALID);
    CHECK_STR_CONTAINS(err.msg, "checksum");
    CHECK_EQ_INT(setdesc_table_check(m, table, table_len - 8, &err), WEIGHTD_E_INVALID);
    CHECK_STR_CONTAINS(err.msg, "bytes");
    CHECK(m->table == NULL);
    free(bad);
  }
  for (size_t i = 0; i < 3 && out.nleases == 3; i++) {
    const struct setdesc_lease *a = &in.leases[i], *b = &out.leases[i];
    CHECK(strcmp(a->id, b->id) == 0 && strcmp(a->set_id, b->set_id) == 0 && strcmp(a->client, b->client) == 0);
    CHECK_EQ_INT(b->uid, a->uid);
    CHECK_EQ_INT(b->pid, a->pid);
  }
  setdesc_free(&out);
  CHECK(out.sets == NULL && out.nsets == 0);
  /* An empty description round-trips too. */
  struct setdesc empty = {.generation = 1};
  unsigned char *eb;
  size_t el;
  CHECK_EQ_INT(setdesc_write(&empty, &eb, &el, &err), 0);
  CHECK_EQ_INT(el, SETDESC_HEADER_BYTES);
  CHECK_EQ_INT(setdesc_read(eb, el, &out, &err), 0);
  CHECK_EQ_INT(out.generation, 1);
  CHECK_EQ_INT(out.nsets + out.nleases, 0);
  setdesc_free(&out);
  free(eb);
  free(buf);
}

static void test_every_truncation_rejected(void) {
  unsigned char *buf;
  size_t len;
  write_sample(&buf, &len);
  for (size_t n = 0; n < len; n++) expect_rejected(buf, n, NULL);
  /* With the header's length and checksum made to match, the body's own bounds reject it. */
  for (size_t n = SETDESC_HEADER_BYTES; n < len; n++) {
    unsigned char *c = malloc(len);
    memcpy(c, buf, n);
    uint64_t total = n, sum = ttab_xxh64(c + SETDESC_HEADER_BYTES, n - SETDESC_HEADER_BYTES);
    memcpy(c + 16, &total, 8);
    memcpy(c + 40, &sum, 8);
    expect_rejected(c, n, NULL);
    free(c);
  }
  free(buf);
}

/* Rewrites the checksum after a change, so that the rule itself rejects it. */
static void reseal(unsigned char *buf, size_t len) {
  uint64_t sum = ttab_xxh64(buf + SETDESC_HEADER_BYTES, len - SETDESC_HEADER_BYTES);
  memcpy(buf + 40, &sum, 8);
}

static void test_bad_header_rejected(void) {
  unsigned char *buf;
  size_t len;
  write_sample(&buf, &len);
  buf[0] ^= 1;
  expect_rejected(buf, len, "bad magic");
  buf[0] ^= 1;
  uint32_t v = SETDESC_VERSION + 1;
  memcpy(buf + 8, &v, 4);
  expect_rejected(buf, len, "version 4");
  v = SETDESC_VERSION;
  memcpy(buf + 8, &v, 4);
  buf[len / 2] ^= 0x40;
  expect_rejected(buf, len, "checksum");
  buf[len / 2] ^= 0x40;
  uint32_t many = 1u << 30;
  memcpy(buf + 32, &many, 4);
  expect_rejected(buf, len, "do not fit");
  free(buf);
}

/*
 * Descriptions earlier weightds wrote are read: version 2 with its tables
 * inline (checked there, 8-byte aligned), version 1 also without ids; its
 * bytes are version 2's without the identity fields.
 */
static void test_version_1_read(void) {
  struct setdesc d, out;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  sample(&d, sets, leases);
  struct wd_error err = {0};
  unsigned char *v2, *v1;
  size_t l2, l1;
  d.version = 2;
  CHECK_EQ_INT(setdesc_write(&d, &v2, &l2, &err), 0);
  CHECK_EQ_INT(setdesc_read(v2, l2, &out, &err), 0);
  CHECK_EQ_INT(out.version, 2);
  for (size_t i = 0; i < out.nsets; i++) {
    CHECK(out.sets[i].has_ids && out.sets[i].table_fdname == NULL);
    CHECK(out.sets[i].table_len == table_len && memcmp(out.sets[i].table, table, table_len) == 0);
    CHECK_EQ_INT(((uintptr_t)out.sets[i].table) % 8, 0);
  }
  setdesc_free(&out);
  d.version = 1;
  CHECK_EQ_INT(setdesc_write(&d, &v1, &l1, &err), 0);
  CHECK(l2 > l1); /* two sets' ids (68 bytes each; the padding before the tables moves with them) */
  free(v2);
  CHECK_EQ_INT(setdesc_read(v1, l1, &out, &err), 0);
  CHECK_EQ_INT(out.version, 1);
  CHECK_EQ_INT(out.nsets, 2);
  for (size_t i = 0; i < out.nsets; i++) {
    CHECK(!out.sets[i].has_ids && !out.sets[i].content_known);
    CHECK(strcmp(out.sets[i].plan_key, sets[i].plan_key) == 0 && out.sets[i].nshards == sets[i].nshards);
  }
  CHECK_EQ_INT(out.nleases, 3);
  setdesc_free(&out);
  d.version = 9;
  CHECK_EQ_INT(setdesc_write(&d, &v2, &l2, &err), WEIGHTD_E_INVALID);
  CHECK(v2 == NULL);
  free(v1);
}

/* A content id flag other than 0 or 1, or id bytes with the flag 0, is refused. */
static void test_bad_ids_rejected(void) {
  struct setdesc d;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  sample(&d, sets, leases);
  d.nsets = 1;
  d.nleases = 2;
  struct wd_error err = {0};
  unsigned char *buf;
  size_t len;
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  /* Find the content id flag: after the plan key's bytes and the layout id. */
  const char *key = sets[0].plan_key;
  unsigned char *k = memmem(buf, len, key, strlen(key));
  CHECK(k != NULL);
  if (k != NULL) {
    unsigned char *flag = k + strlen(key) + SETDESC_ID_BYTES;
    uint32_t two = 2, zero = 0;
    memcpy(flag, &two, 4);
    reseal(buf, len);
    expect_rejected(buf, len, "content id known is 2");
    memcpy(flag, &zero, 4); /* the id bytes stay: not zeros */
    reseal(buf, len);
    expect_rejected(buf, len, "non-zero id bytes");
  }
  free(buf);
}

static void test_bad_body_rejected(void) {
  struct setdesc d;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  struct wd_error err = {0};
  unsigned char *buf;
  size_t len;
  /* A lease naming a set that is not described. */
  sample(&d, sets, leases);
  leases[2].set_id = "s99";
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "s99");
  free(buf);
  /* Two sets with one id. */
  sample(&d, sets, leases);
  sets[1].id = "s3";
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "given twice");
  free(buf);
  /* A table for another slab size (inline, version 2). */
  sample(&d, sets, leases);
  d.version = 2;
  sets[1].slab_bytes = 512;
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "tensor table is for a slab");
  free(buf);
  /* A broken table (its own checksum fails). */
  unsigned char *bad = malloc(table_len);
  memcpy(bad, table, table_len);
  bad[table_len - 2] ^= 1;
  sample(&d, sets, leases);
  d.version = 2;
  sets[0].table = bad;
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "set 0 (s3): tensor table");
  free(buf);
  free(bad);
  /* A store name systemd would refuse, and a kind byte changed to legacy IPC (resealed). */
  sample(&d, sets, leases);
  sets[0].fdname = "wd:slab";
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "store name");
  free(buf);
  sample(&d, sets, leases);
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  size_t at = SETDESC_HEADER_BYTES + 4 + 2 + 4 + strlen(sets[0].path) + 4 + strlen(sets[0].uuid);
  uint32_t kind = WD_HANDLE_CUDA_IPC;
  memcpy(buf + at, &kind, 4);
  reseal(buf, len);
  expect_rejected(buf, len, "handle kind");
  free(buf);
}

/*
 * Ids and generations are counters the daemon takes over: a number past
 * 2^63 - 1 (UINT64_MAX, or one that overflows) would wrap its counter into
 * an id given twice, so the description is refused; so is anything that is
 * not the letter and a plain decimal number.
 */
static void test_bad_counters_rejected(void) {
  struct setdesc d, out;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  struct wd_error err = {0};
  unsigned char *buf;
  size_t len;
  static char bad_sets[][24] = {"s18446744073709551615", "s99999999999999999999", "s9223372036854775808",
                                "s0", "s012", "s+12", "s 12", "s-1", "s", "x12", "s12x"};
  for (size_t i = 0; i < sizeof bad_sets / sizeof bad_sets[0]; i++) {
    sample(&d, sets, leases);
    sets[1].id = bad_sets[i];
    leases[2].set_id = bad_sets[i];
    CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
    char want[96];
    snprintf(want, sizeof want, "set 1: id '%s' is not 's' and a number from 1 to 9223372036854775807", bad_sets[i]);
    expect_rejected(buf, len, want);
    free(buf);
  }
  sample(&d, sets, leases);
  leases[1].id = "l18446744073709551615";
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "lease 1: id 'l18446744073709551615' is not 'l'");
  free(buf);
  sample(&d, sets, leases);
  leases[0].id = "s4"; /* a set's letter on a lease */
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  expect_rejected(buf, len, "lease 0: id 's4' is not 'l'");
  free(buf);
  /* The largest counter is an id and a generation; one past it, and 0, are not generations. */
  sample(&d, sets, leases);
  sets[1].id = leases[2].set_id = "s9223372036854775807";
  d.generation = SETDESC_COUNTER_MAX;
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
  CHECK_EQ_INT(setdesc_read(buf, len, &out, &err), 0);
  CHECK(out.nsets == 2 && strcmp(out.sets[1].id, "s9223372036854775807") == 0);
  CHECK(out.generation == SETDESC_COUNTER_MAX);
  setdesc_free(&out);
  free(buf);
  static const uint64_t bad_gens[] = {0, SETDESC_COUNTER_MAX + 1, UINT64_MAX};
  for (size_t i = 0; i < 3; i++) {
    sample(&d, sets, leases);
    d.generation = bad_gens[i];
    CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), 0);
    char want[64];
    snprintf(want, sizeof want, "generation %llu is not a number", (unsigned long long)bad_gens[i]);
    expect_rejected(buf, len, want);
    free(buf);
  }
}

/* The counter reader alone: what survive.c reads from "wd-sets-<generation>" too. */
static void test_counter_parse(void) {
  uint64_t v = 0;
  CHECK(setdesc_counter_parse("1", &v) && v == 1);
  CHECK(setdesc_counter_parse("9223372036854775807", &v) && v == SETDESC_COUNTER_MAX);
  static const char *const bad[] = {"", "0", "00", "07", "9223372036854775808", "18446744073709551615",
                                    "99999999999999999999", "184467440737095516150", "+1", "-1", " 1", "1 ", "1x",
                                    "0x10"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    v = 42;
    CHECK(!setdesc_counter_parse(bad[i], &v));
    CHECK_EQ_INT(v, 42);
  }
}

static void test_writer_refuses(void) {
  struct setdesc d;
  struct setdesc_set sets[2];
  struct setdesc_lease leases[3];
  struct wd_error err = {0};
  unsigned char *buf = NULL;
  size_t len = 0;
  sample(&d, sets, leases);
  sets[1].handle_kind = WD_HANDLE_CUDA_IPC;
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "cuda_ipc handles cannot be described");
  CHECK(buf == NULL);
  sample(&d, sets, leases);
  leases[0].id = "l123456789012345678901234";
  CHECK_EQ_INT(setdesc_write(&d, &buf, &len, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "lease id");
}

int main(void) {
  struct wd_error err = {0};
  if (ttab_write(2, get_tensor, NULL, 268, &table, &table_len, &err) != 0) {
    fprintf(stderr, "cannot write the sample table: %s\n", err.msg);
    return 1;
  }
  RUN(test_round_trip);
  RUN(test_every_truncation_rejected);
  RUN(test_bad_header_rejected);
  RUN(test_version_1_read);
  RUN(test_bad_ids_rejected);
  RUN(test_bad_body_rejected);
  RUN(test_bad_counters_rejected);
  RUN(test_counter_parse);
  RUN(test_writer_refuses);
  free(table);
  return tu_finish();
}
