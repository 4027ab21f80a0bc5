/* creds_files.c - the AWS shared config and credentials files (see creds_internal.h). */
#include "creds_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARED_FILE_MAX (1u << 20)

static const char *const prop_names[CREDS_P_COUNT] = {
#define XX(id, name) name,
    CREDS_PROPS(XX)
#undef XX
};

/* ---- reading a file ------------------------------------------------------------ */

static int open_fail(const char *path, const char *label, int e, struct wd_error *err) {
  if (e == ENOENT || e == ENOTDIR) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s %s: no such file", label, path);
  if (e == EACCES || e == EPERM) return err_set(err, WEIGHTD_E_PERMISSION, "%s %s: permission denied", label, path);
  return err_set(err, WEIGHTD_E_IO, "%s %s: cannot open: %s", label, path, strerror(e));
}

int creds_file_read(const char *path, const char *label, size_t max, char **out, size_t *len,
                    struct wd_error *err) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return open_fail(path, label, errno, err);
  struct stat st;
  int rc = 0;
  char *buf = NULL;
  size_t n = 0;
  if (fstat(fd, &st) != 0) rc = err_set(err, WEIGHTD_E_IO, "%s %s: cannot stat: %s", label, path, strerror(errno));
  else if (!S_ISREG(st.st_mode)) rc = err_set(err, WEIGHTD_E_INVALID, "%s %s: not a regular file", label, path);
  else if ((uint64_t)st.st_size > max)
    rc = err_set(err, WEIGHTD_E_LIMIT, "%s %s: larger than %zu bytes", label, path, max);
  else if ((buf = malloc(max + 1)) == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "%s %s: out of memory", label, path);
  while (rc == 0) {
    ssize_t r = read(fd, buf + n, max + 1 - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) rc = err_set(err, WEIGHTD_E_IO, "%s %s: cannot read: %s", label, path, strerror(errno));
    else if (r == 0) break;
    else if ((n += (size_t)r) > max) rc = err_set(err, WEIGHTD_E_LIMIT, "%s %s: larger than %zu bytes", label, path, max);
  }
  close(fd);
  if (rc != 0) {
    if (buf != NULL) explicit_bzero(buf, n < max + 1 ? n : max + 1);
    free(buf);
    return rc;
  }
  buf[n] = '\0';
  *out = buf;
  if (len != NULL) *len = n;
  return 0;
}

/* ---- the INI format ------------------------------------------------------------ */

static bool is_ws(char c) { return c == ' ' || c == '\t'; }

static char *trim(char *s) {
  while (is_ws(*s)) s++;
  size_t n = strlen(s);
  while (n > 0 && is_ws(s[n - 1])) s[--n] = '\0';
  return s;
}

/* Cuts s at its first comment: a '#' or ';' anywhere (need_ws false) or after whitespace. */
static void cut_comment(char *s, bool need_ws) {
  for (char *p = s; *p; p++)
    if ((*p == '#' || *p == ';') && (!need_ws || (p > s && is_ws(p[-1])))) {
      *p = '\0';
      return;
    }
}

/* What a parse keeps while it reads one file. */
struct ini {
  const char *path;
  bool config;           /* the config file ("[profile x]") or the credentials file ("[x]") */
  const char *want;      /* the profile looked for */
  bool in_want;          /* the current section is that profile */
  bool in_section;       /* a section line has been seen */
  int last;              /* the property the previous setting set in the wanted profile, or -1 */
  bool had_setting;      /* the current section has had a setting line */
  struct creds_profile *out;
};

/* The profile a section's inside names in this file, or NULL when it names none. */
static const char *section_profile(struct ini *in, char *inside) {
  char *name = trim(inside);
  if (in->config) {
    if (strcmp(name, "default") == 0) return name;
    if (strncmp(name, "profile", 7) != 0 || !is_ws(name[7])) return NULL;
    name = trim(name + 8);
  }
  if (name[0] == '\0') return NULL;
  for (const char *p = name; *p; p++)
    if (is_ws(*p)) return NULL; /* not a profile name: the AWS tools skip such sections */
  return name;
}

static int ini_error(struct ini *in, size_t lineno, const char *why, struct wd_error *err) {
  return err_set(err, WEIGHTD_E_INVALID, "AWS %s file %s: line %zu: %s", in->config ? "config" : "credentials",
                 in->path, lineno, why);
}

static int set_prop(struct ini *in, int k, const char *value, bool append, struct wd_error *err) {
  char *old = in->out->v[k];
  size_t on = append && old ? strlen(old) : 0, vn = strlen(value);
  char *v = malloc(on + (append ? 1 : 0) + vn + 1);
  if (v == NULL) return err_set(err, WEIGHTD_E_NOMEM, "AWS shared file %s: out of memory", in->path);
  if (on > 0) memcpy(v, old, on);
  if (append) v[on++] = '\n';
  memcpy(v + on, value, vn + 1);
  if (old != NULL) explicit_bzero(old, strlen(old));
  free(old);
  in->out->v[k] = v;
  in->out->from[k] = in->path;
  return 0;
}

static int prop_index(const char *key) {
  for (int k = 0; k < CREDS_P_COUNT; k++)
    if (strcasecmp(key, prop_names[k]) == 0) return k;
  return -1;
}

/* One line (its '\n' and '\r' already cut). */
static int ini_line(struct ini *in, char *line, size_t lineno, struct wd_error *err) {
  bool indented = is_ws(line[0]);
  char *t = trim(line);
  if (t[0] == '\0' || t[0] == '#' || t[0] == ';') return 0;
  if (t[0] == '[') {
    char *close = strchr(t, ']');
    if (close == NULL) return ini_error(in, lineno, "a section line without its ']'", err);
    *close = '\0';
    char *rest = close + 1;
    cut_comment(rest, false);
    if (trim(rest)[0] != '\0') return ini_error(in, lineno, "text after a section's ']'", err);
    const char *name = section_profile(in, t + 1);
    in->in_section = true;
    in->in_want = name != NULL && strcmp(name, in->want) == 0;
    if (in->in_want) in->out->found = true;
    in->last = -1;
    in->had_setting = false;
    return 0;
  }
  if (indented && in->had_setting) {
    /* A continuation of the value above, or a sub-setting of it (which the chain does not read). */
    if (in->last < 0) return 0;
    cut_comment(t, true);
    return set_prop(in, in->last, trim(t), true, err);
  }
  if (indented) return ini_error(in, lineno, "an indented line that continues no setting", err);
  char *eq = strchr(t, '=');
  if (!in->in_section) return ini_error(in, lineno, "a setting before any section ('[name]')", err);
  if (eq == NULL) return ini_error(in, lineno, "expected 'name = value'", err);
  *eq = '\0';
  char *key = trim(t), *value = eq + 1;
  if (key[0] == '\0') return ini_error(in, lineno, "a setting without a name", err);
  cut_comment(value, true);
  value = trim(value);
  in->last = -1;
  in->had_setting = true;
  if (!in->in_want) return 0;
  int k = prop_index(key);
  if (k < 0) return 0;
  in->last = value[0] == '\0' ? -1 : k;
  return set_prop(in, k, value, false, err);
}

static int ini_parse(struct ini *in, char *text, struct wd_error *err) {
  if ((unsigned char)text[0] == 0xef && (unsigned char)text[1] == 0xbb && (unsigned char)text[2] == 0xbf) text += 3;
  size_t lineno = 0;
  for (char *p = text; p != NULL && *p != '\0';) {
    char *nl = strchr(p, '\n');
    if (nl != NULL) *nl = '\0';
    size_t n = strlen(p);
    if (n > 0 && p[n - 1] == '\r') p[n - 1] = '\0';
    int rc = ini_line(in, p, ++lineno, err);
    if (rc != 0) return rc;
    p = nl ? nl + 1 : NULL;
  }
  return 0;
}

static int load_one(const char *path, bool config, const char *name, struct creds_profile *out,
                    struct wd_error *err) {
  if (path == NULL || path[0] == '\0') return 0;
  char *text;
  size_t len;
  const char *label = config ? "AWS config file" : "AWS credentials file";
  int rc = creds_file_read(path, label, SHARED_FILE_MAX, &text, &len, err);
  if (rc == WEIGHTD_E_NOT_FOUND) {
    err_clear(err);
    return 0;
  }
  if (rc != 0) return rc;
  struct ini in = {.path = path, .config = config, .want = name, .last = -1, .out = out};
  rc = ini_parse(&in, text, err);
  explicit_bzero(text, len);
  free(text);
  return rc;
}

int creds_profile_load(const char *config_path, const char *credentials_path, const char *name,
                       struct creds_profile *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  int rc = load_one(config_path, true, name, out, err);
  if (rc == 0) rc = load_one(credentials_path, false, name, out, err);
  return rc;
}

void creds_profile_free(struct creds_profile *p) {
  if (p == NULL) return;
  for (int k = 0; k < CREDS_P_COUNT; k++) {
    if (p->v[k] != NULL) explicit_bzero(p->v[k], strlen(p->v[k]));
    free(p->v[k]);
  }
  memset(p, 0, sizeof *p);
}
