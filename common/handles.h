/*
 * handles.h - what the daemon and libweightd share about memory handles,
 * written once: the handle kinds with their wire names, the sizes of what
 * a handle carries, and the attach features hello negotiates.
 *
 * A handle is how a client reaches a slab's memory. Its kind is fixed when the
 * slab is allocated (a legacy IPC handle cannot be made from VMM memory, nor
 * a VMM file descriptor from cudaMalloc memory), so every attach of a set
 * gets the same kind:
 *   fd        host backend: a sealed memfd sent with SCM_RIGHTS; map it read-only
 *   cuda_ipc  legacy CUDA IPC: a 64-byte cudaIpcMemHandle_t as hex; open it with
 *             cuIpcOpenMemHandle (once per process and device; importers can write)
 *   cuda_vmm  a CUDA VMM allocation exported as a POSIX file descriptor, sent
 *             with SCM_RIGHTS; import it with cuMemImportFromShareableHandle and
 *             map it (any number of times, read-only where the driver allows)
 * The wire names are part of protocol version 1 (docs/protocol.md); a new
 * kind is appended and never renumbers the others.
 *
 * The daemon's cuda backend exports cudaIpcMemHandle_t (the runtime's type);
 * libweightd opens it as the driver's CUipcMemHandle, which it declares itself
 * because it loads the driver at run time. Both are 64 opaque bytes; each side
 * asserts its own type's size against WD_IPC_HANDLE_BYTES, and the handle
 * travels as 2 * WD_IPC_HANDLE_BYTES hex digits.
 */
#ifndef WD_HANDLES_H
#define WD_HANDLES_H

#include <string.h>

#define WD_IPC_HANDLE_BYTES 64

/*
 * A cuda_vmm handle's allocation id: random bytes the daemon draws once per
 * slab, sent as 2 * WD_ALLOC_ID_BYTES hex digits. A client's mapping table
 * needs an identity for "the same allocation" (the exported descriptors of
 * different allocations may all look alike to fstat, and the driver promises
 * nothing about imported handle values), and set ids alone repeat across
 * daemon restarts.
 */
#define WD_ALLOC_ID_BYTES 16

/* XX(ENUM, "wire name"), in the enum's order. */
#define WD_HANDLE_KIND_MAP(XX) \
  XX(FD, "fd")                 \
  XX(CUDA_IPC, "cuda_ipc")     \
  XX(CUDA_VMM, "cuda_vmm")

enum wd_handle_kind {
#define WD_XX_(e, name) WD_HANDLE_##e,
  WD_HANDLE_KIND_MAP(WD_XX_)
#undef WD_XX_
  WD_HANDLE_KIND_COUNT
};

/* A set of kinds, as a bit mask (a client's accepted kinds). */
#define WD_HANDLE_BIT(k) (1u << (unsigned)(k))

/*
 * What a client that lists no kinds in hello accepts: what every libweightd
 * before the cuda_vmm kind could open.
 */
#define WD_HANDLES_DEFAULT (WD_HANDLE_BIT(WD_HANDLE_FD) | WD_HANDLE_BIT(WD_HANDLE_CUDA_IPC))

/* The wire name of kind k ("?" outside the table). */
static inline const char *wd_handle_kind_name(enum wd_handle_kind k) {
  static const char *const names[] = {
#define WD_XX_(e, name) name,
      WD_HANDLE_KIND_MAP(WD_XX_)
#undef WD_XX_
  };
  return (unsigned)k < WD_HANDLE_KIND_COUNT ? names[k] : "?";
}

/* The kind called name, or -1 for a name this build does not know. */
static inline int wd_handle_kind_from_name(const char *name) {
  for (int k = 0; name != NULL && k < WD_HANDLE_KIND_COUNT; k++)
    if (strcmp(wd_handle_kind_name((enum wd_handle_kind)k), name) == 0) return k;
  return -1;
}

/* True when a handle of kind k travels as a file descriptor (SCM_RIGHTS). */
static inline int wd_handle_kind_has_fd(enum wd_handle_kind k) {
  return k == WD_HANDLE_FD || k == WD_HANDLE_CUDA_VMM;
}

/*
 * Features a client asks for in hello ("features", a list of these names;
 * the daemon's reply lists those it has). Unknown names are ignored both
 * ways, so either side may be newer (docs/protocol.md, "hello"):
 *   tensor_table  attach replies carry the tensor table as a sealed memfd in
 *                 the binary format of common/tensor_table.h ("tensor_table")
 *                 instead of the JSON "tensors" list
 *   early_attach  the daemon answers an attach with "early": true while the
 *                 set loads, with its progress page (common/progress_page.h);
 *                 listed by the daemon only (a client asks per attach)
 *   load_group    the daemon takes load_group (every rank of a group in one
 *                 request); listed by the daemon only
 *   topology      devices carry numa_node, link_rate and peers, sets their
 *                 source (a replica may come from a peer's copy, a load be
 *                 striped), and status has "topology"; listed by the daemon only
 *   progress_page every attach (early or not) carries the set's progress
 *                 page, whose flags say when a scrub found it corrupt
 */
#define WD_FEATURE_MAP(XX)              \
  XX(TENSOR_TABLE, "tensor_table")      \
  XX(EARLY_ATTACH, "early_attach")      \
  XX(LOAD_GROUP, "load_group")          \
  XX(TOPOLOGY, "topology")             \
  XX(PROGRESS_PAGE, "progress_page")

enum wd_feature {
#define WD_XX_(e, name) WD_FEATURE_##e,
  WD_FEATURE_MAP(WD_XX_)
#undef WD_XX_
  WD_FEATURE_COUNT
};

#define WD_FEATURE_BIT(f) (1u << (unsigned)(f))

/* The wire name of feature f ("?" outside the table). */
static inline const char *wd_feature_name(enum wd_feature f) {
  static const char *const names[] = {
#define WD_XX_(e, name) name,
      WD_FEATURE_MAP(WD_XX_)
#undef WD_XX_
  };
  return (unsigned)f < WD_FEATURE_COUNT ? names[f] : "?";
}

/* The feature called name, or -1 for one this build does not know. */
static inline int wd_feature_from_name(const char *name) {
  for (int f = 0; name != NULL && f < WD_FEATURE_COUNT; f++)
    if (strcmp(wd_feature_name((enum wd_feature)f), name) == 0) return f;
  return -1;
}

#endif
