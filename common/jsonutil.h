/*
 * jsonutil.h - exact 64-bit integers in cJSON documents.
 *
 * cJSON keeps every number as a double, which is exact only below 2^53; byte
 * counts, offsets and shapes can be larger. These write the integer's decimal
 * digits as a raw item instead, so that what is printed is exact. Used by the
 * protocol's reply builders, plan descriptions and the CLI alike.
 */
#ifndef WD_JSONUTIL_H
#define WD_JSONUTIL_H

#include <cjson/cJSON.h>
#include <stdint.h>

/* A new item printing v exactly, or NULL when memory ran out. */
cJSON *json_u64_create(uint64_t v);

/*
 * Adds v to obj: as member name of an object, or appended to an array when
 * name is NULL. Returns 0, or WEIGHTD_E_NOMEM (nothing is added).
 */
int json_u64_add(cJSON *obj, const char *name, uint64_t v);

#endif
