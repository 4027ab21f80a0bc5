/* ctl_json.c - reading members of a reply's JSON objects, with the defaults every command prints. */
#include "ctl.h"

uint64_t ctl_u64(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) && v->valuedouble > 0 && v->valuedouble < 18446744073709551615.0 ? (uint64_t)v->valuedouble : 0;
}

double ctl_num(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) ? v->valuedouble : 0.0;
}

const char *ctl_str(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) ? v->valuestring : "?";
}
