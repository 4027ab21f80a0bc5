/* backend.c - what every backend shares: destruction, and the cuda fallback. */
#include "backend.h"

const char *wd_link_name(enum wd_link l) {
  static const char *const names[] = {"none", "peer", "pcie", "nvlink", "host"};
  return (unsigned)l < sizeof names / sizeof names[0] ? names[l] : "?";
}

void backend_destroy(struct wd_backend *b) {
  if (b == NULL || b->ops == NULL) return;
  if (b->ops->destroy) b->ops->destroy(b->ctx);
  b->ops = NULL;
  b->ctx = NULL;
}

#ifndef WEIGHTD_HAVE_CUDA
int backend_cuda_create(struct wd_backend *out, enum wd_handle_kind handles, struct wd_error *err) {
  (void)handles;
  out->ops = NULL;
  out->ctx = NULL;
  return err_set(err, WEIGHTD_E_UNSUPPORTED, "this weightd was built without CUDA");
}
#endif
