/*
 * lib_internal.h - libweightd's private structures, shared by its files.
 *
 *   libweightd.c  connections: socket search, hello, the request/reply loop
 *   lib_ops.c     the ops: open, prefetch, load, evict, attach, release
 *   lib_group.c   tensor- and expert-parallel groups (load_group)
 *   lib_set.c     attached sets: the tensor table and its accessors
 *   lib_map.c     the process-wide table of mapped slabs (one per set)
 *   cuda_import.c the CUDA driver, loaded on demand
 */
#ifndef WD_LIB_INTERNAL_H
#define WD_LIB_INTERNAL_H

#include <cjson/cJSON.h>
#include <stdint.h>
#include <sys/types.h>

#include "cuda_import.h"
#include "error.h"
#include "json_strict.h"
#include "progress_page.h"
#include "tensor_table.h"
#include "weightd.h"
#include "wire.h"

struct weightd_client {
  int sock;           /* -1 once closed or never connected */
  pid_t pid;          /* the process that connected: a forked child must not use it */
  int timeout_ms;     /* per frame; -1 waits forever */
  int64_t next_id;    /* the next request id */
  int broken;         /* the stream is out of step or closed: nothing more is sent */
  int shutdown_seen;  /* the daemon announced that it is stopping */
  int reconnecting;   /* lib_usable is reconnecting: the hello and reclaims it sends do not reconnect again */
  char backend[16];   /* from hello */
  char *socket_path;  /* the path connected to */
  char *socket_dir;   /* its private directory (sockpath.h), checked at every reconnect too; NULL when none */
  char client_name[64]; /* sent in hello */
  char daemon_version[32];
  unsigned daemon_features; /* the attach features hello's reply listed (WD_FEATURE_BIT) */
  struct wd_error err;   /* the last error's detail */
  struct weightd_set *sets; /* sets attached through this handle, a list */
};

/*
 * A mapped slab, shared by every attach of the same set in this process. Its
 * identity is the set id plus what names the allocation: the memfd's
 * st_dev/st_ino (fd), the IPC handle's bytes (cuda_ipc) or the daemon's
 * allocation id (cuda_vmm).
 */
struct lib_mapping {
  struct lib_mapping *next;
  char *set_id;
  enum wd_handle_kind handle;
  dev_t dev; /* fd: the memfd's identity */
  ino_t ino;
  unsigned char ipc[WD_IPC_HANDLE_BYTES];        /* cuda_ipc: the handle */
  unsigned char alloc_id[WD_ALLOC_ID_BYTES];     /* cuda_vmm: the allocation's id */
  int fd;                                        /* cuda_vmm: the descriptor, kept until unmapped; else -1 */
  struct cuimp_vmm vmm;                          /* cuda_vmm: the mapping */
  struct cuimp_device cudev;                     /* cuda: the device it is open on */
  int read_only;                                 /* this process cannot write through base */
  void *base;
  uint64_t bytes;
  int refs;
};

/*
 * A mapped binary tensor table, shared by every attach in this process that
 * received the same memfd (the daemon builds one per set), validated once.
 */
struct lib_table {
  struct lib_table *next;
  dev_t dev;
  ino_t ino;
  void *base;
  size_t len;
  struct ttab t;
  int refs;
};

struct weightd_set {
  weightd_client *client; /* NULL once weightd_close detached it */
  struct weightd_set *prev, *next;
  pid_t pid;              /* the process that attached it */
  char *id, *lease, *device;
  enum weightd_memory_kind kind;
  enum wd_handle_kind handle;
  uint64_t bytes;
  struct lib_mapping *map;
  struct lib_table *table;         /* the binary table; NULL: the JSON table below */
  const struct wd_progress_page *page; /* an early attach's progress page; NULL: the set was ready */
  pid_t daemon_pid;                /* with a page: the daemon that writes it (SO_PEERCRED); 0 unknown */
  int daemon_pidfd;                /* with a page: a pidfd of daemon_pid, or -1 (kill(pid, 0) is asked) */
  size_t ntensors;
  struct weightd_tensor *tensors; /* slab order, data filled in */
  size_t *by_name;                /* indexes into tensors, sorted by name */
  char *strings;                  /* names and dtypes, one allocation */
  int64_t *shapes;                /* every tensor's dimensions, one allocation */
};

/* ---- libweightd.c: connections and requests ------------------------------- */

/* Sets the handle's last error and returns code. */
int lib_fail(weightd_client *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Fails with WEIGHTD_E_INVALID when c is NULL, closed, broken or from another process. */
int lib_usable(weightd_client *c);

/*
 * Sends req (an object; its "id" is set here; ownership stays with the caller)
 * and waits for the final reply. On 0, *reply is the parsed reply (the caller
 * deletes it) and, when frame is not NULL, *frame holds its descriptors (the
 * caller clears it). On a daemon error the code is the wire code's and the
 * handle's last error holds the daemon's message; when text is not NULL it
 * receives the reply's raw JSON in both cases.
 */
int lib_call(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *progress_arg,
             cJSON **reply, struct wire_frame *frame, char **text);

/*
 * lib_call with the final successful reply as a json_strict tree in *doc
 * (free it with sj_doc_free), not cJSON: for replies whose size makes cJSON's
 * parse a cost (attach: the tensor table).
 */
int lib_call_doc(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *progress_arg,
                 struct sj_doc *doc, struct wire_frame *frame);

/* A new request object {"op": op}, or NULL when memory ran out. */
cJSON *lib_request_new(const char *op);

/* Adds "path" to req, made absolute against the current directory. */
int lib_add_path(weightd_client *c, cJSON *req, const char *path);

/* Reads a non-negative exact integer member (below 2^53); 0 or WEIGHTD_E_PROTOCOL. */
int lib_get_u64(weightd_client *c, const cJSON *o, const char *key, uint64_t *out);

/* A string member or NULL. */
const char *lib_get_str(const cJSON *o, const char *key);

/* The same for json_strict trees: a member (NULL when o is no object or has none), */
const struct sj_node *lib_sj_get(const struct sj_node *o, const char *key);
/* a string member without NULs inside (NUL-terminated) or NULL, */
const char *lib_sj_str(const struct sj_node *o, const char *key);
/* an exact non-negative integer member (up to 2^64 - 1); 0 or WEIGHTD_E_PROTOCOL. */
int lib_sj_u64(weightd_client *c, const struct sj_node *o, const char *key, uint64_t *out);

/* ---- lib_set.c: sets ---------------------------------------------------------- */

/*
 * Builds a set from an attach reply and its frame's descriptors: maps the
 * slab (or reuses this process's mapping) and reads the tensor table.
 */
int lib_set_from_reply(weightd_client *c, const struct sj_node *reply, struct wire_frame *frame,
                       weightd_set **out);

/* Frees a set's memory (not its mapping). NULL-safe. */
void lib_set_free(weightd_set *s);

/* ---- lib_map.c: the process-wide mapping table ------------------------------- */

/*
 * Maps a host slab received as fd (which this call always closes), or takes
 * another reference on this process's mapping of the same set and memfd.
 */
int lib_map_host(const char *set_id, int fd, uint64_t bytes, struct lib_mapping **out,
                 struct wd_error *err);

/* Opens a CUDA IPC handle on the device with that UUID, or takes another reference. */
int lib_map_cuda(const char *set_id, const char *device_uuid,
                 const unsigned char handle[WD_IPC_HANDLE_BYTES], uint64_t bytes,
                 struct lib_mapping **out, struct wd_error *err);

/*
 * Imports and maps a VMM allocation received as fd (bytes: the whole
 * allocation) on the device with that UUID, or takes another reference on
 * this process's mapping of the same allocation (then fd is closed). The
 * descriptor is kept while mapped and closed by the last lib_map_put; on
 * failure it is closed here.
 */
int lib_map_vmm(const char *set_id, const char *device_uuid, int fd, uint64_t bytes,
                const unsigned char alloc_id[WD_ALLOC_ID_BYTES], struct lib_mapping **out, struct wd_error *err);

/*
 * Maps a binary tensor table received as fd (which this call always closes)
 * read-only and validates it, or takes another reference on this process's
 * mapping of the same memfd. WEIGHTD_E_BAD_TABLE for a table that is not
 * valid, WEIGHTD_E_PROTOCOL for a descriptor that is not a sealed memfd of
 * `bytes`.
 */
int lib_map_table(int fd, uint64_t bytes, struct lib_table **out, struct wd_error *err);
/* Drops a reference; the last one unmaps. NULL-safe. */
void lib_table_put(struct lib_table *t);

/*
 * Drops a reference; the last one unmaps (host, cuda_vmm) or closes the
 * handle (cuda_ipc). in_child says the caller is a forked child of the process
 * that mapped it: the CUDA driver is then left alone (its mappings are not
 * inherited), and only the child's copy of a descriptor is closed.
 */
int lib_map_put(struct lib_mapping *m, int in_child, struct wd_error *err);

#endif
