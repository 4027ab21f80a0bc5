/*
 * creds.h - AWS credentials, found as the AWS tools find them, and kept
 * fresh.
 *
 * The chain, in the AWS CLI's order; the first source that is configured
 * is the one used (a later one is not tried when it fails, as the AWS
 * SDKs do not):
 *   1. environment     AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (both, or it
 *                      is an error), AWS_SESSION_TOKEN optional; never expire
 *   2. web identity    AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN (both, or an
 *                      error), AWS_ROLE_SESSION_NAME optional: STS
 *                      AssumeRoleWithWebIdentity (what Kubernetes gives pods),
 *                      the token file read again at every refresh
 *   3. profile         AWS_PROFILE (default "default") in the shared credentials
 *                      file (AWS_SHARED_CREDENTIALS_FILE, ~/.aws/credentials;
 *                      sections "[name]") and the config file (AWS_CONFIG_FILE,
 *                      ~/.aws/config; sections "[default]" and "[profile name]"),
 *                      the credentials file's values winning: role_arn with
 *                      web_identity_token_file (web identity as in 2), else
 *                      aws_access_key_id with aws_secret_access_key (and
 *                      aws_session_token). A profile named by AWS_PROFILE that
 *                      exists in neither file is an error; one that exists
 *                      without credentials passes to 4. Assume-role chains
 *                      (source_profile, credential_source), credential_process
 *                      and SSO are refused with an error that says so.
 *   4. instance metadata (IMDSv2) unless AWS_EC2_METADATA_DISABLED=true:
 *                      PUT /latest/api/token first, then
 *                      /latest/meta-data/iam/security-credentials/ and /ROLE with
 *                      the session token; AWS_EC2_METADATA_SERVICE_ENDPOINT, else
 *                      http://169.254.169.254 (http://[fd00:ec2::254] with
 *                      AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=IPv6). Never IMDSv1.
 * Which source is used is decided at creds_provider_create from the
 * variables and the files alone (no request is made there); the files are
 * read then, and again only when a new provider is made (a reload).
 *
 * Temporary credentials (web identity, instance metadata) are fetched at the
 * first creds_get and again from CREDS_REFRESH_MARGIN_MS before they expire.
 * A refresh that fails while the current credentials are still valid keeps
 * them (the failure is logged, and tried again no sooner than
 * CREDS_RETRY_MS later); once they have expired, creds_get fails with the
 * refresh's error.
 *
 * STS: https://sts.REGION.amazonaws.com (https://sts.amazonaws.com without a
 * region), or AWS_ENDPOINT_URL_STS, else AWS_ENDPOINT_URL. Requests are
 * blocking libcurl easy transfers with timeouts (CREDS_HTTP_TIMEOUT_MS; the
 * metadata service CREDS_IMDS_TIMEOUT_MS), made by the caller's thread: call
 * creds_get from a worker thread, never from the event loop.
 *
 * Secrets: keys, session tokens and web identity tokens appear in no error
 * message and no log line; errors name the source, the file or endpoint and
 * the server's error code. Buffers that held them are wiped when freed.
 *
 * Thread-safe: one mutex per provider guards its cached credentials; a
 * refresh runs under it (other callers wait for its result).
 */
#ifndef WD_REMOTE_CREDS_H
#define WD_REMOTE_CREDS_H

#include <stdbool.h>
#include <stdint.h>

#include "base/log.h"
#include "error.h"

#define CREDS_KEY_MAX 256                      /* bytes of an access key id or secret, with the NUL */
#define CREDS_REFRESH_MARGIN_MS (5 * 60 * 1000) /* refresh this long before expiry */
#define CREDS_RETRY_MS (30 * 1000)             /* a failed refresh is tried again no sooner than this */
#define CREDS_HTTP_TIMEOUT_MS 10000            /* an STS request, whole */
#define CREDS_IMDS_TIMEOUT_MS 2000             /* a metadata request, whole (1 s to connect) */

/* One set of credentials, the caller's copy. */
struct s3_creds {
  char access_key[CREDS_KEY_MAX];
  char secret_key[CREDS_KEY_MAX];
  char *token;             /* the session token, malloc'd; NULL for long-term keys */
  int64_t expires_unix_ms; /* when they expire (wall clock); 0: never */
};

/* Wipes c (explicit_bzero) and frees its token; NULL-safe. */
void creds_clear(struct s3_creds *c);

/*
 * A snapshot of what the chain reads from the environment, so that the
 * daemon and the tests each pass their own. NULL or "" means unset (as the
 * AWS tools treat an empty variable). The strings need to live only until
 * creds_provider_create returns.
 */
struct creds_env {
  const char *access_key_id;           /* AWS_ACCESS_KEY_ID */
  const char *secret_access_key;       /* AWS_SECRET_ACCESS_KEY */
  const char *session_token;           /* AWS_SESSION_TOKEN */
  const char *profile;                 /* AWS_PROFILE */
  const char *shared_credentials_file; /* AWS_SHARED_CREDENTIALS_FILE */
  const char *config_file;             /* AWS_CONFIG_FILE */
  const char *web_identity_token_file; /* AWS_WEB_IDENTITY_TOKEN_FILE */
  const char *role_arn;                /* AWS_ROLE_ARN */
  const char *role_session_name;       /* AWS_ROLE_SESSION_NAME */
  const char *region;                  /* AWS_REGION, else AWS_DEFAULT_REGION */
  const char *sts_endpoint;            /* AWS_ENDPOINT_URL_STS, else AWS_ENDPOINT_URL */
  const char *imds_endpoint;           /* AWS_EC2_METADATA_SERVICE_ENDPOINT (or the IPv6 mode's address) */
  bool imds_disabled;                  /* AWS_EC2_METADATA_DISABLED is "true" (any case) */
  const char *home;                    /* HOME, for ~/.aws */
  unsigned duration_s;                 /* web identity sessions' DurationSeconds (not an AWS
                                          variable; 0: STS's default, 3600) */
};

/* Fills e from getenv (pointers into the environment). Returns 0. */
int creds_env_from_environ(struct creds_env *e);

/*
 * What a provider calls back, all optional (a NULL struct or member: the
 * default). clock_ms: the wall clock in milliseconds since the epoch (tests
 * move it to exercise refreshes; default CLOCK_REALTIME). log: a line about
 * a refresh (LOG_INFO when credentials were fetched, LOG_WARN when a refresh
 * failed and the current ones stay in use); never holds a secret.
 */
struct creds_hooks {
  int64_t (*clock_ms)(void *arg);
  void (*log)(void *arg, enum log_level level, const char *line);
  void *arg;
};

struct creds_provider;

/*
 * Decides the source (the chain above) and reads what it needs now: the
 * variables, and the shared files when the chain gets to them. Returns 0,
 * or: WEIGHTD_E_NOT_FOUND when no source is configured (err lists what was
 * looked at), WEIGHTD_E_INVALID for a partial or malformed configuration
 * (a key without its secret, an unparsable file line, a profile named but
 * absent, an endpoint that is not an http(s) URL), WEIGHTD_E_UNSUPPORTED for
 * a profile that needs what is not implemented, WEIGHTD_E_IO / _PERMISSION
 * for a file that cannot be read, WEIGHTD_E_NOMEM. hooks may be NULL; it is
 * copied.
 */
int creds_provider_create(const struct creds_env *e, const struct creds_hooks *hooks,
                          struct creds_provider **out, struct wd_error *err);

/*
 * Copies current credentials into out (the caller clears it with
 * creds_clear), fetching or refreshing temporary ones first when needed (see
 * above). Returns 0, or the fetch's error when there are no valid
 * credentials: WEIGHTD_E_PERMISSION (the service refused: STS's error code
 * and message, or the metadata service's status), WEIGHTD_E_TIMEOUT,
 * WEIGHTD_E_IO (unreachable, or an answer that cannot be read),
 * WEIGHTD_E_NOMEM. out is cleared on failure.
 */
int creds_get(struct creds_provider *p, struct s3_creds *out, struct wd_error *err);

/*
 * Where credentials come from, for status and logs: "environment",
 * "web identity (role ARN)", "profile NAME (FILE)", "profile NAME: web
 * identity (role ARN)", "instance metadata (ENDPOINT)". Valid while p lives.
 */
const char *creds_source(const struct creds_provider *p);

/* The region the environment or the profile names (AWS_REGION, ..., "region"), or NULL. */
const char *creds_region(const struct creds_provider *p);

/* Wipes and frees p; NULL-safe. */
void creds_provider_free(struct creds_provider *p);

#endif
