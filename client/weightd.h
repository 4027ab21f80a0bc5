/*
 * weightd.h - the public C interface of weightd.
 *
 * This header is the contract between weightd and the programs that link
 * libweightd. Everything else in the source tree is internal.
 *
 * Error codes: every function that can fail returns 0 on success or one of
 * the negative WEIGHTD_E* codes below. weightd_strerror() gives a short
 * message for a code, weightd_err_name() the name that travels on the wire.
 * A code's number never changes and is never reused.
 */
#ifndef WEIGHTD_H
#define WEIGHTD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Everything declared here is exported from libweightd, which hides the rest. */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

#define WEIGHTD_VERSION_MAJOR 0
#define WEIGHTD_VERSION_MINOR 1
#define WEIGHTD_VERSION_PATCH 0
#define WEIGHTD_VERSION_STRING "0.1.0"
/* One number for comparisons: 0xMMmmpp. */
#define WEIGHTD_VERSION_HEX \
  ((WEIGHTD_VERSION_MAJOR << 16) | (WEIGHTD_VERSION_MINOR << 8) | WEIGHTD_VERSION_PATCH)

/*
 * The error table: XX(NAME, number, message). The wire name of a code is
 * NAME as written here ("BAD_HEADER"); the C constant is WEIGHTD_E_NAME.
 */
#define WEIGHTD_ERRNO_MAP(XX)                                                   \
  XX(IO,            1, "input/output error")                                    \
  XX(NOMEM,         2, "out of memory")                                         \
  XX(INVALID,       3, "invalid argument")                                      \
  XX(NOT_FOUND,     4, "not found")                                             \
  XX(BAD_HEADER,    5, "invalid safetensors header")                            \
  XX(BAD_TENSOR,    6, "invalid tensor entry")                                  \
  XX(BAD_SIZE,      7, "file size does not match its header")                   \
  XX(BAD_INDEX,     8, "invalid checkpoint index")                              \
  XX(BAD_CONFIG,    9, "invalid or incomplete model config")                    \
  XX(PATH_DENIED,  10, "path outside the configured model roots")              \
  XX(BAD_REQUEST,  11, "malformed request")                                     \
  XX(PROTOCOL,     12, "protocol error")                                        \
  XX(VERSION,      13, "protocol version not supported")                        \
  XX(PERMISSION,   14, "permission denied")                                     \
  XX(BUSY,         15, "resource busy")                                         \
  XX(CANCELED,     16, "operation canceled")                                    \
  XX(DEVICE,       17, "device error")                                          \
  XX(DEVICE_NOMEM, 18, "device out of memory")                                  \
  XX(STALE,        19, "file changed since it was opened")                      \
  XX(FAULT,        20, "file truncated or unreadable under its mapping")        \
  XX(BAD_PLAN,     21, "plan does not fit the checkpoint")                      \
  XX(CONNECT,      22, "cannot connect to the daemon")                          \
  XX(CLOSED,       23, "connection closed")                                     \
  XX(TIMEOUT,      24, "timed out")                                             \
  XX(UNSUPPORTED,  25, "not supported")                                         \
  XX(SHUTDOWN,     26, "daemon is shutting down")                               \
  XX(LIMIT,        27, "limit exceeded")                                        \
  XX(BAD_CHECKSUM, 28, "bytes differ from the file")                            \
  XX(INTERNAL,     29, "internal error")

enum weightd_errno {
  WEIGHTD_OK = 0,
#define WEIGHTD_XX_(name, num, msg) WEIGHTD_E_##name = -(num),
  WEIGHTD_ERRNO_MAP(WEIGHTD_XX_)
#undef WEIGHTD_XX_
};

/* The message for an error code ("unknown error" for codes not in the table). */
const char *weightd_strerror(int code);
/* The wire name of an error code ("OK" for 0, "UNKNOWN" outside the table). */
const char *weightd_err_name(int code);
/* The library's version, WEIGHTD_VERSION_HEX of the build that is running. */
unsigned weightd_version(void);
/* The library's version as a string, e.g. "0.1.0". */
const char *weightd_version_string(void);

/* ---- connections ----------------------------------------------------------
 *
 * Thread safety: a weightd_client may be used by one thread at a time (calls
 * on one handle from several threads must be serialised by the caller, and
 * weightd_release of a set counts as a call on the handle that attached it);
 * separate handles are independent. Sets attached through a handle may be
 * read from any thread. The table of mappings shared by all handles of the
 * process (see weightd_attach) has its own lock.
 *
 * fork(): the child must not use the parent's handles (they share the
 * parent's socket and leases); calls on them fail with WEIGHTD_E_INVALID and
 * it makes its own with weightd_connect. The child may read host sets it
 * inherited; weightd_release there only unmaps them and sends nothing (the
 * parent's lease stays); CUDA mappings are not inherited at all.
 *
 * All I/O is blocking; no event loop is needed. Checkpoint paths that are
 * relative are made absolute against the caller's working directory before
 * they are sent, since the daemon resolves paths in its own.
 */

typedef struct weightd_client weightd_client;
typedef struct weightd_set weightd_set;

/* The protocol version this library speaks. */
#define WEIGHTD_PROTOCOL_VERSION 1

/*
 * Connects and performs the hello exchange. socket_path NULL means: try
 * $WEIGHTD_SOCKET, then /run/weightd/weightd.sock, then the per-user socket
 * ($XDG_RUNTIME_DIR/weightd.sock, else /tmp/weightd-$UID.sock); the first
 * that accepts wins, and WEIGHTD_E_CONNECT's message names every path tried.
 * A daemon that does not speak this protocol gives WEIGHTD_E_VERSION, one
 * that refuses this user WEIGHTD_E_PERMISSION; hello waits at most 30 s.
 * On failure *out is still set when memory allowed, so that
 * weightd_last_error() can say why; close it with weightd_close().
 */
int weightd_connect(const char *socket_path, weightd_client **out);

/*
 * Closes the connection; the daemon ends its leases. NULL-safe. Sets still
 * attached through c are detached, not freed: call weightd_release on each,
 * which then only unmaps it and frees its memory. Until then a host set stays
 * readable (its mapping keeps the memory alive), but a CUDA set's memory may
 * be freed by the daemon as soon as it is unleased: do not touch it.
 */
void weightd_close(weightd_client *c);

/* The last error's detail on this handle ("" when none). NULL-safe. */
const char *weightd_last_error(const weightd_client *c);

/* The daemon's backend ("host" or "cuda") as reported by hello. */
const char *weightd_backend(const weightd_client *c);

/*
 * Sets how long a call waits for the daemon's next frame, in milliseconds;
 * each progress event starts the wait again. 0 or less waits forever (the
 * default). A call that times out returns WEIGHTD_E_TIMEOUT and the handle
 * stays usable: the late reply is recognised by its id and dropped (a lease
 * it grants is released, a timed-out load is canceled).
 */
void weightd_set_timeout(weightd_client *c, int timeout_ms);

/* Progress of a load: bytes done of bytes total. */
typedef void (*weightd_progress_fn)(uint64_t bytes_done, uint64_t bytes_total, void *arg);

/*
 * Options of a load or load-and-attach. Set struct_size to sizeof the struct
 * you compiled against: fields added later are appended and read only when
 * struct_size covers them. NULL options mean all defaults.
 */
struct weightd_load_options {
  size_t struct_size;
  const char *device;          /* a UUID or an index as text; NULL: device 0 */
  const char *plan_json;       /* a plan object as JSON text; NULL: {"preset":"whole"} */
  weightd_progress_fn progress;/* called from inside weightd_load; may be NULL */
  void *progress_arg;
};

/* Opens (validates and maps) a checkpoint in the daemon. */
int weightd_open(weightd_client *c, const char *path);

/* Warms a checkpoint in the page cache; pin asks for the pinned tier; wait blocks until done. */
int weightd_prefetch(weightd_client *c, const char *path, int pin, int wait);

/*
 * Loads a checkpoint onto a device and writes the resident set's id into
 * set_id (set_id_len bytes, 32 is enough).
 */
int weightd_load(weightd_client *c, const char *path, const struct weightd_load_options *opts,
                 char *set_id, size_t set_id_len);

/*
 * Attaches a resident set by id: takes a lease and maps its memory (host: the
 * sealed memfd, read-only; cuda: cuIpcOpenMemHandle on the device whose UUID
 * the daemon names, found among this process's devices whatever its
 * CUDA_VISIBLE_DEVICES; the CUDA driver is loaded on first use, so the library
 * runs on machines without one). Every attach of the same set in this process,
 * through any handle, shares one mapping, so weightd_set_base is the same for
 * all of them. A set that cannot be mapped gives its lease back at once.
 */
int weightd_attach(weightd_client *c, const char *set_id, weightd_set **out);

/* Loads if needed, then attaches: one call for an engine starting up. */
int weightd_attach_path(weightd_client *c, const char *path,
                        const struct weightd_load_options *opts, weightd_set **out);

/*
 * Releases the lease and unmaps the set (once no other attach in this process
 * uses it), then frees s, also when the daemon's answer is an error (which is
 * returned). A set whose handle was closed or whose connection died only
 * unmaps. NULL-safe.
 */
int weightd_release(weightd_set *s);

/* Evicts a set that no one leases. */
int weightd_evict(weightd_client *c, const char *set_id);

/*
 * Sends one request (a JSON object without "id"; one is added) and returns the
 * final reply as JSON text in *reply (free it with weightd_free), also when
 * the reply is an error; the return value is 0 or the reply's error code
 * (*reply is NULL when no reply came). Progress events are passed to progress
 * when given. Descriptors that come with a reply are closed: use
 * weightd_attach to map a set.
 */
int weightd_request(weightd_client *c, const char *request_json, char **reply,
                    weightd_progress_fn progress, void *progress_arg);

/* Frees memory returned by this library. */
void weightd_free(void *p);

/* ---- attached sets --------------------------------------------------------- */

enum weightd_memory_kind {
  WEIGHTD_MEMORY_HOST = 1, /* pointers are readable host addresses */
  WEIGHTD_MEMORY_CUDA = 2, /* pointers are CUDA device addresses */
};

typedef struct weightd_tensor {
  const char *name;
  const char *dtype;     /* safetensors dtype name: "BF16", "F8_E4M3", ... */
  int ndim;
  const int64_t *shape;
  uint64_t offset;       /* from the slab base */
  uint64_t nbytes;
  void *data;            /* slab base + offset (host or device address, see the kind) */
} weightd_tensor;

const char *weightd_set_id(const weightd_set *s);
const char *weightd_set_lease(const weightd_set *s);
const char *weightd_set_device(const weightd_set *s); /* the device UUID */
enum weightd_memory_kind weightd_set_memory_kind(const weightd_set *s);
void *weightd_set_base(const weightd_set *s);
uint64_t weightd_set_bytes(const weightd_set *s);
size_t weightd_set_tensor_count(const weightd_set *s);
/* The i-th tensor (in slab order); WEIGHTD_E_NOT_FOUND past the end. */
int weightd_set_tensor(const weightd_set *s, size_t i, weightd_tensor *out);
/* The tensor called name; WEIGHTD_E_NOT_FOUND when the set has none. */
int weightd_set_find(const weightd_set *s, const char *name, weightd_tensor *out);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif

#endif /* WEIGHTD_H */
