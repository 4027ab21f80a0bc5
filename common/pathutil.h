/*
 * pathutil.h - path checks shared by the checkpoint reader and the daemon.
 */
#ifndef WD_PATHUTIL_H
#define WD_PATHUTIL_H

#include <stddef.h>

/*
 * True when rel is a safe relative path as text: not empty, no leading '/',
 * no ".." component. Symlinks are judged separately, after resolution.
 */
int path_rel_is_safe(const char *rel);

/* True when the resolved path lies at or under one of the resolved roots. */
int path_under_roots(const char *resolved, const char *const *roots, size_t nroots);

/* Joins dir and rel with one '/'; returns a new string or NULL. */
char *path_join(const char *dir, const char *rel);

/* The directory part of path ("." when there is none); a new string or NULL. */
char *path_dirname(const char *path);

/* Reads a whole (small) file; *out is NUL-terminated. Returns 0 or -errno. */
int path_read_file(const char *path, size_t max_len, char **out, size_t *len);

#endif
