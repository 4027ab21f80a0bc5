/*
 * reload.h - applying a new configuration to a running daemon (SIGHUP).
 *
 * The keys the config table marks reloadable take effect; a changed key that
 * is not reloadable keeps its running value and is reported with a warning.
 * Existing sets, leases and connections stay: new requests follow the new
 * rules (model roots, allowed uids/gids, limits), budgets that shrink evict
 * unleased sets and unpin checkpoints that are not loading. Loop thread only.
 */
#ifndef WD_RELOAD_H
#define WD_RELOAD_H

#include "daemon.h"
#include "error.h"

/*
 * Applies next (a complete, validated configuration) to d, after capping its
 * budgets at the machine's memory as start-up does (next is changed so).
 * Returns 0 with next's reloadable values in d->cfg, or an error (a model
 * root that does not resolve, inconsistent limits) with d->cfg unchanged.
 */
int reload_apply(struct daemon *d, struct wd_config *next, struct wd_error *err);

#endif
