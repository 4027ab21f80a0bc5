/*
 * test_fetch.c - the remote range-GET engine (daemon/remote/fetch.h).
 *
 *   test_fetch unit            the pieces without I/O (backoff, retry
 *                              decisions, Content-Range, S3 error codes,
 *                              forbidden addresses), the configuration's
 *                              checks, and the forbidden addresses against a
 *                              real server in a private network namespace
 *                              (a redirect to 169.254.169.254, a direct
 *                              request there), so that a broken check can
 *                              send nothing off the machine
 *   test_fetch stat URL [opt]  rf_stat, printing one JSON object
 *   test_fetch read URL [opt]  rf_stat, then rf_read of the ranges of
 *                              --ranges (or the whole object) from --threads
 *                              threads (with --vector: all of them as one
 *                              rf_readv, in the file's order; with --memfd:
 *                              each into a fresh memfd mapping, as a host
 *                              slab is, not malloc'd memory); the bytes go
 *                              to --out, range after range; one JSON object
 *                              on stdout
 *
 * The stat and read modes are driven by tests/integration/test_fetch.py
 * against SeaweedFS and the fault proxy (tests/remote). URLs are parsed here
 * with the minimum the tests need (http(s)://host[:port]/path[?query]): the
 * engine takes endpoints and paths, the URL layer is remote/url.h's.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "remote/fetch.h"
#include "testutil.h"

/* ---- the pieces without I/O -------------------------------------------------- */

static void test_backoff(void) {
  /* Full jitter: a draw in [0, cap], cap = base * 2^(attempt-1) up to max. */
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 1, 100), 100);
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 1, 101), 0);
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 1, 57), 57);
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 3, 400), 400);
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 3, 401), 0);
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 7, 5000), 5000); /* 6400 capped at 5000 */
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 7, 5001), 0);
  CHECK_EQ_INT(rf_backoff_ms(100, 5000, 4000000000u, 4999), 4999); /* no overflow at any attempt */
  CHECK(rf_backoff_ms(100, 5000, 2, UINT64_MAX) <= 200);
  CHECK_EQ_INT(rf_backoff_ms(0, 0, 3, 12345), 0);
}

static void test_retry_decide(void) {
  struct rf_config c;
  rf_config_defaults(&c);
  c.retries = 3;
  c.retry_budget_ms = 1000;
  c.backoff_base_ms = 100;
  c.backoff_max_ms = 400;
  uint64_t d = 99;
  CHECK_EQ_INT(rf_retry_decide(&c, 1, 0, 0, 50, &d), RF_RETRY);
  CHECK_EQ_INT(d, 50);
  CHECK_EQ_INT(rf_retry_decide(&c, 3, 0, 0, 400, &d), RF_RETRY);
  CHECK_EQ_INT(d, 400);
  CHECK_EQ_INT(rf_retry_decide(&c, 4, 0, 0, 0, &d), RF_GIVE_UP_COUNT);
  CHECK_EQ_INT(d, 0);
  /* A retry that would land past the budget is not made. */
  CHECK_EQ_INT(rf_retry_decide(&c, 2, 900, 0, 150, &d), RF_GIVE_UP_BUDGET);
  CHECK_EQ_INT(rf_retry_decide(&c, 2, 900, 0, 100, &d), RF_RETRY);
  CHECK_EQ_INT(d, 100);
  /* Retry-After wins over a shorter backoff, and within the budget only. */
  CHECK_EQ_INT(rf_retry_decide(&c, 1, 0, 700, 10, &d), RF_RETRY);
  CHECK_EQ_INT(d, 700);
  CHECK_EQ_INT(rf_retry_decide(&c, 1, 0, 3600000, 10, &d), RF_GIVE_UP_BUDGET);
  c.retries = 0;
  CHECK_EQ_INT(rf_retry_decide(&c, 1, 0, 0, 0, &d), RF_GIVE_UP_COUNT);
}

static void test_content_range(void) {
  uint64_t f, l, t;
  CHECK_EQ_INT(rf_content_range_parse("bytes 0-99/1000", &f, &l, &t), 0);
  CHECK(f == 0 && l == 99 && t == 1000);
  CHECK_EQ_INT(rf_content_range_parse("bytes 999-999/1000", &f, &l, &t), 0);
  CHECK(f == 999 && l == 999 && t == 1000);
  CHECK_EQ_INT(rf_content_range_parse("bytes 5-9/*", &f, &l, &t), 0);
  CHECK(f == 5 && l == 9 && t == UINT64_MAX);
  CHECK_EQ_INT(rf_content_range_parse("bytes */0", &f, &l, &t), 0);
  CHECK(f == UINT64_MAX && l == UINT64_MAX && t == 0);
  CHECK_EQ_INT(rf_content_range_parse("bytes 18446744073709551614-18446744073709551614/18446744073709551615", &f, &l, &t),
               0);
  const char *bad[] = {"bytes 9-5/100", "bytes 0-100/100", "items 0-1/2", "bytes 0-1/2x", "bytes */*",
                       "bytes 0-1", "bytes -1-2/3", "bytes 0-99999999999999999999/1", "", "bytes 0-1/ 2"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    if (rf_content_range_parse(bad[i], &f, &l, &t) != -1) {
      tu_failed_checks++;
      fprintf(stderr, "content range '%s' accepted\n", bad[i]);
    }
  }
}

static void test_s3_code(void) {
  char code[32];
  const char *xml = "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>x</Message></Error>";
  rf_s3_error_code(xml, strlen(xml), code, sizeof code);
  CHECK(strcmp(code, "NoSuchKey") == 0);
  rf_s3_error_code("<html>404</html>", 16, code, sizeof code);
  CHECK(code[0] == '\0');
  const char *odd = "<Code>Slow\r\n Down\x01</Code>";
  rf_s3_error_code(odd, strlen(odd), code, sizeof code);
  CHECK(strcmp(code, "SlowDown") == 0);
  rf_s3_error_code("<Code>NoClose", 13, code, sizeof code);
  CHECK(code[0] == '\0');
  const char *longc = "<Code>ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEFGHIJ</Code>";
  rf_s3_error_code(longc, strlen(longc), code, 8);
  CHECK(strcmp(code, "ABCDEFG") == 0);
  /* The length is honoured: a <Code> past it is not read. */
  rf_s3_error_code(xml, 20, code, sizeof code);
  CHECK(code[0] == '\0');
}

static void test_forbidden_hosts(void) {
  const char *yes[] = {"169.254.169.254", "169.254.0.1", "169.254.255.255", "100.100.100.200", "fe80::1",
                       "febf:ffff::1", "fd00:ec2::254", "::ffff:169.254.169.254", "FE80::abcd"};
  const char *no[] = {"127.0.0.1", "169.255.0.1", "169.253.255.255", "100.100.100.201", "fec0::1",
                      "fd00:ec2::253", "::1", "s3.amazonaws.com", "10.0.0.1", "::ffff:127.0.0.1"};
  for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
    if (!rf_host_forbidden(yes[i])) tu_failed_checks++, fprintf(stderr, "%s not forbidden\n", yes[i]);
  for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
    if (rf_host_forbidden(no[i])) tu_failed_checks++, fprintf(stderr, "%s forbidden\n", no[i]);
}

static void test_config_checks(void) {
  struct rf_config c;
  struct rf_client *cl = (struct rf_client *)1;
  struct wd_error err = {0};
  rf_config_defaults(&c);
  c.max_connections = 0;
  CHECK_EQ_INT(rf_client_create(&c, &cl, &err), WEIGHTD_E_INVALID);
  CHECK(cl == NULL);
  CHECK_STR_CONTAINS(err.msg, "max_connections");
  rf_config_defaults(&c);
  c.part_bytes = 100;
  CHECK_EQ_INT(rf_client_create(&c, &cl, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "part_bytes");
  rf_config_defaults(&c);
  c.backoff_max_ms = 1;
  CHECK_EQ_INT(rf_client_create(&c, &cl, &err), WEIGHTD_E_INVALID);
  rf_config_defaults(&c);
  CHECK_EQ_INT(rf_client_create(&c, &cl, &err), 0);
  struct rf_stats st;
  rf_client_stats(cl, &st);
  CHECK_EQ_INT(st.in_flight, 0);
  rf_client_free(cl);
  rf_client_free(NULL);
}

/* ---- forbidden addresses against a real server, in a private network namespace ---- */

/* A server on 127.0.0.1 that answers every request with a redirect to the metadata address. */
static void *redirect_server(void *arg) {
  int ls = *(int *)arg;
  for (;;) {
    int s = accept(ls, NULL, NULL);
    if (s < 0) return NULL;
    char buf[4096];
    ssize_t n = recv(s, buf, sizeof buf, 0);
    (void)n;
    const char *reply = "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://169.254.169.254/latest/meta-data/\r\n"
                        "Content-Length: 0\r\nConnection: close\r\n\r\n";
    ssize_t w = send(s, reply, strlen(reply), MSG_NOSIGNAL);
    (void)w;
    close(s);
  }
}

static bool allow_all(void *arg, const struct rf_endpoint *to, const char *path) {
  (void)arg, (void)to, (void)path;
  return true;
}

/* A fresh network namespace with only its loopback up: nothing sent there leaves the machine. */
static int private_netns(void) {
  if (unshare(CLONE_NEWNET) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0) {
    fprintf(stderr, "unshare(CLONE_NEWNET): %s (this test needs root or user namespaces)\n", strerror(errno));
    return -1;
  }
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
  int rc = s < 0 ? -1 : ioctl(s, SIOCGIFFLAGS, &ifr);
  if (rc == 0) {
    ifr.ifr_flags |= IFF_UP;
    rc = ioctl(s, SIOCSIFFLAGS, &ifr);
  }
  if (s >= 0) close(s);
  if (rc != 0) fprintf(stderr, "bringing lo up: %s\n", strerror(errno));
  return rc;
}

/* Runs in a child, in its own network namespace; returns the number of failed checks. */
static int forbidden_child(void) {
  if (private_netns() != 0) return 1;
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, 16) != 0 ||
      getsockname(ls, (struct sockaddr *)&a, &al) != 0) {
    fprintf(stderr, "redirect server: %s\n", strerror(errno));
    return 1;
  }
  pthread_t th;
  pthread_create(&th, NULL, redirect_server, &ls);
  struct rf_config c;
  rf_config_defaults(&c);
  c.retries = 1;
  c.backoff_base_ms = c.backoff_max_ms = 1;
  struct rf_client *cl;
  struct wd_error err = {0};
  if (rf_client_create(&c, &cl, &err) != 0) {
    fprintf(stderr, "%s\n", err.msg);
    return 1;
  }
  int before = tu_failed_checks;
  struct rf_auth auth = {.allow_redirect = allow_all};
  struct rf_object o;
  /* A redirect there is refused although the root allows every host. */
  struct rf_location loc = {.ep = {.tls = false, .host = "127.0.0.1", .port = ntohs(a.sin_port)}, .path = "/x"};
  CHECK_EQ_INT(rf_stat(cl, &auth, &loc, NULL, &o, &err), WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(err.msg, "169.254.169.254");
  CHECK_STR_CONTAINS(err.msg, "link-local or metadata");
  /* So is a request that goes there itself: the connection's address is checked. */
  struct rf_location meta = {.ep = {.tls = false, .host = "169.254.169.254", .port = 80}, .path = "/latest/"};
  CHECK_EQ_INT(rf_stat(cl, &auth, &meta, NULL, &o, &err), WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(err.msg, "refused to connect to 169.254.169.254");
  struct rf_location meta6 = {.ep = {.tls = false, .host = "fd00:ec2::254", .port = 80}, .path = "/latest/"};
  CHECK_EQ_INT(rf_stat(cl, &auth, &meta6, NULL, &o, &err), WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(err.msg, "refused to connect to fd00:ec2::254");
  struct rf_stats st;
  rf_client_stats(cl, &st);
  CHECK_EQ_INT(st.redirects, 0);
  rf_client_free(cl);
  return tu_failed_checks - before;
}

static void test_forbidden_addresses(void) {
  fflush(NULL);
  pid_t p = fork();
  if (p == 0) _exit(forbidden_child() == 0 ? 0 : 1);
  int status = 0;
  CHECK(p > 0 && waitpid(p, &status, 0) == p);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* rf_readv refuses extents out of order, empty or beyond the object before it sends a request. */
static void test_readv_checks(void) {
  struct rf_config c;
  rf_config_defaults(&c);
  struct rf_client *cl = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(rf_client_create(&c, &cl, &err), 0);
  struct rf_object o = {.ep = {.host = "127.0.0.1", .port = 9}, .path = "/b/k", .query = "", .name = "s3://b/k",
                        .size = 100};
  unsigned char buf[100];
  struct rf_extent desc[2] = {{.off = 50, .len = 10, .dst = buf}, {.off = 10, .len = 10, .dst = buf + 10}};
  CHECK_EQ_INT(rf_readv(cl, NULL, &o, desc, 2, NULL, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "s3://b/k: extent 1 (byte 10) comes before");
  struct rf_extent empty[1] = {{.off = 5, .len = 0, .dst = buf}};
  CHECK_EQ_INT(rf_readv(cl, NULL, &o, empty, 1, NULL, &err), WEIGHTD_E_INVALID);
  struct rf_extent beyond[2] = {{.off = 0, .len = 10, .dst = buf}, {.off = 95, .len = 6, .dst = buf + 10}};
  CHECK_EQ_INT(rf_readv(cl, NULL, &o, beyond, 2, NULL, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "beyond its 100 bytes");
  CHECK_EQ_INT(rf_readv(cl, NULL, &o, beyond, 0, NULL, &err), 0); /* nothing to read */
  struct rf_stats st;
  rf_client_stats(cl, &st);
  CHECK_EQ_INT(st.requests[0] + st.requests[2] + st.connects, 0); /* no request was sent */
  rf_client_free(cl);
}

static int run_unit(void) {
  RUN(test_backoff);
  RUN(test_retry_decide);
  RUN(test_content_range);
  RUN(test_s3_code);
  RUN(test_forbidden_hosts);
  RUN(test_config_checks);
  RUN(test_readv_checks);
  RUN(test_forbidden_addresses);
  return tu_finish();
}

/* ---- stat and read against a server ------------------------------------------ */

#define MAX_HEADERS 8
#define MAX_ALLOW 8

struct opts {
  struct rf_config cfg;
  const char *ranges_file, *out_file, *name;
  unsigned threads;
  const char *headers[MAX_HEADERS];
  unsigned nheaders;
  const char *allow[MAX_ALLOW]; /* host:port */
  unsigned nallow;
  bool allow_any;
  uint64_t cancel_after_bytes; /* 0: never */
  bool vector;                 /* every range in one rf_readv */
  bool memfd;                  /* each range read into a fresh memfd mapping, not malloc'd memory */
};

struct range {
  uint64_t off, len, out_off;
  int rc;
};

struct shared {
  struct rf_client *cl;
  const struct rf_auth *auth;
  struct rf_object *obj;
  struct range *ranges;
  size_t nranges;
  unsigned threads;
  int out_fd;
  bool memfd;
  atomic_bool cancel;
  atomic_bool finished;
  pthread_mutex_t lock;
  int first_rc;
  struct wd_error first_err;
};

static int hook_headers(void *arg, const char *method, const struct rf_endpoint *ep, const char *path,
                        const char *query, char ***lines, size_t *n, struct wd_error *err) {
  (void)method, (void)ep, (void)path, (void)query, (void)err;
  const struct opts *o = arg;
  *lines = calloc(o->nheaders ? o->nheaders : 1, sizeof **lines);
  if (*lines == NULL) return WEIGHTD_E_NOMEM;
  for (unsigned i = 0; i < o->nheaders; i++) (*lines)[i] = strdup(o->headers[i]);
  *n = o->nheaders;
  return 0;
}

static bool hook_allow(void *arg, const struct rf_endpoint *to, const char *path) {
  (void)path;
  const struct opts *o = arg;
  if (o->allow_any) return true;
  char hp[RF_HOST_MAX + 16];
  snprintf(hp, sizeof hp, "%s:%d", to->host, to->port);
  for (unsigned i = 0; i < o->nallow; i++)
    if (strcmp(o->allow[i], hp) == 0) return true;
  return false;
}

/* http(s)://host[:port]/path[?query] into a location (path and query point into text, which is changed). */
static int parse_url(char *text, struct rf_location *loc) {
  memset(loc, 0, sizeof *loc);
  char *p;
  if (strncmp(text, "http://", 7) == 0) p = text + 7;
  else if (strncmp(text, "https://", 8) == 0) p = text + 8, loc->ep.tls = true;
  else return -1;
  char *slash = strchr(p, '/');
  if (slash == NULL) return -1;
  char *q = strchr(slash, '?');
  char hostport[RF_HOST_MAX + 16];
  size_t hl = (size_t)(slash - p);
  if (hl == 0 || hl >= sizeof hostport) return -1;
  memcpy(hostport, p, hl);
  hostport[hl] = '\0';
  char *colon = strrchr(hostport, ':');
  loc->ep.port = loc->ep.tls ? 443 : 80;
  if (colon) {
    *colon = '\0';
    loc->ep.port = atoi(colon + 1);
  }
  snprintf(loc->ep.host, sizeof loc->ep.host, "%s", hostport);
  if (q) {
    *q = '\0';
    loc->query = q + 1;
  }
  loc->path = slash;
  return 0;
}

static uint64_t num_arg(const char *s) { return strtoull(s, NULL, 0); }

static int parse_opts(int argc, char **argv, int i, struct opts *o) {
  rf_config_defaults(&o->cfg);
  o->threads = 1;
  for (; i < argc; i++) {
    const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v == NULL && strcmp(k, "--allow-any") != 0 && strcmp(k, "--vector") != 0 && strcmp(k, "--memfd") != 0) {
      fprintf(stderr, "%s needs a value\n", k);
      return -1;
    }
    if (strcmp(k, "--allow-any") == 0) { o->allow_any = true; continue; }
    if (strcmp(k, "--vector") == 0) { o->vector = true; continue; }
    if (strcmp(k, "--memfd") == 0) { o->memfd = true; continue; }
    i++;
    if (strcmp(k, "--ranges") == 0) o->ranges_file = v;
    else if (strcmp(k, "--out") == 0) o->out_file = v;
    else if (strcmp(k, "--name") == 0) o->name = v;
    else if (strcmp(k, "--threads") == 0) o->threads = (unsigned)num_arg(v);
    else if (strcmp(k, "--header") == 0 && o->nheaders < MAX_HEADERS) o->headers[o->nheaders++] = v;
    else if (strcmp(k, "--allow") == 0 && o->nallow < MAX_ALLOW) o->allow[o->nallow++] = v;
    else if (strcmp(k, "--cancel-after-bytes") == 0) o->cancel_after_bytes = num_arg(v);
    else if (strcmp(k, "--part-bytes") == 0) o->cfg.part_bytes = num_arg(v);
    else if (strcmp(k, "--max-connections") == 0) o->cfg.max_connections = (unsigned)num_arg(v);
    else if (strcmp(k, "--retries") == 0) o->cfg.retries = (unsigned)num_arg(v);
    else if (strcmp(k, "--budget-ms") == 0) o->cfg.retry_budget_ms = (unsigned)num_arg(v);
    else if (strcmp(k, "--backoff-base-ms") == 0) o->cfg.backoff_base_ms = (unsigned)num_arg(v);
    else if (strcmp(k, "--backoff-max-ms") == 0) o->cfg.backoff_max_ms = (unsigned)num_arg(v);
    else if (strcmp(k, "--stall-ms") == 0) o->cfg.stall_ms = (unsigned)num_arg(v);
    else if (strcmp(k, "--connect-timeout-ms") == 0) o->cfg.connect_timeout_ms = (unsigned)num_arg(v);
    else if (strcmp(k, "--ca") == 0) o->cfg.ca_file = v;
    else {
      fprintf(stderr, "unknown option %s\n", k);
      return -1;
    }
  }
  if (o->threads < 1) o->threads = 1;
  return 0;
}

static int load_ranges(const char *file, uint64_t size, struct range **out, size_t *n) {
  if (file == NULL) {
    *out = calloc(1, sizeof **out);
    (*out)[0] = (struct range){.off = 0, .len = size};
    *n = 1;
    return 0;
  }
  FILE *f = fopen(file, "r");
  if (f == NULL) return -1;
  size_t cap = 64, cnt = 0;
  struct range *r = malloc(cap * sizeof *r);
  unsigned long long off, len;
  uint64_t out_off = 0;
  while (fscanf(f, "%llu %llu", &off, &len) == 2) {
    if (cnt == cap) r = realloc(r, (cap *= 2) * sizeof *r);
    r[cnt++] = (struct range){.off = off, .len = len, .out_off = out_off};
    out_off += len;
  }
  fclose(f);
  *out = r;
  *n = cnt;
  return 0;
}

/* n bytes of a fresh memfd, mapped shared: the memory a host-backend slab is (4 KiB shmem pages, zeroed as faulted). */
static unsigned char *memfd_buffer(size_t n) {
  int fd = memfd_create("test_fetch", MFD_CLOEXEC);
  if (fd < 0) return NULL;
  void *p = ftruncate(fd, (off_t)n) == 0 ? mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  return p == MAP_FAILED ? NULL : p;
}

static void *reader_thread(void *arg) {
  struct shared *sh = ((void **)arg)[0];
  unsigned t = (unsigned)(uintptr_t)((void **)arg)[1];
  for (size_t i = t; i < sh->nranges; i += sh->threads) {
    struct range *r = &sh->ranges[i];
    size_t n = r->len ? r->len : 1;
    unsigned char *buf = sh->memfd ? memfd_buffer(n) : malloc(n);
    struct wd_error err = {0};
    r->rc = buf == NULL ? WEIGHTD_E_NOMEM : rf_read(sh->cl, sh->auth, sh->obj, r->off, r->len, buf, &sh->cancel, &err);
    if (r->rc == 0 && sh->out_fd >= 0 && pwrite(sh->out_fd, buf, r->len, (off_t)r->out_off) != (ssize_t)r->len)
      r->rc = WEIGHTD_E_IO, snprintf(err.msg, sizeof err.msg, "writing the output: %s", strerror(errno));
    if (sh->memfd && buf != NULL) munmap(buf, n);
    else free(buf);
    pthread_mutex_lock(&sh->lock);
    if (r->rc != 0 && sh->first_rc == 0) {
      sh->first_rc = r->rc;
      sh->first_err = err;
    }
    pthread_mutex_unlock(&sh->lock);
  }
  return NULL;
}

/* Every range as one rf_readv into one buffer (range i at its out_off), then written out. */
static void read_vector(struct shared *sh) {
  uint64_t total = 0;
  for (size_t i = 0; i < sh->nranges; i++) total += sh->ranges[i].len;
  unsigned char *buf = malloc(total ? total : 1);
  struct rf_extent *ext = calloc(sh->nranges ? sh->nranges : 1, sizeof *ext);
  for (size_t i = 0; i < sh->nranges; i++)
    ext[i] = (struct rf_extent){.off = sh->ranges[i].off, .len = sh->ranges[i].len, .dst = buf + sh->ranges[i].out_off};
  struct wd_error err = {0};
  int rc = rf_readv(sh->cl, sh->auth, sh->obj, ext, sh->nranges, &sh->cancel, &err);
  if (rc == 0 && sh->out_fd >= 0 && pwrite(sh->out_fd, buf, total, 0) != (ssize_t)total)
    rc = WEIGHTD_E_IO, snprintf(err.msg, sizeof err.msg, "writing the output: %s", strerror(errno));
  for (size_t i = 0; i < sh->nranges; i++) sh->ranges[i].rc = rc;
  sh->first_rc = rc;
  sh->first_err = err;
  free(ext);
  free(buf);
}

/* Sets the cancel flag once the client has delivered cancel_after bytes (a read is then under way). */
static void *cancel_thread(void *arg) {
  struct shared *sh = ((void **)arg)[0];
  uint64_t after = (uint64_t)(uintptr_t)((void **)arg)[1];
  while (!atomic_load(&sh->finished)) {
    struct rf_stats st;
    rf_client_stats(sh->cl, &st);
    if (st.bytes >= after) {
      atomic_store(&sh->cancel, true);
      return NULL;
    }
    usleep(1000);
  }
  return NULL;
}

static void print_result(int rc, const struct wd_error *err, const struct rf_object *o, struct rf_client *cl,
                         const struct range *ranges, size_t nranges) {
  cJSON *j = cJSON_CreateObject();
  cJSON_AddStringToObject(j, "rc", weightd_err_name(rc));
  cJSON_AddStringToObject(j, "msg", rc ? err->msg : "");
  if (o && o->name) {
    cJSON_AddNumberToObject(j, "size", (double)o->size);
    cJSON_AddStringToObject(j, "etag", o->etag);
    cJSON_AddStringToObject(j, "last_modified", o->last_modified);
    cJSON_AddBoolToObject(j, "redirected", o->redirected);
    cJSON_AddStringToObject(j, "host", o->ep.host);
    cJSON_AddNumberToObject(j, "port", o->ep.port);
  }
  if (ranges) {
    cJSON *a = cJSON_AddArrayToObject(j, "ranges");
    for (size_t i = 0; i < nranges; i++) cJSON_AddItemToArray(a, cJSON_CreateString(weightd_err_name(ranges[i].rc)));
  }
  if (cl) {
    struct rf_stats st;
    rf_client_stats(cl, &st);
    cJSON *s = cJSON_AddObjectToObject(j, "stats");
    cJSON *req = cJSON_AddArrayToObject(s, "requests");
    for (int i = 0; i < 6; i++) cJSON_AddItemToArray(req, cJSON_CreateNumber((double)st.requests[i]));
    cJSON_AddNumberToObject(s, "bytes", (double)st.bytes);
    cJSON_AddNumberToObject(s, "retries", (double)st.retries);
    cJSON_AddNumberToObject(s, "stalls", (double)st.stalls);
    cJSON_AddNumberToObject(s, "redirects", (double)st.redirects);
    cJSON_AddNumberToObject(s, "connects", (double)st.connects);
    cJSON_AddNumberToObject(s, "http2", (double)st.http2);
    cJSON_AddNumberToObject(s, "in_flight", (double)st.in_flight);
  }
  char *text = cJSON_PrintUnformatted(j);
  printf("%s\n", text);
  free(text);
  cJSON_Delete(j);
}

static int run_remote(bool read, int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: test_fetch stat|read URL [options]\n");
    return 2;
  }
  struct opts o = {0};
  struct rf_location loc;
  char *url = strdup(argv[2]);
  if (parse_url(url, &loc) != 0 || parse_opts(argc, argv, 3, &o) != 0) {
    fprintf(stderr, "test_fetch: bad URL or options\n");
    return 2;
  }
  loc.name = o.name;
  struct rf_auth auth = {.headers = hook_headers, .allow_redirect = hook_allow, .arg = &o};
  struct rf_client *cl = NULL;
  struct wd_error err = {0};
  struct rf_object obj = {0};
  int rc = rf_client_create(&o.cfg, &cl, &err);
  if (rc == 0) rc = rf_stat(cl, &auth, &loc, NULL, &obj, &err);
  if (rc != 0 || !read) {
    print_result(rc, &err, &obj, cl, NULL, 0);
    rf_object_clear(&obj);
    rf_client_free(cl);
    free(url);
    return 0;
  }
  struct shared sh = {.cl = cl, .auth = &auth, .obj = &obj, .threads = o.threads, .out_fd = -1, .memfd = o.memfd};
  pthread_mutex_init(&sh.lock, NULL);
  if (load_ranges(o.ranges_file, obj.size, &sh.ranges, &sh.nranges) != 0) {
    fprintf(stderr, "test_fetch: cannot read %s\n", o.ranges_file);
    return 2;
  }
  if (o.out_file && (sh.out_fd = open(o.out_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
    fprintf(stderr, "test_fetch: %s: %s\n", o.out_file, strerror(errno));
    return 2;
  }
  pthread_t canceller;
  void *cargs[2] = {&sh, (void *)(uintptr_t)o.cancel_after_bytes};
  if (o.cancel_after_bytes) pthread_create(&canceller, NULL, cancel_thread, cargs);
  pthread_t *th = calloc(o.threads, sizeof *th);
  void **args = calloc(o.threads * 2, sizeof *args);
  if (o.vector) {
    read_vector(&sh);
    o.threads = 0;
  }
  for (unsigned t = 0; t < o.threads; t++) {
    args[2 * t] = &sh;
    args[2 * t + 1] = (void *)(uintptr_t)t;
    pthread_create(&th[t], NULL, reader_thread, &args[2 * t]);
  }
  for (unsigned t = 0; t < o.threads; t++) pthread_join(th[t], NULL);
  atomic_store(&sh.finished, true);
  if (o.cancel_after_bytes) pthread_join(canceller, NULL);
  print_result(sh.first_rc, &sh.first_err, &obj, cl, sh.ranges, sh.nranges);
  if (sh.out_fd >= 0) close(sh.out_fd);
  free(th);
  free(args);
  free(sh.ranges);
  pthread_mutex_destroy(&sh.lock);
  rf_object_clear(&obj);
  rf_client_free(cl);
  free(url);
  return 0;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2 || strcmp(argv[1], "unit") == 0) return run_unit();
  if (strcmp(argv[1], "stat") == 0) return run_remote(false, argc, argv);
  if (strcmp(argv[1], "read") == 0) return run_remote(true, argc, argv);
  fprintf(stderr, "usage: test_fetch unit | stat URL [options] | read URL [options]\n");
  return 2;
}
