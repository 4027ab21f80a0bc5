/*
 * test_sockpath.c - the socket's place and the daemon a client accepts
 * (common/sockpath.c): the search (a named socket alone, else the service's
 * and the per-user socket), the private directory's checks (made 0700
 * whatever the umask; another owner, another mode, a link or a file
 * refused with the path named), the uids trusted (the service user looked
 * up by name, a missing account trusting no one) and the peer check on a
 * real socket, against a listener of another uid when run as root.
 */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "sockpath.h"
#include "testutil.h"

#define NOBODY 65534u

static char *dir;

static void test_search(void) {
  struct sockpath sp[2];
  size_t n = 9;
  setenv("WEIGHTD_SOCKET", "/env/weightd.sock", 1);
  CHECK_EQ_INT(sockpath_search("/arg/weightd.sock", 1000, sp, &n, NULL), 0);
  CHECK(n == 1 && strcmp(sp[0].path, "/arg/weightd.sock") == 0 && sp[0].label[0] == '\0');
  CHECK_EQ_INT(sockpath_search(NULL, 1000, sp, &n, NULL), 0);
  CHECK(n == 1 && strcmp(sp[0].path, "/env/weightd.sock") == 0 && strcmp(sp[0].label, "$WEIGHTD_SOCKET=") == 0);
  CHECK(sp[0].private_dir[0] == '\0');
  setenv("WEIGHTD_SOCKET", "", 1);
  setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
  CHECK_EQ_INT(sockpath_search(NULL, 1000, sp, &n, NULL), 0);
  CHECK(n == 2 && strcmp(sp[0].path, SOCKPATH_SERVICE) == 0);
  CHECK(strcmp(sp[1].path, "/run/user/1000/weightd.sock") == 0 && sp[1].private_dir[0] == '\0');
  /* A relative XDG_RUNTIME_DIR is not one: the private directory under /tmp. */
  setenv("XDG_RUNTIME_DIR", "run/user", 1);
  CHECK_EQ_INT(sockpath_search(NULL, 1000, sp, &n, NULL), 0);
  CHECK(n == 2 && strcmp(sp[1].path, "/tmp/weightd-1000/weightd.sock") == 0);
  CHECK(strcmp(sp[1].private_dir, "/tmp/weightd-1000") == 0);
  unsetenv("XDG_RUNTIME_DIR");
  unsetenv("WEIGHTD_SOCKET");
}

static void test_dir_created_private(void) {
  char d[PATH_MAX];
  snprintf(d, sizeof d, "%s/made", dir);
  struct wd_error err = {0};
  CHECK_EQ_INT(sockpath_dir_check(d, (unsigned)geteuid(), false, &err), WEIGHTD_E_NOT_FOUND);
  mode_t old = umask(0277); /* would leave 0500 */
  CHECK_EQ_INT(sockpath_dir_check(d, (unsigned)geteuid(), true, &err), 0);
  umask(old);
  struct stat st;
  CHECK(lstat(d, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 07777) == 0700 && st.st_uid == geteuid());
  CHECK_EQ_INT(sockpath_dir_check(d, (unsigned)geteuid(), false, &err), 0);
}

static void test_dir_refused(void) {
  char d[PATH_MAX], target[PATH_MAX + 8];
  struct wd_error err = {0};
  unsigned me = (unsigned)geteuid();
  snprintf(d, sizeof d, "%s/open", dir);
  CHECK(mkdir(d, 0700) == 0 && chmod(d, 0755) == 0);
  CHECK_EQ_INT(sockpath_dir_check(d, me, true, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, d);
  CHECK_STR_CONTAINS(err.msg, "mode 0755, not 0700");
  snprintf(d, sizeof d, "%s/link", dir);
  snprintf(target, sizeof target, "%s/made-elsewhere", dir);
  CHECK(mkdir(target, 0700) == 0 && symlink(target, d) == 0);
  CHECK_EQ_INT(sockpath_dir_check(d, me, true, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, "is a symbolic link");
  snprintf(d, sizeof d, "%s/file", dir);
  FILE *fp = fopen(d, "w");
  CHECK(fp != NULL);
  if (fp != NULL) fclose(fp);
  CHECK_EQ_INT(sockpath_dir_check(d, me, true, &err), WEIGHTD_E_PERMISSION);
  CHECK_STR_CONTAINS(err.msg, "is not a directory");
  /* A directory of the right mode that is someone else's: the other uid is named. */
  snprintf(d, sizeof d, "%s/theirs", dir);
  CHECK(mkdir(d, 0700) == 0);
  CHECK_EQ_INT(sockpath_dir_check(d, me + 1, false, &err), WEIGHTD_E_PERMISSION);
  char want[96];
  snprintf(want, sizeof want, "is owned by uid %u", me);
  CHECK_STR_CONTAINS(err.msg, want);
  snprintf(want, sizeof want, "not by uid %u", me + 1);
  CHECK_STR_CONTAINS(err.msg, want);
}

static void test_uids_trusted(void) {
  CHECK(sockpath_uid_trusted(0, NULL));
  CHECK(sockpath_uid_trusted((unsigned)getuid(), NULL));
  CHECK(sockpath_uid_trusted((unsigned)geteuid(), "no-such-account-wd"));
  if (getuid() != NOBODY) {
    CHECK(!sockpath_uid_trusted(NOBODY, NULL));
    CHECK(!sockpath_uid_trusted(NOBODY, "no-such-account-wd"));
    CHECK(sockpath_uid_trusted(NOBODY, "nobody")); /* the service user, by its name */
  }
  CHECK(!sockpath_uid_trusted(4000000000u, SOCKPATH_SERVICE_USER));
}

/* The abstract socket address named name (no file, so no directory permissions are in the way). */
static socklen_t abstract_addr(const char *name, struct sockaddr_un *a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  size_t n = strlen(name);
  memcpy(a->sun_path + 1, name, n);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* A listener on the abstract socket name, run by a child of uid; returns its pid once it listens. */
static pid_t listener_as(unsigned uid, const char *name) {
  int ready[2];
  if (pipe(ready) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    close(ready[0]);
    if (setgid(uid) != 0 || setuid(uid) != 0) _exit(1);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a;
    socklen_t len = abstract_addr(name, &a);
    if (bind(fd, (struct sockaddr *)&a, len) != 0 || listen(fd, 4) != 0) _exit(1);
    if (write(ready[1], "r", 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char b;
  ssize_t r = read(ready[0], &b, 1);
  close(ready[0]);
  return r == 1 ? pid : -1;
}

static int connect_to(const char *name) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a;
  socklen_t len = abstract_addr(name, &a);
  if (connect(fd, (struct sockaddr *)&a, len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static void test_peer_check(void) {
  struct wd_error err = {0};
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  CHECK_EQ_INT(sockpath_peer_check(sv[0], "pair", &err), 0); /* ourselves */
  close(sv[0]);
  close(sv[1]);
  if (geteuid() != 0) {
    printf("  (not root: no listener of another uid)\n");
    return;
  }
  char path[64];
  snprintf(path, sizeof path, "wd-test-sockpath-%d", (int)getpid());
  pid_t pid = listener_as(NOBODY, path);
  CHECK(pid > 0);
  int fd = pid > 0 ? connect_to(path) : -1;
  CHECK(fd >= 0);
  if (fd >= 0) {
    CHECK_EQ_INT(sockpath_peer_check(fd, path, &err), WEIGHTD_E_PERMISSION);
    CHECK_STR_CONTAINS(err.msg, path);
    CHECK_STR_CONTAINS(err.msg, "runs as uid 65534 (nobody)");
    char want[32];
    snprintf(want, sizeof want, "pid %d", (int)pid);
    CHECK_STR_CONTAINS(err.msg, want);
    close(fd);
  }
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
  }
}

int main(void) {
  dir = fx_tmpdir("sockpath");
  RUN(test_search);
  RUN(test_dir_created_private);
  RUN(test_dir_refused);
  RUN(test_uids_trusted);
  RUN(test_peer_check);
  fx_rmtree(dir);
  free(dir);
  return tu_finish();
}
