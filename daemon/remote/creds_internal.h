/*
 * creds_internal.h - the parts of the credentials chain (creds.h) that the
 * chain's file and network halves share, and that unit tests call directly:
 * the shared files' reader (creds_files.c) and the two services that hand
 * out temporary credentials, STS and the instance metadata service
 * (creds_fetch.c).
 */
#ifndef WD_REMOTE_CREDS_INTERNAL_H
#define WD_REMOTE_CREDS_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "creds.h"

/* ---- the shared files (creds_files.c) --------------------------------------------- */

/* The settings of a profile that the chain reads; others are ignored. */
#define CREDS_PROPS(XX)                              \
  XX(ACCESS_KEY, "aws_access_key_id")                \
  XX(SECRET_KEY, "aws_secret_access_key")            \
  XX(SESSION_TOKEN, "aws_session_token")             \
  XX(ROLE_ARN, "role_arn")                           \
  XX(TOKEN_FILE, "web_identity_token_file")          \
  XX(SESSION_NAME, "role_session_name")              \
  XX(REGION, "region")                               \
  XX(SOURCE_PROFILE, "source_profile")               \
  XX(CREDENTIAL_SOURCE, "credential_source")         \
  XX(CREDENTIAL_PROCESS, "credential_process")       \
  XX(SSO_START_URL, "sso_start_url")                 \
  XX(SSO_SESSION, "sso_session")

enum creds_prop {
#define XX(id, name) CREDS_P_##id,
  CREDS_PROPS(XX)
#undef XX
  CREDS_P_COUNT
};

/* A profile as the two files define it together. */
struct creds_profile {
  bool found;                 /* a section of that name is in either file */
  char *v[CREDS_P_COUNT];     /* the values, NULL when unset */
  const char *from[CREDS_P_COUNT]; /* which file each value came from (the path given) */
};

/*
 * Reads profile `name` from the config file (sections "[default]" and
 * "[profile NAME]"; other sections, "[NAME]" included, are not profiles
 * there) and then the credentials file (sections "[NAME]", taken as
 * written), later values replacing earlier ones: a key given twice in a
 * profile, a profile given twice, the credentials file over the config file.
 * The format is the AWS tools' INI: "name = value" lines (names in any case,
 * whitespace around both trimmed), comment lines starting with '#' or ';',
 * inline comments in a value only after whitespace (" #", " ;"), in a
 * section line anywhere after the ']', an indented line continuing the
 * value above it. A path that is NULL or names no file is skipped.
 * Returns 0, or WEIGHTD_E_INVALID naming the file and line (never its text:
 * it may hold a secret), WEIGHTD_E_PERMISSION / _IO when a file exists but
 * cannot be read, WEIGHTD_E_LIMIT for a file over 1 MiB, WEIGHTD_E_NOMEM.
 * out is freed with creds_profile_free in every case.
 */
int creds_profile_load(const char *config_path, const char *credentials_path, const char *name,
                       struct creds_profile *out, struct wd_error *err);

void creds_profile_free(struct creds_profile *p);

/*
 * Reads a small file whole (a web identity token, a shared file) into a
 * malloc'd NUL-terminated buffer, at most max bytes, without blocking on a
 * FIFO: regular files only. *len may be NULL. The caller wipes and frees it.
 * Returns 0, WEIGHTD_E_NOT_FOUND, WEIGHTD_E_PERMISSION, WEIGHTD_E_LIMIT,
 * WEIGHTD_E_INVALID (not a regular file), WEIGHTD_E_IO or WEIGHTD_E_NOMEM,
 * with err naming label and the path.
 */
int creds_file_read(const char *path, const char *label, size_t max, char **out, size_t *len,
                    struct wd_error *err);

/* ---- the services (creds_fetch.c) ------------------------------------------------- */

/* What an AssumeRoleWithWebIdentity call sends. */
struct creds_web_identity {
  const char *role_arn;
  const char *token_file;   /* read again at each call */
  const char *session_name;
  const char *sts_url;      /* "https://sts.us-east-1.amazonaws.com/" */
  unsigned duration_s;      /* 0: not sent */
};

/*
 * Calls STS AssumeRoleWithWebIdentity (an unsigned POST; the token goes in
 * the body) and fills out. Errors start with label (the source's name) and
 * name the endpoint, the HTTP status and STS's error code and message.
 */
int creds_fetch_sts(const struct creds_web_identity *w, const char *label, struct s3_creds *out,
                    struct wd_error *err);

/*
 * Asks the instance metadata service at base_url ("http://169.254.169.254/")
 * for the instance role's credentials, IMDSv2: a session token first (PUT),
 * then the role's name and its credentials with it. Errors start with label.
 */
int creds_fetch_imds(const char *base_url, const char *label, struct s3_creds *out, struct wd_error *err);

/*
 * Parses an ISO 8601 UTC time as STS and the metadata service write them
 * ("2026-12-01T10:20:30Z", with optional fractional seconds, or "+00:00")
 * into milliseconds since the epoch. Returns 0 or WEIGHTD_E_INVALID.
 */
int creds_parse_time(const char *s, int64_t *unix_ms);

/* Writes unix_ms as "2026-12-01T10:20:30Z" (for log lines); returns buf. */
const char *creds_format_time(int64_t unix_ms, char *buf, size_t len);

#endif
