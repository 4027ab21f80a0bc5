/*
 * test_access.c - a client's own access (common/access.c): the mode's
 * classes as the kernel picks them (the first that matches decides, even
 * when a later one would grant more), supplementary groups, POSIX ACLs
 * (named users and groups limited by the mask, any matching group entry
 * granting, other only when no group matched), the xattr format's
 * validation, and walks over real files: a directory on the way that may
 * not be searched, a file that may not be read, a symbolic link into a
 * private directory, the shared directories walked once, an ACL on disk,
 * and a file that is not the one expected.
 */
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <sys/xattr.h>

#include "access.h"
#include "fixture.h"
#include "testutil.h"

/* Credentials: uid, primary gid and supplementary groups. */
static struct acc_cred cred(uid_t uid, gid_t gid, const gid_t *groups, size_t n) {
  return (struct acc_cred){.uid = uid, .gid = gid, .ngroups = n, .groups = groups};
}

static bool may(const struct acc_cred *c, uid_t owner, gid_t group, mode_t mode, const struct acc_acl_entry *acl,
                size_t nacl, unsigned want) {
  const struct acc_object o = {owner, group, mode, acl, nacl};
  return acc_permits(c, &o, want);
}

#define U 0xFFFFFFFFu /* the id of entries that have none */

/* ---- the mode ------------------------------------------------------------------------- */

static void test_mode_classes(void) {
  struct acc_cred owner = cred(100, 200, NULL, 0), member = cred(101, 200, NULL, 0), other = cred(102, 300, NULL, 0);
  gid_t extra[] = {7, 250};
  struct acc_cred supplementary = cred(103, 300, extra, 2);
  CHECK(may(&owner, 100, 250, 0600, NULL, 0, ACC_READ));
  CHECK(!may(&member, 100, 200, 0600, NULL, 0, ACC_READ));
  CHECK(may(&member, 100, 200, 0640, NULL, 0, ACC_READ));
  CHECK(!may(&member, 100, 200, 0640, NULL, 0, ACC_READ | ACC_WRITE));
  CHECK(!may(&other, 100, 200, 0640, NULL, 0, ACC_READ));
  CHECK(may(&other, 100, 200, 0644, NULL, 0, ACC_READ));
  /* The first class that matches decides: an owner denied by the owner bits is denied, whatever others get. */
  CHECK(!may(&owner, 100, 200, 0077, NULL, 0, ACC_READ));
  CHECK(!may(&member, 100, 200, 0707, NULL, 0, ACC_READ));
  /* A supplementary group is the group class, as the primary one is. */
  CHECK(may(&supplementary, 100, 250, 0640, NULL, 0, ACC_READ));
  CHECK(!may(&supplementary, 100, 250, 0604, NULL, 0, ACC_READ));
  /* Search on a directory is the x bit of its class. */
  CHECK(may(&other, 100, 200, 0711, NULL, 0, ACC_EXEC));
  CHECK(!may(&other, 100, 200, 0744, NULL, 0, ACC_EXEC));
  CHECK(!may(&member, 100, 200, 0705, NULL, 0, ACC_EXEC));
}

/* ---- ACLs ----------------------------------------------------------------------------- */

static void test_acl_rules(void) {
  struct acc_cred owner = cred(100, 200, NULL, 0), named = cred(42, 300, NULL, 0), other = cred(43, 300, NULL, 0);
  gid_t g77[] = {77};
  struct acc_cred in77 = cred(44, 300, g77, 1), in200 = cred(45, 200, NULL, 0);
  /* user::rw- user:42:r-- group::--- group:77:r-- mask::r-- other::--- */
  const struct acc_acl_entry acl[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER, 4, 42},  {ACC_ACL_GROUP_OBJ, 0, U},
                                      {ACC_ACL_GROUP, 4, 77},   {ACC_ACL_MASK, 4, U},   {ACC_ACL_OTHER, 0, U}};
  CHECK(may(&owner, 100, 200, 0640, acl, 6, ACC_READ | ACC_WRITE));
  CHECK(may(&named, 100, 200, 0640, acl, 6, ACC_READ));
  CHECK(!may(&named, 100, 200, 0640, acl, 6, ACC_WRITE));
  CHECK(may(&in77, 100, 200, 0640, acl, 6, ACC_READ));
  CHECK(!may(&in200, 100, 200, 0640, acl, 6, ACC_READ)); /* the owning group's entry grants nothing */
  CHECK(!may(&other, 100, 200, 0644, acl, 6, ACC_READ)); /* the ACL, not the mode's other bits, decides */

  /* The mask limits named entries and group entries, never the owner or other. */
  const struct acc_acl_entry masked[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER, 6, 42}, {ACC_ACL_GROUP_OBJ, 4, U},
                                         {ACC_ACL_MASK, 0, U},     {ACC_ACL_OTHER, 4, U}};
  CHECK(!may(&named, 100, 200, 0604, masked, 5, ACC_READ));
  CHECK(!may(&in200, 100, 200, 0604, masked, 5, ACC_READ));
  CHECK(may(&owner, 100, 200, 0604, masked, 5, ACC_READ));
  CHECK(may(&other, 100, 200, 0604, masked, 5, ACC_READ));

  /* Any matching group entry may grant; when one matched and none granted, other does not apply. */
  gid_t both[] = {77, 78};
  struct acc_cred in_both = cred(46, 300, both, 2);
  const struct acc_acl_entry groups[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_GROUP_OBJ, 0, U}, {ACC_ACL_GROUP, 0, 77},
                                         {ACC_ACL_GROUP, 4, 78},   {ACC_ACL_MASK, 7, U},      {ACC_ACL_OTHER, 4, U}};
  CHECK(may(&in_both, 100, 200, 0674, groups, 6, ACC_READ));
  CHECK(!may(&in77, 100, 200, 0674, groups, 6, ACC_READ)); /* other would grant, but a group matched */
  CHECK(may(&other, 100, 200, 0674, groups, 6, ACC_READ));

  /* A minimal ACL (no mask): the owning group's entry unmasked. */
  const struct acc_acl_entry minimal[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_GROUP_OBJ, 4, U}, {ACC_ACL_OTHER, 0, U}};
  CHECK(may(&in200, 100, 200, 0640, minimal, 3, ACC_READ));
  CHECK(!may(&other, 100, 200, 0640, minimal, 3, ACC_READ));
}

/* The xattr bytes of entries: version 2, then tag, perm and id, little-endian. */
static size_t acl_bytes(const struct acc_acl_entry *e, size_t n, unsigned version, unsigned char *out) {
  unsigned char *p = out;
  for (int b = 0; b < 4; b++) *p++ = (unsigned char)(version >> (8 * b));
  for (size_t i = 0; i < n; i++) {
    *p++ = (unsigned char)e[i].tag;
    *p++ = (unsigned char)(e[i].tag >> 8);
    *p++ = (unsigned char)e[i].perm;
    *p++ = (unsigned char)(e[i].perm >> 8);
    for (int b = 0; b < 4; b++) *p++ = (unsigned char)(e[i].id >> (8 * b));
  }
  return (size_t)(p - out);
}

static int parse(const struct acc_acl_entry *e, size_t n, unsigned version, size_t *got) {
  unsigned char buf[4 + 8 * 16];
  struct acc_acl_entry out[16];
  size_t len = acl_bytes(e, n, version, buf);
  return acc_acl_parse(buf, len, out, 16, got);
}

static void test_acl_format(void) {
  const struct acc_acl_entry good[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER, 4, 65534}, {ACC_ACL_GROUP_OBJ, 0, U},
                                       {ACC_ACL_MASK, 4, U},     {ACC_ACL_OTHER, 0, U}};
  unsigned char buf[4 + 8 * 16];
  struct acc_acl_entry out[16];
  size_t n = 0, len = acl_bytes(good, 5, ACC_ACL_XATTR_VERSION, buf);
  CHECK_EQ_INT(acc_acl_parse(buf, len, out, 16, &n), 0);
  CHECK_EQ_INT(n, 5);
  CHECK(out[1].tag == ACC_ACL_USER && out[1].perm == 4 && out[1].id == 65534);
  CHECK_EQ_INT(acc_acl_parse(buf, len, out, 4, &n), -E2BIG);
  CHECK_EQ_INT(acc_acl_parse(buf, len - 1, out, 16, &n), -EINVAL);
  CHECK_EQ_INT(acc_acl_parse(buf, 3, out, 16, &n), -EINVAL);
  CHECK_EQ_INT(parse(good, 5, 1, &n), -EINVAL); /* another version */
  const struct acc_acl_entry no_mask[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER, 4, 7}, {ACC_ACL_GROUP_OBJ, 0, U},
                                          {ACC_ACL_OTHER, 0, U}};
  CHECK_EQ_INT(parse(no_mask, 4, 2, &n), -EINVAL);
  const struct acc_acl_entry out_of_order[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_GROUP_OBJ, 0, U},
                                               {ACC_ACL_USER, 4, 7},     {ACC_ACL_MASK, 4, U}, {ACC_ACL_OTHER, 0, U}};
  CHECK_EQ_INT(parse(out_of_order, 5, 2, &n), -EINVAL);
  const struct acc_acl_entry no_other[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_GROUP_OBJ, 0, U}};
  CHECK_EQ_INT(parse(no_other, 2, 2, &n), -EINVAL);
  const struct acc_acl_entry two_owners[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER_OBJ, 6, U},
                                             {ACC_ACL_GROUP_OBJ, 0, U}, {ACC_ACL_OTHER, 0, U}};
  CHECK_EQ_INT(parse(two_owners, 4, 2, &n), -EINVAL);
  const struct acc_acl_entry unknown_tag[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_GROUP_OBJ, 0, U}, {0x40, 4, U},
                                              {ACC_ACL_OTHER, 0, U}};
  CHECK_EQ_INT(parse(unknown_tag, 4, 2, &n), -EINVAL);
  const struct acc_acl_entry bad_perm[] = {{ACC_ACL_USER_OBJ, 8, U}, {ACC_ACL_GROUP_OBJ, 0, U}, {ACC_ACL_OTHER, 0, U}};
  CHECK_EQ_INT(parse(bad_perm, 3, 2, &n), -EINVAL);
  const struct acc_acl_entry after_other[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_GROUP_OBJ, 0, U},
                                              {ACC_ACL_OTHER, 0, U}, {ACC_ACL_OTHER, 0, U}};
  CHECK_EQ_INT(parse(after_other, 4, 2, &n), -EINVAL);
}

/* ---- walks over real files -------------------------------------------------------------- */

/* True when every directory from / down to dir may be searched by anyone (o+x): the walk tests' premise. */
static bool searchable_by_all(const char *dir) {
  char p[PATH_MAX];
  if (realpath(dir, p) == NULL) return false;
  for (char *s = p + strlen(p); s > p; s = strrchr(p, '/')) {
    struct stat sb;
    if (stat(p, &sb) != 0 || !(sb.st_mode & S_IXOTH)) return false;
    *s = '\0';
    if (strrchr(p, '/') == NULL) break;
  }
  return true;
}

static void write_file(const char *path, mode_t mode) {
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (f != NULL) {
    fputs("SECRET-BYTES", f);
    fclose(f);
  }
  CHECK_EQ_INT(chmod(path, mode), 0);
}

static void test_walks(void) {
  char *d = fx_tmpdir("access");
  char root[PATH_MAX], priv[PATH_MAX], open_dir[PATH_MAX], a[PATH_MAX], b[PATH_MAX], secret[PATH_MAX],
      hidden[PATH_MAX], link[PATH_MAX];
  CHECK(d != NULL && realpath(d, root) != NULL);
  CHECK_EQ_INT(chmod(root, 0755), 0);
  if (!searchable_by_all(root)) {
    fprintf(stderr, "test_walks: %s is not searchable by all: walks not tested\n", root);
    fx_rmtree(d);
    free(d);
    return;
  }
  snprintf(open_dir, sizeof open_dir, "%s/open", root);
  snprintf(priv, sizeof priv, "%s/private", root);
  CHECK_EQ_INT(mkdir(open_dir, 0755), 0);
  CHECK_EQ_INT(mkdir(priv, 0700), 0);
  snprintf(a, sizeof a, "%s/a", open_dir);
  snprintf(b, sizeof b, "%s/b", open_dir);
  snprintf(secret, sizeof secret, "%s/secret", open_dir);
  snprintf(hidden, sizeof hidden, "%s/hidden", priv);
  snprintf(link, sizeof link, "%s/link", open_dir);
  write_file(a, 0644);
  write_file(b, 0644);
  write_file(secret, 0600);
  write_file(hidden, 0644);
  CHECK_EQ_INT(symlink("../private/hidden", link), 0);

  uid_t me = geteuid();
  struct acc_cred other = cred(me == 65534 ? 65533 : 65534, 65534, NULL, 0), self = cred(me, getegid(), NULL, 0);
  struct acc_check k;
  struct wd_error err = {0};
  acc_check_init(&k, &other, NULL, "'ckpt'");
  CHECK_EQ_INT(acc_check_path(&k, a, ACC_READ, NULL, &err), 0);
  size_t walked = k.ndirs;
  CHECK(walked >= 2); /* at least / and the directory of the files */
  CHECK_EQ_INT(acc_check_path(&k, b, ACC_READ, NULL, &err), 0);
  CHECK_EQ_INT(k.ndirs, walked); /* the second file of the directory walks nothing new */

  CHECK_EQ_INT(acc_check_path(&k, secret, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, "'ckpt': uid ");
  CHECK_STR_CONTAINS(err.msg, "may not read ");
  CHECK_STR_CONTAINS(err.msg, secret);
  CHECK(strstr(err.msg, "SECRET-BYTES") == NULL);
  CHECK_EQ_INT(acc_check_path(&k, hidden, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, "may not search ");
  CHECK_STR_CONTAINS(err.msg, priv);
  /* Through the link: the target's directory counts, as it does for open(2). */
  CHECK_EQ_INT(acc_check_path(&k, link, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, priv);
  /* A name behind a directory the caller may not search: the same refusal whether it exists or not. */
  char missing[PATH_MAX];
  snprintf(missing, sizeof missing, "%s/nothing-here", priv);
  CHECK_EQ_INT(acc_check_path(&k, missing, 0, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_EQ_INT(acc_check_path(&k, priv, ACC_EXEC, NULL, &err), WEIGHTD_E_PERMISSION);
  /* Not the file expected. */
  struct stat sb;
  CHECK_EQ_INT(stat(b, &sb), 0);
  CHECK_EQ_INT(acc_check_path(&k, a, ACC_READ, &sb, &err), WEIGHTD_E_STALE);
  acc_check_reset(&k);
  CHECK_EQ_INT(k.ndirs, 0);

  /* Its owner may read all of it. */
  acc_check_init(&k, &self, NULL, "'ckpt'");
  CHECK_EQ_INT(acc_check_path(&k, secret, ACC_READ, NULL, &err), 0);
  CHECK_EQ_INT(acc_check_path(&k, link, ACC_READ, NULL, &err), 0);
  acc_check_fini(&k);

  /* An ACL on disk: user:<other>:r-- on the 0600 file lets other read it (twice: the cache does not change it). */
  unsigned char buf[4 + 8 * 8];
  const struct acc_acl_entry acl[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER, 4, (uint32_t)other.uid},
                                      {ACC_ACL_GROUP_OBJ, 0, U}, {ACC_ACL_MASK, 4, U}, {ACC_ACL_OTHER, 0, U}};
  size_t len = acl_bytes(acl, 5, ACC_ACL_XATTR_VERSION, buf);
  if (setxattr(secret, "system.posix_acl_access", buf, len, 0) != 0) {
    fprintf(stderr, "test_walks: no POSIX ACLs here (%s): the ACL on disk not tested\n", strerror(errno));
  } else {
    struct acc_cache *cache = acc_cache_create();
    CHECK(cache != NULL);
    for (int round = 0; round < 2; round++) {
      acc_check_init(&k, &other, cache, "'ckpt'");
      CHECK_EQ_INT(acc_check_path(&k, secret, ACC_READ, NULL, &err), 0);
      acc_check_fini(&k);
    }
    /* A changed ACL changes the ctime: the cache is not consulted for it. */
    const struct acc_acl_entry none[] = {{ACC_ACL_USER_OBJ, 6, U}, {ACC_ACL_USER, 4, (uint32_t)other.uid},
                                         {ACC_ACL_GROUP_OBJ, 0, U}, {ACC_ACL_MASK, 0, U}, {ACC_ACL_OTHER, 0, U}};
    len = acl_bytes(none, 5, ACC_ACL_XATTR_VERSION, buf);
    CHECK_EQ_INT(setxattr(secret, "system.posix_acl_access", buf, len, 0), 0);
    acc_check_init(&k, &other, cache, "'ckpt'");
    CHECK_EQ_INT(acc_check_path(&k, secret, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
    acc_check_fini(&k);
    acc_cache_free(cache);
  }
  fx_rmtree(d);
  free(d);
}

/* ---- swaps, groups and refusals that stand first --------------------------------------------- */

/* A swap a test makes once the walk stands on `at` and has its mode, before the ACL is read. */
struct swap {
  const char *at;
  const char *from, *to, *aside; /* rename to -> aside (when set), then from -> to */
  int done;
};

static void swap_now(void *arg, const char *path) {
  struct swap *w = arg;
  if (w->done || strcmp(path, w->at) != 0) return;
  w->done = 1;
  if (w->aside != NULL) CHECK_EQ_INT(rename(w->to, w->aside), 0);
  CHECK_EQ_INT(rename(w->from, w->to), 0);
}

/* Sets user:<uid>:<perm> (mask <perm>) as the access ACL of path: the test fails where ACLs cannot be set. */
static void grant_acl(const char *path, uint32_t uid, unsigned perm) {
  unsigned char buf[4 + 8 * 8];
  const struct acc_acl_entry acl[] = {{ACC_ACL_USER_OBJ, 7, U}, {ACC_ACL_USER, (uint16_t)perm, uid},
                                      {ACC_ACL_GROUP_OBJ, 0, U}, {ACC_ACL_MASK, (uint16_t)perm, U},
                                      {ACC_ACL_OTHER, 0, U}};
  size_t len = acl_bytes(acl, 5, ACC_ACL_XATTR_VERSION, buf);
  int rc = setxattr(path, "system.posix_acl_access", buf, len, 0);
  if (rc != 0) fprintf(stderr, "setxattr %s: %s (the test needs POSIX ACLs)\n", path, strerror(errno));
  CHECK_EQ_INT(rc, 0);
}

/*
 * The mode, owner and ACL come from the object the walk stands on: a file or
 * directory renamed over the one being checked, between the walk's fstat and
 * the reading of the ACL, does not lend it its ACL.
 */
static void test_swaps(void) {
  char *d = fx_tmpdir("access-swap");
  char root[PATH_MAX], file[PATH_MAX], granted[PATH_MAX], dir[PATH_MAX], gdir[PATH_MAX], aside[PATH_MAX],
      inner[PATH_MAX];
  CHECK(d != NULL && realpath(d, root) != NULL);
  CHECK_EQ_INT(chmod(root, 0755), 0);
  CHECK(searchable_by_all(root));
  uid_t me = geteuid();
  const struct acc_cred other = cred(me == 65534 ? 65533 : 65534, 65534, NULL, 0);
  struct acc_check k;
  struct wd_error err = {0};

  /* A 0600 file, and a 0600 file with user:other:r: the second is renamed over the first mid-check. */
  snprintf(file, sizeof file, "%s/file", root);
  snprintf(granted, sizeof granted, "%s/granted", root);
  write_file(file, 0600);
  write_file(granted, 0600);
  grant_acl(granted, (uint32_t)other.uid, ACC_READ);
  acc_check_init(&k, &other, NULL, "'ckpt'");
  struct swap w = {.at = file, .from = granted, .to = file};
  k.between = swap_now;
  k.between_arg = &w;
  CHECK_EQ_INT(acc_check_path(&k, file, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK(w.done);
  CHECK_STR_CONTAINS(err.msg, "may not read ");
  acc_check_fini(&k);
  /* Without a swap the granting file is readable: the refusal above was about the object, not the ACL's absence. */
  acc_check_init(&k, &other, NULL, "'ckpt'");
  CHECK_EQ_INT(acc_check_path(&k, file, ACC_READ, NULL, &err), 0);
  acc_check_fini(&k);

  /* A 0700 directory on the way, and one with user:other:x put in its place mid-check. */
  snprintf(dir, sizeof dir, "%s/dir", root);
  snprintf(gdir, sizeof gdir, "%s/gdir", root);
  snprintf(aside, sizeof aside, "%s/dir.old", root);
  CHECK_EQ_INT(mkdir(dir, 0700), 0);
  CHECK_EQ_INT(mkdir(gdir, 0700), 0);
  grant_acl(gdir, (uint32_t)other.uid, ACC_EXEC);
  snprintf(inner, sizeof inner, "%s/gdir/x", root);
  write_file(inner, 0644);
  snprintf(inner, sizeof inner, "%s/dir/x", root);
  write_file(inner, 0644);
  acc_check_init(&k, &other, NULL, "'ckpt'");
  struct swap wd = {.at = dir, .from = gdir, .to = dir, .aside = aside};
  k.between = swap_now;
  k.between_arg = &wd;
  CHECK_EQ_INT(acc_check_path(&k, inner, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK(wd.done);
  CHECK_STR_CONTAINS(err.msg, "may not search ");
  acc_check_fini(&k);
  acc_check_init(&k, &other, NULL, "'ckpt'");
  CHECK_EQ_INT(acc_check_path(&k, inner, ACC_READ, NULL, &err), 0); /* the granting one, walked for itself */
  acc_check_fini(&k);
  fx_rmtree(d);
  free(d);
}

/* Every supplementary group counts (a group that denies, past the 64th, still denies); unknown groups refuse. */
static void test_many_groups(void) {
  char *d = fx_tmpdir("access-groups");
  char root[PATH_MAX], denied[PATH_MAX], granted[PATH_MAX];
  CHECK(d != NULL && realpath(d, root) != NULL);
  CHECK_EQ_INT(chmod(root, 0755), 0);
  CHECK(searchable_by_all(root));
  enum { N = 200 };
  gid_t groups[N];
  snprintf(denied, sizeof denied, "%s/denied", root);
  snprintf(granted, sizeof granted, "%s/granted", root);
  write_file(denied, 0604); /* the group class, which the caller is in, may not read; others may */
  write_file(granted, 0640);
  struct stat sd, sg;
  CHECK(stat(denied, &sd) == 0 && stat(granted, &sg) == 0 && sd.st_gid == sg.st_gid);
  const gid_t last = sd.st_gid; /* the files' group, without chown: the caller's 200th group */
  for (int i = 0; i < N - 1; i++) groups[i] = (gid_t)(50000 + i);
  groups[N - 1] = last;
  uid_t me = geteuid();
  const gid_t primary = last == 65534 ? 65533 : 65534;
  struct acc_cred many = cred(me == 65534 ? 65533 : 65534, primary, groups, N);
  struct acc_check k;
  struct wd_error err = {0};
  acc_check_init(&k, &many, NULL, "'ckpt'");
  groups[N - 1] = 1; /* the check holds its own copy */
  CHECK_EQ_INT(acc_check_path(&k, denied, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_EQ_INT(acc_check_path(&k, granted, ACC_READ, NULL, &err), 0);
  acc_check_fini(&k);
  groups[N - 1] = last;
  /* Credentials whose groups the daemon could not read: nothing is decided, not even what "other" may read. */
  struct acc_cred unknown = cred(many.uid, primary, NULL, 0);
  unknown.groups_unknown = true;
  acc_check_init(&k, &unknown, NULL, "'ckpt'");
  CHECK_EQ_INT(acc_check_path(&k, denied, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, "supplementary groups");
  acc_check_fini(&k);
  CHECK(!acc_cred_equal(&unknown, &unknown));
  fx_rmtree(d);
  free(d);
}

/*
 * Walks with ".." and refusals that stand before the daemon's own failures:
 * ".." is looked up in a directory, which needs search on it; a failure of
 * the daemon's resolution below a directory the caller may not search is
 * that directory's refusal, one in a directory it may search stands.
 */
static void test_dotdot_and_failures(void) {
  char *d = fx_tmpdir("access-dotdot");
  char root[PATH_MAX], priv[PATH_MAX], open_dir[PATH_MAX], p[PATH_MAX];
  CHECK(d != NULL && realpath(d, root) != NULL);
  CHECK_EQ_INT(chmod(root, 0755), 0);
  CHECK(searchable_by_all(root));
  snprintf(priv, sizeof priv, "%s/private", root);
  snprintf(open_dir, sizeof open_dir, "%s/open", root);
  CHECK_EQ_INT(mkdir(priv, 0700), 0);
  CHECK_EQ_INT(mkdir(open_dir, 0755), 0);
  snprintf(p, sizeof p, "%s/a", open_dir);
  write_file(p, 0644);
  uid_t me = geteuid();
  const struct acc_cred other = cred(me == 65534 ? 65533 : 65534, 65534, NULL, 0);
  struct acc_check k;
  struct wd_error err = {0};
  acc_check_init(&k, &other, NULL, "'ckpt'");
  snprintf(p, sizeof p, "%s/private/../open/a", root);
  CHECK_EQ_INT(acc_check_path(&k, p, ACC_READ, NULL, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, "may not search ");
  CHECK_STR_CONTAINS(err.msg, priv);
  snprintf(p, sizeof p, "%s/open/../open/./a", root);
  CHECK_EQ_INT(acc_check_path(&k, p, ACC_READ, NULL, &err), 0);
  snprintf(p, sizeof p, "%s/open/a/", root);
  CHECK_EQ_INT(acc_check_path(&k, p, ACC_READ, NULL, &err), WEIGHTD_E_IO); /* a file with a trailing slash */
  /* The same through a link whose target ends in a slash, as open(2) says (ENOTDIR). */
  char link[PATH_MAX];
  snprintf(link, sizeof link, "%s/slashed", open_dir);
  CHECK_EQ_INT(symlink("a/", link), 0);
  int fd = open(link, O_RDONLY);
  CHECK(fd < 0 && errno == ENOTDIR);
  if (fd >= 0) close(fd);
  CHECK_EQ_INT(acc_check_path(&k, link, ACC_READ, NULL, &err), WEIGHTD_E_IO);
  /* The daemon's NOT_FOUND (or PATH_DENIED) below the private directory: the caller learns only that it may not search it. */
  struct wd_error mine;
  snprintf(p, sizeof p, "%s/nothing-here", priv);
  err_set(&mine, WEIGHTD_E_NOT_FOUND, "'ckpt': No such file or directory");
  CHECK_EQ_INT(acc_check_failure(&k, p, WEIGHTD_E_NOT_FOUND, &mine), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(mine.msg, priv);
  err_set(&mine, WEIGHTD_E_PATH_DENIED, "'ckpt': leads outside the model roots");
  CHECK_EQ_INT(acc_check_failure(&k, p, WEIGHTD_E_PATH_DENIED, &mine), WEIGHTD_E_PERMISSION);
  snprintf(p, sizeof p, "%s/nothing-here", open_dir);
  err_set(&mine, WEIGHTD_E_NOT_FOUND, "'ckpt': No such file or directory");
  CHECK_EQ_INT(acc_check_failure(&k, p, WEIGHTD_E_NOT_FOUND, &mine), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(mine.msg, "No such file");
  acc_check_fini(&k);
  fx_rmtree(d);
  free(d);
}

int main(void) {
  RUN(test_mode_classes);
  RUN(test_acl_rules);
  RUN(test_acl_format);
  RUN(test_walks);
  RUN(test_swaps);
  RUN(test_many_groups);
  RUN(test_dotdot_and_failures);
  return tu_finish();
}
