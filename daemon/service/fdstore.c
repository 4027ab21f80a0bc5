/* fdstore.c - the service manager's file descriptor store (see fdstore.h). */
#include "fdstore.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "service.h"

struct fdstore {
  bool enabled;
  char **names;
  size_t n, cap;
};

struct fdstore *fdstore_create(bool enabled) {
  struct fdstore *fs = calloc(1, sizeof *fs);
  if (fs != NULL) fs->enabled = enabled;
  return fs;
}

void fdstore_destroy(struct fdstore *fs) {
  if (fs == NULL) return;
  for (size_t i = 0; i < fs->n; i++) free(fs->names[i]);
  free(fs->names);
  free(fs);
}

bool fdstore_enabled(const struct fdstore *fs) { return fs != NULL && fs->enabled; }

bool fdstore_has(const struct fdstore *fs, const char *name) {
  for (size_t i = 0; i < fs->n; i++)
    if (strcmp(fs->names[i], name) == 0) return true;
  return false;
}

void fdstore_note(struct fdstore *fs, const char *name) {
  if (fdstore_has(fs, name)) return;
  if (fs->n == fs->cap) {
    size_t cap = fs->cap ? fs->cap * 2 : 16;
    char **v = realloc(fs->names, cap * sizeof *v);
    if (v == NULL) return; /* forgotten: at worst a stale name stays stored until the next restart */
    fs->names = v;
    fs->cap = cap;
  }
  char *copy = strdup(name);
  if (copy != NULL) fs->names[fs->n++] = copy;
}

int fdstore_put(struct fdstore *fs, const char *name, int fd, struct wd_error *err) {
  if (!fs->enabled) return 0;
  char state[320];
  snprintf(state, sizeof state, "FDSTORE=1\nFDNAME=%s\nFDPOLL=0", name);
  int rc = service_notify(state, &fd, 1, err);
  if (rc != 0) return err_prefix(err, "storing %s", name);
  fdstore_note(fs, name);
  return 0;
}

void fdstore_remove(struct fdstore *fs, const char *name) {
  for (size_t i = 0; i < fs->n; i++)
    if (strcmp(fs->names[i], name) == 0) {
      free(fs->names[i]);
      fs->names[i] = fs->names[--fs->n];
      break;
    }
  if (!fs->enabled) return;
  char state[320];
  snprintf(state, sizeof state, "FDSTOREREMOVE=1\nFDNAME=%s", name);
  struct wd_error err = {0};
  if (service_notify(state, NULL, 0, &err) != 0) log_msg(LOG_WARN, "cannot remove %s from the store: %s", name, err.msg);
}

size_t fdstore_count(const struct fdstore *fs) { return fs->n; }
const char *fdstore_name(const struct fdstore *fs, size_t i) { return i < fs->n ? fs->names[i] : NULL; }
