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

int main(void) {
  RUN(test_mode_classes);
  RUN(test_acl_rules);
  RUN(test_acl_format);
  RUN(test_walks);
  return tu_finish();
}
