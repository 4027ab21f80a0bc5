/* clock.c - the monotonic clock (see clock.h). */
#include "clock.h"

#include <time.h>

uint64_t clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t clock_ms(void) { return clock_ns() / 1000000u; }

double clock_s(void) { return (double)clock_ns() / 1e9; }
