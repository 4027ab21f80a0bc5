/* access.c - a client's own access to what the daemon reads for it (see access.h). */
#include "access.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>
#include <time.h>

#include "pathutil.h"

bool acc_cred_equal(const struct acc_cred *a, const struct acc_cred *b) {
  return a->uid == b->uid && a->gid == b->gid && a->ngroups == b->ngroups &&
         memcmp(a->groups, b->groups, a->ngroups * sizeof a->groups[0]) == 0;
}

/* ---- the rules ----------------------------------------------------------------------- */

/* in_group_p: the primary group or a supplementary one. */
static bool in_group(const struct acc_cred *c, gid_t g) {
  if (c->gid == g) return true;
  for (size_t i = 0; i < c->ngroups && i < ACC_MAX_GROUPS; i++)
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
 * Reads the access ACL of the file at path: 0 with *acl (malloc'd; NULL and
 * *n 0 when it has none, or its file system has no ACLs), or -errno.
 */
static int acl_read(const char *path, struct acc_acl_entry **acl, size_t *n) {
  *acl = NULL;
  *n = 0;
  unsigned char small[4 + 8 * CACHE_ENTRIES], *raw = small;
  ssize_t len = lgetxattr(path, ACL_XATTR, small, sizeof small);
  if (len < 0 && errno == ERANGE) {
    ssize_t size = lgetxattr(path, ACL_XATTR, NULL, 0);
    if (size > (ssize_t)(4 + 8 * ACL_MAX_ENTRIES)) return -E2BIG;
    if (size > 0 && (raw = malloc((size_t)size)) == NULL) return -ENOMEM;
    len = size > 0 ? lgetxattr(path, ACL_XATTR, raw, (size_t)size) : size;
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
  if (k->cred.ngroups > ACC_MAX_GROUPS) k->cred.ngroups = ACC_MAX_GROUPS;
  k->cache = cache;
  snprintf(k->label, sizeof k->label, "%s", label);
}

void acc_check_reset(struct acc_check *k) {
  for (size_t i = 0; i < k->ndirs; i++) free(k->dirs[i]);
  free(k->dirs);
  k->dirs = NULL;
  k->ndirs = k->cap = 0;
}

static bool dir_known(const struct acc_check *k, const char *dir) {
  for (size_t i = 0; i < k->ndirs; i++)
    if (strcmp(k->dirs[i], dir) == 0) return true;
  return false;
}

/* Remembers a directory found searchable (when memory is short it is checked again next time). */
static void dir_remember(struct acc_check *k, const char *dir) {
  if (k->ndirs == k->cap) {
    size_t cap = k->cap ? 2 * k->cap : 16;
    char **d = realloc(k->dirs, cap * sizeof *d);
    if (d == NULL) return;
    k->dirs = d;
    k->cap = cap;
  }
  if ((k->dirs[k->ndirs] = strdup(dir)) != NULL) k->ndirs++;
}

/* Whether the caller may `want` the file at path, which lstat described as st: 0 with *ok, or a refusal. */
static int object_permits(struct acc_check *k, const char *path, const struct stat *st, unsigned want, bool *ok,
                          struct wd_error *err) {
  struct acc_acl_entry cached[CACHE_ENTRIES], *acl = cached;
  size_t n = 0;
  if (!cache_get(k->cache, st, cached, &n)) {
    int e = acl_read(path, &acl, &n);
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

/* The caller's want on one object (lstat said st): 0, or PERMISSION naming it. A directory it may search is remembered. */
static int check_object(struct acc_check *k, const char *path, const struct stat *st, unsigned want,
                        struct wd_error *err) {
  bool search = S_ISDIR(st->st_mode) && want == ACC_EXEC, ok;
  if (search && dir_known(k, path)) return 0;
  int rc = object_permits(k, path, st, want, &ok, err);
  if (rc != 0) return rc;
  if (!ok) return refuse(k, search ? "search" : "read", path, err);
  if (search) dir_remember(k, path);
  return 0;
}

/* The walk's visitor: the caller must be able to search every directory a name is looked up in. */
static int visit_dir(void *arg, const char *dir, struct wd_error *err) {
  struct acc_check *k = arg;
  if (dir_known(k, dir)) return 0;
  struct stat st;
  char q[320];
  if (lstat(dir, &st) != 0)
    return err_set(err, errno == ENOMEM ? WEIGHTD_E_NOMEM : WEIGHTD_E_IO, "%s: cannot stat %s: %s", k->label,
                   err_quote(dir, strlen(dir), q, sizeof q), strerror(errno));
  if (!S_ISDIR(st.st_mode))
    return err_set(err, WEIGHTD_E_STALE, "%s: %s changed while it was checked", k->label,
                   err_quote(dir, strlen(dir), q, sizeof q));
  return check_object(k, dir, &st, ACC_EXEC, err);
}

/*
 * A name straight in a directory this check found searchable (and so every
 * directory above it): the walk is that one lstat, unless the name is a
 * symbolic link (walked whole). Fills *res and returns true; false to walk.
 */
static bool known_child(const struct acc_check *k, const char *path, struct path_resolved *res) {
  const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : NULL;
  if (slash == NULL || slash == path || *name == '\0' || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) return false;
  size_t n = (size_t)(slash - path);
  bool known = false;
  for (size_t i = 0; i < k->ndirs && !known; i++) known = strlen(k->dirs[i]) == n && memcmp(k->dirs[i], path, n) == 0;
  if (!known || lstat(path, &res->st) != 0 || S_ISLNK(res->st.st_mode)) return false;
  return (res->real = strdup(path)) != NULL;
}

int acc_check_path(struct acc_check *k, const char *path, unsigned want, const struct stat *expect,
                   struct wd_error *err) {
  struct path_resolved res;
  int rc = known_child(k, path, &res) ? 0 : path_resolve_walk(path, NULL, k->label, visit_dir, k, &res, err);
  if (rc != 0) return rc;
  char q[320];
  if (expect != NULL && (res.st.st_dev != expect->st_dev || res.st.st_ino != expect->st_ino))
    rc = err_set(err, WEIGHTD_E_STALE, "%s: %s changed while it was checked", k->label,
                 err_quote(res.real, strlen(res.real), q, sizeof q));
  else if (want != 0)
    rc = check_object(k, res.real, &res.st, want, err);
  free(res.real);
  return rc;
}
