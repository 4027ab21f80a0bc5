/*
 * clock.h - the monotonic clock, for durations, deadlines and timeouts.
 *
 * Every component reads time through these (daemon, library, CLI, tools), so
 * that all of them measure on the same clock (CLOCK_MONOTONIC: never jumps
 * with the wall clock). Safe from any thread.
 */
#ifndef WD_CLOCK_H
#define WD_CLOCK_H

#include <stdint.h>

/* Nanoseconds since an arbitrary fixed point. */
uint64_t clock_ns(void);
/* Milliseconds since the same point. */
uint64_t clock_ms(void);
/* Seconds since the same point, as a double (for durations). */
double clock_s(void);

#endif
