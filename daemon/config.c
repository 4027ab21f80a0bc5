/* config.c - the configuration table and its readers (see config.h). */
#include "config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "pathutil.h"

enum cfg_type { CFG_STRING, CFG_UINT, CFG_BYTES, CFG_MODE, CFG_ENUM, CFG_PATH_LIST, CFG_ID_LIST };

struct cfg_key {
  const char *name;
  enum cfg_type type;
  size_t offset;     /* of the value in struct wd_config */
  size_t count_off;  /* lists: of the count */
  uint64_t min, max; /* numbers */
  const char *def;   /* default, as text */
  const char *help;
  const char *const *choices; /* CFG_ENUM: the names, in the enum's order, NULL-terminated */
};

/* Enumerated keys are stored as int through the table's offset. */
_Static_assert(sizeof(enum cfg_backend) == sizeof(int) && sizeof(enum log_level) == sizeof(int) &&
                   sizeof(enum cfg_load_method) == sizeof(int),
               "enumerated config keys are stored as int");

static const char *const backend_names[] = {"auto", "cuda", "host", NULL};
static const char *const log_level_names[] = {"error", "warn", "info", "debug", NULL};
static const char *const load_method_names[] = {"auto", "staged", NULL};

#define OFF(f) offsetof(struct wd_config, f)
#define GiB (1ull << 30)
#define MiB (1ull << 20)

static const struct cfg_key keys[] = {
    {"socket", CFG_STRING, OFF(socket), 0, 0, 0, "",
     "socket path (default: /run/weightd/weightd.sock as root, else $XDG_RUNTIME_DIR/weightd.sock "
     "or /tmp/weightd-$UID.sock)"},
    {"socket_group", CFG_STRING, OFF(socket_group), 0, 0, 0, "weightd",
     "group owning the socket; members may connect (kept as is when the group does not exist)"},
    {"socket_mode", CFG_MODE, OFF(socket_mode), 0, 0, 0777, "0660", "permission bits of the socket"},
    {"model_roots", CFG_PATH_LIST, OFF(model_roots), OFF(n_model_roots), 0, 0, NULL,
     "directories checkpoints must resolve into; empty = any path the daemon can read"},
    {"allowed_uids", CFG_ID_LIST, OFF(allowed_uids), OFF(n_allowed_uids), 0, UINT32_MAX, NULL,
     "peer uids allowed besides root and the daemon's uid; with allowed_gids both empty, "
     "anyone who can open the socket"},
    {"allowed_gids", CFG_ID_LIST, OFF(allowed_gids), OFF(n_allowed_gids), 0, UINT32_MAX, NULL,
     "peer primary gids allowed"},
    {"backend", CFG_ENUM, OFF(backend), 0, 0, 0, "auto", "auto | cuda | host", backend_names},
    {"device_memory_budget", CFG_BYTES, OFF(device_memory_budget), 0, 0, UINT64_MAX, "0",
     "bytes of resident sets per device before unleased sets are evicted (0 = a GPU's own memory; "
     "for the host backend, half of physical memory)"},
    {"host_pin_budget", CFG_BYTES, OFF(host_pin_budget), 0, 0, UINT64_MAX, "0",
     "bytes of checkpoint files kept registered for direct DMA (prefetch --pin; 0 = half of "
     "physical memory)"},
    {"fill_threads", CFG_UINT, OFF(fill_threads), 0, 0, 1024, "0",
     "threads copying from the page cache (0 = one per online CPU)"},
    {"job_threads", CFG_UINT, OFF(job_threads), 0, 1, 256, "4",
     "loads, prefetches and frees that run at once"},
    {"control_threads", CFG_UINT, OFF(control_threads), 0, 1, 64, "2",
     "threads for quick work (opening and checking checkpoints, plans, status), apart from loads"},
    {"staging_slots", CFG_UINT, OFF(staging_slots), 0, 2, 64, "2", "pinned staging slots per GPU"},
    {"staging_slot_bytes", CFG_BYTES, OFF(staging_slot_bytes), 0, 1 * MiB, 4 * GiB, "64MiB",
     "bytes per staging slot"},
    {"frame_timeout_ms", CFG_UINT, OFF(frame_timeout_ms), 0, 100, 3600000, "10000",
     "a request frame must arrive whole within this time"},
    {"max_connections", CFG_UINT, OFF(max_connections), 0, 1, 1000000, "1024",
     "connections served at once; more are refused"},
    {"max_queued_output", CFG_BYTES, OFF(max_queued_output), 0, 1 * MiB, 16 * GiB, "64MiB",
     "reply bytes queued for a client that does not read; past half of it the client's requests are not "
     "read, and a reply that would pass it is answered LIMIT"},
    {"max_queued_fds", CFG_UINT, OFF(max_queued_fds), 0, 1, 65536, "64",
     "file descriptors queued in one connection's unread replies; an attach past it is answered LIMIT"},
    {"max_request_bytes", CFG_BYTES, OFF(max_request_bytes), 0, 4096, 16 * MiB, "4MiB",
     "the largest request frame; a longer one is refused from its length prefix, before it is read"},
    {"request_memory", CFG_BYTES, OFF(request_memory), 0, 16 * MiB, 64 * GiB, "1GiB",
     "memory for requests read and not finished, all connections together (charged as 64 bytes per "
     "request byte, what parsing the densest JSON can take); one connection may use a quarter, and a "
     "request that does not fit waits unparsed until memory frees"},
    {"idle_timeout_ms", CFG_UINT, OFF(idle_timeout_ms), 0, 0, 86400000, "300000",
     "a connection that holds no lease and has nothing in progress is closed after this long (0: never)"},
    {"reserved_connections", CFG_UINT, OFF(reserved_connections), 0, 0, 1000, "16",
     "connections beyond max_connections that only root and the daemon's uid may use"},
    {"log_level", CFG_ENUM, OFF(log_level), 0, 0, 0, "info", "error | warn | info | debug", log_level_names},
    {"load_method", CFG_ENUM, OFF(load_method), 0, 0, 0, "auto",
     "auto | staged: staged sends every load through the pinned staging slots, also on the host "
     "backend and for pinned checkpoints (for tests and comparisons)",
     load_method_names},
};

#define NKEYS (sizeof keys / sizeof keys[0])

static const struct cfg_key *find_key(const char *name) {
  for (size_t i = 0; i < NKEYS; i++)
    if (strcmp(keys[i].name, name) == 0) return &keys[i];
  return NULL;
}

/* Parses "123", "64MiB", "2GiB", "1.5GB", "512K": bytes, exact for integers. */
static int parse_bytes(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || v < 0 || !isfinite(v)) return -1;
  while (*end == ' ') end++;
  static const struct {
    const char *suffix;
    double mult;
  } units[] = {{"", 1},           {"B", 1},
               {"K", 1024.0},     {"KiB", 1024.0},
               {"KB", 1e3},       {"M", 1048576.0},
               {"MiB", 1048576.0},{"MB", 1e6},
               {"G", 1073741824.0},{"GiB", 1073741824.0},
               {"GB", 1e9},       {"T", 1099511627776.0},
               {"TiB", 1099511627776.0}, {"TB", 1e12}};
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
    if (strcmp(end, units[i].suffix) != 0) continue;
    double b = v * units[i].mult;
    if (b >= 18446744073709551615.0) return -1;
    *out = (uint64_t)b;
    return 0;
  }
  return -1;
}

static int parse_uint(const char *s, uint64_t *out, int base) {
  if (s[0] < '0' || s[0] > '9') return -1;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, base);
  if (*end != '\0' || errno != 0) return -1;
  *out = v;
  return 0;
}

static int list_append(void **items, size_t *count, size_t elem, const void *value) {
  void *n = realloc(*items, (*count + 1) * elem);
  if (n == NULL) return -1;
  memcpy((char *)n + *count * elem, value, elem);
  *items = n;
  (*count)++;
  return 0;
}

static int set_text(struct wd_config *cfg, const struct cfg_key *k, const char *value,
                    struct wd_error *err) {
  char *base = (char *)cfg;
  uint64_t v;
  switch (k->type) {
  case CFG_STRING: {
    char *dup = strdup(value);
    if (dup == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    char **slot = (char **)(base + k->offset);
    free(*slot);
    *slot = dup;
    return 0;
  }
  case CFG_UINT:
  case CFG_BYTES:
  case CFG_MODE: {
    int bad = k->type == CFG_BYTES ? parse_bytes(value, &v)
                                   : parse_uint(value, &v, k->type == CFG_MODE ? 8 : 10);
    if (bad || v < k->min || v > k->max)
      return err_set(err, WEIGHTD_E_INVALID, "config '%s': '%s' is not %s between %llu and %llu",
                     k->name, value, k->type == CFG_BYTES ? "a size" : "an integer",
                     (unsigned long long)k->min, (unsigned long long)k->max);
    *(uint64_t *)(base + k->offset) = v;
    return 0;
  }
  case CFG_ENUM:
    for (int i = 0; k->choices[i] != NULL; i++)
      if (strcmp(k->choices[i], value) == 0) {
        *(int *)(base + k->offset) = i;
        return 0;
      }
    {
      char list[128] = "";
      for (int i = 0; k->choices[i] != NULL; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", k->choices[i]);
      return err_set(err, WEIGHTD_E_INVALID, "config '%s': '%s' is not one of %s", k->name, value, list);
    }
  case CFG_PATH_LIST: {
    char *dup = strdup(value);
    if (dup == NULL ||
        list_append((void **)(base + k->offset), (size_t *)(base + k->count_off), sizeof dup, &dup)) {
      free(dup);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
    return 0;
  }
  case CFG_ID_LIST:
    if (parse_uint(value, &v, 10) != 0 || v > k->max)
      return err_set(err, WEIGHTD_E_INVALID, "config '%s': '%s' is not a numeric id", k->name, value);
    if (list_append((void **)(base + k->offset), (size_t *)(base + k->count_off), sizeof v, &v))
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    return 0;
  }
  return err_set(err, WEIGHTD_E_INTERNAL, "config: bad key type");
}

int config_set(struct wd_config *cfg, const char *key, const char *value, struct wd_error *err) {
  const struct cfg_key *k = find_key(key);
  if (k == NULL) return err_set(err, WEIGHTD_E_INVALID, "config: unknown key '%s'", key);
  return set_text(cfg, k, value, err);
}

int config_add_model_root(struct wd_config *cfg, const char *dir, struct wd_error *err) {
  return config_set(cfg, "model_roots", dir, err);
}

int config_defaults(struct wd_config *cfg, struct wd_error *err) {
  memset(cfg, 0, sizeof *cfg);
  for (size_t i = 0; i < NKEYS; i++) {
    if (keys[i].def == NULL) continue;
    int rc = set_text(cfg, &keys[i], keys[i].def, err);
    if (rc != 0) return rc;
  }
  return 0;
}

/* One JSON value for key k: strings as text, numbers exact, lists item by item. */
static int set_json(struct wd_config *cfg, const struct cfg_key *k, const cJSON *v,
                    const char *path, struct wd_error *err) {
  char buf[64];
  if (k->type == CFG_PATH_LIST || k->type == CFG_ID_LIST) {
    if (!cJSON_IsArray(v))
      return err_set(err, WEIGHTD_E_INVALID, "%s: '%s' must be a list", path, k->name);
    /* The file replaces the defaults (and earlier values) of a list. */
    char *base = (char *)cfg;
    size_t *count = (size_t *)(base + k->count_off);
    if (k->type == CFG_PATH_LIST) {
      char **items = *(char ***)(base + k->offset);
      for (size_t i = 0; i < *count; i++) free(items[i]);
    }
    free(*(void **)(base + k->offset));
    *(void **)(base + k->offset) = NULL;
    *count = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
      const char *text;
      if (cJSON_IsString(e)) {
        text = e->valuestring;
      } else if (cJSON_IsNumber(e) && e->valuedouble >= 0 && e->valuedouble <= 4294967295.0 &&
                 floor(e->valuedouble) == e->valuedouble) {
        snprintf(buf, sizeof buf, "%.0f", e->valuedouble);
        text = buf;
      } else {
        return err_set(err, WEIGHTD_E_INVALID, "%s: '%s' has an entry of the wrong type", path, k->name);
      }
      int rc = set_text(cfg, k, text, err);
      if (rc != 0) return rc;
    }
    return 0;
  }
  if (cJSON_IsString(v)) return set_text(cfg, k, v->valuestring, err);
  if (cJSON_IsNumber(v) && k->type != CFG_STRING && k->type != CFG_ENUM) {
    if (v->valuedouble < 0 || v->valuedouble > 9007199254740992.0 || floor(v->valuedouble) != v->valuedouble)
      return err_set(err, WEIGHTD_E_INVALID, "%s: '%s' must be a non-negative integer", path, k->name);
    if (k->type == CFG_MODE) snprintf(buf, sizeof buf, "%o", (unsigned)v->valuedouble);
    else snprintf(buf, sizeof buf, "%.0f", v->valuedouble);
    return set_text(cfg, k, buf, err);
  }
  return err_set(err, WEIGHTD_E_INVALID, "%s: '%s' has the wrong type", path, k->name);
}

int config_load_file(struct wd_config *cfg, const char *path, struct wd_error *err) {
  char *text;
  size_t len;
  int r = path_read_file(path, 1u << 20, &text, &len);
  if (r != 0) return err_set(err, WEIGHTD_E_INVALID, "%s: cannot read: %s", path, strerror(-r));
  cJSON *root = cJSON_ParseWithLength(text, len);
  free(text);
  int rc = 0;
  if (root == NULL || !cJSON_IsObject(root)) {
    rc = err_set(err, WEIGHTD_E_INVALID, "%s: not a JSON object", path);
    goto out;
  }
  const cJSON *e;
  cJSON_ArrayForEach(e, root) {
    const struct cfg_key *k = find_key(e->string);
    if (k == NULL) {
      rc = err_set(err, WEIGHTD_E_INVALID, "%s: unknown key '%s'", path, e->string);
      goto out;
    }
    if ((rc = set_json(cfg, k, e, path, err)) != 0) goto out;
  }
out:
  cJSON_Delete(root);
  return rc;
}

const char *config_enum_name(const struct wd_config *cfg, const char *key) {
  const struct cfg_key *k = find_key(key);
  if (k == NULL || k->type != CFG_ENUM) return "?";
  int v = *(const int *)((const char *)cfg + k->offset);
  for (int i = 0; k->choices[i] != NULL; i++)
    if (i == v) return k->choices[i];
  return "?";
}

void config_print_help(FILE *f) {
  fprintf(f, "configuration keys (JSON object; sizes accept \"64MiB\", \"2GiB\"):\n");
  for (size_t i = 0; i < NKEYS; i++)
    fprintf(f, "  %-22s default %-10s %s\n", keys[i].name, keys[i].def ? keys[i].def : "[]", keys[i].help);
}

void config_free(struct wd_config *cfg) {
  if (cfg == NULL) return;
  for (size_t i = 0; i < NKEYS; i++) {
    char *slot = (char *)cfg + keys[i].offset;
    if (keys[i].type == CFG_STRING) free(*(char **)slot);
    if (keys[i].type == CFG_PATH_LIST) {
      char **items = *(char ***)slot;
      size_t n = *(size_t *)((char *)cfg + keys[i].count_off);
      for (size_t j = 0; j < n; j++) free(items[j]);
    }
    if (keys[i].type == CFG_PATH_LIST || keys[i].type == CFG_ID_LIST) free(*(void **)slot);
  }
  memset(cfg, 0, sizeof *cfg);
}
