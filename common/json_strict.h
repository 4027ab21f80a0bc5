/*
 * json_strict.h - a strict JSON parser for untrusted safetensors headers.
 *
 * It accepts exactly RFC 8259 JSON with the limits of serde_json, the parser
 * behind the reference safetensors implementation: nesting deeper than
 * max_depth is refused, numbers that overflow a double are refused, unpaired
 * UTF-16 surrogates in \u escapes are refused, and numbers keep their raw
 * text so that integers can be read exactly up to 2^64 - 1 (cJSON keeps only
 * a double). Input must already be valid UTF-8 (see sj_utf8_valid).
 *
 * The parse builds a tree in one arena that sj_doc_free releases at once.
 * Work is linear in the input; recursion is bounded by max_depth.
 */
#ifndef WD_JSON_STRICT_H
#define WD_JSON_STRICT_H

#include <stddef.h>
#include <stdint.h>

enum sj_type { SJ_NULL, SJ_FALSE, SJ_TRUE, SJ_NUMBER, SJ_STRING, SJ_ARRAY, SJ_OBJECT };

struct sj_node {
  enum sj_type type;
  const char *key; /* decoded member name (objects' children only) */
  size_t key_len;
  const char *str; /* decoded string bytes, or the raw text of a number */
  size_t len;
  struct sj_node *child; /* first element or member */
  struct sj_node *next;  /* next sibling */
  size_t count;          /* number of children */
  size_t offset;         /* byte offset in the input where the value starts */
};

struct sj_arena;

struct sj_doc {
  struct sj_node *root;
  struct sj_arena *arena;
};

/* serde_json's default: a value may nest at most 127 containers deep. */
#define SJ_DEFAULT_MAX_DEPTH 127

/*
 * Parses text[0..len) as one JSON value, optionally surrounded by JSON
 * whitespace. Returns 0 and fills doc, or -1 with a message in why
 * ("at byte N: ...") and doc empty. Returns -2 when memory ran out. A
 * string, object or array the input ends inside (a truncated file) is
 * reported at its start, with where the input ends ("at byte 15:
 * unterminated object: the input ends at byte 37").
 */
int sj_parse(const char *text, size_t len, unsigned max_depth, struct sj_doc *doc, char *why,
             size_t whylen);

/* Frees everything sj_parse allocated for doc; doc may be empty. */
void sj_doc_free(struct sj_doc *doc);

/*
 * Reads a number node as an unsigned 64-bit integer: true only for a plain
 * integer literal (no sign, fraction or exponent) that fits in 64 bits.
 */
int sj_u64(const struct sj_node *n, uint64_t *out);

/* A human name for a node's type ("string", "array", ...). */
const char *sj_type_name(enum sj_type t);

/*
 * True when s[0..len) is well-formed UTF-8 (no overlongs, no surrogates,
 * <= U+10FFFF); otherwise false, with *bad_at (when not NULL) the offset of
 * the first sequence that is not.
 */
int sj_utf8_valid(const unsigned char *s, size_t len, size_t *bad_at);

/*
 * s[0..len) as well-formed UTF-8 (malloc'd, NUL-terminated, its length in
 * *outlen when not NULL), or NULL when memory ran out: each maximal subpart
 * of an ill-formed sequence becomes one U+FFFD (the Unicode Standard's
 * "substitution of maximal subparts", chapter 3.9; what WHATWG's decoder
 * and Python's errors="replace" do). Well-formed input comes back as it is,
 * and no ASCII byte is ever replaced, so JSON text stays JSON with the same
 * structure. The daemon's one rule for bytes that are not UTF-8 (file names
 * above all) in what it sends: replies (msg_serialize) and metric labels.
 */
char *sj_utf8_replace(const char *s, size_t len, size_t *outlen);

#endif
