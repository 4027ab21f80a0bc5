/* jsonutil.c - exact 64-bit integers in cJSON documents (see jsonutil.h). */
#include "jsonutil.h"

#include <inttypes.h>
#include <stdio.h>

#include "error.h"

cJSON *json_u64_create(uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  return cJSON_CreateRaw(buf);
}

int json_u64_add(cJSON *obj, const char *name, uint64_t v) {
  cJSON *item = json_u64_create(v);
  if (item == NULL) return WEIGHTD_E_NOMEM;
  cJSON_bool ok = name != NULL ? cJSON_AddItemToObject(obj, name, item) : cJSON_AddItemToArray(obj, item);
  if (!ok) {
    cJSON_Delete(item);
    return WEIGHTD_E_NOMEM;
  }
  return 0;
}
