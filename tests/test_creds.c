/*
 * test_creds.c - the AWS credentials chain (daemon/remote/creds.c) without
 * a network: which source wins (environment, web identity, the profile in
 * the shared files, instance metadata) and what each needs; the shared
 * files' format ("[profile x]" in the config file, "[x]" in the credentials
 * file, comments, whitespace, continuation lines, CRLF, the credentials
 * file winning); refusals that name what is wrong and never a secret; the
 * time format of STS and the metadata service; and the hold-off after a
 * failed fetch, on an injected clock, against a loopback port that refuses
 * connections. The services themselves are exercised against real servers
 * in tests/integration/test_remote_creds.py.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "remote/creds.h"
#include "remote/creds_internal.h"
#include "testutil.h"

static char *dir;

/* An environment that reaches nothing by accident: no HOME, the metadata service off. */
static struct creds_env quiet_env(void) {
  struct creds_env e = {0};
  e.imds_disabled = true;
  return e;
}

static char *path_of(const char *name) {
  char *p = malloc(strlen(dir) + strlen(name) + 2);
  sprintf(p, "%s/%s", dir, name);
  return p;
}

/* Makes a provider from e; returns its code, with *src the source's text (or the error) copied. */
static int make(const struct creds_env *e, struct creds_provider **p, char *src, size_t n, struct wd_error *err) {
  int rc = creds_provider_create(e, NULL, p, err);
  snprintf(src, n, "%s", rc == 0 ? creds_source(*p) : err->msg);
  return rc;
}

/* The access key (and secret, token) a static provider hands out. */
static void check_keys(struct creds_provider *p, const char *key, const char *secret, const char *token) {
  struct s3_creds c;
  struct wd_error err = {0};
  CHECK_EQ_INT(creds_get(p, &c, &err), 0);
  CHECK(strcmp(c.access_key, key) == 0);
  CHECK(strcmp(c.secret_key, secret) == 0);
  CHECK(token ? c.token && strcmp(c.token, token) == 0 : c.token == NULL);
  CHECK_EQ_INT(c.expires_unix_ms, 0);
  creds_clear(&c);
  CHECK(c.token == NULL && c.access_key[0] == '\0' && c.secret_key[0] == '\0');
}

/* ---- the environment and the chain's order ----------------------------------------- */

static void test_environment(void) {
  struct creds_env e = quiet_env();
  e.access_key_id = "AKIDENV";
  e.secret_access_key = "SECRETENV-0123";
  e.session_token = "TOKENENV-4567";
  struct creds_provider *p;
  struct wd_error err = {0};
  char src[512];
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(strcmp(src, "environment") == 0);
  check_keys(p, "AKIDENV", "SECRETENV-0123", "TOKENENV-4567");
  creds_provider_free(p);
  /* A key without its secret, a secret without its key: refused, naming the variables. */
  e.secret_access_key = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not");
  e.access_key_id = "";
  e.secret_access_key = "SECRETENV-0123";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not");
  CHECK(strstr(src, "SECRETENV") == NULL && strstr(src, "TOKENENV") == NULL);
  /* Empty variables are unset, as the AWS tools take them. */
  e.secret_access_key = "";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_NOT_FOUND);
}

static void test_environ_snapshot(void) {
  setenv("AWS_ACCESS_KEY_ID", "AKIDSNAP", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "", 1);
  setenv("AWS_DEFAULT_REGION", "eu-central-1", 1);
  setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9/", 1);
  setenv("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:10/", 1);
  setenv("AWS_EC2_METADATA_DISABLED", "TRUE", 1);
  setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "IPv6", 1);
  struct creds_env e;
  CHECK_EQ_INT(creds_env_from_environ(&e), 0);
  CHECK(e.access_key_id && strcmp(e.access_key_id, "AKIDSNAP") == 0);
  CHECK(e.secret_access_key == NULL);
  CHECK(e.region && strcmp(e.region, "eu-central-1") == 0);
  CHECK(e.sts_endpoint && strcmp(e.sts_endpoint, "http://127.0.0.1:10/") == 0);
  CHECK(e.imds_disabled);
  CHECK(e.imds_endpoint && strcmp(e.imds_endpoint, "http://[fd00:ec2::254]") == 0);
  setenv("AWS_REGION", "us-west-1", 1);
  unsetenv("AWS_ENDPOINT_URL_STS");
  setenv("AWS_EC2_METADATA_DISABLED", "false", 1);
  CHECK_EQ_INT(creds_env_from_environ(&e), 0);
  CHECK(e.region && strcmp(e.region, "us-west-1") == 0);
  CHECK(e.sts_endpoint && strcmp(e.sts_endpoint, "http://127.0.0.1:9/") == 0);
  CHECK(!e.imds_disabled);
  const char *vars[] = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION",
                        "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED", "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

static void test_chain_order(void) {
  char *tokf = path_of("order-token"), *crd = path_of("order-credentials");
  fx_write_text(dir, "order-token", "eyJhbGciOi.fake.jwt\n");
  fx_write_text(dir, "order-credentials", "[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = SECRETFILE\n");
  struct creds_env e = {0};
  e.access_key_id = "AKIDENV";
  e.secret_access_key = "SECRETENV";
  e.web_identity_token_file = tokf;
  e.role_arn = "arn:aws:iam::123456789012:role/loader";
  e.shared_credentials_file = crd;
  e.imds_endpoint = "http://127.0.0.1:1";
  struct creds_provider *p;
  struct wd_error err = {0};
  char src[512], want[512];
  /* Every source configured: the environment's keys. */
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(strcmp(src, "environment") == 0);
  creds_provider_free(p);
  /* Then web identity. */
  e.access_key_id = e.secret_access_key = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(strcmp(src, "web identity (role arn:aws:iam::123456789012:role/loader)") == 0);
  creds_provider_free(p);
  /* Half of web identity is a mistake, not a reason to go on. */
  e.role_arn = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS_WEB_IDENTITY_TOKEN_FILE is set but AWS_ROLE_ARN is not");
  /* Then the profile. */
  e.web_identity_token_file = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  snprintf(want, sizeof want, "profile default (%s)", crd);
  CHECK(strcmp(src, want) == 0);
  check_keys(p, "AKIDFILE", "SECRETFILE", NULL);
  creds_provider_free(p);
  /* Then the instance metadata service (a default profile that does not exist is no error). */
  e.shared_credentials_file = "/nonexistent/credentials";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(strcmp(src, "instance metadata (http://127.0.0.1:1/)") == 0);
  creds_provider_free(p);
  e.imds_endpoint = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(strcmp(src, "instance metadata (http://169.254.169.254/)") == 0);
  creds_provider_free(p);
  /* And nothing: the message says where it looked. */
  e.imds_disabled = true;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(src, "no AWS credentials");
  CHECK_STR_CONTAINS(src, "/nonexistent/credentials");
  CHECK_STR_CONTAINS(src, "AWS_EC2_METADATA_DISABLED");
  /* Endpoints that are not http(s) URLs are refused at create. */
  e.imds_disabled = false;
  e.imds_endpoint = "http://user:pw@127.0.0.1/";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS_EC2_METADATA_SERVICE_ENDPOINT");
  e.imds_endpoint = NULL;
  e.web_identity_token_file = tokf;
  e.role_arn = "arn:aws:iam::123456789012:role/loader";
  e.sts_endpoint = "s3://bucket";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS_ENDPOINT_URL_STS");
  e.sts_endpoint = NULL;
  e.role_session_name = "has space";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "role session name");
  free(tokf);
  free(crd);
}

static void test_region(void) {
  fx_write_text(dir, "region-config", "[default]\nregion = eu-west-1\n[profile other]\nregion=ap-south-1\n");
  char *cfg = path_of("region-config");
  struct creds_env e = quiet_env();
  e.config_file = cfg;
  e.access_key_id = "AKID";
  e.secret_access_key = "SECRET";
  struct creds_provider *p;
  struct wd_error err = {0};
  char src[512];
  /* The environment's keys, and the profile's region all the same (the region is not a credential). */
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(creds_region(p) && strcmp(creds_region(p), "eu-west-1") == 0);
  creds_provider_free(p);
  e.profile = "other";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(creds_region(p) && strcmp(creds_region(p), "ap-south-1") == 0);
  creds_provider_free(p);
  e.region = "us-east-2";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(creds_region(p) && strcmp(creds_region(p), "us-east-2") == 0);
  creds_provider_free(p);
  e.region = "us-east-2/../x";
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS_REGION");
  e.region = NULL;
  e.config_file = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID); /* AWS_PROFILE=other is nowhere now */
  e.profile = NULL;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(creds_region(p) == NULL);
  creds_provider_free(p);
  free(cfg);
}

/* ---- the shared files ------------------------------------------------------------ */

static const char *config_text =
    "\xef\xbb\xbf# the AWS config file\r\n"
    "; a comment too\r\n"
    "[default]\r\n"
    "region = eu-west-1\r\n"
    "\r\n"
    "[profile work]\n"
    "aws_access_key_id = AKIDWORKCONFIG\n"
    "aws_secret_access_key = SECRETWORKCONFIG\n"
    "region = us-west-2 # where work runs\n"
    "[work2]\n" /* not a profile in the config file */
    "aws_access_key_id = AKIDIGNORED\n"
    "aws_secret_access_key = SECRETIGNORED\n"
    "[  profile   spaced  ]   ; a comment after a section\n"
    "  \n"
    "AWS_ACCESS_KEY_ID=AKIDSPACED\n"
    "Aws_Secret_Access_Key   =   SECRET#SPACED;X   \n"
    "[profile nested]\n"
    "aws_access_key_id = AKIDNESTED\n"
    "s3 =\n"
    "  max_concurrent_requests = 20\n"
    "  aws_secret_access_key = NOTTHISONE\n"
    "aws_secret_access_key = SECRETNESTED\n"
    "[profile continued]\n"
    "aws_access_key_id = AKIDCONT\n"
    "aws_secret_access_key = SECRETCONT\n"
    "aws_session_token = part1\n"
    "   part2 ; not a comment? it is: after whitespace\n"
    "[profile web]\n"
    "role_arn = arn:aws:iam::123456789012:role/web\n"
    "web_identity_token_file = /var/run/secrets/token\n"
    "role_session_name = from-profile\n"
    "[profile chained]\n"
    "role_arn = arn:aws:iam::123456789012:role/x\n"
    "source_profile = default\n"
    "[profile helper]\n"
    "credential_process = /usr/bin/get-creds\n"
    "[profile sso]\n"
    "sso_session = corp\n"
    "[profile lonely-role]\n"
    "role_arn = arn:aws:iam::123456789012:role/y\n"
    "[profile half]\n"
    "aws_secret_access_key = SECRETHALF\n"
    "[sso-session corp]\n"
    "sso_start_url = https://example.com/start\n";

static const char *credentials_text =
    "[default]\n"
    "aws_access_key_id = AKIDDEFAULT\n"
    "aws_secret_access_key = SECRETDEFAULT\n"
    "[work]\n"
    "aws_access_key_id = AKIDWORKCREDS\n"
    "[profile notaname]\n" /* "profile notaname" in the credentials file: a name with a space, no profile */
    "aws_access_key_id = AKIDNOTANAME\n"
    "aws_secret_access_key = SECRETNOTANAME\n"
    "[default]\n" /* a second section of a profile adds to it, later values winning */
    "aws_session_token = TOKENDEFAULT\n";

static struct creds_env files_env(const char *profile, char *cfg, char *crd) {
  struct creds_env e = quiet_env();
  e.profile = profile;
  e.config_file = cfg;
  e.shared_credentials_file = crd;
  return e;
}

static void test_files(void) {
  fx_write_text(dir, "config", config_text);
  fx_write_text(dir, "credentials", credentials_text);
  char *cfg = path_of("config"), *crd = path_of("credentials");
  struct creds_provider *p;
  struct wd_error err = {0};
  char src[1024], want[1024];

  struct creds_env e = files_env(NULL, cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  snprintf(want, sizeof want, "profile default (%s)", crd);
  CHECK(strcmp(src, want) == 0);
  check_keys(p, "AKIDDEFAULT", "SECRETDEFAULT", "TOKENDEFAULT");
  CHECK(creds_region(p) && strcmp(creds_region(p), "eu-west-1") == 0);
  creds_provider_free(p);

  /* "work": the credentials file's key id over the config file's; the secret from the config file. */
  e = files_env("work", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  check_keys(p, "AKIDWORKCREDS", "SECRETWORKCONFIG", NULL);
  CHECK(creds_region(p) && strcmp(creds_region(p), "us-west-2") == 0); /* the inline comment cut */
  creds_provider_free(p);

  /* "[work2]" in the config file is no profile; "[profile notaname]" in the credentials file neither. */
  e = files_env("work2", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "AWS profile work2 (AWS_PROFILE) is in neither");
  e = files_env("notaname", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);

  /* Whitespace around names and values, names in any case, '#' and ';' inside a value kept. */
  e = files_env("spaced", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  check_keys(p, "AKIDSPACED", "SECRET#SPACED;X", NULL);
  creds_provider_free(p);

  /* Sub-settings ("s3 =" and an indented block) are not the profile's settings. */
  e = files_env("nested", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  check_keys(p, "AKIDNESTED", "SECRETNESTED", NULL);
  creds_provider_free(p);

  /* A continuation line joins the value above with a newline. */
  e = files_env("continued", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  check_keys(p, "AKIDCONT", "SECRETCONT", "part1\npart2");
  creds_provider_free(p);

  /* A profile's web identity; the environment's session name would win over the profile's. */
  e = files_env("web", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  CHECK(strcmp(src, "profile web: web identity (role arn:aws:iam::123456789012:role/web)") == 0);
  creds_provider_free(p);

  /* What weightd does not do is refused with an error that says so. */
  const char *unsupported[] = {"chained", "helper", "sso"};
  for (size_t i = 0; i < 3; i++) {
    e = files_env(unsupported[i], cfg, crd);
    CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_UNSUPPORTED);
    CHECK_STR_CONTAINS(src, "not supported");
  }
  e = files_env("lonely-role", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "role_arn without web_identity_token_file");
  e = files_env("half", cfg, crd);
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "aws_secret_access_key without aws_access_key_id");
  CHECK(strstr(src, "SECRETHALF") == NULL);

  /* The files under HOME/.aws when no path is given. */
  char home[PATH_MAX], aws[PATH_MAX];
  snprintf(home, sizeof home, "%s/home", dir);
  snprintf(aws, sizeof aws, "%s/.aws", home);
  mkdir(home, 0700);
  mkdir(aws, 0700);
  fx_write_text(aws, "credentials", "[default]\naws_access_key_id=AKIDHOME\naws_secret_access_key=SECRETHOME\n");
  e = quiet_env();
  e.home = home;
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), 0);
  snprintf(want, sizeof want, "profile default (%s/credentials)", aws);
  CHECK(strcmp(src, want) == 0);
  check_keys(p, "AKIDHOME", "SECRETHOME", NULL);
  creds_provider_free(p);
  free(cfg);
  free(crd);
}

/* A file that breaks the format: refused, naming the file and the line, never the line's text. */
static void check_bad_file(const char *text, const char *why, size_t line) {
  fx_write_text(dir, "bad", text);
  char *crd = path_of("bad");
  struct creds_env e = files_env(NULL, NULL, crd);
  struct creds_provider *p;
  struct wd_error err = {0};
  char src[1024], want[1024];
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  snprintf(want, sizeof want, "AWS credentials file %s: line %zu: %s", crd, line, why);
  if (strstr(src, want) == NULL) fprintf(stderr, "  '%s' does not hold '%s'\n", src, want);
  CHECK(strstr(src, want) != NULL);
  CHECK(strstr(src, "SECRETLINE") == NULL);
  free(crd);
}

static void test_bad_files(void) {
  check_bad_file("[default\naws_access_key_id = A\n", "a section line without its ']'", 1);
  check_bad_file("[default]\naws_secret_access_key SECRETLINE\n", "expected 'name = value'", 2);
  check_bad_file("aws_secret_access_key = SECRETLINE\n", "a setting before any section", 1);
  check_bad_file("[default]\n  SECRETLINE\n", "an indented line that continues no setting", 2);
  check_bad_file("[default] SECRETLINE\n", "text after a section's ']'", 1);
  check_bad_file("[default]\n= SECRETLINE\n", "a setting without a name", 2);
  /* A file that exists but cannot be read is an error; one that is a directory too. */
  char *d = path_of("");
  struct creds_env e = files_env(NULL, NULL, d);
  struct creds_provider *p;
  struct wd_error err = {0};
  char src[1024];
  CHECK_EQ_INT(make(&e, &p, src, sizeof src, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(src, "not a regular file");
  free(d);
}

static void test_profile_load_direct(void) {
  fx_write_text(dir, "direct-config", "[profile a]\nregion = r1\n[profile a]\nregion = r2\nREGION = r3\n");
  fx_write_text(dir, "direct-creds", "[a]\nrole_arn = arn:x\n");
  char *cfg = path_of("direct-config"), *crd = path_of("direct-creds");
  struct creds_profile pr;
  struct wd_error err = {0};
  CHECK_EQ_INT(creds_profile_load(cfg, crd, "a", &pr, &err), 0);
  CHECK(pr.found);
  CHECK(pr.v[CREDS_P_REGION] && strcmp(pr.v[CREDS_P_REGION], "r3") == 0);
  CHECK(pr.from[CREDS_P_REGION] == cfg);
  CHECK(pr.v[CREDS_P_ROLE_ARN] && strcmp(pr.v[CREDS_P_ROLE_ARN], "arn:x") == 0);
  CHECK(pr.from[CREDS_P_ROLE_ARN] == crd);
  creds_profile_free(&pr);
  CHECK_EQ_INT(creds_profile_load(cfg, crd, "b", &pr, &err), 0);
  CHECK(!pr.found);
  creds_profile_free(&pr);
  CHECK_EQ_INT(creds_profile_load(NULL, "/nonexistent", "a", &pr, &err), 0);
  CHECK(!pr.found);
  creds_profile_free(&pr);
  free(cfg);
  free(crd);
}

/* ---- times, and a failed fetch's hold-off ------------------------------------------ */

static void test_times(void) {
  int64_t ms = 0;
  CHECK_EQ_INT(creds_parse_time("2015-08-30T12:36:00Z", &ms), 0);
  CHECK_EQ_INT(ms, 1440938160000LL);
  CHECK_EQ_INT(creds_parse_time("2015-08-30T12:36:00.250Z", &ms), 0);
  CHECK_EQ_INT(ms, 1440938160250LL);
  CHECK_EQ_INT(creds_parse_time("2015-08-30T12:36:00.1234567Z", &ms), 0);
  CHECK_EQ_INT(ms, 1440938160123LL);
  CHECK_EQ_INT(creds_parse_time("2015-08-30T12:36:00+00:00", &ms), 0);
  CHECK_EQ_INT(ms, 1440938160000LL);
  const char *bad[] = {"", "2015-08-30", "2015-08-30T12:36:00", "2015-08-30T12:36:00+01:00", "2015-13-30T12:36:00Z",
                       "2015-08-30T25:36:00Z", "2015-08-30T12:36:00.Z", "2015-08-30 12:36:00Z", "x2015-08-30T12:36:00Z"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) CHECK_EQ_INT(creds_parse_time(bad[i], &ms), WEIGHTD_E_INVALID);
  char buf[32];
  CHECK(strcmp(creds_format_time(1440938160999LL, buf, sizeof buf), "2015-08-30T12:36:00Z") == 0);
}

struct clock_log {
  int64_t now;
  int lines;
  char last[2048];
};

static int64_t test_clock(void *arg) { return ((struct clock_log *)arg)->now; }

static void test_log(void *arg, enum log_level level, const char *line) {
  struct clock_log *c = arg;
  (void)level;
  c->lines++;
  snprintf(c->last, sizeof c->last, "%s", line);
}

static void test_failed_fetch_holds_off(void) {
  char *tokf = path_of("later-token");
  remove(tokf);
  struct creds_env e = quiet_env();
  e.web_identity_token_file = tokf;
  e.role_arn = "arn:aws:iam::123456789012:role/loader";
  e.sts_endpoint = "http://127.0.0.1:1/"; /* loopback, nothing listens: refused at once */
  struct clock_log cl = {.now = 1700000000000LL};
  struct creds_hooks hooks = {.clock_ms = test_clock, .log = test_log, .arg = &cl};
  struct creds_provider *p;
  struct wd_error err = {0};
  CHECK_EQ_INT(creds_provider_create(&e, &hooks, &p, &err), 0);
  struct s3_creds c;
  /* No token file yet: the first get fails, naming the source and the file. */
  CHECK_EQ_INT(creds_get(p, &c, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(err.msg, "web identity (role arn:aws:iam::123456789012:role/loader)");
  CHECK_STR_CONTAINS(err.msg, tokf);
  CHECK(c.token == NULL && c.access_key[0] == '\0');
  /* The file appears; within the hold-off the same failure comes back without a new try. */
  fx_write_text(dir, "later-token", "SECRET-WEB-TOKEN\n");
  cl.now += CREDS_RETRY_MS - 1;
  err.msg[0] = '\0';
  CHECK_EQ_INT(creds_get(p, &c, &err), WEIGHTD_E_NOT_FOUND);
  CHECK_STR_CONTAINS(err.msg, tokf);
  /* After it, a new try: the token is read and STS is asked (nothing listens there). */
  cl.now += 2;
  CHECK_EQ_INT(creds_get(p, &c, &err), WEIGHTD_E_IO);
  CHECK_STR_CONTAINS(err.msg, "POST http://127.0.0.1:1/");
  CHECK(strstr(err.msg, "SECRET-WEB-TOKEN") == NULL);
  CHECK_EQ_INT(cl.lines, 0); /* nothing was fetched, nothing kept: no line */
  creds_provider_free(p);
  free(tokf);
}

int main(void) {
  dir = fx_tmpdir("test_creds");
  if (dir == NULL) {
    fprintf(stderr, "cannot make a scratch directory\n");
    return 1;
  }
  RUN(test_environment);
  RUN(test_environ_snapshot);
  RUN(test_chain_order);
  RUN(test_region);
  RUN(test_files);
  RUN(test_bad_files);
  RUN(test_profile_load_direct);
  RUN(test_times);
  RUN(test_failed_fetch_holds_off);
  int rc = tu_finish();
  fx_rmtree(dir);
  free(dir);
  return rc;
}
