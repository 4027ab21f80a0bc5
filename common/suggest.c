/* suggest.c - the closest name to a misspelt one (see suggest.h). */
#include "suggest.h"

#include <stdlib.h>
#include <string.h>

/* Names longer than this are compared by their first MAX_LEN characters. */
#define MAX_LEN 63

size_t suggest_distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b);
  if (n > MAX_LEN) n = MAX_LEN;
  if (m > MAX_LEN) m = MAX_LEN;
  /* Three rows of the dynamic-programming table: two back (for swaps), one back, this one. */
  size_t rows[3][MAX_LEN + 1];
  size_t *prev2 = rows[0], *prev = rows[1], *cur = rows[2];
  for (size_t j = 0; j <= m; j++) prev[j] = j;
  for (size_t i = 1; i <= n; i++) {
    cur[0] = i;
    for (size_t j = 1; j <= m; j++) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      size_t best = prev[j] + 1;
      if (cur[j - 1] + 1 < best) best = cur[j - 1] + 1;
      if (prev[j - 1] + cost < best) best = prev[j - 1] + cost;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && prev2[j - 2] + 1 < best)
        best = prev2[j - 2] + 1;
      cur[j] = best;
    }
    size_t *t = prev2;
    prev2 = prev;
    prev = cur;
    cur = t;
  }
  return prev[m];
}

const char *suggest_closest(const char *word, const char *const *candidates, size_t n) {
  size_t len = strlen(word);
  size_t limit = len <= 4 ? 1 : len <= 8 ? 2 : 3;
  const char *best = NULL;
  size_t best_d = limit + 1;
  for (size_t i = 0; i < n; i++) {
    if (candidates[i] == NULL) continue;
    size_t d = suggest_distance(word, candidates[i]);
    if (d < best_d) {
      best = candidates[i];
      best_d = d;
    }
  }
  return best;
}
