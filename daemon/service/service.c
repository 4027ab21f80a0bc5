/* service.c - the service manager's protocols (see service.h). */
#include "service.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/log.h"

/* The most descriptors one notification carries (systemd's store takes them one message at a time). */
#define NOTIFY_MAX_FDS 253
/* The most descriptors accepted at start. */
#define LISTEN_MAX_FDS 4096

static struct sockaddr_un notify_addr;
static socklen_t notify_len;
static int notify_fd = -1;
static uint64_t watchdog_usec;
static long long fdstore_max;
static struct service_fd *fds;
static size_t nfds;

/* The value of a decimal variable of this process, or -1 when absent or malformed. */
static long long env_number(const char *name, bool *bad) {
  const char *v = getenv(name);
  if (v == NULL) return -1;
  char *end;
  errno = 0;
  long long n = strtoll(v, &end, 10);
  if (v[0] == '\0' || *end != '\0' || errno != 0 || n < 0) {
    *bad = true;
    return -1;
  }
  return n;
}

static int init_notify(struct wd_error *err) {
  const char *path = getenv("NOTIFY_SOCKET");
  if (path == NULL || path[0] == '\0') return 0;
  size_t n = strlen(path);
  if ((path[0] != '/' && path[0] != '@') || n >= sizeof notify_addr.sun_path)
    return err_set(err, WEIGHTD_E_INVALID, "NOTIFY_SOCKET '%s' is neither an absolute path nor an abstract name",
                   path);
  memset(&notify_addr, 0, sizeof notify_addr);
  notify_addr.sun_family = AF_UNIX;
  memcpy(notify_addr.sun_path, path, n);
  if (path[0] == '@') notify_addr.sun_path[0] = '\0'; /* abstract namespace */
  notify_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
  notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (notify_fd < 0) return err_set(err, WEIGHTD_E_IO, "notify socket: %s", strerror(errno));
  return 0;
}

static int init_watchdog(struct wd_error *err) {
  bool bad = false;
  long long usec = env_number("WATCHDOG_USEC", &bad);
  long long pid = env_number("WATCHDOG_PID", &bad);
  if (bad) return err_set(err, WEIGHTD_E_INVALID, "WATCHDOG_USEC or WATCHDOG_PID is not a number");
  if (usec > 0 && (pid < 0 || pid == (long long)getpid())) watchdog_usec = (uint64_t)usec;
  return 0;
}

static int init_listen(struct wd_error *err) {
  bool bad = false;
  long long pid = env_number("LISTEN_PID", &bad);
  long long count = env_number("LISTEN_FDS", &bad);
  if (bad) return err_set(err, WEIGHTD_E_INVALID, "LISTEN_PID or LISTEN_FDS is not a number");
  if (count <= 0 || pid != (long long)getpid()) return 0; /* not for us */
  if (count > LISTEN_MAX_FDS)
    return err_set(err, WEIGHTD_E_INVALID, "LISTEN_FDS=%lld: more than %d descriptors", count, LISTEN_MAX_FDS);
  fds = calloc((size_t)count, sizeof *fds);
  if (fds == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  const char *names = getenv("LISTEN_FDNAMES");
  for (long long i = 0; i < count; i++) {
    struct service_fd *f = &fds[nfds];
    f->fd = SERVICE_LISTEN_FDS_START + (int)i;
    if (fcntl(f->fd, F_GETFD) < 0)
      return err_set(err, WEIGHTD_E_INVALID, "LISTEN_FDS=%lld, but descriptor %d is not open", count, f->fd);
    fcntl(f->fd, F_SETFD, FD_CLOEXEC);
    if (names != NULL) {
      size_t len = strcspn(names, ":");
      if (len >= sizeof f->name) len = sizeof f->name - 1;
      memcpy(f->name, names, len);
      f->name[len] = '\0';
      names += strcspn(names, ":");
      if (*names == ':') names++;
    }
    nfds++;
  }
  return 0;
}

int service_init(struct wd_error *err) {
  /* Passed descriptors first, before this process opens anything that could take their numbers. */
  int rc = init_listen(err);
  if (rc == 0) rc = init_notify(err);
  if (rc == 0) rc = init_watchdog(err);
  bool bad = false;
  fdstore_max = env_number("FDSTORE", &bad); /* systemd 254+: FileDescriptorStoreMax= when above 0 */
  if (bad) fdstore_max = -1;
  static const char *const vars[] = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID",
                                     "LISTEN_FDS",    "LISTEN_FDNAMES", "FDSTORE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
  return rc;
}

bool service_notify_enabled(void) { return notify_fd >= 0; }

int service_notify(const char *state, const int *pass, size_t npass, struct wd_error *err) {
  if (notify_fd < 0) return 0;
  if (npass > NOTIFY_MAX_FDS)
    return err_set(err, WEIGHTD_E_LIMIT, "%zu descriptors in one notification (at most %d)", npass, NOTIFY_MAX_FDS);
  struct iovec iov = {.iov_base = (void *)state, .iov_len = strlen(state)};
  struct msghdr mh = {.msg_name = &notify_addr, .msg_namelen = notify_len, .msg_iov = &iov, .msg_iovlen = 1};
  union {
    char buf[CMSG_SPACE(sizeof(int) * NOTIFY_MAX_FDS)];
    struct cmsghdr align;
  } ctl;
  if (npass > 0) {
    memset(&ctl, 0, sizeof ctl);
    mh.msg_control = ctl.buf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * npass);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * npass);
    memcpy(CMSG_DATA(cm), pass, sizeof(int) * npass);
  }
  ssize_t n;
  do {
    n = sendmsg(notify_fd, &mh, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return err_set(err, WEIGHTD_E_IO, "notify socket: %s", strerror(errno));
  return 0;
}

void service_notifyf(const char *fmt, ...) {
  if (notify_fd < 0) return;
  char state[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(state, sizeof state, fmt, ap);
  va_end(ap);
  struct wd_error err = {0};
  if (service_notify(state, NULL, 0, &err) != 0) log_msg(LOG_WARN, "cannot notify the service manager: %s", err.msg);
}

uint64_t service_watchdog_usec(void) { return watchdog_usec; }

long long service_fdstore_max(void) { return fdstore_max; }

size_t service_fd_count(void) { return nfds; }
struct service_fd *service_fd(size_t i) { return i < nfds ? &fds[i] : NULL; }

struct service_fd *service_fd_find(const char *name) {
  for (size_t i = 0; i < nfds; i++)
    if (!fds[i].taken && (name == NULL || strcmp(fds[i].name, name) == 0)) return &fds[i];
  return NULL;
}

void service_fds_close_unclaimed(void) {
  for (size_t i = 0; i < nfds; i++)
    if (!fds[i].taken) {
      log_msg(LOG_WARN, "closing descriptor %d ('%s') passed at start: nothing here uses it", fds[i].fd,
              fds[i].name[0] ? fds[i].name : "unnamed");
      close(fds[i].fd);
      fds[i].taken = true;
    }
}
