/*
 * fault.h - reading shard mappings without dying of SIGBUS.
 *
 * A file truncated under a MAP_SHARED mapping raises SIGBUS on access past
 * its new end. fault_install sets a process-wide handler once; a thread that
 * reads a mapping does it inside fault_copy / fault_touch, which arm a
 * per-thread recovery point: a SIGBUS there makes the call return
 * WEIGHTD_E_FAULT instead of killing the daemon. A SIGBUS anywhere else still
 * terminates the process as it would without the handler.
 */
#ifndef WD_FAULT_H
#define WD_FAULT_H

#include <stddef.h>

int fault_install(void);

/* memcpy(dst, src, n) where src may be a file mapping: 0, or WEIGHTD_E_FAULT. */
int fault_copy(void *dst, const void *src, size_t n);

/* Reads one byte per page of [p, p+n): 0, or WEIGHTD_E_FAULT. */
int fault_touch(const void *p, size_t n);

/*
 * Runs fn(arg) with the recovery point armed: returns fn's result, or
 * WEIGHTD_E_FAULT when a SIGBUS interrupted it. fn must hold no locks and
 * own no resources that a jump out of it would leak.
 */
int fault_call(int (*fn)(void *arg), void *arg);

#endif
