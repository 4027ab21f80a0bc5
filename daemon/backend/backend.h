/*
 * backend.h - the device backend interface.
 *
 * A backend is a const table of operations plus a context, in the style of
 * ggml's backends. Optional operations may be NULL and say so. Two backends
 * exist: `host`, where device memory is a sealed memfd handed to clients over
 * SCM_RIGHTS and a copy is a memcpy (CPU engines share weights through it,
 * and every daemon test runs on it), and `cuda`, where a slab is one CUDA VMM
 * allocation exported once as a POSIX file descriptor (cuda_vmm handles, the
 * default) or one cudaMalloc allocation exported with cudaIpcGetMemHandle
 * (legacy cuda_ipc handles). A slab's handle kind is fixed when it is
 * allocated.
 *
 * Several devices: a backend may present any number (the host backend
 * presents host_devices of them, for tests of placement), and may say which
 * pairs can copy device to device (peer access, over NVLink or PCIe) and do
 * such copies; those operations are optional (NULL: no peers), so a backend
 * with one device needs none of them.
 *
 * Threads: device queries, slab allocation and export run on the daemon's
 * loader threads or the loop thread; copies run on loader threads. A backend
 * guards its own shared state; slabs, streams and events are used by one
 * thread at a time, except that a slab may be the source of several peer
 * copies at once.
 */
#ifndef WD_BACKEND_H
#define WD_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define WD_UUID_MAX 64
#include "handles.h"

struct wd_device_info {
  int index;               /* the daemon's index */
  char name[128];          /* "NVIDIA H200", "host memory" */
  char uuid[WD_UUID_MAX];  /* "GPU-8f0e...", "host-<machine id>" */
  uint64_t memory_total;
  uint64_t memory_free;
  enum wd_handle_kind handles; /* the kind of handle this device's slabs get */
  char handles_why[192];       /* why that is not the kind asked for ("" when it is) */
};

/*
 * One export of a slab. For WD_HANDLE_FD and WD_HANDLE_CUDA_VMM, fd is a new
 * descriptor owned by the caller; for WD_HANDLE_CUDA_IPC it is -1 and ipc
 * holds the handle. bytes is what the client maps: the slab's bytes (fd,
 * cuda_ipc) or the whole allocation, a multiple of the VMM granularity
 * (cuda_vmm).
 */
struct wd_handle {
  enum wd_handle_kind kind;
  int fd;
  unsigned char ipc[WD_IPC_HANDLE_BYTES];
  unsigned char alloc_id[WD_ALLOC_ID_BYTES]; /* cuda_vmm: the allocation's identity */
  uint64_t bytes;
};

/* One device allocation holding a resident set's tensors. */
struct wd_slab {
  int device;
  enum wd_handle_kind kind; /* fixed at allocation: what slab_export makes */
  uint64_t bytes;
  void *host_view; /* a writable host mapping while filling (host backend), else NULL */
  /*
   * slab_export may run while the slab is still being filled (early attach),
   * and no importer can write it meanwhile: host slabs sealed against future
   * writes from the start (F_SEAL_FUTURE_WRITE). GPU slabs cannot be
   * protected by the exporter: a cuda_vmm importer chooses its own access
   * flags (libweightd asks for read-only, but any importer may map it
   * read-write) and a cuda_ipc importer can always write, so GPU importers
   * are trusted, filling or filled. 0 when the kernel cannot seal early.
   */
  int export_while_filling;
  void *impl; /* backend-private */
};

struct wd_stream;
struct wd_event;

/* How two devices are connected, as far as the backend can tell. */
enum wd_link {
  WD_LINK_NONE,    /* no device-to-device path (copies would go through host memory) */
  WD_LINK_PEER,    /* peer access, over a link the backend cannot name */
  WD_LINK_PCIE,    /* peer access over PCIe */
  WD_LINK_NVLINK,  /* peer access over NVLink */
  WD_LINK_HOST,    /* host backend: "devices" share host memory; a peer copy is a memcpy */
};

/* The name of a link kind, as status shows it ("nvlink"). */
const char *wd_link_name(enum wd_link l);

/* What one ordered pair of devices can do (peer_query): src's memory read by a copy to dst. */
struct wd_peer_info {
  int access;           /* copy_peer from src to dst runs device to device */
  enum wd_link link;
  int performance_rank; /* the driver's relative rank of the path, lower is faster; -1 unknown */
};

/*
 * Capabilities a backend states (wd_backend_ops.caps), so that callers ask
 * instead of guessing from which operations are NULL.
 *   WD_CAP_HOST_SLABS  slabs are host memory that the CPU fills in place
 *                      (host_view while filling) and that clients map
 *                      directly; the CPU reads any host memory, so nothing
 *                      needs staging or registration.
 */
#define WD_CAP_HOST_SLABS (1u << 0)

/* A byte range of a slab, for slab_hash. */
struct wd_hash_range {
  uint64_t off, len;
};

/* The bytes of one digest slab_hash writes (a tensor digest, canonical: manifest.h's MF_DIGEST_BYTES). */
#define WD_DIGEST_BYTES 16

/* pinned_alloc flags. */
#define WD_PINNED_WRITE_COMBINED (1u << 0) /* only the CPU writes it and only the device reads it */

struct wd_backend_ops {
  const char *name;
  unsigned caps; /* WD_CAP_* */

  /* Devices. */
  int (*device_count)(void *ctx);
  int (*device_info)(void *ctx, int device, struct wd_device_info *out, struct wd_error *err);

  /*
   * Slabs: allocate, make read-only once filled (NULL: nothing to do), export
   * (also while filling, where export_while_filling says so), free.
   */
  int (*slab_alloc)(void *ctx, int device, uint64_t bytes, struct wd_slab **out, struct wd_error *err);
  int (*slab_seal)(void *ctx, struct wd_slab *slab, struct wd_error *err);
  int (*slab_export)(void *ctx, struct wd_slab *slab, struct wd_handle *out, struct wd_error *err);
  void (*slab_free)(void *ctx, struct wd_slab *slab);
  /*
   * Takes back a filled slab from a descriptor an earlier daemon exported
   * (restart survival, docs/architecture.md "Restarts"): fd becomes the
   * slab's on success (the caller closes it on failure); bytes is the
   * slab's size, alloc_bytes and alloc_id what the export said. The slab is
   * read-only (never filled again). NULL: slabs of this backend cannot
   * outlive the daemon (legacy IPC devices refuse with UNSUPPORTED).
   */
  int (*slab_adopt)(void *ctx, int device, enum wd_handle_kind kind, int fd, uint64_t bytes, uint64_t alloc_bytes,
                    const unsigned char *alloc_id, struct wd_slab **out, struct wd_error *err);

  /*
   * Pinned (page-locked) host buffers for the staging pipeline. flags:
   * WD_PINNED_WRITE_COMBINED asks for memory the CPU only writes and the
   * device reads (write-combined, not snooped by the device's reads, very
   * slow for the CPU to read); a backend without such memory ignores it.
   */
  int (*pinned_alloc)(void *ctx, int device, size_t bytes, unsigned flags, void **out, struct wd_error *err);
  void (*pinned_free)(void *ctx, int device, void *p);

  /*
   * Registers an existing host range (a shard mapping) so that copies from it
   * need no staging: the pinned-resident tier. NULL: the backend reads any
   * host memory directly (host) and needs no registration.
   */
  int (*host_register)(void *ctx, void *p, size_t len, struct wd_error *err);
  void (*host_unregister)(void *ctx, void *p, size_t len);

  /* Streams and events: copies are asynchronous on a stream; an event marks completion. */
  int (*stream_create)(void *ctx, int device, struct wd_stream **out, struct wd_error *err);
  void (*stream_destroy)(void *ctx, struct wd_stream *s);
  int (*event_create)(void *ctx, int device, struct wd_event **out, struct wd_error *err);
  void (*event_destroy)(void *ctx, struct wd_event *e);
  int (*event_record)(void *ctx, struct wd_event *e, struct wd_stream *s, struct wd_error *err);
  int (*event_wait)(void *ctx, struct wd_event *e, struct wd_error *err);

  /*
   * Copies host memory into a slab: `height` rows of `width` bytes, rows
   * src_pitch apart in the source and dst_pitch apart in the slab (height 1
   * for a plain copy). Asynchronous on stream s: src must stay valid and
   * unchanged until an event recorded after it has completed.
   */
  int (*copy_h2d)(void *ctx, struct wd_slab *dst, uint64_t dst_offset, size_t dst_pitch,
                  const void *src, size_t src_pitch, size_t width, size_t height,
                  struct wd_stream *s, struct wd_error *err);

  /*
   * Several devices (all optional; NULL: the backend has no peers, and a
   * replica or a striped load never runs device to device).
   *
   * peer_query: what src -> dst can do (src == dst is not a peer: access 0).
   * WEIGHTD_E_NOT_FOUND for a device the backend does not have.
   */
  int (*peer_query)(void *ctx, int src, int dst, struct wd_peer_info *out, struct wd_error *err);
  /*
   * copy_peer: `bytes` from src (a slab of any device, filled and possibly
   * sealed) at src_offset to dst (writable: not yet sealed) at dst_offset,
   * asynchronous on s, a stream of either device (its device's copy engine
   * does the copy); src must stay allocated until an event recorded after it
   * has completed. It gives the stream's device whatever access the copy
   * needs (CUDA VMM: cuMemSetAccess on the daemon's mappings). Works on one
   * device too (a device-to-device copy).
   */
  int (*copy_peer)(void *ctx, struct wd_slab *dst, uint64_t dst_offset, const struct wd_slab *src,
                   uint64_t src_offset, uint64_t bytes, struct wd_stream *s, struct wd_error *err);
  /*
   * slab_hash: the tensor digest (manifest.h's tree of XXH3-128 over
   * MF_LEAF_BYTES leaves, canonical: mf_tensor_digest) of each of n ranges
   * of a slab, filled or sealed, into out[i]. Synchronous: it returns once
   * every digest is written. Runs on a job thread, never the loop; a slab
   * may be hashed while peer copies read it. host: mf_tensor_digest
   * (libxxhash) over the memfd's bytes on the calling thread; cuda: two
   * kernels (slab_hash_cuda.cu), one warp per leaf, then one per range over
   * its leaf digests, on the slab's device. NULL: the backend cannot hash
   * its slabs (scrubs of its sets answer UNSUPPORTED).
   */
  int (*slab_hash)(void *ctx, const struct wd_slab *slab, const struct wd_hash_range *ranges, size_t n,
                   unsigned char (*out)[WD_DIGEST_BYTES], struct wd_error *err);
  /* A device buffer that is never exported (a bounce buffer), freed with slab_free. */
  int (*scratch_alloc)(void *ctx, int device, uint64_t bytes, struct wd_slab **out, struct wd_error *err);
  /*
   * The device's PCI bus id ("0000:1b:00.0", lowercase) into buf, for its
   * NUMA node (/sys/bus/pci/devices/ID/numa_node). NULL, or an error: not a
   * PCI device (host memory).
   */
  int (*pci_bus_id)(void *ctx, int device, char *buf, size_t len, struct wd_error *err);

  void (*destroy)(void *ctx);
};

struct wd_backend {
  const struct wd_backend_ops *ops;
  void *ctx;
};

/* Creates the host backend with one device. */
int backend_host_create(struct wd_backend *out, struct wd_error *err);

/*
 * The host backend with several "devices" (each its own memfd slabs, all in
 * host memory), for tests of multi-device placement: device 0 is
 * host-<machine id> as with one device, device i is host-<machine id>-i.
 * peers says which ordered pairs have "peer access" (a copy_peer is then a
 * memcpy): "all", "none", or pairs "0-1,1-2" (each both ways).
 */
struct wd_host_options {
  int devices;       /* 1 or more */
  const char *peers; /* NULL: "all" */
  /*
   * For tests only: slabs are never sealed against writes, so a client may
   * map its descriptor read-write and change a set's bytes, as a cuda_ipc
   * importer can on a GPU (the scrub's tests inject corruption so).
   */
  int writable;
};
int backend_host_create_devices(struct wd_backend *out, const struct wd_host_options *o, struct wd_error *err);

/*
 * Creates the cuda backend: WEIGHTD_E_UNSUPPORTED when weightd was built
 * without CUDA, WEIGHTD_E_DEVICE when no usable GPU is present. handles is
 * the kind of handle slabs get, WD_HANDLE_CUDA_VMM or WD_HANDLE_CUDA_IPC; a
 * device (or a driver) that cannot export VMM memory as file descriptors gets
 * WD_HANDLE_CUDA_IPC instead, which its wd_device_info says, with why.
 */
int backend_cuda_create(struct wd_backend *out, enum wd_handle_kind handles, struct wd_error *err);

/* Frees a backend created by one of the above (NULL-safe on an empty struct). */
void backend_destroy(struct wd_backend *b);

#endif
