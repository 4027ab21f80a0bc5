/*
 * telemetry.h - the daemon's figures, collected once and rendered twice: as
 * the Prometheus text format (GET /metrics, http.c) and as JSON (the
 * "metrics" object of the status reply), so the two views always agree; and
 * readiness, shared by GET /readyz and the `health` op.
 *
 * Collection reads loop-owned state on the loop thread, in one walk of each
 * list (checkpoints, sets, leases). What is slow to
 * measure runs on a control job and is cached: page-cache residency per
 * checkpoint (mincore over every mapping), refreshed at most every
 * TELEMETRY_RESIDENCY_MS, and sooner only when a checkpoint was opened since
 * the last measurement (so a new one shows from the next scrape but one);
 * the backend's health (a device query of every device, whose free memory
 * it records), refreshed at most every TELEMETRY_HEALTH_MS. A collection
 * starts the refreshes that are due and shows the cached values. A job reads
 * only what it was handed: referenced checkpoints and the backend's const
 * table.
 */
#ifndef WD_TELEMETRY_H
#define WD_TELEMETRY_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>

#include "daemon.h"
#include "error.h"

#define TELEMETRY_RESIDENCY_MS 30000
#define TELEMETRY_HEALTH_MS 5000
/*
 * Per-checkpoint series are the largest this many open checkpoints'; the
 * others are summed in weightd_checkpoints_unlisted*, so a scrape's size does
 * not grow with the number of checkpoints.
 */
#define TELEMETRY_CHECKPOINT_SERIES 32
#define TELEMETRY_CHECKPOINT_SERIES_TEXT "32"

int telemetry_create(struct daemon *d, struct telemetry **out, struct wd_error *err);
/* Frees the cache. Jobs still out reach it through d->tel: clear d->tel first (their results are then dropped). */
void telemetry_destroy(struct telemetry *t);

/* Starts refreshes whose cached values are older than their interval (no-op otherwise). */
void telemetry_refresh(struct daemon *d);

/* The Prometheus text exposition (version 0.0.4) of every figure: a new string. */
char *telemetry_prometheus(struct daemon *d);

/*
 * The same figures as JSON: {"family": {"type", "help", "samples": [{"labels": {...}, "value": v}]}}.
 * Without paths, the samples labelled with a checkpoint's path are left out (status for a client who is
 * not an admin, which may see only the checkpoints it may read; their sums stay).
 */
cJSON *telemetry_json(struct daemon *d, bool paths);

/*
 * Ready to serve: listening, not stopping, and the backend answered its last
 * health probe. Writes why not into why (why may be NULL).
 */
bool telemetry_ready(struct daemon *d, char *why, size_t whylen);

#endif
