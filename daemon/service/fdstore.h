/*
 * fdstore.h - the service manager's file descriptor store, spoken over the
 * notify socket (service.h): descriptors stored with FDSTORE=1, FDNAME=<name>
 * and FDPOLL=0 (so that a slab descriptor that reports POLLHUP is kept), and
 * removed with FDSTOREREMOVE=1. The store hands them back to the next
 * process of the service with LISTEN_FDS/LISTEN_FDNAMES.
 *
 * The module remembers which names it believes are stored (those it stored,
 * and those passed at start), so that its user can remove stale ones.
 * Threads: the loop thread only.
 */
#ifndef WD_FDSTORE_H
#define WD_FDSTORE_H

#include <stdbool.h>
#include <stddef.h>

#include "error.h"

struct fdstore;

/* A store that sends nothing while enabled is false. NULL when memory ran out. */
struct fdstore *fdstore_create(bool enabled);
void fdstore_destroy(struct fdstore *fs);
bool fdstore_enabled(const struct fdstore *fs);

/* Stores a duplicate of fd under name (the caller keeps fd). 0, or an error naming the name. */
int fdstore_put(struct fdstore *fs, const char *name, int fd, struct wd_error *err);

/* Removes every descriptor stored under name (logged when the manager cannot be told). */
void fdstore_remove(struct fdstore *fs, const char *name);

/* Notes a name as stored (a descriptor passed at start came from the store). */
void fdstore_note(struct fdstore *fs, const char *name);

/* True when name is believed stored. */
bool fdstore_has(const struct fdstore *fs, const char *name);

/* The names believed stored, for walking: count and the i-th (valid until the next change). */
size_t fdstore_count(const struct fdstore *fs);
const char *fdstore_name(const struct fdstore *fs, size_t i);

#endif
