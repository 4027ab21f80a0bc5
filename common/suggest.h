/*
 * suggest.h - "did you mean": the closest of a list of names to a misspelt
 * one, for options, commands and configuration keys.
 *
 * Closeness is the optimal string alignment distance (Levenshtein with
 * adjacent transpositions counting as one edit), so '--tp-sise', '--jsn',
 * 'model_root' and 'stauts' find '--tp-size', '--json', 'model_roots' and
 * 'status'.
 */
#ifndef WD_SUGGEST_H
#define WD_SUGGEST_H

#include <stddef.h>

/* The edit distance between a and b (insertions, deletions, substitutions, adjacent swaps). */
size_t suggest_distance(const char *a, const char *b);

/*
 * The candidate closest to word, or NULL when none is close enough to be
 * what was meant: at most 1 edit for words of up to 4 characters, 2 up to
 * 8, 3 beyond; ties go to the first candidate. NULL entries are skipped.
 */
const char *suggest_closest(const char *word, const char *const *candidates, size_t n);

#endif
