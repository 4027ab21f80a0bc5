/*
 * fuzz_request.c - libFuzzer target: one request frame through
 * msg_request_parse, then the field accessors the op handlers use, and the
 * error reply that echoes the request's id.
 */
#include <stdint.h>
#include <stdlib.h>

#include "msg.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct msg_request req;
  struct wd_error err = {0};
  int rc = msg_request_parse((const char *)data, size, &req, &err);
  if (rc == 0) {
    const char *s;
    uint64_t u;
    bool b;
    struct msg_obj plan, nested;
    (void)msg_get_string(&req.args, "path", false, &s, &err);
    (void)msg_get_string(&req.args, "client", false, &s, &err);
    (void)msg_get_u64(&req.args, "device", false, 0, 1024, &u, &err);
    (void)msg_get_u64(&req.args, "lease", false, 0, MSG_INT_MAX, &u, &err);
    (void)msg_get_u64(&req.args, "version", false, 0, UINT32_MAX, &u, &err);
    (void)msg_get_bool(&req.args, "pin", false, false, &b, &err);
    if (msg_get_object(&req.args, "plan", false, &plan, &err) == 1) {
      (void)msg_get_u64(&plan, "tp_size", false, 1, 4096, &u, &err);
      (void)msg_get_bool(&plan, "fuse", false, false, &b, &err);
      (void)msg_get_object(&plan, "experts", false, &nested, &err);
    }
  } else if (err.msg[0] == '\0') {
    abort(); /* every refusal names the problem */
  }
  cJSON *reply = msg_reply_error(req.id, rc == 0 ? WEIGHTD_E_INTERNAL : rc, err.msg);
  char *text = reply != NULL ? msg_serialize(reply) : NULL;
  free(text);
  cJSON_Delete(reply);
  msg_request_free(&req);
  return 0;
}
