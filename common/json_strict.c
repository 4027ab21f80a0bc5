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
    if (end >= p->len) return fail(p, start, "unterminated string");
    unsigned char c = (unsigned char)p->s[end];
    if (c == '"') break;
    if (c < 0x20) return fail(p, end, "control character U+%04X in string", c);
    if (c == '\\') {
      has_escape = 1;
      end++;
      if (end >= p->len) return fail(p, start, "unterminated string");
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
  if (is_float || !sj_u64(n, &ignored)) {
    char small[64];
    char *text = small;
    if (n->len >= sizeof small) {
      text = malloc(n->len + 1);
      if (text == NULL) return nomem(p);
    }
    memcpy(text, n->str, n->len);
    text[n->len] = '\0';
    double d = strtod(text, NULL);
    if (text != small) free(text);
    if (isinf(d)) return fail(p, start, "number out of range");
  }
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
    if (p->pos >= p->len) return fail(p, start, "unterminated %s", is_object ? "object" : "array");
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

int sj_utf8_valid(const unsigned char *s, size_t len, size_t *bad_at) {
  size_t i = 0;
  while (i < len) {
    unsigned char c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t need;
    unsigned cp, min;
    if ((c & 0xE0) == 0xC0) {
      need = 1;
      cp = c & 0x1F;
      min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      need = 2;
      cp = c & 0x0F;
      min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      need = 3;
      cp = c & 0x07;
      min = 0x10000;
    } else {
      goto bad;
    }
    if (len - i - 1 < need) goto bad;
    for (size_t k = 1; k <= need; k++) {
      unsigned char cc = s[i + k];
      if ((cc & 0xC0) != 0x80) goto bad;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) goto bad;
    i += need + 1;
  }
  return 1;
bad:
  if (bad_at != NULL) *bad_at = i;
  return 0;
}
