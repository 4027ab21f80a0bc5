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
 * is logged. http(s):// roots are fetched unsigned.
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

/*
 * Parses urls[0..n) (each s3://BUCKET[/PREFIX] or http(s)://HOST[:PORT][/PREFIX])
 * and starts what fetching needs; ca_file (NULL: the system's) verifies
 * https servers. 0 with *out; INVALID naming the entry that is not a URL
 * or names a query; the credential chain's error for a partial or
 * malformed AWS configuration; IO when the client cannot start.
 */
int rroots_create(const char *const *urls, size_t n, const char *ca_file, struct rroots **out, struct wd_error *err);

/* True when u lies within one of the roots. */
bool rroots_allows(const struct rroots *rr, const struct rurl *u);

/* Where requests go and who signs them, for rck_open (valid while rr lives). */
const struct rck_target *rroots_target(const struct rroots *rr);

/* The roots as configured, for status and the log: n of them, each formatted. */
size_t rroots_count(const struct rroots *rr);
const char *rroots_text(const struct rroots *rr, size_t i);
/* Where s3:// credentials come from ("environment", ...), or "none (unsigned)". */
const char *rroots_creds_source(const struct rroots *rr);
/* The range-GET client, for its counters (status, metrics). */
struct rf_client *rroots_client(const struct rroots *rr);

void rroots_free(struct rroots *rr); /* NULL-safe; no request may be running */

#endif
