/*
 * test_json_strict.c - the strict JSON parser (sj_parse, sj_u64), the
 * UTF-8 validator (sj_utf8_valid) and the replacement of what is not UTF-8
 * (sj_utf8_replace).
 *
 * The parser's contract is serde_json's, the parser behind the reference
 * safetensors package: RFC 8259 exactly, nesting at most 127 containers,
 * numbers that overflow a double refused, paired surrogates only. Each test
 * checks the decoded values or the refusal and the reason given in `why`.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_strict.h"
#include "testutil.h"

/* ---- helpers ------------------------------------------------------------- */

static char why[256];

/* Parses the NUL-terminated text s with the default depth limit. */
static int parse(const char *s, struct sj_doc *doc) {
  why[0] = '\0';
  return sj_parse(s, strlen(s), SJ_DEFAULT_MAX_DEPTH, doc, why, sizeof why);
}

/*
 * Parses s into a malloc'd copy of exactly its length (no terminating NUL, so
 * that AddressSanitizer catches a read past the end) and frees the document.
 * Returns sj_parse's result; `why` holds the reason.
 */
static int parse_len(const char *s, size_t len, unsigned max_depth) {
  char *copy = malloc(len ? len : 1);
  if (copy == NULL) return -2;
  memcpy(copy, s, len);
  struct sj_doc doc;
  why[0] = '\0';
  int rc = sj_parse(copy, len, max_depth, &doc, why, sizeof why);
  if (rc == 0)
    CHECK(doc.root != NULL);
  else
    CHECK(doc.root == NULL && doc.arena == NULL);
  sj_doc_free(&doc);
  free(copy);
  return rc;
}

static int parse_str(const char *s) { return parse_len(s, strlen(s), SJ_DEFAULT_MAX_DEPTH); }

/* Refusal of s, with a reason containing `reason`; reports the caller's line. */
#define CHECK_REFUSES(s, reason)     \
  do {                               \
    CHECK_EQ_INT(parse_str(s), -1);  \
    CHECK_STR_CONTAINS(why, reason); \
  } while (0)

#define CHECK_ACCEPTS(s)                                         \
  do {                                                           \
    int rc_ = parse_str(s);                                      \
    if (rc_ != 0) fprintf(stderr, "  refused %s: %s\n", s, why); \
    CHECK_EQ_INT(rc_, 0);                                        \
  } while (0)

/* A string of depth d of nested containers: "[[[...]]]" or, when mixed, "[{"a":[{"a":...}]}]". */
static char *nested(size_t d, int mixed) {
  char *s = malloc(d * 6 + 2);
  if (s == NULL) return NULL;
  size_t o = 0;
  for (size_t i = 0; i < d; i++) {
    if (mixed && i % 2 == 1) {
      memcpy(s + o, "{\"a\":", 5);
      o += 5;
    } else {
      s[o++] = '[';
    }
  }
  for (size_t i = d; i-- > 0;) s[o++] = (mixed && i % 2 == 1) ? '}' : ']';
  s[o] = '\0';
  return s;
}

/* ---- values ---------------------------------------------------------------- */

static void test_scalars(void) {
  static const struct {
    const char *text;
    enum sj_type type;
    size_t offset;
  } cases[] = {
      {"null", SJ_NULL, 0},       {"true", SJ_TRUE, 0},        {"false", SJ_FALSE, 0},
      {" \t\r\n0", SJ_NUMBER, 4}, {"\"x\"  \n", SJ_STRING, 0}, {"\n[]", SJ_ARRAY, 1},
      {"{} ", SJ_OBJECT, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct sj_doc doc;
    CHECK_EQ_INT(parse(cases[i].text, &doc), 0);
    if (doc.root == NULL) continue;
    CHECK_EQ_INT(doc.root->type, cases[i].type);
    CHECK_EQ_INT(doc.root->offset, cases[i].offset);
    CHECK_EQ_INT(doc.root->count, 0);
    CHECK(doc.root->child == NULL);
    sj_doc_free(&doc);
  }
}

static void test_numbers_keep_raw_text(void) {
  static const char *const nums[] = {"0",       "-0",      "7",
                                     "-1.5e+3", "1E5",     "0.0",
                                     "1e-400",  "-0.0e-0", "123456789012345678901234567890",
                                     "1e308"};
  for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
    char text[64];
    snprintf(text, sizeof text, "[ %s ]", nums[i]);
    struct sj_doc doc;
    CHECK_EQ_INT(parse(text, &doc), 0);
    if (doc.root == NULL) continue;
    const struct sj_node *n = doc.root->child;
    CHECK_EQ_INT(n->type, SJ_NUMBER);
    CHECK_EQ_INT(n->len, strlen(nums[i]));
    CHECK(n->len == strlen(nums[i]) && memcmp(n->str, nums[i], n->len) == 0);
    CHECK_EQ_INT(n->offset, 2);
    sj_doc_free(&doc);
  }
}

static void test_object_and_array_tree(void) {
  const char *text = "{\"a\": [1, \"two\", {\"b\": null}], \"c\": true, \"\": false}";
  struct sj_doc doc;
  CHECK_EQ_INT(parse(text, &doc), 0);
  if (doc.root == NULL) return;
  const struct sj_node *r = doc.root;
  CHECK_EQ_INT(r->type, SJ_OBJECT);
  CHECK_EQ_INT(r->count, 3);
  const struct sj_node *a = r->child;
  CHECK_EQ_INT(a->key_len, 1);
  CHECK(strcmp(a->key, "a") == 0);
  CHECK_EQ_INT(a->type, SJ_ARRAY);
  CHECK_EQ_INT(a->count, 3);
  CHECK_EQ_INT(a->offset, 6);
  const struct sj_node *e1 = a->child, *e2 = e1->next, *e3 = e2->next;
  CHECK(e1->type == SJ_NUMBER && e1->len == 1 && e1->str[0] == '1');
  CHECK(e1->key == NULL);
  CHECK(e2->type == SJ_STRING && e2->len == 3 && strcmp(e2->str, "two") == 0);
  CHECK_EQ_INT(e2->offset, 10);
  CHECK(e3->type == SJ_OBJECT && e3->count == 1 && e3->next == NULL);
  CHECK(strcmp(e3->child->key, "b") == 0 && e3->child->type == SJ_NULL);
  const struct sj_node *c = a->next;
  CHECK(strcmp(c->key, "c") == 0 && c->type == SJ_TRUE);
  const struct sj_node *empty = c->next;
  CHECK(empty->key_len == 0 && empty->key[0] == '\0' && empty->type == SJ_FALSE);
  CHECK(empty->next == NULL);
  sj_doc_free(&doc);
}

/* Objects keep every member in order, repeated keys included: dedup is the caller's. */
static void test_repeated_keys_are_kept(void) {
  struct sj_doc doc;
  CHECK_EQ_INT(parse("{\"k\":1,\"k\":2}", &doc), 0);
  if (doc.root == NULL) return;
  CHECK_EQ_INT(doc.root->count, 2);
  CHECK(doc.root->child->str[0] == '1' && doc.root->child->next->str[0] == '2');
  sj_doc_free(&doc);
}

/* ---- strings --------------------------------------------------------------- */

/* Parses the JSON string literal `lit` and compares its decoded bytes with want[0..wlen). */
static int decodes_to(const char *lit, const char *want, size_t wlen) {
  struct sj_doc doc;
  if (parse(lit, &doc) != 0) {
    fprintf(stderr, "  %s refused: %s\n", lit, why);
    return 0;
  }
  const struct sj_node *n = doc.root;
  int ok = n->type == SJ_STRING && n->len == wlen && memcmp(n->str, want, wlen) == 0 &&
           n->str[wlen] == '\0';
  sj_doc_free(&doc);
  return ok;
}

static void test_string_escapes(void) {
  CHECK(decodes_to("\"plain\"", "plain", 5));
  CHECK(decodes_to("\"\"", "", 0));
  CHECK(decodes_to("\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\/\b\f\n\r\t", 8));
  CHECK(decodes_to("\"\\u0041\"", "A", 1));
  CHECK(decodes_to("\"\\u00e9\"", "\xC3\xA9", 2));
  CHECK(decodes_to("\"\\u00C9\"", "\xC3\x89", 2));
  CHECK(decodes_to("\"\\u07FF\"", "\xDF\xBF", 2));
  CHECK(decodes_to("\"\\u0800\"", "\xE0\xA0\x80", 3));
  CHECK(decodes_to("\"\\u20ac\"", "\xE2\x82\xAC", 3));
  CHECK(decodes_to("\"\\uFFFF\"", "\xEF\xBF\xBF", 3));
  CHECK(decodes_to("\"\\ud83d\\ude00\"", "\xF0\x9F\x98\x80", 4));
  CHECK(decodes_to("\"\\uD800\\uDC00\"", "\xF0\x90\x80\x80", 4));
  CHECK(decodes_to("\"\\udbff\\udfff\"", "\xF4\x8F\xBF\xBF", 4));
  CHECK(decodes_to("\"a\\u0000b\"", "a\0b", 3));
  CHECK(decodes_to("\"x\\n\\u00e9y\\t\"", "x\n\xC3\xA9y\t", 6));
  /* Raw UTF-8 and DEL pass through untouched. */
  CHECK(decodes_to("\"\xC3\xA9\xF0\x9F\x98\x80\x7F\"", "\xC3\xA9\xF0\x9F\x98\x80\x7F", 7));
}

static void test_object_keys_are_decoded(void) {
  struct sj_doc doc;
  CHECK_EQ_INT(parse("{\"k\\u00e9\\n\":1}", &doc), 0);
  if (doc.root == NULL) return;
  const struct sj_node *m = doc.root->child;
  CHECK_EQ_INT(m->key_len, 4);
  CHECK(memcmp(m->key, "k\xC3\xA9\n", 4) == 0 && m->key[4] == '\0');
  sj_doc_free(&doc);
}

static void test_string_errors(void) {
  CHECK_REFUSES("\"\\ud800\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ude00\"", "lone trailing surrogate");
  CHECK_REFUSES("\"\\udc00\"", "lone trailing surrogate");
  CHECK_REFUSES("\"\\udbff\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ud800\\udbff\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ud800\\ue000\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\udfff\"", "lone trailing surrogate");
  CHECK_REFUSES("\"\\ud800\\u0041\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ud800\\ud800\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ud800x\\udc00\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ud800\\n\"", "lone leading surrogate");
  CHECK_REFUSES("\"\\ude00\\ud800\"", "lone trailing surrogate");
  CHECK_REFUSES("\"\\ud800\\udc0\"", "surrogate");
  CHECK_REFUSES("\"\\uzzzz\"", "invalid \\u escape");
  CHECK_REFUSES("\"\\u12\"", "invalid \\u escape");
  CHECK_REFUSES("\"\\u12G4\"", "invalid \\u escape");
  CHECK_REFUSES("\"\\U0041\"", "invalid escape");
  CHECK_REFUSES("\"\\x41\"", "invalid escape");
  CHECK_REFUSES("\"\\'\"", "invalid escape");
  CHECK_REFUSES("\"\\a\"", "invalid escape");
  CHECK_REFUSES("\"a\x01z\"", "control character U+0001");
  CHECK_REFUSES("\"tab\there\"", "control character U+0009");
  CHECK_REFUSES("\"line\nbreak\"", "control character U+000A");
  CHECK_REFUSES("\"\x1f\"", "control character U+001F");
  CHECK_REFUSES("\"abc", "unterminated string");
  CHECK_REFUSES("\"abc\\\"", "unterminated string");
  CHECK_REFUSES("\"\\", "unterminated string");
  CHECK_REFUSES("\"", "unterminated string");
  CHECK_REFUSES("'single'", "expected a value");
  /* A raw NUL inside a string is a control character. */
  CHECK_EQ_INT(parse_len("\"a\0b\"", 5, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_STR_CONTAINS(why, "control character U+0000");
  /* Errors in keys are caught too. */
  CHECK_REFUSES("{\"\\ud800\":1}", "surrogate");
  CHECK_REFUSES("{\"a\x02\":1}", "control character");
}

/* ---- numbers --------------------------------------------------------------- */

static void test_numbers_invalid(void) {
  CHECK_REFUSES("01", "leading zero");
  CHECK_REFUSES("-01", "leading zero");
  CHECK_REFUSES("00", "leading zero");
  CHECK_REFUSES("[007]", "leading zero");
  CHECK_REFUSES("1.", "invalid number");
  CHECK_REFUSES("1.e5", "invalid number");
  CHECK_REFUSES(".5", "expected a value");
  CHECK_REFUSES("-", "invalid number");
  CHECK_REFUSES("-a", "invalid number");
  CHECK_REFUSES("--1", "invalid number");
  CHECK_REFUSES("-.5", "invalid number");
  CHECK_REFUSES("+1", "expected a value");
  CHECK_REFUSES("1e", "invalid number");
  CHECK_REFUSES("1e+", "invalid number");
  CHECK_REFUSES("1E-", "invalid number");
  CHECK_REFUSES("1e+-1", "invalid number");
  CHECK_REFUSES("[1.]", "invalid number");
  CHECK_REFUSES("1.5.2", "trailing characters");
  CHECK_REFUSES("0x10", "trailing characters");
  CHECK_REFUSES("1_000", "trailing characters");
  CHECK_REFUSES("Infinity", "expected a value");
  CHECK_REFUSES("-Infinity", "invalid number");
  CHECK_REFUSES("NaN", "expected a value");
}

static void test_numbers_out_of_range(void) {
  CHECK_REFUSES("1e400", "out of range");
  CHECK_REFUSES("-1e400", "out of range");
  CHECK_REFUSES("[0, 1e309]", "out of range");
  CHECK_REFUSES("2e308", "out of range");
  CHECK_REFUSES("1e99999999999999999999", "out of range");
  char big[512];
  memset(big, '9', 400);
  big[400] = '\0';
  CHECK_REFUSES(big, "out of range");
  big[0] = '-';
  CHECK_REFUSES(big, "out of range");
  memcpy(big, "1.", 2);
  strcpy(big + 2 + 397, "e400"); /* 1.999...e400 with a long fraction */
  CHECK_REFUSES(big, "out of range");
  /* In range, or rounding to zero, are accepted. */
  CHECK_ACCEPTS("1e308");
  CHECK_ACCEPTS("-1e308");
  CHECK_ACCEPTS("1.7976931348623157e308");
  CHECK_ACCEPTS("1e-400");
  CHECK_ACCEPTS("-1e-400");
  CHECK_ACCEPTS("1e-99999999999999999999");
  CHECK_ACCEPTS("0e99999999999999999999");
  CHECK_ACCEPTS("0.1e309");
  CHECK_ACCEPTS("18446744073709551616");
  memset(big, '9', 300); /* a 300-digit integer is about 1e300 */
  big[300] = '\0';
  CHECK_ACCEPTS(big);
  memcpy(big, "1", 1);
  memset(big + 1, '0', 400);
  strcpy(big + 401, "e-400"); /* 1 followed by 400 zeros, times 1e-400 */
  CHECK_ACCEPTS(big);
}

/*
 * The overflow verdict must be serde_json's, not a correctly rounded one:
 * serde_json (without its float_roundtrip feature, as safetensors 0.8.0 is
 * built) computes significand * POW10[exponent] in doubles and refuses an
 * infinite product. Near DBL_MAX that differs from strtod + isinf in both
 * directions. Verdicts captured with safetensors.deserialize 0.8.0.
 */
static void test_number_range_matches_serde_json(void) {
  CHECK_REFUSES("1.7976931348623158e308", "out of range"); /* strtod: DBL_MAX */
  CHECK_REFUSES("17976931348623158e292", "out of range");  /* strtod: DBL_MAX */
  CHECK_REFUSES("-1.7976931348623158e308", "out of range");
  /* DBL_MAX written out as its exact 309-digit integer. */
  CHECK_REFUSES(
      "17976931348623157081452742373170435679807056752584499659891747680315726078002853"
      "87605895586327668781715404589535143824642343213268894641827684675467035375169860"
      "49910576551282076245490090389328944075868508455133942304583236903222948165808559"
      "332123348274797826204144723168738177180919299881250404026184124858368",
      "out of range");
  CHECK_ACCEPTS("1.79769313486231584e308"); /* strtod: inf */
  CHECK_ACCEPTS("1.79769313486231598e308"); /* strtod: inf */
  CHECK_ACCEPTS("17976931348623157e292");
}

static void test_u64(void) {
  static const struct {
    const char *text;
    int ok;
    uint64_t want;
  } cases[] = {
      {"0", 1, 0},
      {"1", 1, 1},
      {"4294967296", 1, 4294967296ull},
      {"10000000000000000000", 1, 10000000000000000000ull},
      {"18446744073709551610", 1, 18446744073709551610ull},
      {"18446744073709551615", 1, UINT64_MAX},
      {"18446744073709551616", 0, 0},
      {"18446744073709551620", 0, 0},
      {"99999999999999999999", 0, 0},
      {"184467440737095516150", 0, 0},
      {"-0", 0, 0},
      {"-1", 0, 0},
      {"1.0", 0, 0},
      {"0.0", 0, 0},
      {"1e0", 0, 0},
      {"1E2", 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct sj_doc doc;
    CHECK_EQ_INT(parse(cases[i].text, &doc), 0);
    if (doc.root == NULL) continue;
    uint64_t v = 12345;
    int ok = sj_u64(doc.root, &v);
    if (ok != cases[i].ok) fprintf(stderr, "  sj_u64(%s) = %d\n", cases[i].text, ok);
    CHECK_EQ_INT(ok, cases[i].ok);
    if (cases[i].ok) CHECK(v == cases[i].want);
    sj_doc_free(&doc);
  }
  /* Not a number at all. */
  struct sj_doc doc;
  CHECK_EQ_INT(parse("[\"1\", true, null, [1]]", &doc), 0);
  if (doc.root != NULL) {
    uint64_t v;
    for (const struct sj_node *n = doc.root->child; n != NULL; n = n->next) CHECK(!sj_u64(n, &v));
    sj_doc_free(&doc);
  }
  uint64_t v;
  CHECK(!sj_u64(NULL, &v));
}

/* ---- literals, structure, whitespace -------------------------------------- */

static void test_literals(void) {
  CHECK_REFUSES("tru", "expected a value");
  CHECK_REFUSES("nul", "expected a value");
  CHECK_REFUSES("f", "expected a value");
  CHECK_REFUSES("True", "expected a value");
  CHECK_REFUSES("NULL", "expected a value");
  CHECK_REFUSES("nulll", "trailing characters");
  CHECK_REFUSES("falsey", "trailing characters");
  CHECK_REFUSES("[truefalse]", "expected ','");
  CHECK_REFUSES("undefined", "expected a value");
}

static void test_structure_errors(void) {
  CHECK_REFUSES("[1,]", "trailing comma");
  CHECK_REFUSES("[1, ]", "trailing comma");
  CHECK_REFUSES("{\"a\":1,}", "trailing comma");
  CHECK_REFUSES("{\"a\":1 , \n}", "trailing comma");
  CHECK_REFUSES("[,]", "expected a value");
  CHECK_REFUSES("[,1]", "expected a value");
  CHECK_REFUSES("[1,,2]", "expected a value");
  CHECK_REFUSES("{,}", "expected a string key");
  CHECK_REFUSES("[1 2]", "expected ',' or ']'");
  CHECK_REFUSES("{\"a\":1 \"b\":2}", "expected ',' or '}'");
  CHECK_REFUSES("[1}", "expected ',' or ']'");
  CHECK_REFUSES("{\"a\":1]", "expected ',' or '}'");
  CHECK_REFUSES("{\"a\" 1}", "expected ':'");
  CHECK_REFUSES("{\"a\"}", "expected ':'");
  CHECK_REFUSES("{\"a\":}", "expected a value");
  CHECK_REFUSES("{1:2}", "expected a string key");
  CHECK_REFUSES("{a:2}", "expected a string key");
  CHECK_REFUSES("{'a':2}", "expected a string key");
  CHECK_REFUSES("[1", "at byte 0: unterminated array: the input ends at byte 2");
  CHECK_REFUSES("{\"a\":[1, {\"b\": 2}", "at byte 5: unterminated array: the input ends at byte 17");
  CHECK_REFUSES("{\"a\":{\"b\": 2}", "at byte 0: unterminated object: the input ends at byte 13");
  CHECK_REFUSES("[\"ab", "at byte 1: unterminated string: the input ends at byte 4");
  CHECK_REFUSES("[1,", "unexpected end of input");
  CHECK_REFUSES("{\"a\":1", "unterminated object");
  CHECK_REFUSES("{\"a\":", "unexpected end of input");
  CHECK_REFUSES("{\"a\"", "expected ':'");
  CHECK_REFUSES("{", "unexpected end of input in object");
  CHECK_REFUSES("[", "unexpected end of input");
  CHECK_REFUSES("", "unexpected end of input");
  CHECK_REFUSES("   ", "unexpected end of input");
  CHECK_REFUSES("]", "expected a value");
  CHECK_REFUSES("1 2", "trailing characters");
  CHECK_REFUSES("{} x", "trailing characters");
  CHECK_REFUSES("{}{}", "trailing characters");
  CHECK_REFUSES("{\"a\":1}}", "trailing characters");
  CHECK_REFUSES("[]]", "trailing characters");
}

static void test_whitespace(void) {
  CHECK_ACCEPTS(" \t\r\n{ \t\r\n\"a\" \t\r\n: \t\r\n[ 1 , 2 ] \t\r\n} \t\r\n");
  CHECK_REFUSES("\f{}", "expected a value");
  CHECK_REFUSES("\v{}", "expected a value");
  CHECK_REFUSES("{}\f", "trailing characters");
  CHECK_REFUSES("\xC2\xA0{}", "expected a value");     /* NO-BREAK SPACE */
  CHECK_REFUSES("\xEF\xBB\xBF{}", "expected a value"); /* byte order mark */
  CHECK_REFUSES("[1,\xC2\xA0 2]", "expected a value");
  /* A NUL after the value is not whitespace. */
  CHECK_EQ_INT(parse_len("{}\0", 3, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_STR_CONTAINS(why, "at byte 2: trailing characters");
}

/* The parser reads text[0..len) only, not up to a NUL. */
static void test_length_is_respected(void) {
  CHECK_EQ_INT(parse_len("[1]garbage", 3, SJ_DEFAULT_MAX_DEPTH), 0);
  CHECK_EQ_INT(parse_len("[1]", 2, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_STR_CONTAINS(why, "unterminated array");
  CHECK_EQ_INT(parse_len("true", 3, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_EQ_INT(parse_len("\"ab\"", 3, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_STR_CONTAINS(why, "unterminated string");
  CHECK_EQ_INT(parse_len("\"\\u00e9\"", 6, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_EQ_INT(parse_len("12", 1, SJ_DEFAULT_MAX_DEPTH), 0);
  CHECK_EQ_INT(parse_len("1e5", 2, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_EQ_INT(parse_len("", 0, SJ_DEFAULT_MAX_DEPTH), -1);
}

/* The reason names the byte offset where the problem is. */
static void test_why_names_the_offset(void) {
  CHECK_REFUSES("[1, 2, x]", "at byte 7: expected a value");
  CHECK_REFUSES("{\"a\": \"\\q\"}", "at byte 7: invalid escape '\\q'");
  CHECK_REFUSES("[01]", "at byte 1:");
  /* A small or absent why buffer is safe. */
  struct sj_doc doc;
  char tiny[8];
  CHECK_EQ_INT(sj_parse("[1,]", 4, SJ_DEFAULT_MAX_DEPTH, &doc, tiny, sizeof tiny), -1);
  CHECK_EQ_INT(strlen(tiny), 7);
  CHECK_EQ_INT(sj_parse("[1,]", 4, SJ_DEFAULT_MAX_DEPTH, &doc, NULL, 0), -1);
  CHECK(doc.root == NULL);
  sj_doc_free(&doc); /* freeing an empty doc is allowed */
  CHECK_EQ_INT(sj_parse("[1]", 3, SJ_DEFAULT_MAX_DEPTH, &doc, NULL, 0), 0);
  sj_doc_free(&doc);
  sj_doc_free(&doc); /* and twice */
  sj_doc_free(NULL);
}

/* ---- nesting --------------------------------------------------------------- */

static void test_depth_limit(void) {
  for (int mixed = 0; mixed <= 1; mixed++) {
    char *s = nested(SJ_DEFAULT_MAX_DEPTH, mixed);
    CHECK_EQ_INT(parse_str(s), 0);
    free(s);
    s = nested(SJ_DEFAULT_MAX_DEPTH + 1, mixed);
    CHECK_EQ_INT(parse_str(s), -1);
    CHECK_STR_CONTAINS(why, "nesting deeper than the limit");
    free(s);
  }
  /* The limit is the caller's. */
  CHECK_EQ_INT(parse_len("1", 1, 0), 0);
  CHECK_EQ_INT(parse_len("[]", 2, 0), -1);
  CHECK_EQ_INT(parse_len("{}", 2, 0), -1);
  CHECK_EQ_INT(parse_len("[]", 2, 1), 0);
  CHECK_EQ_INT(parse_len("[[]]", 4, 1), -1);
  CHECK_EQ_INT(parse_len("[{}]", 4, 1), -1);
  CHECK_EQ_INT(parse_len("{\"a\":[]}", 8, 1), -1);
  CHECK_EQ_INT(parse_len("{\"a\":[]}", 8, 2), 0);
}

/* Depth is given back on every close, empty containers included. */
static void test_depth_counts_nesting_not_siblings(void) {
  size_t n = 1000;
  char *s = malloc(n * 5 + 3);
  size_t o = 0;
  s[o++] = '[';
  for (size_t i = 0; i < n; i++) {
    memcpy(s + o, i % 2 ? "[[]]," : "{},", i % 2 ? 5 : 3);
    o += i % 2 ? 5 : 3;
  }
  s[o - 1] = ']';
  CHECK_EQ_INT(parse_len(s, o, 3), 0);
  CHECK_EQ_INT(parse_len(s, o, 2), -1);
  free(s);
}

/* Hostile nesting is refused at the limit, without deep recursion. */
static void test_deep_nesting_is_refused(void) {
  size_t n = 100000;
  char *s = malloc(n);
  memset(s, '[', n);
  CHECK_EQ_INT(parse_len(s, n, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_STR_CONTAINS(why, "at byte 127: nesting deeper than the limit");
  for (size_t i = 0; i + 6 <= n; i += 6) memcpy(s + i, "{\"a\": ", 6);
  CHECK_EQ_INT(parse_len(s, n - n % 6, SJ_DEFAULT_MAX_DEPTH), -1);
  CHECK_STR_CONTAINS(why, "nesting deeper than the limit");
  free(s);
}

/* ---- size ------------------------------------------------------------------ */

/* Many values, and one value larger than an arena chunk. */
static void test_large_documents(void) {
  size_t n = 200000;
  char *s = malloc(n * 2 + 2);
  size_t o = 0;
  s[o++] = '[';
  for (size_t i = 0; i < n; i++) {
    s[o++] = (char)('0' + i % 10);
    s[o++] = ',';
  }
  s[o - 1] = ']';
  struct sj_doc doc;
  CHECK_EQ_INT(sj_parse(s, o, SJ_DEFAULT_MAX_DEPTH, &doc, why, sizeof why), 0);
  if (doc.root != NULL) {
    CHECK_EQ_INT(doc.root->count, n);
    size_t i = 0;
    const struct sj_node *last = NULL;
    for (const struct sj_node *c = doc.root->child; c != NULL; c = c->next, i++) last = c;
    CHECK_EQ_INT(i, n);
    CHECK(last != NULL && last->str[0] == (char)('0' + (n - 1) % 10));
    CHECK_EQ_INT(last->offset, o - 2);
  }
  sj_doc_free(&doc);
  free(s);

  size_t len = 1 << 20;
  s = malloc(len + 2);
  s[0] = '"';
  for (size_t i = 1; i <= len; i++) s[i] = (char)('a' + i % 26);
  s[len + 1] = '"';
  CHECK_EQ_INT(sj_parse(s, len + 2, SJ_DEFAULT_MAX_DEPTH, &doc, why, sizeof why), 0);
  if (doc.root != NULL) {
    CHECK_EQ_INT(doc.root->len, len);
    CHECK(memcmp(doc.root->str, s + 1, len) == 0);
  }
  sj_doc_free(&doc);
  free(s);
}

static void test_type_names(void) {
  CHECK(strcmp(sj_type_name(SJ_NULL), "null") == 0);
  CHECK(strcmp(sj_type_name(SJ_TRUE), "boolean") == 0);
  CHECK(strcmp(sj_type_name(SJ_FALSE), "boolean") == 0);
  CHECK(strcmp(sj_type_name(SJ_NUMBER), "number") == 0);
  CHECK(strcmp(sj_type_name(SJ_STRING), "string") == 0);
  CHECK(strcmp(sj_type_name(SJ_ARRAY), "array") == 0);
  CHECK(strcmp(sj_type_name(SJ_OBJECT), "object") == 0);
}

/* ---- UTF-8 ----------------------------------------------------------------- */

/* Validity of s[0..len), and where the first bad sequence starts. */
static int utf8_ok(const char *s, size_t len, size_t *bad_at) {
  unsigned char *copy = malloc(len ? len : 1);
  memcpy(copy, s, len);
  size_t at = (size_t)-1;
  int ok = sj_utf8_valid(copy, len, &at);
  free(copy);
  if (bad_at != NULL) *bad_at = at;
  return ok;
}

static void test_utf8_valid(void) {
  static const char *const good[] = {
      "",
      "plain ASCII \x01\x7f",
      "\xC2\x80",         /* U+0080 */
      "\xC3\xA9",         /* U+00E9 */
      "\xDF\xBF",         /* U+07FF */
      "\xE0\xA0\x80",     /* U+0800 */
      "\xE2\x82\xAC",     /* U+20AC */
      "\xED\x9F\xBF",     /* U+D7FF, just below the surrogates */
      "\xEE\x80\x80",     /* U+E000, just above them */
      "\xEF\xBF\xBF",     /* U+FFFF */
      "\xF0\x90\x80\x80", /* U+10000 */
      "\xF0\x9F\x98\x80", /* U+1F600 */
      "\xF4\x8F\xBF\xBF", /* U+10FFFF */
      "a\xC3\xA9z\xF0\x9F\x98\x80!",
  };
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    if (!utf8_ok(good[i], strlen(good[i]), NULL)) fprintf(stderr, "  good[%zu] refused\n", i);
    CHECK(utf8_ok(good[i], strlen(good[i]), NULL));
  }
  CHECK(utf8_ok("a\0b", 3, NULL));
}

static void test_utf8_invalid(void) {
  static const struct {
    const char *s;
    size_t bad_at;
  } bad[] = {
      {"\xC0\x80", 0},                 /* overlong NUL */
      {"\xC1\xBF", 0},                 /* overlong U+007F */
      {"\xE0\x80\x80", 0},             /* overlong 3-byte */
      {"\xE0\x9F\xBF", 0},             /* overlong U+07FF */
      {"\xF0\x80\x80\x80", 0},         /* overlong 4-byte */
      {"\xF0\x8F\xBF\xBF", 0},         /* overlong U+FFFF */
      {"\xED\xA0\x80", 0},             /* U+D800 */
      {"\xED\xBF\xBF", 0},             /* U+DFFF */
      {"\xED\xA0\xBD\xED\xB8\x80", 0}, /* CESU-8 surrogate pair */
      {"\xF4\x90\x80\x80", 0},         /* U+110000 */
      {"\xF5\x80\x80\x80", 0},
      {"\xF7\xBF\xBF\xBF", 0},
      {"\xF8\x88\x80\x80\x80", 0}, /* 5-byte form */
      {"\xFC\x84\x80\x80\x80\x80", 0},
      {"\xFE", 0},
      {"\xFF", 0},
      {"\x80", 0}, /* lone continuation */
      {"\xBF", 0},
      {"ab\xC3", 2}, /* truncated at the end */
      {"ab\xE2\x82", 2},
      {"ab\xF0\x9F\x98", 2},
      {"\xE2\x82\x41", 0}, /* truncated before an ASCII 'A' */
      {"\xC3\xC3\xA9", 0}, /* lead byte where a continuation belongs */
      {"ok \xC3\xA9 then \xED\xA0\x80", 11},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    size_t at;
    int ok = utf8_ok(bad[i].s, strlen(bad[i].s), &at);
    if (ok || at != bad[i].bad_at) fprintf(stderr, "  bad[%zu]: ok=%d at=%zu\n", i, ok, at);
    CHECK(!ok);
    CHECK_EQ_INT(at, bad[i].bad_at);
  }
  /* A NULL bad_at is allowed. */
  CHECK(!sj_utf8_valid((const unsigned char *)"\xC0\x80", 2, NULL));
}

/*
 * Each maximal ill-formed subpart becomes one U+FFFD. The expected strings
 * are Python's bytes.decode("utf-8", errors="replace") of the inputs (an
 * independent implementation of the Unicode Standard's practice).
 */
static void test_utf8_replace(void) {
  static const struct {
    const char *in;
    size_t len;
    const char *out;
  } cases[] = {
      {"\xC0\x80", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xE0\x80\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xE0\x9F\xBF", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF0\x80\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xED\xA0\xBD\xED\xB8\x80", 6, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF4\x90\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF5\x80\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF8\x88\x80\x80\x80", 5, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xFF", 1, "\xEF\xBF\xBD"},
      {"\x80\xBF", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"ab\xC3", 3, "ab\xEF\xBF\xBD"},
      {"ab\xE2\x82", 4, "ab\xEF\xBF\xBD"},
      {"ab\xF0\x9F\x98", 5, "ab\xEF\xBF\xBD"},
      {"\xE2\x82""A", 3, "\xEF\xBF\xBD""A"},
      {"\xC3\xC3\xA9", 3, "\xEF\xBF\xBD\xC3\xA9"},
      {"\xF0\x9F\x98\"x", 5, "\xEF\xBF\xBD\"x"},
      {"/models/ck-\xFF\xFE/\xE9t\xE9", 17, "/models/ck-\xEF\xBF\xBD\xEF\xBF\xBD/\xEF\xBF\xBDt\xEF\xBF\xBD"},
      {"caf\xC3\xA9 \xF0\x9F\x98\x80 ok", 13, "caf\xC3\xA9 \xF0\x9F\x98\x80 ok"},
      {"a\0b", 3, "a\0b"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t want = strlen(cases[i].out) + (i == sizeof cases / sizeof cases[0] - 1 ? 2 : 0), n = 0;
    char *got = sj_utf8_replace(cases[i].in, cases[i].len, &n);
    CHECK(got != NULL && n == want && memcmp(got, cases[i].out, want) == 0 && got[n] == '\0');
    if (got == NULL || n != want || memcmp(got, cases[i].out, want) != 0) fprintf(stderr, "  case %zu differs\n", i);
    CHECK(got != NULL && utf8_ok(got, n, NULL));
    free(got);
  }
  /* An ill-formed byte at every offset of ASCII runs (the validator reads eight at a time). */
  char buf[40];
  for (size_t at = 0; at < 24; at++) {
    memset(buf, 'a', sizeof buf);
    buf[at] = (char)0xFF;
    size_t bad = 0;
    CHECK(!utf8_ok(buf, sizeof buf, &bad));
    CHECK_EQ_INT(bad, at);
    size_t n = 0;
    char *got = sj_utf8_replace(buf, sizeof buf, &n);
    CHECK(got != NULL && n == sizeof buf + 2 && memcmp(got + at, "\xEF\xBF\xBD", 3) == 0 && got[at + 3] == 'a');
    free(got);
  }
}

int main(void) {
  RUN(test_scalars);
  RUN(test_numbers_keep_raw_text);
  RUN(test_object_and_array_tree);
  RUN(test_repeated_keys_are_kept);
  RUN(test_string_escapes);
  RUN(test_object_keys_are_decoded);
  RUN(test_string_errors);
  RUN(test_numbers_invalid);
  RUN(test_numbers_out_of_range);
  RUN(test_number_range_matches_serde_json);
  RUN(test_u64);
  RUN(test_literals);
  RUN(test_structure_errors);
  RUN(test_whitespace);
  RUN(test_length_is_respected);
  RUN(test_why_names_the_offset);
  RUN(test_depth_limit);
  RUN(test_depth_counts_nesting_not_siblings);
  RUN(test_deep_nesting_is_refused);
  RUN(test_large_documents);
  RUN(test_type_names);
  RUN(test_utf8_valid);
  RUN(test_utf8_invalid);
  RUN(test_utf8_replace);
  return tu_finish();
}
