/*
 * stream_copy.c - non-temporal copies for staging slots (see stream_copy.h).
 */
#include "stream_copy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>

/* Below this a copy is mostly its unaligned ends: memcpy it. */
#define STREAM_MIN 256

void *stream_copy(void *dst, const void *src, size_t n) {
  if (n < STREAM_MIN) return memcpy(dst, src, n);
  unsigned char *d = dst;
  const unsigned char *s = src;
  /* Whole cache lines only: a line written partly by streaming stores is written back in pieces. */
  size_t head = (size_t)(-(uintptr_t)d & 63);
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64) {
    __m128i a = _mm_loadu_si128((const __m128i_u *)s);
    __m128i b = _mm_loadu_si128((const __m128i_u *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i_u *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i_u *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
  }
  memcpy(d, s, n);
  return dst;
}

void stream_copy_fence(void) { _mm_sfence(); }

bool stream_copy_native(void) { return true; }

#else

void *stream_copy(void *dst, const void *src, size_t n) { return memcpy(dst, src, n); }

/*
 * Plain stores here; in write-combined slots (Normal non-cacheable memory on
 * aarch64) the fence must order them for the device too, which an
 * inner-shareable barrier does not promise: a full-system store barrier.
 */
void stream_copy_fence(void) {
#if defined(__aarch64__)
  __asm__ volatile("dsb st" ::: "memory");
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

bool stream_copy_native(void) { return false; }

#endif
