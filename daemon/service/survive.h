/*
 * survive.h - restart survival: resident sets that outlive the daemon.
 *
 * While sets change, every READY set whose memory can outlive the process
 * (cuda_vmm slabs; on the host backend, memfd slabs) has its slab
 * descriptor in the service manager's fd store ("wd-slab-<set id>"), and a
 * sealed set description (daemon/service/setdesc.h) names them all with their
 * checkpoints' identities, tensor tables and leases ("wd-sets-<generation>";
 * each change stores a new generation, then removes the stale names).
 * Legacy IPC sets are never stored. At start, the newest description passed
 * back (LISTEN_FDS/LISTEN_FDNAMES) is read, and each set whose checkpoint
 * files are unchanged (device, inode, size, mtime of every shard, opened
 * through the registry and so confined to the model roots) is re-adopted
 * READY without reading a weight; its leases wait restart_grace_ms for their
 * holders to reclaim them (ops: reclaim). docs/architecture.md, "Restarts".
 *
 * Threads: the loop thread only; re-adoption opens checkpoints through the
 * registry's jobs and continues in their callbacks.
 */
#ifndef WD_SURVIVE_H
#define WD_SURVIVE_H

#include <stdbool.h>

struct daemon;
struct survive;

/*
 * Decides from fd_store, NOTIFY_SOCKET, $FDSTORE and the descriptors passed
 * at start whether sets survive restarts, and logs the verdict. NULL when
 * memory ran out (restart survival is then off).
 */
struct survive *survive_create(struct daemon *d);

/*
 * Re-adopts what the store passed back (nothing when it passed nothing or
 * survival is off). Returns true when the work continues on the loop: done
 * (arg) runs once it is finished, before anything is served; false when it
 * finished already (done does not run). Never fails: a set or a description
 * it cannot use is dropped with a log line saying why.
 */
bool survive_start(struct survive *sv, void (*done)(void *arg), void *arg);

/* Stops storing (an orderly stop: the store keeps what the last generation said). */
void survive_freeze(struct survive *sv);

/* Sets re-adopted at start (for the start-up log and status). */
unsigned survive_adopted(const struct survive *sv);

/* NULL-safe; closes its timers (the loop must run once more). */
void survive_destroy(struct survive *sv);

#endif
