/*
 * sealed_memfd.h - bytes in a memfd sealed against every change
 * (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): what the daemon
 * hands out or stores when a descriptor must carry immutable bytes (a set's
 * binary tensor table, the set description).
 */
#ifndef WD_SEALED_MEMFD_H
#define WD_SEALED_MEMFD_H

#include <fcntl.h>
#include <stddef.h>

#include "error.h"

/* The seals a sealed memfd carries. */
#define SEALED_MEMFD_SEALS (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/*
 * Writes len bytes into a new memfd called name (close-on-exec) and seals
 * it: *out is its descriptor. 0, or WEIGHTD_E_NOMEM / WEIGHTD_E_INTERNAL
 * naming what failed.
 */
int sealed_memfd_create(const char *name, const void *buf, size_t len, int *out, struct wd_error *err);

/*
 * Maps a sealed memfd read-only after checking that it carries at least
 * the write, shrink and grow seals: *map and *len (munmap it; an empty one
 * gives NULL and 0). 0, or WEIGHTD_E_INVALID saying what is wrong.
 */
int sealed_memfd_map(int fd, const void **map, size_t *len, struct wd_error *err);

#endif
