/*
 * plan_key.c - a plan's identity key (see plan_build.h): the normal form of
 * a preset, or a digest of an explicit plan's outputs. docs/protocol.md
 * ("Plans" -> "Identity") defines both forms; they are version 1, and any
 * change here that changes a key for the same plan is a new version there.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan_build.h"
#include "sha256.h"

/* An expert list whose text is longer than this is digested in the key. */
#define EXPERTS_INLINE_MAX 128u

/* Text written to a digest, its length counted and its start kept while it is short. */
struct sink {
  struct sha256 sha;
  uint64_t len;
  char head[EXPERTS_INLINE_MAX + 1];
};

static void put(struct sink *k, const char *s, size_t n) {
  sha256_update(&k->sha, s, n);
  if (k->len + n <= EXPERTS_INLINE_MAX) memcpy(k->head + k->len, s, n);
  k->len += n;
}

static void put_text(struct sink *k, const char *s) { put(k, s, strlen(s)); }

static void put_u64(struct sink *k, uint64_t v) {
  char buf[24];
  int n = snprintf(buf, sizeof buf, "%" PRIu64, v);
  put(k, buf, (size_t)n);
}

/*
 * s as a JSON string: '"' and '\' escaped with a backslash, \b \f \n \r \t
 * for those bytes, \u00xx (lowercase) for the other bytes below 0x20, every
 * other byte as it is - Python's json.dumps(s, ensure_ascii=False).
 */
static void put_string(struct sink *k, const char *s) {
  static const char *const short_form[32] = {['\b'] = "\\b", ['\f'] = "\\f", ['\n'] = "\\n", ['\r'] = "\\r",
                                             ['\t'] = "\\t"};
  put(k, "\"", 1);
  const char *run = s;
  for (; *s != '\0'; s++) {
    unsigned char c = (unsigned char)*s;
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    put(k, run, (size_t)(s - run));
    run = s + 1;
    char esc[8];
    if (c == '"' || c == '\\') snprintf(esc, sizeof esc, "\\%c", c);
    else if (short_form[c] != NULL) snprintf(esc, sizeof esc, "%s", short_form[c]);
    else snprintf(esc, sizeof esc, "\\u%04x", c);
    put_text(k, esc);
  }
  put(k, run, (size_t)(s - run));
  put(k, "\"", 1);
}

/* The outputs' normal form: the JSON array of {"name","dtype","shape","pieces"}, compact, in plan order. */
static void put_outputs(struct sink *k, const struct plan *p) {
  put_text(k, "[");
  for (size_t i = 0; i < p->noutputs; i++) {
    const struct plan_output *o = &p->outputs[i];
    put_text(k, i ? ",{\"name\":" : "{\"name\":");
    put_string(k, o->name);
    put_text(k, ",\"dtype\":");
    put_string(k, dtype_name(o->dtype));
    put_text(k, ",\"shape\":[");
    for (unsigned d = 0; d < o->ndim; d++) {
      if (d) put_text(k, ",");
      put_u64(k, o->shape[d]);
    }
    put_text(k, "],\"pieces\":[");
    for (size_t j = 0; j < o->npieces; j++) {
      const struct plan_piece *pc = &o->pieces[j];
      put_text(k, j ? ",{" : "{");
      if (pc->src == NULL) {
        put_text(k, "\"zeros\":");
      } else {
        put_text(k, "\"tensor\":");
        put_string(k, pc->src->t->name);
        put_text(k, ",\"dim\":");
        put_u64(k, pc->dim);
        put_text(k, ",\"start\":");
        put_u64(k, pc->start);
        put_text(k, ",\"end\":");
      }
      put_u64(k, pc->end);
      put_text(k, "}");
    }
    put_text(k, "]}");
  }
  put_text(k, "]");
}

/* The sorted expert list: `[a,b,...]` while that is short, else {"count":n,"sha256":its digest}. */
static void put_experts(const struct plan_spec *s, char *out, size_t len) {
  struct sink k = {.len = 0};
  sha256_init(&k.sha);
  put_text(&k, "[");
  for (size_t i = 0; i < s->nexperts; i++) {
    if (i) put_text(&k, ",");
    put_u64(&k, s->experts[i]);
  }
  put_text(&k, "]");
  unsigned char digest[SHA256_DIGEST_LEN];
  char hex[SHA256_HEX_LEN + 1];
  sha256_final(&k.sha, digest);
  sha256_hex(digest, hex);
  if (k.len <= EXPERTS_INLINE_MAX) snprintf(out, len, "%.*s", (int)k.len, k.head);
  else snprintf(out, len, "{\"count\":%zu,\"sha256\":\"%s\"}", s->nexperts, hex);
}

int plan_key_make(const struct plan_spec *s, const struct plan *p, char **key, struct wd_error *err) {
  char text[PLAN_KEY_MAX + 1], experts[EXPERTS_INLINE_MAX + 1] = "";
  unsigned char digest[SHA256_DIGEST_LEN];
  char hex[SHA256_HEX_LEN + 1];
  int n = 0;
  *key = NULL;
  if (s->kind == PLAN_WHOLE) {
    n = snprintf(text, sizeof text, "{\"preset\":\"whole\"}");
  } else if (s->kind == PLAN_LAYERS) {
    if (s->experts != NULL) put_experts(s, experts, sizeof experts);
    n = snprintf(text, sizeof text,
                 "{\"preset\":\"%s\",\"tp_size\":%" PRIu64 ",\"tp_rank\":%" PRIu64 ",\"ep_size\":%" PRIu64
                 ",\"ep_rank\":%" PRIu64 ",\"fuse\":%s%s%s}",
                 family_name(s->family), s->tp_size, s->tp_rank, s->ep_size, s->ep_rank, s->fuse ? "true" : "false",
                 s->experts != NULL ? ",\"experts\":" : "", experts);
  } else {
    struct sink k = {.len = 0};
    sha256_init(&k.sha);
    put_outputs(&k, p);
    sha256_final(&k.sha, digest);
    sha256_hex(digest, hex);
    n = snprintf(text, sizeof text, "{\"outputs\":%zu,\"sha256\":\"%s\"}", p->noutputs, hex);
  }
  if (n < 0 || (size_t)n > PLAN_KEY_MAX) return err_set(err, WEIGHTD_E_INTERNAL, "a plan key outgrew %u bytes", PLAN_KEY_MAX);
  *key = strdup(text);
  return *key != NULL ? 0 : err_set(err, WEIGHTD_E_NOMEM, "out of memory writing a plan key");
}
