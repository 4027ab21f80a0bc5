/*
 * test_msg.c - the op catalogue, strict request parsing, field accessors,
 * the exact text of replies and events, and the handle hex codec.
 */
#include <stdint.h>

#include "handles.h"
#include "json_strict.h"
#include "jsonutil.h"
#include "msg.h"
#include "testutil.h"

/* ---- the catalogue ------------------------------------------------------ */

static void test_op_names(void) {
  static const char *const names[] = {"hello",  "open",    "close", "prefetch", "load",    "cancel",
                                      "attach", "release", "evict", "status",   "shutdown", "health",
                                      "load_group", "reclaim", "scrub"};
  CHECK_EQ_INT(MSG_OP_COUNT, sizeof names / sizeof names[0]);
  for (int i = 0; i < MSG_OP_COUNT; i++) {
    const char *n = msg_op_name((enum msg_op)i);
    CHECK(n != NULL && strcmp(n, names[i]) == 0);
    CHECK_EQ_INT(msg_op_from_name(names[i]), i);

    char json[64];
    snprintf(json, sizeof json, "{\"op\":\"%s\"}", names[i]);
    struct msg_request req;
    struct wd_error err = {0};
    CHECK_EQ_INT(msg_request_parse(json, strlen(json), &req, &err), 0);
    CHECK_EQ_INT(req.op, i);
    CHECK(req.id == NULL);
    msg_request_free(&req);
  }
  CHECK_EQ_INT(msg_op_from_name("HELLO"), MSG_OP_UNKNOWN);
  CHECK_EQ_INT(msg_op_from_name("hello "), MSG_OP_UNKNOWN);
  CHECK_EQ_INT(msg_op_from_name(""), MSG_OP_UNKNOWN);
  CHECK_EQ_INT(msg_op_from_name(NULL), MSG_OP_UNKNOWN);
  CHECK(msg_op_name(MSG_OP_COUNT) == NULL);
  CHECK(msg_op_name(MSG_OP_UNKNOWN) == NULL);
}

/* ---- parsing ------------------------------------------------------------ */

/* The handle kinds' wire names are protocol: fixed, distinct, and read back to their kind. */
static void test_handle_kinds(void) {
  CHECK(strcmp(wd_handle_kind_name(WD_HANDLE_FD), "fd") == 0);
  CHECK(strcmp(wd_handle_kind_name(WD_HANDLE_CUDA_IPC), "cuda_ipc") == 0);
  CHECK(strcmp(wd_handle_kind_name(WD_HANDLE_CUDA_VMM), "cuda_vmm") == 0);
  CHECK_EQ_INT(WD_HANDLE_KIND_COUNT, 3);
  for (int k = 0; k < WD_HANDLE_KIND_COUNT; k++)
    CHECK_EQ_INT(wd_handle_kind_from_name(wd_handle_kind_name((enum wd_handle_kind)k)), k);
  CHECK_EQ_INT(wd_handle_kind_from_name("cuda_fabric"), -1); /* a kind this build does not know */
  CHECK_EQ_INT(wd_handle_kind_from_name("FD"), -1);          /* names are exact */
  CHECK_EQ_INT(wd_handle_kind_from_name(""), -1);
  CHECK_EQ_INT(wd_handle_kind_from_name(NULL), -1);
  CHECK(strcmp(wd_handle_kind_name(WD_HANDLE_KIND_COUNT), "?") == 0);
  CHECK(wd_handle_kind_has_fd(WD_HANDLE_FD) && wd_handle_kind_has_fd(WD_HANDLE_CUDA_VMM));
  CHECK(!wd_handle_kind_has_fd(WD_HANDLE_CUDA_IPC));
  /* A client that lists no kinds speaks what libweightd spoke before cuda_vmm existed. */
  CHECK_EQ_INT(WD_HANDLES_DEFAULT, WD_HANDLE_BIT(WD_HANDLE_FD) | WD_HANDLE_BIT(WD_HANDLE_CUDA_IPC));
}

static void test_parse_ok(void) {
  const char *j =
      "{\"op\":\"load\",\"id\":7,\"path\":\"/models/q\",\"tp_rank\":3,\"pin\":true,"
      "\"plan\":{\"tp_size\":8,\"names\":[\"a\",\"b\"]},\"max\":9007199254740991}";
  struct msg_request req;
  struct wd_error err = {0};
  CHECK_EQ_INT(msg_request_parse(j, strlen(j), &req, &err), 0);
  CHECK_EQ_INT(req.op, MSG_OP_LOAD);
  CHECK(cJSON_IsNumber(req.id) && req.id->valuedouble == 7);

  const char *path = NULL;
  CHECK_EQ_INT(msg_get_string(&req.args, "path", true, &path, &err), 1);
  CHECK(path != NULL && strcmp(path, "/models/q") == 0);
  uint64_t u = 0;
  CHECK_EQ_INT(msg_get_u64(&req.args, "tp_rank", true, 0, 7, &u, &err), 1);
  CHECK_EQ_INT(u, 3);
  CHECK_EQ_INT(msg_get_u64(&req.args, "max", true, 0, UINT64_MAX, &u, &err), 1);
  CHECK(u == (UINT64_C(1) << 53) - 1);
  bool b = false;
  CHECK_EQ_INT(msg_get_bool(&req.args, "pin", false, false, &b, &err), 1);
  CHECK(b);
  struct msg_obj plan;
  CHECK_EQ_INT(msg_get_object(&req.args, "plan", true, &plan, &err), 1);
  CHECK(strcmp(plan.path, "plan") == 0);
  CHECK_EQ_INT(msg_get_u64(&plan, "tp_size", true, 0, 1024, &u, &err), 1);
  CHECK_EQ_INT(u, 8);

  /* Absent optional fields give their defaults and return 0. */
  CHECK_EQ_INT(msg_get_u64(&req.args, "ep_rank", false, 5, 10, &u, &err), 0);
  CHECK_EQ_INT(u, 5);
  b = false;
  CHECK_EQ_INT(msg_get_bool(&req.args, "verify", false, true, &b, &err), 0);
  CHECK(b);
  path = "x";
  CHECK_EQ_INT(msg_get_string(&req.args, "device", false, &path, &err), 0);
  CHECK(path == NULL);
  struct msg_obj none;
  CHECK_EQ_INT(msg_get_object(&req.args, "opts", false, &none, &err), 0);
  CHECK(none.json == NULL);
  CHECK_EQ_INT(msg_get_u64(&none, "x", false, 1, 10, &u, &err), 0);

  msg_request_free(&req);
  msg_request_free(&req); /* idempotent */

  /* String ids up to 128 bytes; negative integer ids. */
  char big[256];
  char idstr[130];
  memset(idstr, 'x', 128);
  idstr[128] = '\0';
  snprintf(big, sizeof big, "{\"id\":\"%s\",\"op\":\"status\"}", idstr);
  CHECK_EQ_INT(msg_request_parse(big, strlen(big), &req, &err), 0);
  CHECK(cJSON_IsString(req.id) && strlen(req.id->valuestring) == 128);
  msg_request_free(&req);
  j = " {\"op\":\"status\",\"id\":-42} \n";
  CHECK_EQ_INT(msg_request_parse(j, strlen(j), &req, &err), 0);
  CHECK(cJSON_IsNumber(req.id) && req.id->valuedouble == -42);
  msg_request_free(&req);
}

/* The request is read from a buffer with no terminating NUL (ASan checks bounds). */
static void test_parse_unterminated(void) {
  const char *j = "{\"op\":\"attach\",\"id\":\"a\",\"n\":12345}";
  size_t n = strlen(j);
  char *buf = malloc(n);
  memcpy(buf, j, n);
  struct msg_request req;
  struct wd_error err = {0};
  CHECK_EQ_INT(msg_request_parse(buf, n, &req, &err), 0);
  CHECK_EQ_INT(req.op, MSG_OP_ATTACH);
  uint64_t u = 0;
  CHECK_EQ_INT(msg_get_u64(&req.args, "n", true, 0, UINT64_MAX, &u, &err), 1);
  CHECK_EQ_INT(u, 12345);
  msg_request_free(&req);
  /* A prefix of a valid request is not valid. */
  CHECK_EQ_INT(msg_request_parse(buf, n - 1, &req, &err), WEIGHTD_E_BAD_REQUEST);
  msg_request_free(&req);
  free(buf);
}

struct bad_case {
  const char *json;
  size_t len; /* 0: strlen */
  const char *needle;
};

static void test_parse_bad(void) {
  char long_id[300];
  snprintf(long_id, sizeof long_id, "{\"op\":\"hello\",\"id\":\"%0129d\"}", 0);
  static const char raw_nul[] = "{\"op\":\"hello\"}\0 ";
  const struct bad_case cases[] = {
      {"", 0, "not valid JSON"},
      {"[]", 0, "must be a JSON object, not an array"},
      {"\"op\"", 0, "must be a JSON object, not a string"},
      {"42", 0, "must be a JSON object, not a number"},
      {"null", 0, "must be a JSON object"},
      {"{}", 0, "missing field 'op'"},
      {"{\"id\":1}", 0, "missing field 'op'"},
      {"{\"op\":1}", 0, "field 'op' must be a string, not a number"},
      {"{\"op\":[\"hello\"]}", 0, "field 'op' must be a string, not an array"},
      {"{\"op\":null}", 0, "field 'op' must be a string, not null"},
      {"{\"op\":\"frobnicate\"}", 0, "unknown op 'frobnicate'"},
      {"{\"op\":\"Hello\"}", 0, "unknown op 'Hello'"},
      {"{\"op\":\"he\\nllo\"}", 0, "unknown op 'he\\x0allo'"},
      {"{\"op\":\"hello\",\"id\":[1]}", 0,
       "field 'id' must be a string of at most 128 bytes or an integer, not an array"},
      {"{\"op\":\"hello\",\"id\":{}}", 0, "field 'id' must be a string"},
      {"{\"op\":\"hello\",\"id\":true}", 0, "field 'id' must be a string"},
      {"{\"op\":\"hello\",\"id\":null}", 0, "field 'id' must be a string"},
      {"{\"op\":\"hello\",\"id\":1.5}", 0, "field 'id' must be an integer"},
      {"{\"op\":\"hello\",\"id\":9007199254740992}", 0, "field 'id' must be an integer"},
      {"{\"op\":\"hello\",\"id\":1e300}", 0, "field 'id' must be an integer"},
      {long_id, 0, "field 'id' is a string of 129 bytes"},
      {"{\"op\":\"hello\",\"op\":\"load\"}", 0, "duplicate field 'op'"},
      {"{\"op\":\"hello\",\"plan\":{\"a\":1,\"b\":2,\"a\":3}}", 0, "duplicate field 'plan.a'"},
      {"{\"op\":\"open\",\"path\":\"/m/a\\u0000b\"}", 0, "field 'path' contains a NUL character"},
      {"{\"op\":\"open\",\"plan\":{\"x\":[\"a\",\"b\\u0000\"]}}", 0,
       "field 'plan.x[1]' contains a NUL"},
      {"{\"op\":\"open\",\"a\\u0000b\":1}", 0, "member name 'a\\x00b' contains a NUL"},
      {"{\"op\":\"hello\"} x", 0, "not valid JSON"},
      {"{\"op\":\"hello\",}", 0, "not valid JSON"},
      {"{\"op\":\"hello\",\"n\":01}", 0, "not valid JSON"},
      {"{\"op\":\"hello\",\"n\":1e999}", 0, "not valid JSON"},
      {"{'op':'hello'}", 0, "not valid JSON"},
      {"{\"op\":\"hel\xffo\"}", 0, "not valid UTF-8"},
      {"{\"op\":\"hello\",\"s\":\"\\ud800\"}", 0, "not valid JSON"},
      {raw_nul, sizeof raw_nul - 1, "not valid JSON"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct msg_request req;
    struct wd_error err = {0};
    size_t len = cases[i].len ? cases[i].len : strlen(cases[i].json);
    int rc = msg_request_parse(cases[i].json, len, &req, &err);
    CHECK_EQ_INT(rc, WEIGHTD_E_BAD_REQUEST);
    CHECK_STR_CONTAINS(err.msg, cases[i].needle);
    if (rc != WEIGHTD_E_BAD_REQUEST || strstr(err.msg, cases[i].needle) == NULL)
      fprintf(stderr, "  case %zu: %s\n", i, cases[i].json);
    msg_request_free(&req);
  }

  /* The id survives a later failure so that the error reply can echo it. */
  const char *j = "{\"id\":\"r1\",\"op\":\"nope\"}";
  struct msg_request req;
  struct wd_error err = {0};
  CHECK_EQ_INT(msg_request_parse(j, strlen(j), &req, &err), WEIGHTD_E_BAD_REQUEST);
  CHECK(cJSON_IsString(req.id) && strcmp(req.id->valuestring, "r1") == 0);
  cJSON *rep = msg_reply_error(req.id, err.code, err.msg);
  char *text = msg_serialize(rep);
  CHECK(text != NULL && strcmp(text,
                               "{\"id\":\"r1\",\"error\":{\"code\":\"BAD_REQUEST\",\"message\":"
                               "\"unknown op 'nope'\"}}") == 0);
  free(text);
  cJSON_Delete(rep);
  msg_request_free(&req);
}

static void test_accessors_bad(void) {
  const char *j =
      "{\"op\":\"load\",\"s\":1,\"n\":\"x\",\"neg\":-1,\"frac\":1.5,\"two53\":9007199254740992,"
      "\"two53p1\":9007199254740993,\"huge\":1e20,\"b\":\"true\",\"o\":[],\"a\":{},\"nul\":null,"
      "\"ten\":10,\"negzero\":-0,\"plan\":{\"tp_rank\":-2,\"inner\":{\"k\":0.25}}}";
  struct msg_request req;
  struct wd_error err = {0};
  CHECK_EQ_INT(msg_request_parse(j, strlen(j), &req, &err), 0);
  const struct msg_obj *o = &req.args;
  const char *s;
  uint64_t u = 77;
  bool b;
  struct msg_obj sub;

#define BAD(call, needle)                        \
  do {                                           \
    err.msg[0] = '\0';                           \
    CHECK_EQ_INT((call), WEIGHTD_E_BAD_REQUEST); \
    CHECK_STR_CONTAINS(err.msg, needle);         \
  } while (0)

  BAD(msg_get_string(o, "s", true, &s, &err), "field 's' must be a string, not a number");
  BAD(msg_get_string(o, "nul", false, &s, &err), "field 'nul' must be a string, not null");
  BAD(msg_get_string(o, "path", true, &s, &err), "missing field 'path'");
  BAD(msg_get_u64(o, "n", true, 0, 100, &u, &err),
      "field 'n' must be a non-negative integer, not a string");
  BAD(msg_get_u64(o, "neg", true, 0, 100, &u, &err), "field 'neg' must not be negative");
  BAD(msg_get_u64(o, "frac", true, 0, 100, &u, &err), "field 'frac' must be an integer (got 1.5)");
  BAD(msg_get_u64(o, "two53", true, 0, UINT64_MAX, &u, &err),
      "field 'two53' is too large: integers above 2^53 - 1 (9007199254740991)");
  BAD(msg_get_u64(o, "two53p1", true, 0, UINT64_MAX, &u, &err), "field 'two53p1' is too large");
  BAD(msg_get_u64(o, "huge", true, 0, UINT64_MAX, &u, &err), "field 'huge' is too large");
  BAD(msg_get_u64(o, "ten", true, 0, 9, &u, &err), "field 'ten' is 10, above the maximum 9");
  BAD(msg_get_u64(o, "nul", false, 0, 9, &u, &err),
      "field 'nul' must be a non-negative integer, not null");
  BAD(msg_get_u64(o, "tp_rank", true, 0, 9, &u, &err), "missing field 'tp_rank'");
  BAD(msg_get_bool(o, "b", true, false, &b, &err), "field 'b' must be true or false, not a string");
  BAD(msg_get_bool(o, "ten", true, false, &b, &err),
      "field 'ten' must be true or false, not a number");
  BAD(msg_get_object(o, "o", true, &sub, &err), "field 'o' must be an object, not an array");
  BAD(msg_get_object(o, "missing", true, &sub, &err), "missing field 'missing'");

  /* Nested objects name the whole path. */
  struct msg_obj plan, inner;
  CHECK_EQ_INT(msg_get_object(o, "plan", true, &plan, &err), 1);
  BAD(msg_get_u64(&plan, "tp_rank", true, 0, 9, &u, &err),
      "field 'plan.tp_rank' must not be negative (got -2)");
  BAD(msg_get_u64(&plan, "tp_size", true, 0, 9, &u, &err), "missing field 'plan.tp_size'");
  CHECK_EQ_INT(msg_get_object(&plan, "inner", true, &inner, &err), 1);
  BAD(msg_get_u64(&inner, "k", true, 0, 9, &u, &err),
      "field 'plan.inner.k' must be an integer (got 0.25)");
#undef BAD

  /* -0 reads as 0; a failed read leaves nothing half-set that matters. */
  CHECK_EQ_INT(msg_get_u64(o, "negzero", true, 0, 9, &u, &err), 1);
  CHECK_EQ_INT(u, 0);
  msg_request_free(&req);
}

/* ---- replies ------------------------------------------------------------ */

static void check_json(cJSON *j, const char *want) {
  CHECK(j != NULL);
  char *text = msg_serialize(j);
  CHECK(text != NULL && strcmp(text, want) == 0);
  if (text != NULL && strcmp(text, want) != 0)
    fprintf(stderr, "  got  %s\n  want %s\n", text, want);
  free(text);
  cJSON_Delete(j);
}

static void test_replies(void) {
  cJSON *id7 = cJSON_CreateNumber(7), *ids = cJSON_CreateString("a\"b"),
        *idbig = cJSON_CreateNumber(9007199254740991.0), *idneg = cJSON_CreateNumber(-42);
  check_json(msg_reply_ok(id7), "{\"id\":7,\"ok\":true}");
  check_json(msg_reply_ok(ids), "{\"id\":\"a\\\"b\",\"ok\":true}");
  check_json(msg_reply_ok(idbig), "{\"id\":9007199254740991,\"ok\":true}");
  check_json(msg_reply_ok(idneg), "{\"id\":-42,\"ok\":true}");
  check_json(msg_reply_ok(NULL), "{\"ok\":true}");

  cJSON *r = msg_reply_ok(id7);
  CHECK_EQ_INT(json_u64_add(r, "bytes", UINT64_C(1) << 63), 0);
  CHECK_EQ_INT(msg_add_string(r, "name", "w\xff\xfe.bin"), 0);
  check_json(r, "{\"id\":7,\"ok\":true,\"bytes\":9223372036854775808,\"name\":\"w\xEF\xBF\xBD\xEF\xBF\xBD.bin\"}");

  check_json(msg_reply_error(id7, WEIGHTD_E_BAD_REQUEST, "unknown op 'x'"),
             "{\"id\":7,\"error\":{\"code\":\"BAD_REQUEST\",\"message\":\"unknown op 'x'\"}}");
  check_json(msg_reply_error(NULL, WEIGHTD_E_DEVICE_NOMEM, NULL),
             "{\"error\":{\"code\":\"DEVICE_NOMEM\",\"message\":\"device out of memory\"}}");
  check_json(msg_reply_error(ids, WEIGHTD_E_PATH_DENIED, "/etc\n\"x\"\xc3\x28"),
             "{\"id\":\"a\\\"b\",\"error\":{\"code\":\"PATH_DENIED\",\"message\":\"/"
             "etc\\n\\\"x\\\"\xEF\xBF\xBD(\"}}");
  /* Strings added by any call, keys too, are replaced when serialized (the status reply's metrics). */
  r = msg_reply_ok(id7);
  cJSON *m = cJSON_AddObjectToObject(r, "metrics");
  CHECK(cJSON_AddStringToObject(m, "p\xff", "/m/\xe2\x82\"") != NULL);
  check_json(r, "{\"id\":7,\"ok\":true,\"metrics\":{\"p\xEF\xBF\xBD\":\"/m/\xEF\xBF\xBD\\\"\"}}");
  check_json(
      msg_event_progress(id7, 1, UINT64_C(1) << 63),
      "{\"id\":7,\"event\":\"progress\",\"bytes_done\":1,\"bytes_total\":9223372036854775808}");
  r = msg_event(NULL, "shutdown");
  CHECK_EQ_INT(msg_add_string(r, "message", "daemon is stopping"), 0);
  check_json(r, "{\"event\":\"shutdown\",\"message\":\"daemon is stopping\"}");
  check_json(msg_event_progress(NULL, 0, 0),
             "{\"event\":\"progress\",\"bytes_done\":0,\"bytes_total\":0}");

  /* Every byte count prints exactly and reads back exactly. */
  static const uint64_t vals[] = {0,
                                  1,
                                  (UINT64_C(1) << 53) - 1,
                                  (UINT64_C(1) << 53) + 1,
                                  UINT64_C(8040000000),
                                  (UINT64_C(1) << 63) - 1,
                                  UINT64_C(1) << 63,
                                  UINT64_MAX};
  for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
    cJSON *o = cJSON_CreateObject();
    CHECK_EQ_INT(json_u64_add(o, "v", vals[i]), 0);
    char *text = msg_serialize(o);
    char want[64];
    snprintf(want, sizeof want, "{\"v\":%" PRIu64 "}", vals[i]);
    CHECK(text != NULL && strcmp(text, want) == 0);
    struct sj_doc doc;
    CHECK_EQ_INT(sj_parse(text, strlen(text), 8, &doc, NULL, 0), 0);
    uint64_t back = 0;
    CHECK(doc.root != NULL && sj_u64(doc.root->child, &back) && back == vals[i]);
    sj_doc_free(&doc);
    free(text);
    cJSON_Delete(o);
  }

  /* A reply parses back with the id it was built from. */
  r = msg_reply_ok(idbig);
  char *text = msg_serialize(r);
  cJSON *back = cJSON_Parse(text);
  CHECK(back != NULL && cJSON_GetObjectItem(back, "id")->valuedouble == 9007199254740991.0);
  cJSON_Delete(back);
  free(text);
  cJSON_Delete(r);

  cJSON_Delete(id7);
  cJSON_Delete(ids);
  cJSON_Delete(idbig);
  cJSON_Delete(idneg);
}

/* ---- hex ---------------------------------------------------------------- */

static void test_hex(void) {
  unsigned char raw[64], back[64];
  for (int i = 0; i < 64; i++) raw[i] = (unsigned char)(i * 37 + 11);
  raw[0] = 0x00;
  raw[1] = 0xff;
  raw[2] = 0xa5;
  char hex[129];
  msg_hex_encode(raw, 64, hex);
  CHECK_EQ_INT(strlen(hex), 128);
  CHECK(strncmp(hex, "00ffa5", 6) == 0);
  for (int i = 0; i < 128; i++)
    CHECK((hex[i] >= '0' && hex[i] <= '9') || (hex[i] >= 'a' && hex[i] <= 'f'));
  CHECK_EQ_INT(msg_hex_decode(hex, back, 64), 0);
  CHECK(memcmp(raw, back, 64) == 0);

  char bad[140];
  /* Uppercase. */
  memcpy(bad, hex, 129);
  bad[3] = 'F';
  CHECK_EQ_INT(msg_hex_decode(bad, back, 64), WEIGHTD_E_INVALID);
  /* Not hex. */
  memcpy(bad, hex, 129);
  bad[100] = 'g';
  CHECK_EQ_INT(msg_hex_decode(bad, back, 64), WEIGHTD_E_INVALID);
  bad[100] = ' ';
  CHECK_EQ_INT(msg_hex_decode(bad, back, 64), WEIGHTD_E_INVALID);
  /* Odd, short and long. */
  memcpy(bad, hex, 129);
  bad[127] = '\0';
  CHECK_EQ_INT(msg_hex_decode(bad, back, 64), WEIGHTD_E_INVALID);
  bad[126] = '\0';
  CHECK_EQ_INT(msg_hex_decode(bad, back, 64), WEIGHTD_E_INVALID);
  memcpy(bad, hex, 129);
  bad[128] = '0';
  bad[129] = '0';
  bad[130] = '\0';
  CHECK_EQ_INT(msg_hex_decode(bad, back, 64), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(msg_hex_decode("0x00", back, 2), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(msg_hex_decode(NULL, back, 1), WEIGHTD_E_INVALID);
  CHECK_EQ_INT(msg_hex_decode("", back, 0), 0);
  CHECK_EQ_INT(msg_hex_decode("7f", back, 1), 0);
  CHECK_EQ_INT(back[0], 0x7f);
}

int main(void) {
  RUN(test_op_names);
  RUN(test_handle_kinds);
  RUN(test_parse_ok);
  RUN(test_parse_unterminated);
  RUN(test_parse_bad);
  RUN(test_accessors_bad);
  RUN(test_replies);
  RUN(test_hex);
  return tu_finish();
}
