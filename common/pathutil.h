/*
 * pathutil.h - path rules shared by the checkpoint reader and the daemon:
 * relative names as text, resolution and confinement to the model roots,
 * and opening a file so that no open can block or land outside them.
 */
#ifndef WD_PATHUTIL_H
#define WD_PATHUTIL_H

#include <stddef.h>
#include <sys/stat.h>

#include "error.h"

/*
 * True when rel is a safe relative path as text: not empty, no leading '/',
 * no ".." component. Symlinks are judged separately, after resolution.
 */
int path_rel_is_safe(const char *rel);

/* True when the resolved path lies at or under one of the resolved roots. */
int path_under_roots(const char *resolved, const char *const *roots, size_t nroots);

/* The model roots a resolution is confined to: resolved directories; none means no confinement. */
struct path_roots {
  const char *const *dirs;
  size_t n;
};

/* A resolved path: no symbolic link, "." or ".." in it, and what lstat said of it. */
struct path_resolved {
  char *real; /* malloc'd */
  struct stat st;
};

/*
 * Resolves path as realpath(3) does, with lstat and readlink only (nothing is
 * ever opened, so no FIFO or device is touched), and confines the result to
 * roots. The verdict never depends on what exists outside the roots: a path
 * whose resolution fails at, or ends on, an entry outside every root is
 * refused the same way whether that entry exists or not. Returns 0 and fills
 * out (free out->real), or fails with detail in err naming the path by label:
 * WEIGHTD_E_PATH_DENIED (it leads outside the roots), WEIGHTD_E_NOT_FOUND (a
 * missing entry inside them), WEIGHTD_E_IO (ELOOP, ENOTDIR, EACCES, a name
 * too long), WEIGHTD_E_NOMEM.
 */
int path_resolve(const char *path, const struct path_roots *roots, const char *label,
                 struct path_resolved *out, struct wd_error *err);

/*
 * Called by path_resolve_walk before each name (".." included) is looked up
 * in dir: "/" or a resolved directory (no symbolic link, "." or ".." in it),
 * the directories open(2) needs search permission on. A nonzero return (a
 * negative code, err filled) ends the walk with it.
 */
typedef int (*path_visit_fn)(void *arg, const char *dir, struct wd_error *err);

/* path_resolve, calling visit (when not NULL) for every directory the walk looks a name up in, in order. */
int path_resolve_walk(const char *path, const struct path_roots *roots, const char *label, path_visit_fn visit,
                      void *arg, struct path_resolved *out, struct wd_error *err);

/*
 * Opens a regular file confined to roots, so that the open cannot block and
 * cannot be redirected: resolves path (path_resolve), refuses anything but a
 * regular file before opening it, opens the resolved path with O_RDONLY |
 * O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY (through openat2 with
 * RESOLVE_NO_SYMLINKS where the kernel has it, so that a symlink swapped into
 * any component after the check fails the open), and checks with fstat that
 * the descriptor is a regular file with the device and inode that were
 * resolved. Returns 0 with *fd open, out filled (out->st from fstat) and
 * *fd's flags back to blocking reads; or path_resolve's failures,
 * WEIGHTD_E_INVALID (not a regular file) and WEIGHTD_E_STALE (changed while
 * it was opened).
 */
int path_open_confined(const char *path, const struct path_roots *roots, const char *label, int *fd,
                       struct path_resolved *out, struct wd_error *err);

/* Joins dir and rel with one '/'; returns a new string or NULL. */
char *path_join(const char *dir, const char *rel);

/* The directory part of path ("." when there is none); a new string or NULL. */
char *path_dirname(const char *path);

/*
 * Reads a whole (small) file from the open descriptor fd, which must be a
 * regular file of at most max_len bytes; *out is NUL-terminated. Returns 0 or
 * -errno (-EINVAL: not a regular file; -EFBIG: too large).
 */
int path_read_fd(int fd, size_t max_len, char **out, size_t *len);

/*
 * Reads a whole (small) regular file, opened without blocking (a FIFO is
 * refused, not waited on). Returns 0 or -errno as path_read_fd.
 */
int path_read_file(const char *path, size_t max_len, char **out, size_t *len);

#endif
