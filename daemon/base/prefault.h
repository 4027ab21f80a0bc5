/*
 * prefault.h - making destination memory present before a transfer writes
 * into it.
 *
 * A fresh host slab (a memfd mapping) or any untouched buffer faults on its
 * first write to each page, and the kernel zeroes the page then, on the
 * writing thread. For remote reads that thread is the range-GET engine's one
 * loop thread (remote/fetch.h: bodies are written from its callbacks), where
 * the zeroing competes with every transfer's receive. Faulting the pages in
 * beforehand on the thread that asks for the read (a fill thread) moves that
 * work off the loop thread and spreads it over the fill threads.
 */
#ifndef WD_PREFAULT_H
#define WD_PREFAULT_H

#include <stddef.h>

/*
 * Makes every page that holds a byte of [p, p + n) present and writable
 * (madvise MADV_POPULATE_WRITE, Linux 5.14 and later), without changing a
 * byte. Returns 0, or -errno where the kernel did not: EINVAL before 5.14
 * or for a mapping it cannot populate (pinned or device memory, which is
 * present already), EFAULT or ENOMEM otherwise. A caller that gets an error
 * writes as it would have (the pages fault as they are written): nothing
 * depends on the prefault but speed.
 */
int prefault_write(void *p, size_t n);

#endif
