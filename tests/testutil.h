/*
 * testutil.h - the tiny harness every C test uses.
 *
 * A test file defines static void test_*(void) functions and lists them in
 * main with RUN(test_name). CHECK records a failure with file and line and
 * keeps going; the process exits 1 if any check failed, 77 (ctest's skip code)
 * if the file called SKIP_ALL, else 0.
 */
#ifndef WD_TESTUTIL_H
#define WD_TESTUTIL_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tu_failed_checks;
static int tu_tests_failed, tu_tests_passed;
static const char *tu_current;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      tu_failed_checks++;                                                             \
      fprintf(stderr, "%s:%d: %s: CHECK failed: %s\n", __FILE__, __LINE__, tu_current, \
              #cond);                                                                 \
    }                                                                                 \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                                   \
  do {                                                                                       \
    long long tu_a = (long long)(a), tu_b = (long long)(b);                                  \
    if (tu_a != tu_b) {                                                                      \
      tu_failed_checks++;                                                                    \
      fprintf(stderr, "%s:%d: %s: %s == %lld, expected %s == %lld\n", __FILE__, __LINE__,    \
              tu_current, #a, tu_a, #b, tu_b);                                               \
    }                                                                                        \
  } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                                      \
  do {                                                                                       \
    const char *tu_h = (hay), *tu_n = (needle);                                              \
    if (tu_h == NULL || strstr(tu_h, tu_n) == NULL) {                                        \
      tu_failed_checks++;                                                                    \
      fprintf(stderr, "%s:%d: %s: \"%s\" does not contain \"%s\"\n", __FILE__, __LINE__,     \
              tu_current, tu_h ? tu_h : "(null)", tu_n);                                     \
    }                                                                                        \
  } while (0)

#define RUN(fn)                                                                              \
  do {                                                                                       \
    int tu_before = tu_failed_checks;                                                        \
    tu_current = #fn;                                                                        \
    fn();                                                                                    \
    if (tu_failed_checks == tu_before) {                                                     \
      tu_tests_passed++;                                                                     \
    } else {                                                                                 \
      tu_tests_failed++;                                                                     \
      fprintf(stderr, "FAIL %s\n", #fn);                                                     \
    }                                                                                        \
  } while (0)

#define TEST_SKIP_CODE 77

#define SKIP_ALL(why)                                   \
  do {                                                  \
    printf("SKIP: %s\n", why);                          \
    exit(TEST_SKIP_CODE);                               \
  } while (0)

static inline int tu_finish(void) {
  printf("%d passed, %d failed\n", tu_tests_passed, tu_tests_failed);
  return tu_tests_failed ? 1 : 0;
}

#endif
