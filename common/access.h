/*
 * access.h - whether a client may read what the daemon reads for it.
 *
 * The daemon opens checkpoints with its own rights for clients of other
 * uids; reading for a client what that client could not read itself would
 * make it a confused deputy. So, before any byte of a file reaches a client
 * (a header, an index entry, a config value, a message about one of them),
 * the client's own access is evaluated as the kernel evaluates it for an
 * open(2) by that client: search (x) permission on every directory a name
 * is looked up in while the path is resolved (symbolic links followed, so
 * the directories of each link's target count, as they do for the kernel),
 * and read permission on the file it ends on. The check uses the client's
 * credentials as the daemon read them at accept: uid, primary gid and
 * supplementary groups.
 *
 * Permission is decided as the kernel decides it (acl_permission_check,
 * posix_acl_permission): the owner class when the uid owns the object, else
 * the group class when the primary or a supplementary group is the
 * object's group, else other; or, when the object has a POSIX access ACL
 * (the xattr system.posix_acl_access), the ACL: the owner entry, a named
 * user entry (limited by the mask), the owning group and named group
 * entries (any one that grants the access, limited by the mask), else other.
 * An ACL that cannot be read or parsed refuses: nothing is granted on a
 * guess. Capabilities are not modelled: root and the daemon's own uid, who
 * could read the files themselves, are not checked at all (the callers skip
 * them).
 *
 * The first half is pure (the permission rules and the ACL format, for unit
 * tests); the second walks paths and reads ACLs, on a job thread.
 */
#ifndef WD_ACCESS_H
#define WD_ACCESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "error.h"

/* The access an open(2) asks for, as the mode bits of one class. */
#define ACC_EXEC 1u   /* search, for a directory */
#define ACC_WRITE 2u
#define ACC_READ 4u

/*
 * Whose access is checked. A view: groups points at the caller's list, which
 * acc_check_init copies (a check owns its credentials; the list may then go).
 * groups_unknown: the daemon could not read the peer's supplementary groups,
 * so nothing is granted (acc_check_path refuses).
 */
struct acc_cred {
  uid_t uid;
  gid_t gid;            /* primary */
  size_t ngroups;       /* supplementary groups in groups[], all of them */
  const gid_t *groups;  /* NULL when ngroups is 0 */
  bool groups_unknown;
};

/* True when two credentials grant the same (same uid, gid and groups, in order; both known). */
bool acc_cred_equal(const struct acc_cred *a, const struct acc_cred *b);

/* ---- the rules (pure) ------------------------------------------------------------ */

/* The tags of a POSIX ACL entry, as the kernel's xattr format numbers them. */
enum acc_acl_tag {
  ACC_ACL_USER_OBJ = 0x01,
  ACC_ACL_USER = 0x02,
  ACC_ACL_GROUP_OBJ = 0x04,
  ACC_ACL_GROUP = 0x08,
  ACC_ACL_MASK = 0x10,
  ACC_ACL_OTHER = 0x20,
};

struct acc_acl_entry {
  uint16_t tag;  /* enum acc_acl_tag */
  uint16_t perm; /* ACC_READ | ACC_WRITE | ACC_EXEC */
  uint32_t id;   /* the uid or gid of ACC_ACL_USER and ACC_ACL_GROUP entries */
};

/* What permission is decided on: an object's owner, group and mode, and its access ACL (nacl 0: none). */
struct acc_object {
  uid_t uid;
  gid_t gid;
  mode_t mode;
  const struct acc_acl_entry *acl;
  size_t nacl;
};

/* Whether cred may have every access in want (ACC_* bits) to o. */
bool acc_permits(const struct acc_cred *cred, const struct acc_object *o, unsigned want);

/* The version of the xattr's format the kernel writes (POSIX_ACL_XATTR_VERSION). */
#define ACC_ACL_XATTR_VERSION 2

/*
 * Parses the value of system.posix_acl_access: a little-endian u32 version
 * (2), then entries of u16 tag, u16 perm, u32 id. The ACL must be one the
 * kernel accepts (posix_acl_valid): entries in tag order, exactly one
 * owner, owning group and other entry, a mask when there is a named user or
 * group entry, at most one mask, no unknown tag or permission bit (ids are
 * not judged: the first entry that matches decides, as in the kernel).
 * Fills out[0..*n) (at most cap
 * entries) and returns 0, or -EINVAL for anything else (-E2BIG when it holds
 * more than cap entries).
 */
int acc_acl_parse(const void *buf, size_t len, struct acc_acl_entry *out, size_t cap, size_t *n);

/* ---- checking paths (I/O) -------------------------------------------------------- */

/*
 * A bounded memory of the access ACLs of files and directories, keyed by
 * device, inode and ctime (a chmod, chown or setfacl changes the ctime, so
 * a changed ACL is never taken from it; one whose ctime is under 2 s old is
 * not kept, since a change in the same clock tick could leave the ctime as
 * it was), so that a checkpoint checked on
 * every request costs a stat per file, not an xattr read too (which is a
 * round trip on network file systems). Thread-safe.
 */
struct acc_cache;
struct acc_cache *acc_cache_create(void);
void acc_cache_free(struct acc_cache *c);

/* A directory one check found the caller may search: the object (device, inode), its path, a descriptor. */
struct acc_dir {
  dev_t dev;
  ino_t ino;
  char *path; /* resolved text, for starting a later walk below it */
  int fd;     /* O_PATH, or -1 past ACC_DIR_FDS (then it is only known, not a starting point) */
};

/* Descriptors one check keeps open on directories it may start later walks from. */
#define ACC_DIR_FDS 16

/*
 * One check made for one request: whose, what it is about (the name the
 * request gave, for messages), and the directories it has already found the
 * caller may search, so that the shards of one checkpoint share the walk of
 * their common directories (a later walk starts from the descriptor of the
 * deepest one its path begins with, and skips the check of any directory
 * object it meets again).
 */
struct acc_check {
  struct acc_cred cred;    /* groups: the check's own copy */
  struct acc_cache *cache; /* or NULL */
  char label[320];         /* quoted: "what the request named" */
  struct acc_dir *dirs;    /* found searchable, during this check */
  size_t ndirs, cap, nfds;
  /* Tests only (NULL in the daemon): called with an object's path once the walk stands on it and has its
   * mode, before its ACL is read, so that a test can swap what the path names in between. */
  void (*between)(void *arg, const char *path);
  void *between_arg;
};

/* Starts a check for cred (copied, groups too; an allocation that fails makes the groups unknown). */
void acc_check_init(struct acc_check *k, const struct acc_cred *cred, struct acc_cache *cache, const char *label);
/* Closes and forgets the directories found searchable (a later walk checks them afresh). */
void acc_check_reset(struct acc_check *k);
/* Frees all the check holds (acc_check_reset, and its credentials' groups). */
void acc_check_fini(struct acc_check *k);

/*
 * Whether the caller may resolve path and have `want` (ACC_* bits; 0: only
 * the walk) to what it ends on, following symbolic links as open(2) does.
 * With expect, the object must be that file (its device and inode), else
 * WEIGHTD_E_STALE: the check is about the file the daemon serves. Returns
 * 0; WEIGHTD_E_PERMISSION naming the label, the caller's uid and the
 * directory it may not search or the file it may not read (names only,
 * never a byte of a file; the first refusal from the root down, so nothing
 * behind a directory it may not search shows); or the walk's own failures
 * (WEIGHTD_E_NOT_FOUND, WEIGHTD_E_IO, WEIGHTD_E_NOMEM), each of which the
 * caller could learn itself (they come only from directories it may search).
 */
int acc_check_path(struct acc_check *k, const char *path, unsigned want, const struct stat *expect,
                   struct wd_error *err);

/*
 * For a failure rc (err filled) of the daemon's own resolution or open of
 * path made for k's caller: when the caller's walk to path is refused first
 * (a directory on the way it may not search), that refusal replaces the
 * failure, so that NOT_FOUND, PATH_DENIED, INVALID and the like never tell
 * what lies behind a directory the caller may not search. Returns the code
 * err now holds (rc when it stands; NOMEM and SHUTDOWN always stand).
 */
int acc_check_failure(struct acc_check *k, const char *path, int rc, struct wd_error *err);

#endif
