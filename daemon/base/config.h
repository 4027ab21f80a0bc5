/*
 * config.h - the daemon's configuration: one table of keys (name, type,
 * bounds, default, help), read from a JSON file and overridden by flags.
 */
#ifndef WD_CONFIG_H
#define WD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "error.h"
#include "log.h"

/* Choices of the enumerated keys, parsed once when the config is read. */
enum cfg_backend { CFG_BACKEND_AUTO, CFG_BACKEND_CUDA, CFG_BACKEND_HOST };
enum cfg_load_method { CFG_LOAD_AUTO, CFG_LOAD_STAGED };
enum cfg_cuda_handles { CFG_CUDA_HANDLES_VMM, CFG_CUDA_HANDLES_LEGACY };
/* In the order of enum plan_strided (plan_stage.h). */
enum cfg_strided { CFG_STRIDED_GATHER, CFG_STRIDED_ROWS, CFG_STRIDED_AUTO };
enum cfg_pin { CFG_PIN_AFTER_LOAD, CFG_PIN_ON_OPEN, CFG_PIN_OFF };
enum cfg_writes { CFG_WRITES_AUTO, CFG_WRITES_CACHED, CFG_WRITES_STREAMING, CFG_WRITES_WRITE_COMBINED, CFG_WRITES_COUNT };
enum cfg_switch { CFG_SWITCH_AUTO, CFG_SWITCH_OFF }; /* a feature the daemon uses where it helps, or never */
enum cfg_fd_store { CFG_FD_STORE_AUTO, CFG_FD_STORE_ON, CFG_FD_STORE_OFF };
/* In the order of enum ld_source_choice (load/source.h). */
enum cfg_source { CFG_SOURCE_AUTO, CFG_SOURCE_MMAP, CFG_SOURCE_DIRECT };
enum cfg_onoff { CFG_OFF, CFG_ON };
enum cfg_verify { CFG_VERIFY_OFF, CFG_VERIFY_ON_LOAD };

struct wd_config {
  char *socket;         /* "" = the default for this uid */
  char *socket_fd_name; /* socket activation: the passed socket's name */
  char *socket_group;   /* group of the socket file */
  uint64_t socket_mode; /* permission bits of the socket file */
  char **model_roots;   /* as configured; resolved at start */
  size_t n_model_roots;
  char **root_sources;  /* "SOURCE:DIR": a model root's own source */
  size_t n_root_sources;
  char **remote_roots;  /* s3://BUCKET[/PREFIX], http(s)://HOST[:PORT][/PREFIX]: what may be fetched */
  size_t n_remote_roots;
  char *remote_ca_file; /* PEM bundle for https servers; "" = the system's */
  char **remote_bearer_token_files; /* "ROOT=FILE": the bearer token of an http(s) root */
  size_t n_remote_bearer_token_files;
  uint64_t *allowed_uids;
  size_t n_allowed_uids;
  uint64_t *allowed_gids;
  size_t n_allowed_gids;
  uint64_t *admin_gids; /* may evict, release and cancel what other users started */
  size_t n_admin_gids;
  enum cfg_backend backend;
  uint64_t device_memory_budget; /* bytes per device for resident sets; 0 = no limit */
  uint64_t host_pin_budget;    /* bytes of checkpoints in the pinned-resident tier; 0 = derived (hostmem.h) */
  enum cfg_pin pin;            /* when checkpoints enter the pinned-resident tier by themselves */
  uint64_t max_open_checkpoints;         /* open at once, all uids */
  uint64_t max_open_checkpoints_per_uid; /* open for one uid */
  uint64_t checkpoint_memory;            /* bytes open checkpoints are charged, all uids */
  uint64_t checkpoint_memory_per_uid;    /* bytes for one uid */
  uint64_t checkpoint_idle_ms;           /* an unused open checkpoint is closed after this; 0 = never */
  uint64_t fill_threads;       /* 0 = one per online CPU */
  uint64_t job_threads;      /* loads, prefetches, frees */
  uint64_t control_threads;  /* opens, checks, plans, status: never behind loads */
  uint64_t staging_slots;
  uint64_t staging_slot_bytes;
  uint64_t frame_timeout_ms;
  uint64_t max_connections;
  uint64_t max_queued_output; /* reply bytes queued for a client before its replies become LIMIT errors */
  uint64_t max_total_queued_output; /* reply bytes queued for all clients together */
  uint64_t max_uid_queued_output;   /* reply bytes queued for one uid's clients; 0 = a quarter of the total */
  uint64_t max_queued_fds;    /* descriptors queued in one connection's replies */
  uint64_t max_request_bytes; /* the largest request frame */
  uint64_t request_memory;    /* requests read and not finished, all connections (estimated) */
  uint64_t idle_timeout_ms;   /* a connection with no lease and nothing in progress is closed after this */
  uint64_t reserved_connections; /* beyond max_connections, for root and the daemon's uid */
  enum log_level log_level;
  char *log_file; /* "" = none */
  char *syslog_socket; /* where a detached daemon logs without log_file ("" = none: stderr) */
  char *metrics_address;        /* HOST:PORT of /metrics, /healthz, /readyz; "" = off */
  uint64_t metrics_connections; /* HTTP connections served at once */
  uint64_t metrics_request_timeout_ms; /* an HTTP request's deadline, from accept or the last answer */
  enum cfg_source source;           /* where loads read bytes from (load/source.h) */
  uint64_t auto_direct_bytes;       /* source auto: larger plans read O_DIRECT; 0 = half of host memory */
  enum cfg_verify verify;           /* on_load: loads check the bytes they read against the manifest */
  enum cfg_onoff scrub;             /* digests at load, and scrubs against them */
  uint64_t scrub_duty;              /* percent of the scrub thread's time spent hashing sets in the background; 0: off */
  uint64_t scrub_interval_ms;       /* between the end of one set's background scrub and the start of the next */
  enum cfg_onoff scrub_reload;      /* a set a scrub finds corrupt is retired and loaded again */
  enum cfg_load_method load_method; /* staged: force the staging pipeline (tests, comparisons) */
  enum cfg_cuda_handles cuda_handles; /* how GPU sets are allocated and shared: VMM descriptors or legacy IPC */
  enum cfg_strided staged_strided;  /* how staged loads stage strided pieces */
  enum cfg_writes staging_writes;   /* how fill threads write the staging slots */
  char *test_load_gate; /* "" = none; for tests: a FIFO loads read a byte from before each window */
  enum cfg_onoff test_refuse_odirect; /* for tests: every O_DIRECT open fails with EINVAL */
  enum cfg_onoff test_writable_slabs; /* for tests: host slabs are never sealed against writes */
  /* Several devices (docs/multi-gpu.md). */
  enum cfg_switch replicas;  /* a set resident on a peer is copied device to device */
  enum cfg_switch striping;  /* a load borrows idle neighbours' host links */
  char *link_rates;          /* host-to-device GiB/s per device ("" = equal, unmeasured) */
  uint64_t stripe_min_bytes; /* smaller loads are never striped */
  enum cfg_switch numa;      /* fill threads and staging memory placed per NUMA node */
  uint64_t host_devices;     /* host backend: devices it presents */
  char *host_peers;          /* host backend: pairs with "peer access" */
  enum cfg_fd_store fd_store; /* keep sets in the service manager's fd store across restarts */
  uint64_t fd_store_max;      /* descriptors the fd store holds (0: $FDSTORE, else 512) */
  uint64_t restart_grace_ms;  /* how long recovered leases wait for their holders to reclaim them */
};

/* Fills cfg with the defaults. */
int config_defaults(struct wd_config *cfg, struct wd_error *err);

/* Applies a JSON config file on top of cfg; unknown keys and bad values are errors. */
int config_load_file(struct wd_config *cfg, const char *path, struct wd_error *err);

/* Sets one key from text (a flag or an environment override). */
int config_set(struct wd_config *cfg, const char *key, const char *value, struct wd_error *err);

/* Appends a model root. */
int config_add_model_root(struct wd_config *cfg, const char *dir, struct wd_error *err);

/* The text of an enumerated key's current value ("cuda", "info"), for logs and status. */
const char *config_enum_name(const struct wd_config *cfg, const char *key);

/* True when a running daemon applies a new value of key at reload (SIGHUP). */
bool config_key_reloadable(const char *key);

/* Calls changed() for every key whose value differs between a and b, in table order. */
void config_compare(const struct wd_config *a, const struct wd_config *b,
                    void (*changed)(void *arg, const char *key, bool reloadable), void *arg);

/* Copies key's value from src into dst (strings and lists deep). */
int config_copy_key(struct wd_config *dst, const struct wd_config *src, const char *key, struct wd_error *err);

/* Writes every key with its help and default as a commented example. */
void config_print_help(FILE *f);

/* Writes every key with its default and help as man page .TP entries. */
void config_print_man(FILE *f);

void config_free(struct wd_config *cfg);

#endif
