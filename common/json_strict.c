/* json_strict.c - strict JSON parsing for untrusted headers (see json_strict.h). */
#include "json_strict.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ------------------------------------------------------------- */

struct sj_chunk {
  struct sj_chunk *prev;
  size_t used, cap;
  max_align_t data[];
};

struct sj_arena {
  struct sj_chunk *top;
};

#define SJ_CHUNK_BYTES (64u * 1024u)

static void *arena_alloc(struct sj_arena *a, size_t n) {
  n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
  struct sj_chunk *c = a->top;
  if (c == NULL || c->cap - c->used < n) {
    size_t cap = n > SJ_CHUNK_BYTES ? n : SJ_CHUNK_BYTES;
    c = malloc(sizeof *c + cap);
    if (c == NULL) return NULL;
    c->prev = a->top;
    c->used = 0;
    c->cap = cap;
    a->top = c;
  }
  void *p = (char *)c->data + c->used;
  c->used += n;
  return p;
}

static void arena_free(struct sj_arena *a) {
  if (a == NULL) return;
  struct sj_chunk *c = a->top;
  while (c != NULL) {
    struct sj_chunk *prev = c->prev;
    free(c);
    c = prev;
  }
  free(a);
}

/* ---- parser ------------------------------------------------------------ */

struct parser {
  const char *s;
  size_t len, pos;
  unsigned depth_left;
  struct sj_arena *arena;
  char *why;
  size_t whylen;
  int oom;
};

static int fail(struct parser *p, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(struct parser *p, size_t at, const char *fmt, ...) {
  if (p->why != NULL && p->whylen > 0) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->why, p->whylen, "at byte %zu: %s", at, msg);
  }
  return -1;
}

static int nomem(struct parser *p) {
  p->oom = 1;
  return fail(p, p->pos, "out of memory");
}

static void skip_ws(struct parser *p) {
  while (p->pos < p->len) {
    char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

static int hex4(const char *s, unsigned *out) {
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    char c = s[i];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
    else return -1;
  }
  *out = v;
  return 0;
}

static size_t put_utf8(char *o, unsigned cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/*
 * Parses a string starting at the opening quote. The decoded form is never
 * longer than the raw text, so one allocation of the raw length suffices.
 */
static int parse_string(struct parser *p, const char **out, size_t *out_len) {
  size_t start = p->pos++;
  size_t end = p->pos;
  int has_escape = 0;
  for (;;) {
    if (end >= p->len) return fail(p, start, "unterminated string: the input ends at byte %zu", p->len);
    unsigned char c = (unsigned char)p->s[end];
    if (c == '"') break;
    if (c < 0x20) return fail(p, end, "control character U+%04X in string", c);
    if (c == '\\') {
      has_escape = 1;
      end++;
      if (end >= p->len) return fail(p, start, "unterminated string: the input ends at byte %zu", p->len);
    }
    end++;
  }
  size_t raw = end - p->pos;
  char *buf = arena_alloc(p->arena, raw + 1);
  if (buf == NULL) return nomem(p);
  if (!has_escape) {
    memcpy(buf, p->s + p->pos, raw);
    buf[raw] = '\0';
    *out = buf;
    *out_len = raw;
    p->pos = end + 1;
    return 0;
  }
  size_t o = 0;
  size_t i = p->pos;
  while (i < end) {
    char c = p->s[i];
    if (c != '\\') {
      buf[o++] = c;
      i++;
      continue;
    }
    char e = p->s[i + 1];
    switch (e) {
    case '"': buf[o++] = '"'; i += 2; break;
    case '\\': buf[o++] = '\\'; i += 2; break;
    case '/': buf[o++] = '/'; i += 2; break;
    case 'b': buf[o++] = '\b'; i += 2; break;
    case 'f': buf[o++] = '\f'; i += 2; break;
    case 'n': buf[o++] = '\n'; i += 2; break;
    case 'r': buf[o++] = '\r'; i += 2; break;
    case 't': buf[o++] = '\t'; i += 2; break;
    case 'u': {
      unsigned cp;
      if (i + 6 > end || hex4(p->s + i + 2, &cp) != 0) return fail(p, i, "invalid \\u escape");
      i += 6;
      if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(p, i - 6, "lone trailing surrogate in \\u escape");
      if (cp >= 0xD800 && cp <= 0xDBFF) {
        unsigned lo;
        if (i + 6 > end || p->s[i] != '\\' || p->s[i + 1] != 'u' || hex4(p->s + i + 2, &lo) != 0 ||
            lo < 0xDC00 || lo > 0xDFFF)
          return fail(p, i - 6, "lone leading surrogate in \\u escape");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        i += 6;
      }
      o += put_utf8(buf + o, cp);
      break;
    }
    default:
      return fail(p, i, "invalid escape '\\%c'", e);
    }
  }
  buf[o] = '\0';
  *out = buf;
  *out_len = o;
  p->pos = end + 1;
  return 0;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Powers of ten as serde_json's table holds them: 1e0 .. 1e308, correctly rounded. */
static const double pow10_table[309] = {
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7,
    1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
    1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22, 1e23,
    1e24, 1e25, 1e26, 1e27, 1e28, 1e29, 1e30, 1e31,
    1e32, 1e33, 1e34, 1e35, 1e36, 1e37, 1e38, 1e39,
    1e40, 1e41, 1e42, 1e43, 1e44, 1e45, 1e46, 1e47,
    1e48, 1e49, 1e50, 1e51, 1e52, 1e53, 1e54, 1e55,
    1e56, 1e57, 1e58, 1e59, 1e60, 1e61, 1e62, 1e63,
    1e64, 1e65, 1e66, 1e67, 1e68, 1e69, 1e70, 1e71,
    1e72, 1e73, 1e74, 1e75, 1e76, 1e77, 1e78, 1e79,
    1e80, 1e81, 1e82, 1e83, 1e84, 1e85, 1e86, 1e87,
    1e88, 1e89, 1e90, 1e91, 1e92, 1e93, 1e94, 1e95,
    1e96, 1e97, 1e98, 1e99, 1e100, 1e101, 1e102, 1e103,
    1e104, 1e105, 1e106, 1e107, 1e108, 1e109, 1e110, 1e111,
    1e112, 1e113, 1e114, 1e115, 1e116, 1e117, 1e118, 1e119,
    1e120, 1e121, 1e122, 1e123, 1e124, 1e125, 1e126, 1e127,
    1e128, 1e129, 1e130, 1e131, 1e132, 1e133, 1e134, 1e135,
    1e136, 1e137, 1e138, 1e139, 1e140, 1e141, 1e142, 1e143,
    1e144, 1e145, 1e146, 1e147, 1e148, 1e149, 1e150, 1e151,
    1e152, 1e153, 1e154, 1e155, 1e156, 1e157, 1e158, 1e159,
    1e160, 1e161, 1e162, 1e163, 1e164, 1e165, 1e166, 1e167,
    1e168, 1e169, 1e170, 1e171, 1e172, 1e173, 1e174, 1e175,
    1e176, 1e177, 1e178, 1e179, 1e180, 1e181, 1e182, 1e183,
    1e184, 1e185, 1e186, 1e187, 1e188, 1e189, 1e190, 1e191,
    1e192, 1e193, 1e194, 1e195, 1e196, 1e197, 1e198, 1e199,
    1e200, 1e201, 1e202, 1e203, 1e204, 1e205, 1e206, 1e207,
    1e208, 1e209, 1e210, 1e211, 1e212, 1e213, 1e214, 1e215,
    1e216, 1e217, 1e218, 1e219, 1e220, 1e221, 1e222, 1e223,
    1e224, 1e225, 1e226, 1e227, 1e228, 1e229, 1e230, 1e231,
    1e232, 1e233, 1e234, 1e235, 1e236, 1e237, 1e238, 1e239,
    1e240, 1e241, 1e242, 1e243, 1e244, 1e245, 1e246, 1e247,
    1e248, 1e249, 1e250, 1e251, 1e252, 1e253, 1e254, 1e255,
    1e256, 1e257, 1e258, 1e259, 1e260, 1e261, 1e262, 1e263,
    1e264, 1e265, 1e266, 1e267, 1e268, 1e269, 1e270, 1e271,
    1e272, 1e273, 1e274, 1e275, 1e276, 1e277, 1e278, 1e279,
    1e280, 1e281, 1e282, 1e283, 1e284, 1e285, 1e286, 1e287,
    1e288, 1e289, 1e290, 1e291, 1e292, 1e293, 1e294, 1e295,
    1e296, 1e297, 1e298, 1e299, 1e300, 1e301, 1e302, 1e303,
    1e304, 1e305, 1e306, 1e307, 1e308
};

/*
 * serde_json's verdict on a number it must hold as a double (it has a fraction
 * or exponent, or does not fit in 64 bits): it keeps the leading digits that
 * fit in a u64 significand, counts the rest as powers of ten, and scales by a
 * table power of ten, refusing a result that overflows. This rounds
 * differently from strtod near the largest double, so it is followed exactly
 * rather than approximated. text is a valid JSON number.
 */
static int serde_float_in_range(const char *t, size_t n) {
  size_t i = 0;
  if (t[i] == '-') i++;
  uint64_t sig = 0;
  int64_t exp = 0;
  int overflowed = 0;
  for (; i < n && is_digit(t[i]); i++) {
    unsigned d = (unsigned)(t[i] - '0');
    if (overflowed || sig > (UINT64_MAX - d) / 10) {
      overflowed = 1;
      exp++;
    } else {
      sig = sig * 10 + d;
    }
  }
  if (i < n && t[i] == '.') {
    for (i++; i < n && is_digit(t[i]); i++) {
      unsigned d = (unsigned)(t[i] - '0');
      if (overflowed || sig > (UINT64_MAX - d) / 10) {
        overflowed = 1;
      } else {
        sig = sig * 10 + d;
        exp--;
      }
    }
  }
  if (i < n && (t[i] == 'e' || t[i] == 'E')) {
    i++;
    int positive = 1;
    if (t[i] == '+' || t[i] == '-') positive = t[i++] == '+';
    int64_t e = 0;
    for (; i < n && is_digit(t[i]); i++) {
      unsigned d = (unsigned)(t[i] - '0');
      if (e > (INT32_MAX - (int64_t)d) / 10) return !(sig != 0 && positive); /* exponent overflow */
      e = e * 10 + d;
    }
    exp = positive ? exp + e : exp - e;
    if (exp > INT32_MAX) exp = INT32_MAX;
    if (exp < INT32_MIN) exp = INT32_MIN;
  }
  double f = (double)sig;
  for (;;) {
    int64_t a = exp < 0 ? -exp : exp;
    if (a <= 308) {
      if (exp >= 0) {
        f *= pow10_table[a];
        if (isinf(f)) return 0;
      }
      return 1;
    }
    if (f == 0.0) return 1;
    if (exp >= 0) return 0;
    f /= 1e308;
    exp += 308;
  }
}

static int parse_number(struct parser *p, struct sj_node *n) {
  size_t start = p->pos, i = p->pos;
  if (i < p->len && p->s[i] == '-') i++;
  if (i >= p->len || !is_digit(p->s[i])) return fail(p, start, "invalid number");
  if (p->s[i] == '0') {
    i++;
    if (i < p->len && is_digit(p->s[i])) return fail(p, start, "invalid number (leading zero)");
  } else {
    while (i < p->len && is_digit(p->s[i])) i++;
  }
  int is_float = 0;
  if (i < p->len && p->s[i] == '.') {
    i++;
    if (i >= p->len || !is_digit(p->s[i])) return fail(p, start, "invalid number");
    while (i < p->len && is_digit(p->s[i])) i++;
    is_float = 1;
  }
  if (i < p->len && (p->s[i] == 'e' || p->s[i] == 'E')) {
    i++;
    if (i < p->len && (p->s[i] == '+' || p->s[i] == '-')) i++;
    if (i >= p->len || !is_digit(p->s[i])) return fail(p, start, "invalid number");
    while (i < p->len && is_digit(p->s[i])) i++;
    is_float = 1;
  }
  n->type = SJ_NUMBER;
  n->str = p->s + start;
  n->len = i - start;
  p->pos = i;
  /* serde_json refuses numbers whose double value overflows. */
  uint64_t ignored;
  if ((is_float || !sj_u64(n, &ignored)) && !serde_float_in_range(n->str, n->len))
    return fail(p, start, "number out of range");
  return 0;
}

static int parse_value(struct parser *p, struct sj_node *n);

static int parse_container(struct parser *p, struct sj_node *n, int is_object) {
  size_t start = p->pos;
  if (p->depth_left == 0) return fail(p, start, "nesting deeper than the limit");
  p->depth_left--;
  n->type = is_object ? SJ_OBJECT : SJ_ARRAY;
  p->pos++;
  struct sj_node **tail = &n->child;
  char close = is_object ? '}' : ']';
  skip_ws(p);
  if (p->pos < p->len && p->s[p->pos] == close) {
    p->pos++;
    p->depth_left++;
    return 0;
  }
  for (;;) {
    struct sj_node *c = arena_alloc(p->arena, sizeof *c);
    if (c == NULL) return nomem(p);
    memset(c, 0, sizeof *c);
    skip_ws(p);
    if (is_object) {
      if (p->pos >= p->len) return fail(p, p->pos, "unexpected end of input in object");
      if (p->s[p->pos] != '"') {
        if (p->s[p->pos] == '}') return fail(p, p->pos, "trailing comma");
        return fail(p, p->pos, "expected a string key");
      }
      if (parse_string(p, &c->key, &c->key_len) != 0) return -1;
      skip_ws(p);
      if (p->pos >= p->len || p->s[p->pos] != ':') return fail(p, p->pos, "expected ':'");
      p->pos++;
      skip_ws(p);
    } else if (p->pos < p->len && p->s[p->pos] == ']') {
      return fail(p, p->pos, "trailing comma");
    }
    if (parse_value(p, c) != 0) return -1;
    *tail = c;
    tail = &c->next;
    n->count++;
    skip_ws(p);
    if (p->pos >= p->len)
      return fail(p, start, "unterminated %s: the input ends at byte %zu", is_object ? "object" : "array", p->len);
    char d = p->s[p->pos];
    if (d == ',') {
      p->pos++;
      continue;
    }
    if (d == close) {
      p->pos++;
      break;
    }
    return fail(p, p->pos, "expected ',' or '%c'", close);
  }
  p->depth_left++;
  return 0;
}

static int parse_literal(struct parser *p, const char *word, enum sj_type t, struct sj_node *n) {
  size_t wl = strlen(word);
  if (p->len - p->pos < wl || memcmp(p->s + p->pos, word, wl) != 0)
    return fail(p, p->pos, "expected a value");
  n->type = t;
  p->pos += wl;
  return 0;
}

static int parse_value(struct parser *p, struct sj_node *n) {
  skip_ws(p);
  n->offset = p->pos;
  if (p->pos >= p->len) return fail(p, p->pos, "unexpected end of input");
  char c = p->s[p->pos];
  switch (c) {
  case '{': return parse_container(p, n, 1);
  case '[': return parse_container(p, n, 0);
  case '"':
    n->type = SJ_STRING;
    return parse_string(p, &n->str, &n->len);
  case 't': return parse_literal(p, "true", SJ_TRUE, n);
  case 'f': return parse_literal(p, "false", SJ_FALSE, n);
  case 'n': return parse_literal(p, "null", SJ_NULL, n);
  default:
    if (c == '-' || is_digit(c)) return parse_number(p, n);
    return fail(p, p->pos, "expected a value");
  }
}

int sj_parse(const char *text, size_t len, unsigned max_depth, struct sj_doc *doc, char *why,
             size_t whylen) {
  doc->root = NULL;
  doc->arena = calloc(1, sizeof *doc->arena);
  if (doc->arena == NULL) return -2;
  struct parser p = {
      .s = text, .len = len, .pos = 0, .depth_left = max_depth, .arena = doc->arena,
      .why = why, .whylen = whylen, .oom = 0,
  };
  struct sj_node *root = arena_alloc(p.arena, sizeof *root);
  if (root == NULL) {
    sj_doc_free(doc);
    return -2;
  }
  memset(root, 0, sizeof *root);
  int rc = parse_value(&p, root);
  if (rc == 0) {
    skip_ws(&p);
    if (p.pos != p.len) rc = fail(&p, p.pos, "trailing characters after the value");
  }
  if (rc != 0) {
    sj_doc_free(doc);
    return p.oom ? -2 : -1;
  }
  doc->root = root;
  return 0;
}

void sj_doc_free(struct sj_doc *doc) {
  if (doc == NULL) return;
  arena_free(doc->arena);
  doc->arena = NULL;
  doc->root = NULL;
}

int sj_u64(const struct sj_node *n, uint64_t *out) {
  if (n == NULL || n->type != SJ_NUMBER || n->len == 0) return 0;
  uint64_t v = 0;
  for (size_t i = 0; i < n->len; i++) {
    char c = n->str[i];
    if (!is_digit(c)) return 0;
    unsigned d = (unsigned)(c - '0');
    if (v > (UINT64_MAX - d) / 10) return 0;
    v = v * 10 + d;
  }
  *out = v;
  return 1;
}

const char *sj_type_name(enum sj_type t) {
  switch (t) {
  case SJ_NULL: return "null";
  case SJ_FALSE:
  case SJ_TRUE: return "boolean";
  case SJ_NUMBER: return "number";
  case SJ_STRING: return "string";
  case SJ_ARRAY: return "array";
  case SJ_OBJECT: return "object";
  }
  return "?";
}

/* ---- UTF-8 --------------------------------------------------------------- */

/*
 * The length of the well-formed sequence s[0..len) starts with (len > 0;
 * the Unicode Standard's table 3-7: no overlongs, no surrogates, at most
 * U+10FFFF), or 0 when there is none; *bad is then the length of the
 * maximal subpart there: the longest prefix of some well-formed sequence,
 * at least one byte, never an ASCII byte after the first.
 */
static size_t utf8_seq(const unsigned char *s, size_t len, size_t *bad) {
  unsigned char c = s[0], lo = 0x80, hi = 0xBF;
  size_t need;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; k++, lo = 0x80, hi = 0xBF)
    if (k >= len || s[k] < lo || s[k] > hi) {
      *bad = k;
      return 0;
    }
  return need + 1;
}

/* The end of the run of ASCII bytes from i, eight at a time where it can. */
static size_t skip_ascii(const unsigned char *s, size_t i, size_t len) {
  for (uint64_t w; i + 8 <= len; i += 8) {
    memcpy(&w, s + i, 8);
    if (w & UINT64_C(0x8080808080808080)) break;
  }
  while (i < len && s[i] < 0x80) i++;
  return i;
}

int sj_utf8_valid(const unsigned char *s, size_t len, size_t *bad_at) {
  size_t i = 0, bad;
  while ((i = skip_ascii(s, i, len)) < len) {
    size_t n = utf8_seq(s + i, len - i, &bad);
    if (n == 0) {
      if (bad_at != NULL) *bad_at = i;
      return 0;
    }
    i += n;
  }
  return 1;
}

/* Writes s with every maximal subpart replaced into out (when not NULL); returns the length. */
static size_t utf8_replace_into(const unsigned char *s, size_t len, char *out) {
  static const char fffd[3] = {'\xEF', '\xBF', '\xBD'};
  size_t i = 0, o = 0, bad;
  while (i < len) {
    size_t n = utf8_seq(s + i, len - i, &bad);
    if (n == 0) {
      if (out != NULL) memcpy(out + o, fffd, 3);
      o += 3;
      i += bad;
    } else {
      if (out != NULL) memcpy(out + o, s + i, n);
      o += n;
      i += n;
    }
  }
  return o;
}

char *sj_utf8_replace(const char *s, size_t len, size_t *outlen) {
  size_t n = utf8_replace_into((const unsigned char *)s, len, NULL);
  char *out = malloc(n + 1);
  if (out == NULL) return NULL;
  utf8_replace_into((const unsigned char *)s, len, out);
  out[n] = '\0';
  if (outlen != NULL) *outlen = n;
  return out;
}
