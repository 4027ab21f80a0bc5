/* config.c - the configuration table and its readers (see config.h). */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "json_strict.h"
#include "optab.h"
#include "pathutil.h"
#include "sockpath.h"
#include "suggest.h"

enum cfg_type { CFG_STRING, CFG_UINT, CFG_BYTES, CFG_MODE, CFG_ENUM, CFG_PATH_LIST, CFG_ID_LIST };

struct cfg_key {
  const char *name;
  enum cfg_type type;
  size_t offset;     /* of the value in struct wd_config */
  size_t count_off;  /* lists: of the count */
  uint64_t min, max; /* numbers */
  const char *def;   /* default, as text */
  const char *help;
  const char *const *choices; /* CFG_ENUM: the names, in the enum's order, NULL-terminated */
  bool reload;                /* a running daemon applies a new value at SIGHUP */
};

/* Enumerated keys are stored as int through the table's offset. */
_Static_assert(sizeof(enum cfg_backend) == sizeof(int) && sizeof(enum log_level) == sizeof(int) &&
                   sizeof(enum cfg_load_method) == sizeof(int) && sizeof(enum cfg_cuda_handles) == sizeof(int) &&
                   sizeof(enum cfg_strided) == sizeof(int) && sizeof(enum cfg_pin) == sizeof(int) &&
                   sizeof(enum cfg_switch) == sizeof(int) && sizeof(enum cfg_fd_store) == sizeof(int) &&
                   sizeof(enum cfg_writes) == sizeof(int) && sizeof(enum cfg_source) == sizeof(int) &&
                   sizeof(enum cfg_onoff) == sizeof(int) && sizeof(enum cfg_verify) == sizeof(int),
               "enumerated config keys are stored as int");

static const char *const backend_names[] = {"auto", "cuda", "host", NULL};
static const char *const log_level_names[] = {"error", "warn", "info", "debug", NULL};
static const char *const load_method_names[] = {"auto", "staged", NULL};
static const char *const cuda_handles_names[] = {"vmm", "legacy", NULL};
static const char *const strided_names[] = {"gather", "rows", "auto", NULL};
static const char *const pin_names[] = {"after_load", "on_open", "off", NULL};
static const char *const writes_names[] = {"auto", "cached", "streaming", "write_combined", NULL};
_Static_assert(sizeof writes_names / sizeof writes_names[0] == CFG_WRITES_COUNT + 1, "a name per staging_writes choice");
static const char *const switch_names[] = {"auto", "off", NULL};
static const char *const fd_store_names[] = {"auto", "on", "off", NULL};
static const char *const source_names[] = {"auto", "mmap", "direct", NULL};
static const char *const onoff_names[] = {"off", "on", NULL};
static const char *const verify_names[] = {"off", "on_load", NULL};

#define OFF(f) offsetof(struct wd_config, f)
#define GiB (1ull << 30)
#define MiB (1ull << 20)

static const struct cfg_key keys[] = {
    {"socket", CFG_STRING, OFF(socket), 0, 0, 0, "",
     "socket path (default: " SOCKPATH_DAEMON_TEXT ")"},
    {"socket_fd_name", CFG_STRING, OFF(socket_fd_name), 0, 0, 0, "weightd.socket",
     "under socket activation, the name (LISTEN_FDNAMES) of the passed socket to serve; a single unnamed "
     "descriptor is served too"},
    {"socket_group", CFG_STRING, OFF(socket_group), 0, 0, 0, "weightd",
     "group owning the socket; members may connect (kept as is when the group does not exist)"},
    {"socket_mode", CFG_MODE, OFF(socket_mode), 0, 0, 0777, "0660", "permission bits of the socket"},
    {"model_roots", CFG_PATH_LIST, OFF(model_roots), OFF(n_model_roots), 0, 0, NULL,
     "directories checkpoints must resolve into; empty = any path the daemon can read", .reload = true},
    {"root_sources", CFG_PATH_LIST, OFF(root_sources), OFF(n_root_sources), 0, 0, NULL,
     "per directory, where loads of checkpoints under it read bytes from, as SOURCE:DIR (SOURCE as for "
     "'source'; DIR resolved at start and reload, the longest that holds a checkpoint wins); others use 'source'",
     .reload = true},
    {"remote_roots", CFG_PATH_LIST, OFF(remote_roots), OFF(n_remote_roots), 0, 0, NULL,
     "URLs checkpoints may be fetched from, each s3://BUCKET[/PREFIX] or http(s)://HOST[:PORT][/PREFIX] "
     "(a load, prefetch or attach may then name a URL within one); read at start"},
    {"remote_ca_file", CFG_STRING, OFF(remote_ca_file), 0, 0, 0, "",
     "PEM file of the certificate authorities that https remote servers are verified with; empty = the system's"},
    {"remote_bearer_token_files", CFG_PATH_LIST, OFF(remote_bearer_token_files), OFF(n_remote_bearer_token_files), 0,
     0, NULL,
     "entries ROOT=FILE: requests to the http(s) remote root ROOT carry 'Authorization: Bearer' with the token "
     "FILE holds (one line; read at start)"},
    {"allowed_uids", CFG_ID_LIST, OFF(allowed_uids), OFF(n_allowed_uids), 0, UINT32_MAX, NULL,
     "peer uids allowed besides root and the daemon's uid; with allowed_gids both empty, "
     "anyone who can open the socket", .reload = true},
    {"allowed_gids", CFG_ID_LIST, OFF(allowed_gids), OFF(n_allowed_gids), 0, UINT32_MAX, NULL,
     "peer primary gids allowed", .reload = true},
    {"admin_gids", CFG_ID_LIST, OFF(admin_gids), OFF(n_admin_gids), 0, UINT32_MAX, NULL,
     "groups (primary or supplementary) whose members may, besides root and the daemon's user, evict sets other "
     "users loaded, release their leases and cancel their requests", .reload = true},
    {"backend", CFG_ENUM, OFF(backend), 0, 0, 0, "auto", "auto | cuda | host", backend_names},
    {"device_memory_budget", CFG_BYTES, OFF(device_memory_budget), 0, 0, UINT64_MAX, "0",
     "bytes of resident sets per device before unleased sets are evicted (0 = a GPU's own memory; "
     "for the host backend, half of physical memory)", .reload = true},
    {"host_pin_budget", CFG_BYTES, OFF(host_pin_budget), 0, 0, UINT64_MAX, "0",
     "bytes of checkpoint files kept registered for direct DMA (0 = half of the memory the daemon may use: "
     "MemTotal, or its cgroup's memory limit when lower, read whenever a pin is considered)", .reload = true},
    {"pin", CFG_ENUM, OFF(pin), 0, 0, 0, "after_load",
     "after_load | on_open | off: after_load registers the byte ranges a load read, in the background once it "
     "finished, when they fit host_pin_budget, so later loads of them copy straight from the page cache; "
     "on_open also registers a whole checkpoint that fits as soon as it is opened",
     pin_names, .reload = true},
    {"max_open_checkpoints", CFG_UINT, OFF(max_open_checkpoints), 0, 1, 1000000, "4096",
     "checkpoints open at once (validated and mapped), all users together; an open past it first closes idle "
     "ones (no resident set, load, prefetch or pin), least recently used first, else is answered LIMIT",
     .reload = true},
    {"max_open_checkpoints_per_uid", CFG_UINT, OFF(max_open_checkpoints_per_uid), 0, 1, 1000000, "1024",
     "checkpoints open for one uid (a checkpoint several uids opened counts for each); past it that uid's idle "
     "ones are closed, least recently used first, else its open is answered LIMIT",
     .reload = true},
    {"checkpoint_memory", CFG_BYTES, OFF(checkpoint_memory), 0, 64 * 1024, UINT64_MAX, "1GiB",
     "memory open checkpoints may hold, all together: their parsed headers and tensor tables and their "
     "mappings' kernel structures (not the file bytes, which are page cache); past it idle ones are closed, "
     "least recently used first, else the open is answered LIMIT",
     .reload = true},
    {"checkpoint_memory_per_uid", CFG_BYTES, OFF(checkpoint_memory_per_uid), 0, 64 * 1024, UINT64_MAX, "256MiB",
     "checkpoint_memory of the checkpoints open for one uid (each counts for every uid that opened it)",
     .reload = true},
    {"checkpoint_idle_ms", CFG_UINT, OFF(checkpoint_idle_ms), 0, 0, 2592000000ull, "600000",
     "an open checkpoint nothing uses (no resident set, load, prefetch or pin) is closed after this long "
     "unused (0: never); the next request for it opens it again, reading its headers",
     .reload = true},
    {"fill_threads", CFG_UINT, OFF(fill_threads), 0, 0, 1024, "0",
     "threads copying from the page cache (0 = one per online CPU)"},
    {"job_threads", CFG_UINT, OFF(job_threads), 0, 1, 256, "4",
     "loads, prefetches and frees that run at once (with several devices, at least one per device and two "
     "more, so that a whole tensor-parallel group loads at once)"},
    {"control_threads", CFG_UINT, OFF(control_threads), 0, 1, 64, "2",
     "threads for quick work (opening and checking checkpoints, plans, status), apart from loads"},
    {"staging_slots", CFG_UINT, OFF(staging_slots), 0, 2, 64, "4",
     "pinned staging slots per GPU (the defaults, 4 x 16 MiB, were among the fastest measured on an H200 host: "
     "slots that stay in the CPU's last-level cache between the fill and the copy; docs/benchmarks.md)"},
    {"staging_slot_bytes", CFG_BYTES, OFF(staging_slot_bytes), 0, 1 * MiB, 4 * GiB, "16MiB",
     "bytes per staging slot: the staging pipeline's window"},
    {"frame_timeout_ms", CFG_UINT, OFF(frame_timeout_ms), 0, 100, 3600000, "10000",
     "a request frame must arrive whole within this time; a whole frame that gets no request memory "
     "within it is answered LIMIT",
     .reload = true},
    {"max_connections", CFG_UINT, OFF(max_connections), 0, 1, 1000000, "1024",
     "connections served at once; more are refused", .reload = true},
    {"max_queued_output", CFG_BYTES, OFF(max_queued_output), 0, 1 * MiB, 16 * GiB, "64MiB",
     "reply bytes queued for a client that does not read; past half of it the client's requests are not "
     "read and its progress events are dropped, a reply that would pass it is answered LIMIT, and a LIMIT "
     "answer that would pass twice it closes the connection", .reload = true},
    {"max_total_queued_output", CFG_BYTES, OFF(max_total_queued_output), 0, 1 * MiB, 1024 * GiB, "1GiB",
     "reply bytes queued for clients that do not read, all connections together; a reply that would pass it "
     "closes the connections holding the most unread bytes first (only those holding more than its own); past "
     "half of it, a connection whose replies wait unsent is not read", .reload = true},
    {"max_uid_queued_output", CFG_BYTES, OFF(max_uid_queued_output), 0, 0, 1024 * GiB, "0",
     "reply bytes queued for the connections of one uid together (0: a quarter of max_total_queued_output; "
     "root and the daemon's uid are exempt): past half of it its connections whose replies wait unsent are "
     "not read, a reply that would pass it is answered LIMIT", .reload = true},
    {"max_queued_fds", CFG_UINT, OFF(max_queued_fds), 0, 1, 65536, "64",
     "file descriptors queued in one connection's unread replies; an attach past it is answered LIMIT", .reload = true},
    {"max_request_bytes", CFG_BYTES, OFF(max_request_bytes), 0, 4096, 16 * MiB, "4MiB",
     "the largest request frame; a longer one is refused from its length prefix, before it is read", .reload = true},
    {"request_memory", CFG_BYTES, OFF(request_memory), 0, 16 * MiB, 64 * GiB, "1GiB",
     "memory for requests read and not finished, all connections together (charged as 64 bytes per "
     "request byte, what parsing the densest JSON can take); one connection may use a quarter; a "
     "request that does not fit waits unparsed until memory frees, at most frame_timeout_ms, then is "
     "answered LIMIT; requests that wait for a load or a prefetch hold none",
     .reload = true},
    {"idle_timeout_ms", CFG_UINT, OFF(idle_timeout_ms), 0, 0, 86400000, "300000",
     "a connection that holds no lease and has nothing in progress is closed after this long (0: never)", .reload = true},
    {"reserved_connections", CFG_UINT, OFF(reserved_connections), 0, 0, 1000, "16",
     "connections beyond max_connections that only root and the daemon's uid may use", .reload = true},
    {"metrics_address", CFG_STRING, OFF(metrics_address), 0, 0, 0, "127.0.0.1:9477",
     "HOST:PORT serving GET /metrics (Prometheus), /healthz and /readyz; [v6]:PORT for IPv6; \"\" turns "
     "them off", .reload = true},
    {"metrics_connections", CFG_UINT, OFF(metrics_connections), 0, 1, 4096, "64",
     "HTTP connections served at once (32 at most from one address); past either limit the ones waiting "
     "longest for a whole request are closed first, never one on its first answer", .reload = true},
    {"metrics_request_timeout_ms", CFG_UINT, OFF(metrics_request_timeout_ms), 0, 1000, 600000, "10000",
     "an HTTP request must arrive and be answered within this time, counted from its connection's accept "
     "or its previous answer; the connection is closed otherwise", .reload = true},
    {"log_level", CFG_ENUM, OFF(log_level), 0, 0, 0, "info", "error | warn | info | debug", log_level_names,
     .reload = true},
    {"log_file", CFG_STRING, OFF(log_file), 0, 0, 0, "",
     "append the log to this file (reopened at SIGHUP, for rotation) instead of syslog when detached; "
     "under journald the journal wins", .reload = true},
    {"syslog_socket", CFG_STRING, OFF(syslog_socket), 0, 0, 0, "/dev/log",
     "the syslog daemon's socket, where a detached daemon logs without journald or log_file; when it cannot be "
     "reached at start (or is \"\"), lines go to stderr, which the daemon then keeps", .reload = true},
    {"source", CFG_ENUM, OFF(source), 0, 0, 0, "auto",
     "where loads read checkpoint bytes from (a load's 'source' option wins): mmap (the page cache), direct "
     "(O_DIRECT reads, no page-cache use; mmap where the filesystem refuses O_DIRECT), or auto: mmap, unless "
     "the plan's bytes exceed auto_direct_bytes, then warm ranges from the page cache and the rest with "
     "O_DIRECT",
     source_names, .reload = true},
    {"auto_direct_bytes", CFG_BYTES, OFF(auto_direct_bytes), 0, 0, UINT64_MAX, "0",
     "source auto: a plan of more payload bytes than this is read with O_DIRECT (warm ranges from the page "
     "cache); 0 (the default): more than half of the host memory the daemon may use (MemTotal or its cgroup's "
     "limit, read at each load)"},
    {"verify", CFG_ENUM, OFF(verify), 0, 0, 0, "off",
     "off | on_load: with on_load, a load of a checkpoint that has a manifest (weightd.manifest.json beside its "
     "index, written by `weightctl manifest`) checks every 4 MiB chunk of the files it reads against the "
     "manifest before its set is ready, and fails with BAD_CHECKSUM naming the file and the bytes that differ; "
     "a manifest that does not describe the files fails every open of the checkpoint, whatever this setting; "
     "a remote checkpoint with a manifest is checked as it is fetched, whatever this setting (read at start)",
     verify_names},
    {"scrub", CFG_ENUM, OFF(scrub), 0, 0, 0, "off",
     "on: every load records a tensor digest (XXH3-128, a tree of 256 KiB leaves past one leaf) of each "
     "tensor of its set as loaded (whole tensors also checked against the manifest), which weightctl scrub "
     "and the background scrub compare the resident bytes with; "
     "off (the default, until its cost on a GPU load is measured): no digests, and scrubs answer UNSUPPORTED "
     "(read at start)", onoff_names},
    {"scrub_duty", CFG_UINT, OFF(scrub_duty), 0, 0, 100, "1",
     "percent of its time the scrub thread spends hashing resident sets in the background, one set at a time "
     "in turn, against the digests recorded when each was loaded (it sleeps in proportion to each batch it "
     "hashed); a tensor that differs marks its set corrupt (log, status, metric, an event to its holders; new "
     "leases refused with BAD_CHECKSUM). 0: no background scrubs (weightctl scrub still works); with scrub off "
     "nothing is scrubbed; read at start"},
    {"scrub_interval_ms", CFG_UINT, OFF(scrub_interval_ms), 0, 1, 86400000, "60000",
     "the pause between the end of one set's background scrub and the start of the next one's; read at start"},
    {"scrub_reload", CFG_ENUM, OFF(scrub_reload), 0, 0, 0, "on",
     "on (the default): a set a scrub finds corrupt is taken off the daemon's list at once and loaded again "
     "from its checkpoint (the same plan and device) under a new set id, so the next load or attach by path "
     "gets good bytes; its holders keep the old memory until they release it, and are told (event, and the "
     "corrupt flag on its progress page). off: the corrupt set stays listed, refusing new leases, until it "
     "is evicted", onoff_names, .reload = true},
    {"load_method", CFG_ENUM, OFF(load_method), 0, 0, 0, "auto",
     "auto | staged: staged sends every load through the pinned staging slots, also on the host "
     "backend and for pinned checkpoints (for tests and comparisons)",
     load_method_names},
    /*
     * Not reloadable: a set's handle kind is fixed when its memory is
     * allocated (legacy IPC handles cannot be made from VMM memory), so a
     * change would leave resident sets of the old kind beside new ones.
     */
    {"cuda_handles", CFG_ENUM, OFF(cuda_handles), 0, 0, 0, "vmm",
     "vmm | legacy: how the cuda backend allocates and shares sets. vmm: CUDA VMM memory whose handle is a file "
     "descriptor (libweightd maps it read-only, any number of times, but any importer may map it read-write: "
     "every client that can attach a set is trusted with write access to it); legacy: cudaMalloc memory shared with "
     "cudaIpcMemHandle, for clients that open only those (they get UNSUPPORTED for a vmm set). A GPU or driver "
     "without VMM descriptor export gets legacy, with a warning",
     cuda_handles_names},
    {"staged_strided", CFG_ENUM, OFF(staged_strided), 0, 0, 0, "auto",
     "gather | rows | auto: how staged loads stage strided pieces (column slices): gather their rows on the CPU, "
     "or copy whole source rows and let the GPU's copy engine take each row's part (auto: rows only for short "
     "rows, by a provisional rule; docs/benchmarks.md)",
     strided_names},
    {"staging_writes", CFG_ENUM, OFF(staging_writes), 0, 0, 0, "auto",
     "auto | cached | streaming | write_combined: how fill threads write the pinned staging slots: plain "
     "stores, non-temporal stores (x86-64; plain elsewhere), or plain stores into write-combined slots that "
     "the GPU reads without snooping the CPU's caches (auto: cached; docs/benchmarks.md)",
     writes_names},
    /* Several devices (docs/multi-gpu.md): read at start. */
    {"replicas", CFG_ENUM, OFF(replicas), 0, 0, 0, "auto",
     "auto | off: a set already resident on another device with peer access to the target (NVLink) is copied "
     "device to device instead of from host memory; falls back to host memory when the peer is busy or absent",
     switch_names},
    {"striping", CFG_ENUM, OFF(striping), 0, 0, 0, "off",
     "off | auto: a load onto one GPU borrows idle neighbours' host links (a share of the bytes through a bounce "
     "buffer on the neighbour, forwarded over the peer link); off until a multi-GPU run of weightd-bench measures it",
     switch_names},
    {"link_rates", CFG_STRING, OFF(link_rates), 0, 0, 0, "",
     "host-to-device GiB/s of each device's link, comma-separated in device order (weightd-bench --multi all "
     "prints them); striping shares bytes in proportion. Empty: all equal, shown as unmeasured"},
    {"stripe_min_bytes", CFG_BYTES, OFF(stripe_min_bytes), 0, 0, UINT64_MAX, "512MiB",
     "loads smaller than this are never striped"},
    {"numa", CFG_ENUM, OFF(numa), 0, 0, 0, "auto",
     "auto | off: on a machine with several NUMA nodes, fill threads are spread over the nodes and feed the "
     "devices of their own node first, and staging memory is allocated near its device",
     switch_names},
    {"host_devices", CFG_UINT, OFF(host_devices), 0, 1, 64, "1",
     "host backend: how many devices it presents (each its own memfd slabs in host memory, sharing it); for "
     "tests of multi-device placement"},
    {"host_peers", CFG_STRING, OFF(host_peers), 0, 0, 0, "all",
     "host backend: which device pairs have peer access (a peer copy is a memcpy): all, none, or pairs such as "
     "0-1,2-3"},
    /* Not reloadable: what was stored, and whether sets were re-adopted, is decided at start. */
    {"fd_store", CFG_ENUM, OFF(fd_store), 0, 0, 0, "auto",
     "auto | on | off: keep resident VMM sets (host: memfd sets) and their leases in the service manager's file "
     "descriptor store, so that a restarted daemon re-adopts them without loading (docs/operations.md, "
     "\"Restarts\"). auto: on when NOTIFY_SOCKET is set and the manager announces a store ($FDSTORE, systemd 254+) "
     "or passed a set description at start; on: whenever NOTIFY_SOCKET is set (systemd 252 announces nothing: "
     "set on there, with FileDescriptorStoreMax= in the unit); off: never", fd_store_names},
    {"fd_store_max", CFG_UINT, OFF(fd_store_max), 0, 0, 65536, "0",
     "descriptors the service manager's fd store holds (FileDescriptorStoreMax= in the unit): sets that would "
     "pass it are not stored (logged) and the description and every set stored keep working; 0 = what the "
     "manager announces ($FDSTORE, systemd 254+), else 512 (the shipped unit's)"},
    {"restart_grace_ms", CFG_UINT, OFF(restart_grace_ms), 0, 0, 86400000, "30000",
     "after a restart, how long a re-adopted lease waits for its holder (same uid and pid) to reclaim it before "
     "it ends (read at start)"},
    {"test_load_gate", CFG_STRING, OFF(test_load_gate), 0, 0, 0, "",
     "for tests only: a FIFO from which loads read one byte before each window they fill (memcpy loads: each "
     "256 MiB window; staged loads: each staging window, once every window before it has landed; end of file lets "
     "every window through), so that a test holds a load midway; \"\" (the default): none"},
    {"test_refuse_odirect", CFG_ENUM, OFF(test_refuse_odirect), 0, 0, 0, "off",
     "for tests only: on makes every O_DIRECT open fail as on a filesystem that refuses O_DIRECT (loads then "
     "fall back to mmap, and say so); off (the default): no effect", onoff_names},
    {"test_writable_slabs", CFG_ENUM, OFF(test_writable_slabs), 0, 0, 0, "off",
     "for tests only: on leaves host-backend sets unsealed, so that a client can map one read-write and change "
     "its bytes as a legacy cuda_ipc importer can on a GPU (the scrub's tests); off (the default): sets are "
     "sealed read-only", onoff_names},
};

#define NKEYS (sizeof keys / sizeof keys[0])

static const struct cfg_key *find_key(const char *name) {
  for (size_t i = 0; i < NKEYS; i++)
    if (strcmp(keys[i].name, name) == 0) return &keys[i];
  return NULL;
}

/* Parses "123", "64MiB", "2GiB", "1.5GB", "512K": bytes, exact for integers. */
static int parse_bytes(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || v < 0 || !isfinite(v)) return -1;
  while (*end == ' ') end++;
  static const struct {
    const char *suffix;
    double mult;
  } units[] = {{"", 1},           {"B", 1},
               {"K", 1024.0},     {"KiB", 1024.0},
               {"KB", 1e3},       {"M", 1048576.0},
               {"MiB", 1048576.0},{"MB", 1e6},
               {"G", 1073741824.0},{"GiB", 1073741824.0},
               {"GB", 1e9},       {"T", 1099511627776.0},
               {"TiB", 1099511627776.0}, {"TB", 1e12}};
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
    if (strcmp(end, units[i].suffix) != 0) continue;
    double b = v * units[i].mult;
    if (b >= 18446744073709551615.0) return -1;
    *out = (uint64_t)b;
    return 0;
  }
  return -1;
}

static int parse_uint(const char *s, uint64_t *out, int base) {
  if (s[0] < '0' || s[0] > '9') return -1;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, base);
  if (*end != '\0' || errno != 0) return -1;
  *out = v;
  return 0;
}

static int list_append(void **items, size_t *count, size_t elem, const void *value) {
  void *n = realloc(*items, (*count + 1) * elem);
  if (n == NULL) return -1;
  memcpy((char *)n + *count * elem, value, elem);
  *items = n;
  (*count)++;
  return 0;
}

static int set_text(struct wd_config *cfg, const struct cfg_key *k, const char *value,
                    struct wd_error *err) {
  char *base = (char *)cfg;
  uint64_t v;
  switch (k->type) {
  case CFG_STRING: {
    char *dup = strdup(value);
    if (dup == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    char **slot = (char **)(base + k->offset);
    free(*slot);
    *slot = dup;
    return 0;
  }
  case CFG_UINT:
  case CFG_BYTES:
  case CFG_MODE: {
    int bad = k->type == CFG_BYTES ? parse_bytes(value, &v)
                                   : parse_uint(value, &v, k->type == CFG_MODE ? 8 : 10);
    if (bad || v < k->min || v > k->max)
      return err_set(err, WEIGHTD_E_INVALID, "config '%s': '%s' is not %s between %llu and %llu",
                     k->name, value, k->type == CFG_BYTES ? "a size" : "an integer",
                     (unsigned long long)k->min, (unsigned long long)k->max);
    *(uint64_t *)(base + k->offset) = v;
    return 0;
  }
  case CFG_ENUM:
    for (int i = 0; k->choices[i] != NULL; i++)
      if (strcmp(k->choices[i], value) == 0) {
        *(int *)(base + k->offset) = i;
        return 0;
      }
    {
      char list[128] = "";
      for (int i = 0; k->choices[i] != NULL; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", k->choices[i]);
      return err_set(err, WEIGHTD_E_INVALID, "config '%s': '%s' is not one of %s", k->name, value, list);
    }
  case CFG_PATH_LIST: {
    char *dup = strdup(value);
    if (dup == NULL ||
        list_append((void **)(base + k->offset), (size_t *)(base + k->count_off), sizeof dup, &dup)) {
      free(dup);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
    return 0;
  }
  case CFG_ID_LIST:
    if (parse_uint(value, &v, 10) != 0 || v > k->max)
      return err_set(err, WEIGHTD_E_INVALID, "config '%s': '%s' is not a numeric id", k->name, value);
    if (list_append((void **)(base + k->offset), (size_t *)(base + k->count_off), sizeof v, &v))
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    return 0;
  }
  return err_set(err, WEIGHTD_E_INTERNAL, "config: bad key type");
}

/* "unknown key 'x'", with the closest key when one is close. */
static int unknown_key(const char *key, struct wd_error *err) {
  const char *names[NKEYS];
  for (size_t i = 0; i < NKEYS; i++) names[i] = keys[i].name;
  const char *best = suggest_closest(key, names, NKEYS);
  if (best != NULL) return err_set(err, WEIGHTD_E_INVALID, "config: unknown key '%s'; did you mean '%s'?", key, best);
  return err_set(err, WEIGHTD_E_INVALID, "config: unknown key '%s' (weightd --help lists the keys)", key);
}

int config_set(struct wd_config *cfg, const char *key, const char *value, struct wd_error *err) {
  const struct cfg_key *k = find_key(key);
  if (k == NULL) return unknown_key(key, err);
  return set_text(cfg, k, value, err);
}

int config_add_model_root(struct wd_config *cfg, const char *dir, struct wd_error *err) {
  return config_set(cfg, "model_roots", dir, err);
}

int config_defaults(struct wd_config *cfg, struct wd_error *err) {
  memset(cfg, 0, sizeof *cfg);
  for (size_t i = 0; i < NKEYS; i++) {
    if (keys[i].def == NULL) continue;
    int rc = set_text(cfg, &keys[i], keys[i].def, err);
    if (rc != 0) return rc;
  }
  return 0;
}

/* ---- the config file ------------------------------------------------------------------ */

/* Where a byte offset of the file is, as line and column (both from 1; columns count bytes). */
static void position(const char *text, size_t off, size_t *line, size_t *col) {
  *line = 1;
  *col = 1;
  for (size_t i = 0; i < off && text[i] != '\0'; i++) {
    if (text[i] == '\n') {
      (*line)++;
      *col = 1;
    } else {
      (*col)++;
    }
  }
}

/* The offset of a member's key, found back from its value: the opening quote before ':'. */
static size_t key_offset(const char *text, size_t value_off) {
  size_t i = value_off;
  while (i > 0 && (text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n' || text[i - 1] == '\r')) i--;
  if (i > 0 && text[i - 1] == ':') i--;
  while (i > 0 && (text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n' || text[i - 1] == '\r')) i--;
  if (i == 0 || text[i - 1] != '"') return value_off;
  i--; /* the closing quote */
  while (i > 0) {
    i--;
    if (text[i] == '"' && (i == 0 || text[i - 1] != '\\')) return i;
  }
  return value_off;
}

/* Fills err with "FILE:LINE:COLUMN: message" for the byte at off. */
static int fail_at(struct wd_error *err, const char *path, const char *text, size_t off, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static int fail_at(struct wd_error *err, const char *path, const char *text, size_t off, const char *fmt, ...) {
  char msg[WD_ERROR_MSG_MAX / 2];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  size_t line, col;
  position(text, off, &line, &col);
  return err_set(err, WEIGHTD_E_INVALID, "%s:%zu:%zu: %s", path, line, col, msg);
}

/* What a key's values must be, for messages: "a number", "a size such as \"64MiB\" or a number of bytes". */
static const char *expected(const struct cfg_key *k) {
  switch (k->type) {
  case CFG_STRING: return "a string";
  case CFG_UINT: return "a number";
  case CFG_BYTES: return "a number of bytes or a size such as \"64MiB\"";
  case CFG_MODE: return "a string of octal digits such as \"0660\"";
  case CFG_ENUM: return "a string";
  case CFG_PATH_LIST: return "a list of paths (strings)";
  case CFG_ID_LIST: return "a list of numeric ids";
  }
  return "?";
}

/* The text of a JSON scalar as set_text takes it, when the key's type accepts the node's type; NULL otherwise. */
static const char *scalar_text(const struct cfg_key *k, const struct sj_node *n, char *buf, size_t len) {
  bool number_ok = k->type == CFG_UINT || k->type == CFG_BYTES || k->type == CFG_ID_LIST;
  bool string_ok = k->type == CFG_STRING || k->type == CFG_BYTES || k->type == CFG_MODE || k->type == CFG_ENUM ||
                   k->type == CFG_PATH_LIST;
  if (n->type == SJ_STRING && string_ok) {
    if (memchr(n->str, '\0', n->len) != NULL || n->len >= len) return NULL;
    memcpy(buf, n->str, n->len);
    buf[n->len] = '\0';
    return buf;
  }
  if (n->type == SJ_NUMBER && number_ok) {
    if (n->len >= len) return NULL;
    memcpy(buf, n->str, n->len);
    buf[n->len] = '\0';
    return buf;
  }
  return NULL;
}

/* Applies one member (key k, value n) of the file; errors name the file, line and column. */
static int set_member(struct wd_config *cfg, const struct cfg_key *k, const struct sj_node *n, const char *path,
                      const char *text, struct wd_error *err) {
  char buf[4096];
  struct wd_error e = {0};
  if (k->type == CFG_PATH_LIST || k->type == CFG_ID_LIST) {
    if (n->type != SJ_ARRAY)
      return fail_at(err, path, text, n->offset, "'%s' must be %s, not %s", k->name, expected(k),
                     sj_type_name(n->type));
    /* The file replaces the defaults (and earlier values) of a list. */
    char *base = (char *)cfg;
    size_t *count = (size_t *)(base + k->count_off);
    if (k->type == CFG_PATH_LIST) {
      char **items = *(char ***)(base + k->offset);
      for (size_t i = 0; i < *count; i++) free(items[i]);
    }
    free(*(void **)(base + k->offset));
    *(void **)(base + k->offset) = NULL;
    *count = 0;
    size_t i = 0;
    for (const struct sj_node *e2 = n->child; e2 != NULL; e2 = e2->next, i++) {
      const char *t = scalar_text(k, e2, buf, sizeof buf);
      if (t == NULL)
        return fail_at(err, path, text, e2->offset, "'%s' entry %zu must be %s, not %s", k->name, i,
                       k->type == CFG_PATH_LIST ? "a path (a string)" : "a numeric id (a number)",
                       sj_type_name(e2->type));
      if (set_text(cfg, k, t, &e) != 0) return fail_at(err, path, text, e2->offset, "%s", e.msg);
    }
    return 0;
  }
  const char *t = scalar_text(k, n, buf, sizeof buf);
  if (t == NULL) {
    if (n->type == SJ_STRING && k->type == CFG_UINT)
      return fail_at(err, path, text, n->offset, "'%s' must be a number, not a string (write %.*s without quotes)",
                     k->name, (int)(n->len < 40 ? n->len : 40), n->str);
    return fail_at(err, path, text, n->offset, "'%s' must be %s, not %s", k->name, expected(k), sj_type_name(n->type));
  }
  if (set_text(cfg, k, t, &e) != 0) return fail_at(err, path, text, n->offset, "%s", e.msg);
  return 0;
}

int config_load_file(struct wd_config *cfg, const char *path, struct wd_error *err) {
  char *text;
  size_t len;
  int r = path_read_file(path, 1u << 20, &text, &len);
  if (r != 0) return err_set(err, WEIGHTD_E_INVALID, "%s: cannot read: %s", path, strerror(-r));
  struct sj_doc doc = {0};
  char why[256];
  size_t bad = 0;
  int rc = 0;
  if (!sj_utf8_valid((const unsigned char *)text, len, &bad)) {
    rc = fail_at(err, path, text, bad, "not UTF-8");
    goto out;
  }
  int prc = sj_parse(text, len, 16, &doc, why, sizeof why);
  if (prc == -2) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", path);
    goto out;
  }
  if (prc != 0) {
    /* "at byte N: what": the position as line and column. */
    unsigned long long at = 0;
    const char *what = why;
    if (sscanf(why, "at byte %llu: ", &at) == 1 && strstr(why, ": ") != NULL) what = strstr(why, ": ") + 2;
    rc = fail_at(err, path, text, (size_t)at, "%s", what);
    goto out;
  }
  if (doc.root->type != SJ_OBJECT) {
    rc = fail_at(err, path, text, doc.root->offset, "the configuration must be a JSON object, not %s",
                 sj_type_name(doc.root->type));
    goto out;
  }
  for (const struct sj_node *n = doc.root->child; n != NULL; n = n->next) {
    char name[128];
    snprintf(name, sizeof name, "%.*s", (int)(n->key_len < sizeof name ? n->key_len : sizeof name - 1), n->key);
    size_t at = key_offset(text, n->offset);
    for (const struct sj_node *m = doc.root->child; m != n; m = m->next)
      if (m->key_len == n->key_len && memcmp(m->key, n->key, n->key_len) == 0) {
        size_t line, col;
        position(text, key_offset(text, m->offset), &line, &col);
        rc = fail_at(err, path, text, at, "'%s' is given twice (first at line %zu)", name, line);
        goto out;
      }
    const struct cfg_key *k = find_key(name);
    if (k == NULL) {
      const char *names[NKEYS];
      for (size_t i = 0; i < NKEYS; i++) names[i] = keys[i].name;
      const char *best = suggest_closest(name, names, NKEYS);
      if (best != NULL) rc = fail_at(err, path, text, at, "unknown key '%s'; did you mean '%s'?", name, best);
      else rc = fail_at(err, path, text, at, "unknown key '%s' (weightd --help lists the keys)", name);
      goto out;
    }
    if ((rc = set_member(cfg, k, n, path, text, err)) != 0) goto out;
  }
out:
  sj_doc_free(&doc);
  free(text);
  return rc;
}

const char *config_enum_name(const struct wd_config *cfg, const char *key) {
  const struct cfg_key *k = find_key(key);
  if (k == NULL || k->type != CFG_ENUM) return "?";
  int v = *(const int *)((const char *)cfg + k->offset);
  for (int i = 0; k->choices[i] != NULL; i++)
    if (i == v) return k->choices[i];
  return "?";
}

bool config_key_reloadable(const char *key) {
  const struct cfg_key *k = find_key(key);
  return k != NULL && k->reload;
}

/* True when key k holds the same value in a and b. */
static bool same_value(const struct cfg_key *k, const struct wd_config *a, const struct wd_config *b) {
  const char *pa = (const char *)a + k->offset, *pb = (const char *)b + k->offset;
  switch (k->type) {
  case CFG_STRING: return strcmp(*(char *const *)pa, *(char *const *)pb) == 0;
  case CFG_UINT:
  case CFG_BYTES:
  case CFG_MODE: return *(const uint64_t *)pa == *(const uint64_t *)pb;
  case CFG_ENUM: return *(const int *)pa == *(const int *)pb;
  case CFG_PATH_LIST:
  case CFG_ID_LIST: {
    size_t na = *(const size_t *)((const char *)a + k->count_off), nb = *(const size_t *)((const char *)b + k->count_off);
    if (na != nb) return false;
    for (size_t i = 0; i < na; i++) {
      bool eq = k->type == CFG_PATH_LIST ? strcmp((*(char *const *const *)pa)[i], (*(char *const *const *)pb)[i]) == 0
                                         : (*(const uint64_t *const *)pa)[i] == (*(const uint64_t *const *)pb)[i];
      if (!eq) return false;
    }
    return true;
  }
  }
  return false;
}

void config_compare(const struct wd_config *a, const struct wd_config *b,
                    void (*changed)(void *arg, const char *key, bool reloadable), void *arg) {
  for (size_t i = 0; i < NKEYS; i++)
    if (!same_value(&keys[i], a, b)) changed(arg, keys[i].name, keys[i].reload);
}

int config_copy_key(struct wd_config *dst, const struct wd_config *src, const char *key, struct wd_error *err) {
  const struct cfg_key *k = find_key(key);
  if (k == NULL) return err_set(err, WEIGHTD_E_INVALID, "config: unknown key '%s'", key);
  char *d = (char *)dst + k->offset;
  const char *s = (const char *)src + k->offset;
  switch (k->type) {
  case CFG_STRING: {
    char *dup = strdup(*(char *const *)s);
    if (dup == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    free(*(char **)d);
    *(char **)d = dup;
    return 0;
  }
  case CFG_UINT:
  case CFG_BYTES:
  case CFG_MODE: *(uint64_t *)d = *(const uint64_t *)s; return 0;
  case CFG_ENUM: *(int *)d = *(const int *)s; return 0;
  case CFG_PATH_LIST:
  case CFG_ID_LIST: {
    size_t n = *(const size_t *)((const char *)src + k->count_off);
    size_t *dn = (size_t *)((char *)dst + k->count_off);
    if (k->type == CFG_PATH_LIST) {
      char **items = *(char ***)d;
      for (size_t i = 0; i < *dn; i++) free(items[i]);
    }
    free(*(void **)d);
    *(void **)d = NULL;
    *dn = 0;
    for (size_t i = 0; i < n; i++) {
      int rc;
      if (k->type == CFG_PATH_LIST) {
        rc = set_text(dst, k, (*(char *const *const *)s)[i], err);
      } else {
        char buf[24];
        snprintf(buf, sizeof buf, "%" PRIu64, (*(const uint64_t *const *)s)[i]);
        rc = set_text(dst, k, buf, err);
      }
      if (rc != 0) return rc;
    }
    return 0;
  }
  }
  return err_set(err, WEIGHTD_E_INTERNAL, "config: bad key type");
}

void config_print_help(FILE *f) {
  fprintf(f, "configuration keys (JSON object; sizes accept \"64MiB\", \"2GiB\"):\n");
  for (size_t i = 0; i < NKEYS; i++)
    fprintf(f, "  %-22s default %-10s %s%s\n", keys[i].name, keys[i].def ? keys[i].def : "[]", keys[i].help,
            keys[i].reload ? " [reloadable]" : "");
}

void config_print_man(FILE *f) {
  for (size_t i = 0; i < NKEYS; i++) {
    fputs(".TP\n\\fB", f);
    optab_man_text(f, keys[i].name);
    fputs("\\fR (default \\fI", f);
    optab_man_text(f, keys[i].def ? (keys[i].def[0] ? keys[i].def : "\"\"") : "[]");
    fputs("\\fR)\n", f);
    optab_man_text(f, keys[i].help);
    fputs(keys[i].reload ? " Reloaded at SIGHUP.\n" : "\n", f);
  }
}

void config_free(struct wd_config *cfg) {
  if (cfg == NULL) return;
  for (size_t i = 0; i < NKEYS; i++) {
    char *slot = (char *)cfg + keys[i].offset;
    if (keys[i].type == CFG_STRING) free(*(char **)slot);
    if (keys[i].type == CFG_PATH_LIST) {
      char **items = *(char ***)slot;
      size_t n = *(size_t *)((char *)cfg + keys[i].count_off);
      for (size_t j = 0; j < n; j++) free(items[j]);
    }
    if (keys[i].type == CFG_PATH_LIST || keys[i].type == CFG_ID_LIST) free(*(void **)slot);
  }
  memset(cfg, 0, sizeof *cfg);
}
