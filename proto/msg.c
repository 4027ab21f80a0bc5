/* msg.c - the message catalogue, request parsing and reply builders (see msg.h). */
#include "msg.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_strict.h"
#include "jsonutil.h"

/* ---- the catalogue ------------------------------------------------------ */

struct op_entry {
  const char *name;
  unsigned flags;
};

static const struct op_entry op_table[MSG_OP_COUNT] = {
#define MSG_XX_(e, n, f, h) [MSG_OP_##e] = {.name = n, .flags = f},
    MSG_OP_MAP(MSG_XX_)
#undef MSG_XX_
};

enum msg_op msg_op_from_name(const char *name) {
  if (name == NULL) return MSG_OP_UNKNOWN;
  for (int i = 0; i < MSG_OP_COUNT; i++)
    if (strcmp(op_table[i].name, name) == 0) return (enum msg_op)i;
  return MSG_OP_UNKNOWN;
}

const char *msg_op_name(enum msg_op op) {
  return op >= 0 && op < MSG_OP_COUNT ? op_table[op].name : NULL;
}

unsigned msg_op_flags(enum msg_op op) { return op >= 0 && op < MSG_OP_COUNT ? op_table[op].flags : 0; }

/* ---- message helpers ---------------------------------------------------- */

/* Copies s[0..n) into buf for a message: control bytes escaped, long text cut with "...". */
static const char *printable(const char *s, size_t n, char *buf, size_t buflen) {
  size_t o = 0, i = 0;
  for (; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    size_t need = (c < 0x20 || c == 0x7f) ? 4 : 1;
    if (o + need + 4 > buflen) break;
    if (need == 4)
      o += (size_t)snprintf(buf + o, buflen - o, "\\x%02x", c);
    else
      buf[o++] = (char)c;
  }
  if (i < n) {
    memcpy(buf + o, "...", 3);
    o += 3;
  }
  buf[o] = '\0';
  return buf;
}

/* Joins a path and a member name ("plan" + "tp_rank" -> "plan.tp_rank"). */
static void join_path(char *out, size_t outlen, const char *path, const char *name, size_t nlen) {
  char pn[MSG_PATH_MAX];
  printable(name, nlen, pn, sizeof pn);
  if (path[0] == '\0')
    snprintf(out, outlen, "%s", pn);
  else
    snprintf(out, outlen, "%s.%s", path, pn);
}

static const char *cjson_type(const cJSON *j) {
  if (cJSON_IsString(j)) return "a string";
  if (cJSON_IsNumber(j)) return "a number";
  if (cJSON_IsBool(j)) return "a boolean";
  if (cJSON_IsNull(j)) return "null";
  if (cJSON_IsArray(j)) return "an array";
  if (cJSON_IsObject(j)) return "an object";
  return "an unknown value";
}

/* ---- strict checks over the whole document ------------------------------ */

static int key_cmp(const void *a, const void *b) {
  const struct sj_node *x = *(const struct sj_node *const *)a,
                       *y = *(const struct sj_node *const *)b;
  size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
  int c = memcmp(x->key, y->key, n);
  if (c != 0) return c;
  return (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

/* Finds a duplicate member name of object n; returns it or NULL (sets *oom on failure). */
static const struct sj_node *find_duplicate(const struct sj_node *n, int *oom) {
  if (n->count < 2) return NULL;
  if (n->count <= 16) {
    for (const struct sj_node *a = n->child; a != NULL; a = a->next)
      for (const struct sj_node *b = a->next; b != NULL; b = b->next)
        if (a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0) return b;
    return NULL;
  }
  const struct sj_node **v = malloc(n->count * sizeof *v);
  if (v == NULL) {
    *oom = 1;
    return NULL;
  }
  size_t k = 0;
  for (const struct sj_node *c = n->child; c != NULL && k < n->count; c = c->next) v[k++] = c;
  qsort(v, k, sizeof *v, key_cmp);
  const struct sj_node *dup = NULL;
  for (size_t i = 1; i < k && dup == NULL; i++)
    if (key_cmp(&v[i - 1], &v[i]) == 0) dup = v[i];
  free(v);
  return dup;
}

/*
 * Refuses duplicate member names and NUL characters in strings anywhere in
 * the tree; path names node for messages.
 */
static int check_tree(const struct sj_node *n, const char *path, struct wd_error *err) {
  char sub[MSG_PATH_MAX];
  switch (n->type) {
  case SJ_STRING:
    if (memchr(n->str, '\0', n->len) != NULL)
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' contains a NUL character (\\u0000)",
                     path[0] ? path : "(root)");
    return 0;
  case SJ_OBJECT: {
    int oom = 0;
    const struct sj_node *dup = find_duplicate(n, &oom);
    if (oom) return err_set(err, WEIGHTD_E_NOMEM, "out of memory checking a request");
    if (dup != NULL) {
      join_path(sub, sizeof sub, path, dup->key, dup->key_len);
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "duplicate field '%s'", sub);
    }
    for (const struct sj_node *c = n->child; c != NULL; c = c->next) {
      join_path(sub, sizeof sub, path, c->key, c->key_len);
      if (memchr(c->key, '\0', c->key_len) != NULL)
        return err_set(err, WEIGHTD_E_BAD_REQUEST,
                       "member name '%s' contains a NUL character (\\u0000)", sub);
      int rc = check_tree(c, sub, err);
      if (rc < 0) return rc;
    }
    return 0;
  }
  case SJ_ARRAY: {
    size_t i = 0;
    for (const struct sj_node *c = n->child; c != NULL; c = c->next, i++) {
      snprintf(sub, sizeof sub, "%s[%zu]", path, i);
      int rc = check_tree(c, sub, err);
      if (rc < 0) return rc;
    }
    return 0;
  }
  default: return 0;
  }
}

/* ---- request parsing ---------------------------------------------------- */

static int read_id(const cJSON *root, cJSON **out, struct wd_error *err) {
  const cJSON *id = cJSON_GetObjectItemCaseSensitive(root, "id");
  if (id == NULL) return 0;
  if (cJSON_IsString(id)) {
    size_t n = strlen(id->valuestring);
    if (n > MSG_ID_MAX)
      return err_set(err, WEIGHTD_E_BAD_REQUEST,
                     "field 'id' is a string of %zu bytes, longer than %d", n, MSG_ID_MAX);
  } else if (cJSON_IsNumber(id)) {
    double v = id->valuedouble;
    if (!(v >= -(double)MSG_INT_MAX && v <= (double)MSG_INT_MAX) || (double)(int64_t)v != v)
      return err_set(err, WEIGHTD_E_BAD_REQUEST,
                     "field 'id' must be an integer of magnitude at most 2^53 - 1, not %.17g", v);
  } else {
    return err_set(err, WEIGHTD_E_BAD_REQUEST,
                   "field 'id' must be a string of at most %d bytes or an integer, not %s",
                   MSG_ID_MAX, cjson_type(id));
  }
  *out = cJSON_Duplicate(id, 0);
  if (*out == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory copying the request id");
  return 0;
}

/* Skips white space; returns the index of the next byte. */
static size_t skip_ws(const char *s, size_t i, size_t len) {
  while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
  return i;
}

/* Skips a string that starts at s[i] ('"'); returns the index past its closing quote, or len. */
static size_t skip_string(const char *s, size_t i, size_t len) {
  for (i++; i < len; i++) {
    if (s[i] == '\\') i++;
    else if (s[i] == '"') return i + 1;
  }
  return len;
}

/* Skips one value of the top-level object: up to the ',' or '}' that ends it at depth one. */
static size_t skip_value(const char *s, size_t i, size_t len) {
  unsigned depth = 0;
  while (i < len) {
    char ch = s[i];
    if (ch == '"') {
      i = skip_string(s, i, len);
      continue;
    }
    if (ch == '{' || ch == '[') depth++;
    else if ((ch == '}' || ch == ']') && depth > 0) depth--;
    else if ((ch == ',' || ch == '}') && depth == 0) return i;
    i++;
  }
  return len;
}

cJSON *msg_request_peek_id(const char *json, size_t len) {
  size_t i = skip_ws(json, 0, len);
  if (i >= len || json[i] != '{') return NULL;
  i = skip_ws(json, i + 1, len);
  while (i < len && json[i] == '"') {
    size_t key = i + 1;
    i = skip_string(json, i, len);
    bool is_id = i - key == 3 && memcmp(json + key, "id", 2) == 0;
    i = skip_ws(json, i, len);
    if (i >= len || json[i] != ':') return NULL;
    i = skip_ws(json, i + 1, len);
    if (is_id) {
      if (i >= len || !(json[i] == '"' || json[i] == '-' || (json[i] >= '0' && json[i] <= '9'))) return NULL;
      const char *end = NULL;
      cJSON *v = cJSON_ParseWithLengthOpts(json + i, len - i, &end, 0);
      cJSON *wrap = v != NULL ? cJSON_CreateObject() : NULL;
      cJSON *id = NULL;
      struct wd_error err = {0};
      if (wrap != NULL && cJSON_AddItemToObject(wrap, "id", v)) {
        v = NULL;
        if (read_id(wrap, &id, &err) != 0) id = NULL;
      }
      cJSON_Delete(v);
      cJSON_Delete(wrap);
      return id;
    }
    i = skip_value(json, i, len);
    if (i >= len || json[i] != ',') return NULL;
    i = skip_ws(json, i + 1, len);
  }
  return NULL;
}

int msg_request_parse(const char *json, size_t len, struct msg_request *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  out->op = MSG_OP_UNKNOWN;
  size_t bad = 0;
  if (!sj_utf8_valid((const unsigned char *)json, len, &bad))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "request is not valid UTF-8 (byte %zu)", bad);

  char why[256];
  struct sj_doc doc;
  int prc = sj_parse(json, len, SJ_DEFAULT_MAX_DEPTH, &doc, why, sizeof why);
  if (prc == -2) return err_set(err, WEIGHTD_E_NOMEM, "out of memory parsing a request");
  if (prc != 0) return err_set(err, WEIGHTD_E_BAD_REQUEST, "request is not valid JSON: %s", why);
  int rc;
  if (doc.root->type != SJ_OBJECT) {
    rc = err_set(err, WEIGHTD_E_BAD_REQUEST, "request must be a JSON object, not %s %s",
                 doc.root->type == SJ_ARRAY || doc.root->type == SJ_OBJECT ? "an" : "a",
                 sj_type_name(doc.root->type));
    sj_doc_free(&doc);
    return rc;
  }
  rc = check_tree(doc.root, "", err);
  sj_doc_free(&doc);
  if (rc < 0) return rc;

  const char *end = NULL;
  out->root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
  if (out->root == NULL) {
    size_t at = end != NULL && end >= json ? (size_t)(end - json) : 0;
    return err_set(err, WEIGHTD_E_BAD_REQUEST,
                   "request is valid JSON that cJSON cannot read (near byte %zu)", at);
  }
  out->args.json = out->root;
  out->args.path[0] = '\0';

  rc = read_id(out->root, &out->id, err);
  if (rc < 0) return rc;

  const cJSON *op = cJSON_GetObjectItemCaseSensitive(out->root, "op");
  if (op == NULL) return err_set(err, WEIGHTD_E_BAD_REQUEST, "missing field 'op'");
  if (!cJSON_IsString(op))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'op' must be a string, not %s",
                   cjson_type(op));
  out->op = msg_op_from_name(op->valuestring);
  if (out->op == MSG_OP_UNKNOWN) {
    char pb[80];
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "unknown op '%s'",
                   printable(op->valuestring, strlen(op->valuestring), pb, sizeof pb));
  }
  return 0;
}

bool msg_id_equal(const cJSON *a, const cJSON *b) {
  if (a == NULL || b == NULL) return false;
  if (cJSON_IsString(a) && cJSON_IsString(b)) return strcmp(a->valuestring, b->valuestring) == 0;
  /* Parsed ids are integers of magnitude below 2^53: exact as doubles, so equality is exact. */
  if (cJSON_IsNumber(a) && cJSON_IsNumber(b)) return a->valuedouble == b->valuedouble;
  return false;
}

void msg_request_free(struct msg_request *req) {
  if (req == NULL) return;
  cJSON_Delete(req->root);
  cJSON_Delete(req->id);
  memset(req, 0, sizeof *req);
  req->op = MSG_OP_UNKNOWN;
}

/* ---- field accessors ---------------------------------------------------- */

/* Looks name up in o; fills full with its path for messages. */
static const cJSON *member(const struct msg_obj *o, const char *name, char *full, size_t fulllen) {
  join_path(full, fulllen, o->path, name, strlen(name));
  if (o->json == NULL || !cJSON_IsObject(o->json)) return NULL;
  return cJSON_GetObjectItemCaseSensitive(o->json, name);
}

static int missing(const char *full, struct wd_error *err) {
  return err_set(err, WEIGHTD_E_BAD_REQUEST, "missing field '%s'", full);
}

int msg_get_string(const struct msg_obj *o, const char *name, bool required, const char **out,
                   struct wd_error *err) {
  char full[MSG_PATH_MAX];
  const cJSON *j = member(o, name, full, sizeof full);
  *out = NULL;
  if (j == NULL) return required ? missing(full, err) : 0;
  if (!cJSON_IsString(j))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' must be a string, not %s", full,
                   cjson_type(j));
  *out = j->valuestring;
  return 1;
}

int msg_get_u64(const struct msg_obj *o, const char *name, bool required, uint64_t def,
                uint64_t max, uint64_t *out, struct wd_error *err) {
  char full[MSG_PATH_MAX];
  const cJSON *j = member(o, name, full, sizeof full);
  if (j == NULL) {
    *out = def;
    return required ? missing(full, err) : 0;
  }
  if (!cJSON_IsNumber(j))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' must be a non-negative integer, not %s",
                   full, cjson_type(j));
  double v = j->valuedouble;
  if (v < 0)
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' must not be negative (got %.17g)", full,
                   v);
  if (!(v <= (double)MSG_INT_MAX))
    return err_set(err, WEIGHTD_E_BAD_REQUEST,
                   "field '%s' is too large: integers above 2^53 - 1 (%" PRIu64
                   ") cannot be read exactly",
                   full, MSG_INT_MAX);
  uint64_t u = (uint64_t)v;
  if ((double)u != v)
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' must be an integer (got %.17g)", full,
                   v);
  if (u > max)
    return err_set(err, WEIGHTD_E_BAD_REQUEST,
                   "field '%s' is %" PRIu64 ", above the maximum %" PRIu64, full, u, max);
  *out = u;
  return 1;
}

int msg_get_bool(const struct msg_obj *o, const char *name, bool required, bool def, bool *out,
                 struct wd_error *err) {
  char full[MSG_PATH_MAX];
  const cJSON *j = member(o, name, full, sizeof full);
  if (j == NULL) {
    *out = def;
    return required ? missing(full, err) : 0;
  }
  if (!cJSON_IsBool(j))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' must be true or false, not %s", full,
                   cjson_type(j));
  *out = cJSON_IsTrue(j);
  return 1;
}

int msg_get_object(const struct msg_obj *o, const char *name, bool required, struct msg_obj *out,
                   struct wd_error *err) {
  char full[MSG_PATH_MAX];
  const cJSON *j = member(o, name, full, sizeof full);
  out->json = NULL;
  snprintf(out->path, sizeof out->path, "%s", full);
  if (j == NULL) return required ? missing(full, err) : 0;
  if (!cJSON_IsObject(j))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field '%s' must be an object, not %s", full,
                   cjson_type(j));
  out->json = j;
  return 1;
}

/* ---- replies ------------------------------------------------------------ */

static int add_raw(cJSON *obj, const char *name, const char *text) {
  cJSON *item = cJSON_CreateRaw(text);
  if (item == NULL) return WEIGHTD_E_NOMEM;
  if (!cJSON_AddItemToObject(obj, name, item)) {
    cJSON_Delete(item);
    return WEIGHTD_E_NOMEM;
  }
  return 0;
}

int msg_add_string(cJSON *obj, const char *name, const char *s) {
  return cJSON_AddStringToObject(obj, name, s) != NULL ? 0 : WEIGHTD_E_NOMEM;
}

/* Adds "id" echoing the request's id exactly; nothing when id is NULL. */
static int add_id(cJSON *obj, const cJSON *id) {
  if (id == NULL) return 0;
  if (cJSON_IsString(id)) return msg_add_string(obj, "id", id->valuestring);
  if (cJSON_IsRaw(id)) return add_raw(obj, "id", id->valuestring); /* an id echoed in a reply */
  if (cJSON_IsNumber(id)) {
    char buf[24];
    snprintf(buf, sizeof buf, "%" PRId64, (int64_t)id->valuedouble);
    return add_raw(obj, "id", buf);
  }
  return WEIGHTD_E_INVALID;
}

cJSON *msg_reply_ok(const cJSON *id) {
  cJSON *r = cJSON_CreateObject();
  if (r == NULL) return NULL;
  if (add_id(r, id) < 0 || cJSON_AddTrueToObject(r, "ok") == NULL) goto fail;
  return r;
fail:
  cJSON_Delete(r);
  return NULL;
}

cJSON *msg_reply_error(const cJSON *id, int code, const char *message) {
  cJSON *r = cJSON_CreateObject();
  if (r == NULL) return NULL;
  if (add_id(r, id) < 0) goto fail;
  cJSON *e = cJSON_AddObjectToObject(r, "error");
  if (e == NULL) goto fail;
  if (cJSON_AddStringToObject(e, "code", weightd_err_name(code)) == NULL) goto fail;
  if (msg_add_string(e, "message", message != NULL ? message : weightd_strerror(code)) < 0)
    goto fail;
  return r;
fail:
  cJSON_Delete(r);
  return NULL;
}

cJSON *msg_event(const cJSON *id, const char *name) {
  cJSON *r = cJSON_CreateObject();
  if (r == NULL) return NULL;
  if (add_id(r, id) < 0 || cJSON_AddStringToObject(r, "event", name) == NULL) {
    cJSON_Delete(r);
    return NULL;
  }
  return r;
}

cJSON *msg_event_progress(const cJSON *id, uint64_t done, uint64_t total) {
  cJSON *r = msg_event(id, "progress");
  if (r == NULL) return NULL;
  if (json_u64_add(r, "bytes_done", done) < 0 || json_u64_add(r, "bytes_total", total) < 0) goto fail;
  return r;
fail:
  cJSON_Delete(r);
  return NULL;
}

char *msg_serialize(const cJSON *j) {
  char *text = cJSON_PrintUnformatted((cJSON *)j);
  if (text == NULL) return NULL;
  size_t n = strlen(text);
  if (sj_utf8_valid((const unsigned char *)text, n, NULL)) return text;
  char *clean = sj_utf8_replace(text, n, NULL); /* cJSON writes a string's bytes as they are */
  cJSON_free(text);
  return clean;
}

/* ---- hex ---------------------------------------------------------------- */

void msg_hex_encode(const void *bytes, size_t n, char *out) {
  static const char digits[] = "0123456789abcdef";
  const unsigned char *b = bytes;
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = digits[b[i] >> 4];
    out[2 * i + 1] = digits[b[i] & 0xF];
  }
  out[2 * n] = '\0';
}

static int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

int msg_hex_decode(const char *hex, void *out, size_t n) {
  if (hex == NULL || strnlen(hex, 2 * n + 1) != 2 * n) return WEIGHTD_E_INVALID;
  unsigned char *b = out;
  for (size_t i = 0; i < n; i++) {
    int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return WEIGHTD_E_INVALID;
    b[i] = (unsigned char)(hi << 4 | lo);
  }
  return 0;
}
