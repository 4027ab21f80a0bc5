/*
 * stream_copy.h - copies into memory the CPU will not read again (pinned
 * staging slots that only the GPU's copy engine reads).
 *
 * A plain memcpy into such memory costs the CPU a read of every destination
 * line before it writes it (read for ownership) and leaves the lines dirty in
 * its caches, where the copy engine then has to snoop them: three passes over
 * DRAM and a cache full of bytes nobody reads. stream_copy writes whole lines
 * with non-temporal stores instead (x86-64; elsewhere it is memcpy), so a
 * byte costs one read and one write. The stores are weakly ordered (so are
 * plain stores into write-combined memory): every thread that wrote calls
 * stream_copy_fence before it tells anyone (a thread, a DMA engine) that its
 * bytes are there; a fence orders only its own thread's stores. Safe from
 * any thread.
 */
#ifndef WD_STREAM_COPY_H
#define WD_STREAM_COPY_H

#include <stdbool.h>
#include <stddef.h>

/* Copies n bytes from src to dst (not overlapping) as memcpy does; returns dst. */
void *stream_copy(void *dst, const void *src, size_t n);

/* Makes every stream_copy of this thread so far visible before the stores after it. */
void stream_copy_fence(void);

/* True where stream_copy uses non-temporal stores; false where it is memcpy. */
bool stream_copy_native(void);

#endif
