/*
 * rroots.h - the remote roots: the allow-list of object-store prefixes and
 * HTTP(S) servers the daemon may fetch checkpoints from (the remote_roots
 * setting and --remote-root), with what fetching from them needs: one
 * range-GET client (fetch.h), the AWS credentials chain (creds.h) for
 * s3:// roots and the S3 endpoint of the environment (rckpt.h).
 *
 * A client can make the daemon fetch only a URL within a root (rurl_within:
 * the same scheme and bucket or host and port, the root's key a prefix of
 * the URL's at a segment boundary), and a redirect is followed only to a URL
 * within an http(s) root: a Hugging Face resolve URL redirects to its
 * content host, which the configuration then lists as a root of its own.
 * Link-local and metadata addresses are never fetched (fetch.h refuses
 * them whatever the roots say).
 *
 * Credentials: for s3:// roots, the chain as the AWS tools find it, decided
 * once at creation from the daemon's environment and files; where no
 * source is configured, s3:// requests go unsigned (a public bucket), which
 * is logged. http(s):// roots are fetched unsigned, or with a bearer token
 * read from a file (struct rroots_opts).
 *
 * Threads: created and freed on the loop thread (at start); the target and
 * rroots_allows are read from any thread afterwards (immutable; the client
 * and the provider guard their own state).
 */
#ifndef WD_REMOTE_RROOTS_H
#define WD_REMOTE_RROOTS_H

#include <stdbool.h>
#include <stddef.h>

#include "error.h"
#include "remote/rckpt.h"
#include "remote/url.h"

struct rroots;

struct rroots_opts {
  const char *const *urls; /* each s3://BUCKET[/PREFIX] or http(s)://HOST[:PORT][/PREFIX] */
  size_t n;
  const char *ca_file; /* PEM bundle https servers are verified with; NULL: the system's */
  /*
   * Entries "ROOT=FILE": requests for URLs within the http(s) root ROOT
   * (one of urls) carry "Authorization: Bearer TOKEN", TOKEN the one line
   * FILE holds (read here, once). The longest root holding a URL decides:
   * its token, or none when it has none. Never sent to a redirect's
   * target, never logged.
   */
  const char *const *token_files;
  size_t ntoken_files;
};

/*
 * Parses the roots and starts what fetching needs. 0 with *out; INVALID
 * naming the entry that is not a URL, a token entry that names no http(s)
 * root, or a token file that is missing, empty or not one printable line
 * (never quoting it); the credential chain's error for a partial or
 * malformed AWS configuration; IO when the client cannot start.
 */
int rroots_create(const struct rroots_opts *o, struct rroots **out, struct wd_error *err);

/* True when u lies within one of the roots. */
bool rroots_allows(const struct rroots *rr, const struct rurl *u);

/* Where requests go and who signs them, for rck_open (valid while rr lives). */
const struct rck_target *rroots_target(const struct rroots *rr);

/* The roots as configured, for status and the log: n of them, each formatted. */
size_t rroots_count(const struct rroots *rr);
const char *rroots_text(const struct rroots *rr, size_t i);
/* Whether requests within root i carry a bearer token. */
bool rroots_has_token(const struct rroots *rr, size_t i);
/* Where s3:// credentials come from ("environment", ...), or "none (unsigned)". */
const char *rroots_creds_source(const struct rroots *rr);
/* The range-GET client, for its counters (status, metrics). */
struct rf_client *rroots_client(const struct rroots *rr);

/* The daemon stops: every open, check and read through the roots stops waiting (CANCELED). NULL-safe. */
void rroots_stop(struct rroots *rr);

void rroots_free(struct rroots *rr); /* NULL-safe; no request may be running */

#endif
