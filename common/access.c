/* access.c - a client's own access to what the daemon reads for it (see access.h). */
#include "access.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

bool acc_cred_equal(const struct acc_cred *a, const struct acc_cred *b) {
  return a->uid == b->uid && a->gid == b->gid && a->ngroups == b->ngroups && !a->groups_unknown &&
         !b->groups_unknown && (a->ngroups == 0 || memcmp(a->groups, b->groups, a->ngroups * sizeof a->groups[0]) == 0);
}

/* ---- the rules ----------------------------------------------------------------------- */

/* in_group_p: the primary group or a supplementary one. */
static bool in_group(const struct acc_cred *c, gid_t g) {
  if (c->gid == g) return true;
  for (size_t i = 0; i < c->ngroups; i++)
    if (c->groups[i] == g) return true;
  return false;
}

static bool grants(unsigned perm, unsigned want) { return (perm & want) == want; }

/* acl_permission_check without an ACL: one class of the mode decides, the first that matches. */
static bool mode_permits(const struct acc_cred *c, const struct acc_object *o, unsigned want) {
  unsigned bits = (unsigned)o->mode;
  if (c->uid == o->uid) bits >>= 6;
  else if (in_group(c, o->gid)) bits >>= 3;
  return grants(bits & 7u, want);
}

/* A matched named or group entry: limited by the mask when the ACL has one. */
static bool masked(const struct acc_acl_entry *e, const struct acc_acl_entry *end, unsigned want) {
  for (const struct acc_acl_entry *m = e + 1; m < end; m++)
    if (m->tag == ACC_ACL_MASK) return grants(e->perm & m->perm, want);
  return grants(e->perm, want);
}

/*
 * posix_acl_permission: the owner entry for the owner; a named user's entry;
 * then every group entry the caller is in (the owning group's and named
 * ones), any of which may grant; other only when no group entry matched.
 */
static bool acl_permits(const struct acc_cred *c, const struct acc_object *o, unsigned want) {
  const struct acc_acl_entry *end = o->acl + o->nacl;
  bool group_matched = false;
  for (const struct acc_acl_entry *e = o->acl; e < end; e++) {
    switch (e->tag) {
    case ACC_ACL_USER_OBJ:
      if (c->uid == o->uid) return grants(e->perm, want);
      break;
    case ACC_ACL_USER:
      if (c->uid == (uid_t)e->id) return masked(e, end, want);
      break;
    case ACC_ACL_GROUP_OBJ:
    case ACC_ACL_GROUP:
      if (in_group(c, e->tag == ACC_ACL_GROUP_OBJ ? o->gid : (gid_t)e->id)) {
        group_matched = true;
        if (grants(e->perm, want)) return masked(e, end, want);
      }
      break;
    case ACC_ACL_MASK:
      break;
    case ACC_ACL_OTHER:
      return !group_matched && grants(e->perm, want);
    default:
      return false;
    }
  }
  return false;
}

bool acc_permits(const struct acc_cred *cred, const struct acc_object *o, unsigned want) {
  return o->nacl > 0 ? acl_permits(cred, o, want) : mode_permits(cred, o, want);
}

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }

int acc_acl_parse(const void *buf, size_t len, struct acc_acl_entry *out, size_t cap, size_t *n) {
  const unsigned char *p = buf;
  *n = 0;
  if (len < 4 || (len - 4) % 8 != 0 || le32(p) != ACC_ACL_XATTR_VERSION) return -EINVAL;
  size_t count = (len - 4) / 8;
  if (count > cap) return -E2BIG;
  /* posix_acl_valid's walk: the owner, named users, the owning group, named groups, the mask, other. */
  unsigned state = ACC_ACL_USER_OBJ;
  bool named = false;
  for (size_t i = 0; i < count; i++) {
    const unsigned char *q = p + 4 + 8 * i;
    struct acc_acl_entry e = {le16(q), le16(q + 2), le32(q + 4)};
    if (e.perm & ~(ACC_READ | ACC_WRITE | ACC_EXEC)) return -EINVAL;
    switch (e.tag) {
    case ACC_ACL_USER_OBJ:
      if (state != ACC_ACL_USER_OBJ) return -EINVAL;
      state = ACC_ACL_USER;
      break;
    case ACC_ACL_USER:
    case ACC_ACL_GROUP:
      if (state != (e.tag == ACC_ACL_USER ? ACC_ACL_USER : ACC_ACL_GROUP)) return -EINVAL;
      named = true;
      break;
    case ACC_ACL_GROUP_OBJ:
      if (state != ACC_ACL_USER) return -EINVAL;
      state = ACC_ACL_GROUP;
      break;
    case ACC_ACL_MASK:
      if (state != ACC_ACL_GROUP) return -EINVAL;
      state = ACC_ACL_OTHER;
      break;
    case ACC_ACL_OTHER:
      if (state != ACC_ACL_OTHER && !(state == ACC_ACL_GROUP && !named)) return -EINVAL;
      state = 0;
      break;
    default:
      return -EINVAL;
    }
    out[i] = e;
  }
  if (state != 0) return -EINVAL;
  *n = count;
  return 0;
}

/* ---- the cache of ACLs ------------------------------------------------------------------ */

#define ACL_XATTR "system.posix_acl_access"
/* Slots of the cache (direct-mapped by device and inode), and the longest ACL one keeps. */
#define CACHE_SLOTS 512
#define CACHE_ENTRIES 16
/* The longest ACL read at all: far past what file systems store (ext4 fits about 500 in a block). */
#define ACL_MAX_ENTRIES 8192

struct cache_slot {
  bool used;
  dev_t dev;
  ino_t ino;
  int64_t ctime_ns;
  uint8_t n;
  struct acc_acl_entry e[CACHE_ENTRIES];
};

struct acc_cache {
  pthread_mutex_t lock;
  struct cache_slot slots[CACHE_SLOTS];
};

struct acc_cache *acc_cache_create(void) {
  struct acc_cache *c = calloc(1, sizeof *c);
  if (c != NULL) pthread_mutex_init(&c->lock, NULL);
  return c;
}

void acc_cache_free(struct acc_cache *c) {
  if (c == NULL) return;
  pthread_mutex_destroy(&c->lock);
  free(c);
}

static int64_t ctime_ns(const struct stat *st) {
  return (int64_t)((uint64_t)st->st_ctim.tv_sec * 1000000000u + (uint64_t)st->st_ctim.tv_nsec);
}

static struct cache_slot *slot_of(struct acc_cache *c, const struct stat *st) {
  uint64_t h = ((uint64_t)st->st_ino * 0x9E3779B97F4A7C15ull) ^ (uint64_t)st->st_dev;
  return &c->slots[(h >> 32) % CACHE_SLOTS];
}

/* Copies a remembered ACL of st's file into out (at most CACHE_ENTRIES); false when none is remembered. */
static bool cache_get(struct acc_cache *c, const struct stat *st, struct acc_acl_entry *out, size_t *n) {
  if (c == NULL) return false;
  pthread_mutex_lock(&c->lock);
  const struct cache_slot *s = slot_of(c, st);
  bool hit = s->used && s->dev == st->st_dev && s->ino == st->st_ino && s->ctime_ns == ctime_ns(st);
  if (hit) {
    *n = s->n;
    if (s->n > 0) memcpy(out, s->e, s->n * sizeof *out);
  }
  pthread_mutex_unlock(&c->lock);
  return hit;
}

/*
 * A ctime this close to now may still be shared by a change to come: file
 * systems stamp with a clock that ticks every few milliseconds, so a setfacl
 * in the same tick could leave the ctime as it was. Such ACLs are not kept
 * (git's "racily clean" rule); a later check keeps them once the tick is past.
 */
#define CACHE_SETTLED_NS 2000000000ll

static bool settled(const struct stat *st) {
  struct timespec now;
  if (clock_gettime(CLOCK_REALTIME, &now) != 0) return false;
  int64_t t = (int64_t)((uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec);
  return ctime_ns(st) < t - CACHE_SETTLED_NS;
}

static void cache_put(struct acc_cache *c, const struct stat *st, const struct acc_acl_entry *e, size_t n) {
  if (c == NULL || n > CACHE_ENTRIES || !settled(st)) return;
  pthread_mutex_lock(&c->lock);
  struct cache_slot *s = slot_of(c, st);
  *s = (struct cache_slot){.used = true, .dev = st->st_dev, .ino = st->st_ino, .ctime_ns = ctime_ns(st), .n = (uint8_t)n};
  if (n > 0) memcpy(s->e, e, n * sizeof *e);
  pthread_mutex_unlock(&c->lock);
}

/*
 * Reads the access ACL of the object fd stands on (an O_PATH descriptor:
 * through /proc/self/fd, which names that object whatever its path now
 * names): 0 with *acl (malloc'd; NULL and *n 0 when it has none, or its file
 * system has no ACLs), or -errno (-ENOENT too when /proc is not mounted:
 * the ACL cannot be read, so nothing is granted).
 */
static int acl_read(int fd, struct acc_acl_entry **acl, size_t *n) {
  *acl = NULL;
  *n = 0;
  char proc[40];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  unsigned char small[4 + 8 * CACHE_ENTRIES], *raw = small;
  ssize_t len = getxattr(proc, ACL_XATTR, small, sizeof small);
  if (len < 0 && errno == ERANGE) {
    ssize_t size = getxattr(proc, ACL_XATTR, NULL, 0);
    if (size > (ssize_t)(4 + 8 * ACL_MAX_ENTRIES)) return -E2BIG;
    if (size > 0 && (raw = malloc((size_t)size)) == NULL) return -ENOMEM;
    len = size > 0 ? getxattr(proc, ACL_XATTR, raw, (size_t)size) : size;
  }
  int rc = 0;
  if (len < 0) {
    rc = errno == ENODATA || errno == ENOTSUP ? 0 : -errno;
  } else if ((*acl = malloc(((size_t)len / 8 + 1) * sizeof **acl)) == NULL) {
    rc = -ENOMEM;
  } else if ((rc = acc_acl_parse(raw, (size_t)len, *acl, (size_t)len / 8 + 1, n)) != 0) {
    free(*acl);
    *acl = NULL;
  }
  if (raw != small) free(raw);
  return rc;
}

/* ---- checking paths ------------------------------------------------------------------------ */

void acc_check_init(struct acc_check *k, const struct acc_cred *cred, struct acc_cache *cache, const char *label) {
  memset(k, 0, sizeof *k);
  k->cred = *cred;
  k->cred.groups = NULL;
  if (cred->ngroups > 0 && !cred->groups_unknown) {
    gid_t *g = cred->ngroups <= SIZE_MAX / sizeof *g ? malloc(cred->ngroups * sizeof *g) : NULL;
    if (g != NULL) memcpy(g, cred->groups, cred->ngroups * sizeof *g);
    else k->cred.groups_unknown = true; /* refused, never judged on fewer groups */
    k->cred.groups = g;
  }
  if (k->cred.groups == NULL) k->cred.ngroups = 0;
  k->cache = cache;
  snprintf(k->label, sizeof k->label, "%s", label);
}

void acc_check_reset(struct acc_check *k) {
  for (size_t i = 0; i < k->ndirs; i++) {
    free(k->dirs[i].path);
    if (k->dirs[i].fd >= 0) close(k->dirs[i].fd);
  }
  free(k->dirs);
  k->dirs = NULL;
  k->ndirs = k->cap = k->nfds = 0;
}

void acc_check_fini(struct acc_check *k) {
  acc_check_reset(k);
  free((gid_t *)k->cred.groups);
  k->cred.groups = NULL;
  k->cred.ngroups = 0;
}

static bool dir_known(const struct acc_check *k, const struct stat *st) {
  for (size_t i = 0; i < k->ndirs; i++)
    if (k->dirs[i].dev == st->st_dev && k->dirs[i].ino == st->st_ino) return true;
  return false;
}

/*
 * Remembers a directory found searchable, with a descriptor of its own while
 * ACC_DIR_FDS allow (when memory or descriptors are short it is checked again
 * next time).
 */
static void dir_remember(struct acc_check *k, int fd, const struct stat *st, const char *path) {
  if (k->ndirs == k->cap) {
    size_t cap = k->cap ? 2 * k->cap : 16;
    struct acc_dir *d = realloc(k->dirs, cap * sizeof *d);
    if (d == NULL) return;
    k->dirs = d;
    k->cap = cap;
  }
  struct acc_dir *d = &k->dirs[k->ndirs];
  if ((d->path = strdup(path)) == NULL) return;
  d->dev = st->st_dev;
  d->ino = st->st_ino;
  d->fd = k->nfds < ACC_DIR_FDS ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
  k->nfds += d->fd >= 0;
  k->ndirs++;
}

/* Whether the caller may `want` the object fd stands on (fstat said st): 0 with *ok, or a refusal. */
static int object_permits(struct acc_check *k, int fd, const char *path, const struct stat *st, unsigned want,
                          bool *ok, struct wd_error *err) {
  struct acc_acl_entry cached[CACHE_ENTRIES], *acl = cached;
  size_t n = 0;
  if (k->between != NULL) k->between(k->between_arg, path);
  if (!cache_get(k->cache, st, cached, &n)) {
    int e = acl_read(fd, &acl, &n);
    if (e != 0) {
      char q[320];
      return err_set(err, WEIGHTD_E_PERMISSION, "%s: the access ACL of %s cannot be evaluated (%s), so it is refused",
                     k->label, err_quote(path, strlen(path), q, sizeof q),
                     e == -EINVAL ? "not the kernel's format" : strerror(-e));
    }
    cache_put(k->cache, st, acl, n);
  }
  const struct acc_object o = {st->st_uid, st->st_gid, st->st_mode, acl, n};
  *ok = acc_permits(&k->cred, &o, want);
  if (acl != cached) free(acl);
  return 0;
}

static int refuse(const struct acc_check *k, const char *verb, const char *what, struct wd_error *err) {
  char q[320];
  return err_set(err, WEIGHTD_E_PERMISSION,
                 "%s: uid %u may not %s %s (weightd reads for a client only what the client may read itself)",
                 k->label, (unsigned)k->cred.uid, verb, err_quote(what, strlen(what), q, sizeof q));
}

/* The caller's want on the object fd stands on: 0, or PERMISSION naming it. A directory it may search is remembered. */
static int check_object(struct acc_check *k, int fd, const char *path, const struct stat *st, unsigned want,
                        struct wd_error *err) {
  bool search = S_ISDIR(st->st_mode) && want == ACC_EXEC, ok;
  if (search && dir_known(k, st)) return 0;
  int rc = object_permits(k, fd, path, st, want, &ok, err);
  if (rc != 0) return rc;
  if (!ok) return refuse(k, search ? "search" : "read", path, err);
  if (search) dir_remember(k, fd, st, path);
  return 0;
}

/* Symbolic links one walk follows at most (the kernel's own limit). */
#define WALK_MAX_LINKS 40

/* A walk: the directory it stands in (a descriptor, what fstat said, its resolved path as text) and what is left. */
struct walk {
  struct acc_check *k;
  int fd;
  struct stat st;
  char cur[PATH_MAX]; /* "" stands for "/" */
  size_t cl;
  char *rest;
  size_t pos;
};

/* The failure of a walk with errno e, as open(2) would have failed for the caller (who may search every directory so far). */
static int walk_fail(const struct walk *w, int e, struct wd_error *err) {
  const char *label = w->k->label;
  if (e == ENOENT) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s: %s", label, strerror(e));
  if (e == ENOMEM) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  return err_set(err, WEIGHTD_E_IO, "%s: cannot resolve: %s", label, strerror(e));
}

/* Replaces what is left by head, then "/" + tail when tail is not empty: a link's target, then what followed it. */
static int rest_set(struct walk *w, const char *head, size_t hl, const char *tail) {
  size_t tl = strlen(tail), sep = tl > 0;
  if (hl + sep + tl >= 2 * PATH_MAX) return ENAMETOOLONG;
  char *n = malloc(hl + sep + tl + 1);
  if (n == NULL) return ENOMEM;
  memcpy(n, head, hl);
  if (sep) n[hl] = '/';
  memcpy(n + hl + sep, tail, tl + 1);
  free(w->rest);
  w->rest = n;
  w->pos = 0;
  return 0;
}

/* Makes fd (with st, at path text p of length pl) the directory the walk stands in. */
static void stand(struct walk *w, int fd, const struct stat *st, const char *p, size_t pl) {
  if (w->fd >= 0) close(w->fd);
  w->fd = fd;
  w->st = *st;
  if (p != w->cur) memmove(w->cur, p, pl);
  w->cl = pl;
  w->cur[pl] = '\0';
}

/* Stands the walk on fd (just opened, or -1 with errno set), whose text is p[0..pl). errno on failure. */
static int stand_fd(struct walk *w, int fd, const char *p, size_t pl) {
  struct stat st;
  if (fd < 0) return errno;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return e;
  }
  stand(w, fd, &st, p, pl);
  return 0;
}

/* Stands the walk on "/" (with an empty text). errno on failure. */
static int stand_root(struct walk *w) { return stand_fd(w, open("/", O_PATH | O_DIRECTORY | O_CLOEXEC), "", 0); }

/*
 * Where a walk of path starts: below the deepest directory this check
 * remembered with a descriptor whose text path begins, else at "/" (or the
 * working directory for a relative path). errno on failure.
 */
static int walk_start(struct walk *w, const char *path) {
  const struct acc_check *k = w->k;
  const struct acc_dir *best = NULL;
  size_t bl = 0;
  for (size_t i = 0; path[0] == '/' && i < k->ndirs; i++) {
    const struct acc_dir *d = &k->dirs[i];
    size_t n = strlen(d->path);
    if (d->fd >= 0 && n > bl && strncmp(path, d->path, n) == 0 && (path[n] == '/' || path[n] == '\0')) {
      best = d;
      bl = n;
    }
  }
  const char *tail = path + bl;
  int e = rest_set(w, tail, strlen(tail), "");
  if (e != 0) return e;
  if (best != NULL) return stand_fd(w, fcntl(best->fd, F_DUPFD_CLOEXEC, 0), best->path, bl);
  if (path[0] == '/') return stand_root(w);
  char cwd[PATH_MAX];
  if (getcwd(cwd, sizeof cwd) == NULL) return errno;
  return stand_fd(w, open(".", O_PATH | O_DIRECTORY | O_CLOEXEC), cwd, strcmp(cwd, "/") == 0 ? 0 : strlen(cwd));
}

int acc_check_path(struct acc_check *k, const char *path, unsigned want, const struct stat *expect,
                   struct wd_error *err) {
  if (k->cred.groups_unknown)
    return err_set(err, WEIGHTD_E_PERMISSION,
                   "%s: the supplementary groups of uid %u could not be read, so its access cannot be decided "
                   "(weightd reads for a client only what the client may read itself)",
                   k->label, (unsigned)k->cred.uid);
  if (path == NULL || path[0] == '\0') return err_set(err, WEIGHTD_E_NOT_FOUND, "%s: empty path", k->label);
  struct walk w = {.k = k, .fd = -1};
  int end = -1, rc = 0, e; /* end: the object the walk ends on, when it is no directory */
  bool slash = false;       /* a '/' follows the name end was found by (then it had to be a directory) */
  struct stat end_st;
  char at[PATH_MAX];
  unsigned links = 0;
  if ((e = walk_start(&w, path)) != 0) {
    rc = walk_fail(&w, e, err);
    goto done;
  }
  for (;;) {
    while (w.rest[w.pos] == '/') w.pos++;
    if (w.rest[w.pos] == '\0') break;
    size_t n = strcspn(w.rest + w.pos, "/");
    const char *name = w.rest + w.pos;
    w.pos += n;
    if (n == 1 && name[0] == '.') continue;
    /* Every lookup in a directory, ".." included, needs search permission on it. */
    if ((rc = check_object(k, w.fd, w.cl ? w.cur : "/", &w.st, ACC_EXEC, err)) != 0) goto done;
    size_t more = w.pos + strspn(w.rest + w.pos, "/");
    bool last = w.rest[more] == '\0';
    if (n == 2 && name[0] == '.' && name[1] == '.') {
      if (w.cl == 0) continue; /* ".." of "/" is "/" */
      int fd = openat(w.fd, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
      struct stat st;
      if (fd < 0 || fstat(fd, &st) != 0) {
        rc = walk_fail(&w, errno, err);
        if (fd >= 0) close(fd);
        goto done;
      }
      size_t cl = w.cl;
      while (cl > 0 && w.cur[cl - 1] != '/') cl--;
      if (cl > 0) cl--;
      stand(&w, fd, &st, w.cur, cl);
      continue;
    }
    if (w.cl + 1 + n >= sizeof at) {
      rc = walk_fail(&w, ENAMETOOLONG, err);
      goto done;
    }
    memcpy(at, w.cur, w.cl);
    at[w.cl] = '/';
    memcpy(at + w.cl + 1, name, n);
    at[w.cl + 1 + n] = '\0';
    int fd = openat(w.fd, at + w.cl + 1, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
      rc = walk_fail(&w, errno, err);
      if (fd >= 0) close(fd);
      goto done;
    }
    if (S_ISLNK(st.st_mode)) {
      char target[PATH_MAX];
      ssize_t tl = ++links > WALK_MAX_LINKS ? (errno = ELOOP, -1) : readlinkat(fd, "", target, sizeof target);
      e = tl < 0 ? errno : tl == 0 ? ENOENT : (size_t)tl >= sizeof target ? ENAMETOOLONG : 0;
      close(fd);
      if (e == 0) e = rest_set(&w, target, (size_t)tl, w.rest + w.pos);
      if (e == 0 && target[0] == '/') e = stand_root(&w);
      if (e != 0) {
        rc = walk_fail(&w, e, err);
        goto done;
      }
      continue;
    }
    if (S_ISDIR(st.st_mode)) {
      stand(&w, fd, &st, at, w.cl + 1 + n);
      continue;
    }
    if (!last) {
      close(fd);
      rc = walk_fail(&w, ENOTDIR, err);
      goto done;
    }
    end = fd;
    end_st = st;
    slash = w.rest[w.pos] == '/';
    memcpy(w.cur, at, w.cl + 1 + n + 1); /* the walk's text now names the object it ends on */
    w.cl += 1 + n;
    break;
  }
  if (end < 0 && w.cl == 0) w.cur[0] = '/', w.cur[1] = '\0';
  const struct stat *st = end >= 0 ? &end_st : &w.st;
  char q[320];
  if (end >= 0 && slash) {
    rc = walk_fail(&w, ENOTDIR, err);
  } else if (expect != NULL && (st->st_dev != expect->st_dev || st->st_ino != expect->st_ino)) {
    rc = err_set(err, WEIGHTD_E_STALE, "%s: %s changed while it was checked", k->label,
                 err_quote(w.cur, strlen(w.cur), q, sizeof q));
  } else if (want != 0) {
    rc = check_object(k, end >= 0 ? end : w.fd, w.cur, st, want, err);
  }
done:
  if (end >= 0) close(end);
  if (w.fd >= 0) close(w.fd);
  free(w.rest);
  return rc;
}

int acc_check_failure(struct acc_check *k, const char *path, int rc, struct wd_error *err) {
  if (rc == 0 || rc == WEIGHTD_E_NOMEM || rc == WEIGHTD_E_SHUTDOWN || rc == WEIGHTD_E_PERMISSION) return rc;
  struct wd_error e;
  if (acc_check_path(k, path, 0, NULL, &e) != WEIGHTD_E_PERMISSION) return rc;
  if (err != NULL) *err = e;
  return e.code;
}
