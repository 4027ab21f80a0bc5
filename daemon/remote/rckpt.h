/*
 * rckpt.h - a checkpoint in an object store or behind an HTTP server, opened
 * by its URL (url.h): the index, config.json, the manifest and every shard's
 * header read with range GETs (fetch.h) and validated exactly as local files
 * are (ckpt_open_fetched, checkpoint.h), then byte ranges of its shards read
 * straight into the caller's memory.
 *
 * What a URL names: a key or path ending in ".safetensors" is that one file
 * (the "file" layout); anything else is a directory: its
 * model.safetensors, else its model.safetensors.index.json and the shards
 * it names (the order ckpt_open reads a local directory in).
 *
 * Where requests go (struct rck_target): an http(s) URL goes to its host
 * and port, unsigned or with its root's bearer token (bearer_for); an s3:// URL goes to the configured S3 endpoint (the
 * daemon's AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; without one AWS's
 * https://s3.REGION.amazonaws.com), in path style ("/BUCKET/KEY", what
 * on-premises stores want) or virtual-host style ("BUCKET.HOST/KEY"), and is
 * signed with SigV4 (sigv4.h) with credentials from the AWS chain (creds.h),
 * fetched on the calling thread for every request. Every shard is opened
 * (rf_stat: size, ETag, Last-Modified) before its header is read, and every
 * read after carries If-Match: an object replaced since the open fails a
 * read with STALE naming it. A shard whose server gives neither an ETag nor
 * a Last-Modified is refused (UNSUPPORTED): nothing could tell its versions
 * apart.
 *
 * Threads: rck_open and rck_close on one thread; rck_read, rck_readv and
 * rck_unchanged from any number of threads at once (the client is shared,
 * the objects read-only).
 */
#ifndef WD_REMOTE_RCKPT_H
#define WD_REMOTE_RCKPT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "checkpoint.h"
#include "error.h"
#include "remote/creds.h"
#include "remote/fetch.h"
#include "remote/url.h"

struct rck_target {
  struct rf_client *client;
  /* s3:// URLs: the endpoint, its addressing and region, and the credentials (NULL: requests go unsigned). */
  struct rf_endpoint s3_endpoint;
  bool s3_path_style;
  const char *s3_region;
  struct creds_provider *creds;
  /*
   * http(s) URLs: the bearer token requests for u carry ("Authorization:
   * Bearer TOKEN", to u's own host only, never after a redirect), or NULL
   * for none; the token outlives the checkpoint. NULL hook: none ever.
   */
  const char *(*bearer_for)(void *arg, const struct rurl *u);
  /* Whether a redirect may be followed (the remote roots' allow-list); NULL: none is. */
  bool (*allow_redirect)(void *arg, const struct rf_endpoint *to, const char *path);
  void *allow_arg;
  bool manifest; /* read the manifest beside the index */
  /* Set when the daemon stops (NULL: never): opens, checks and reads without a cancel of their own stop waiting. */
  const atomic_bool *cancel;
};

/*
 * The S3 endpoint of the environment: AWS_ENDPOINT_URL_S3, else
 * AWS_ENDPOINT_URL (an http(s) URL without a path), with path-style
 * addressing; else https://s3.REGION.amazonaws.com with virtual-host style.
 * 0, or INVALID naming the variable.
 */
int rck_s3_endpoint_from_env(const char *region, struct rf_endpoint *ep, bool *path_style, struct wd_error *err);

struct rck {
  struct rurl url;
  char *name;           /* the URL as errors and status show it */
  struct ckpt *ck;      /* validated; shards' fd -1 */
  struct rf_object *objs; /* per shard, as rf_stat found it */
  size_t nobjs;
  const struct rck_target *t; /* the caller's, outliving the checkpoint */
  struct rf_auth auth;
  const char *bearer; /* http(s): the token its requests carry, or NULL (t's) */
};

/* Opens the checkpoint at url_text (see above): 0 with *out, or an error naming the URL and the file. */
int rck_open(const struct rck_target *t, const char *url_text, struct rck **out, struct wd_error *err);

/* Reads bytes [off, off + len) of shard `shard` into dst (rf_read: STALE when the object changed). */
int rck_read(const struct rck *r, uint32_t shard, uint64_t off, uint64_t len, void *dst, const atomic_bool *cancel,
             struct wd_error *err);

/* Reads extents ext[0..n) of shard `shard` (rf_readv: ascending, adjacent ones fetched as one run). */
int rck_readv(const struct rck *r, uint32_t shard, const struct rf_extent *ext, size_t n, const atomic_bool *cancel,
              struct wd_error *err);

/* 0 when every shard is still the object opened (size and ETag, or Last-Modified), else STALE naming it. */
int rck_unchanged(const struct rck *r, struct wd_error *err);

void rck_close(struct rck *r); /* NULL-safe */

#endif
