/*
 * setdesc.h - the set description: what a daemon leaves in its service
 * manager's file descriptor store so that the next daemon can re-adopt its
 * resident sets (docs/protocol.md, "The set description"). One writer (the
 * daemon, whenever its sets or leases change) and one reader (the daemon at
 * start, and the fuzz target).
 *
 * Version 3, all integers little-endian (versions 1 and 2 are still read:
 * 2 carries each set's tensor table inline, 1 also has no identity fields):
 *
 *   header   SETDESC_HEADER_BYTES: magic "WDSETDSC", u32 version, u32 header
 *            size, u64 total size, u64 generation, u32 sets, u32 leases, u64
 *            checksum (XXH64, seed 0, of every byte after the header)
 *   sets     per set: str id, str checkpoint path (resolved), str device
 *            UUID, u32 handle kind, u64 slab bytes, u64 allocation bytes,
 *            16 bytes allocation id, str store name of the slab descriptor,
 *            str plan key, 32 bytes layout id, u32 content id known (0 or
 *            1), 32 bytes content id (zeros when not known), u32 shard
 *            count, per shard (str name, u64 device,
 *            u64 inode, u64 size, i64 mtime ns), then the tensor table:
 *            str store name of its sealed memfd, u64 its size, u64 its
 *            XXH64 (version 2: u64 table size, zeros to an 8-byte
 *            boundary, the binary tensor table itself, tensor_table.h)
 *   leases   per lease: str id, str set id, u32 uid, i32 pid, str client
 *
 * A str is a u32 length and that many bytes without a NUL. The reader
 * trusts nothing: every length is checked against what is left, every
 * string against its own limit, the checksum, the version, the handle kinds
 * (legacy IPC sets are never described), every inline tensor table with
 * ttab_open (a stored one is checked against its size and XXH64 by the
 * daemon that maps it, setdesc_table_check), unique ids and store names, leases naming described sets, and no byte may
 * follow the last lease. Set ids are "s" and lease ids "l" followed by a
 * counter, and the generation is a counter (setdesc_counter_parse): the
 * daemon takes them over into counters of its own, which must never wrap
 * into an id given twice or a generation that sorts before the last. A
 * description that breaks any rule is WEIGHTD_E_INVALID naming the rule;
 * nothing is read out of bounds on arbitrary bytes.
 */
#ifndef WD_SETDESC_H
#define WD_SETDESC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "handles.h"

#define SETDESC_MAGIC "WDSETDSC" /* 8 bytes, no NUL */
#define SETDESC_VERSION 3u     /* what setdesc_write writes; 1 and 2 are read too */
#define SETDESC_ID_BYTES 32u    /* a layout or content id (checkpoint.h's CKPT_ID_BYTES) */
#define SETDESC_HEADER_BYTES 48u
#define SETDESC_MAX_BYTES (1ull << 30)
#define SETDESC_ID_MAX 23u      /* set and lease ids ("s12", "l13") */
#define SETDESC_NAME_MAX 255u   /* store names (systemd's FDNAME limit) */
#define SETDESC_CLIENT_MAX 63u  /* the name a client gave in hello */
#define SETDESC_STR_MAX 4096u   /* paths, shard names, UUIDs, plan keys */
/* The largest id number and generation, 2^63 - 1: a counter taken over from a description never wraps. */
#define SETDESC_COUNTER_MAX 9223372036854775807ull

struct setdesc_shard {
  char *name; /* the shard's name in the checkpoint (the index's, or the file's) */
  uint64_t dev, ino, size;
  int64_t mtime_ns;
};

struct setdesc_set {
  char *id;
  char *path; /* the checkpoint's resolved path */
  char *uuid; /* the device's */
  uint32_t handle_kind; /* enum wd_handle_kind: fd or cuda_vmm */
  uint64_t slab_bytes;  /* the set's slab (the plan's slab bytes) */
  uint64_t alloc_bytes; /* what the handle maps (cuda_vmm: whole grains) */
  unsigned char alloc_id[WD_ALLOC_ID_BYTES];
  char *fdname;   /* the slab descriptor's name in the store */
  char *plan_key; /* plan.h's identity key */
  bool has_ids;   /* a version 2 description: layout_id is given (and content_id when content_known) */
  unsigned char layout_id[SETDESC_ID_BYTES];
  bool content_known;
  unsigned char content_id[SETDESC_ID_BYTES];
  size_t nshards;
  struct setdesc_shard *shards;
  /* The binary tensor table: version 3 names its memfd (table NULL until the daemon maps it); version 2
   * holds it inline (table points into the reader's buffer; table_fdname NULL). */
  char *table_fdname;
  uint64_t table_sum; /* version 3: its XXH64 */
  const unsigned char *table;
  size_t table_len;
};

struct setdesc_lease {
  char *id;
  char *set_id;
  uint32_t uid;
  int32_t pid;
  char *client; /* "" when the client gave none */
};

struct setdesc {
  uint32_t version; /* read: what the description was written as; written: 0 for SETDESC_VERSION, 1 as a daemon before ids did */
  uint64_t generation;
  size_t nsets;
  struct setdesc_set *sets;
  size_t nleases;
  struct setdesc_lease *leases;
};

/*
 * Writes d into a new buffer (*out, free it; *len its size). WEIGHTD_E_INVALID
 * naming what cannot be written (a string over its limit or holding a NUL, a
 * legacy IPC set), WEIGHTD_E_NOMEM.
 */
int setdesc_write(const struct setdesc *d, unsigned char **out, size_t *len, struct wd_error *err);

/*
 * Validates len bytes at buf (8-byte aligned; it must outlive *out, whose
 * tables point into it) and reads them into *out, whose strings and arrays
 * are new (setdesc_free). 0, or WEIGHTD_E_INVALID with the rule broken
 * ("set 2 (s7): shard 1: name runs past the end"), or WEIGHTD_E_NOMEM.
 */
int setdesc_read(const void *buf, size_t len, struct setdesc *out, struct wd_error *err);

/*
 * Reads a counter (an id's number, a generation, the <generation> of a store
 * name "wd-sets-<generation>") written in decimal: digits only, no sign,
 * space or leading zero, from 1 to SETDESC_COUNTER_MAX. True with *out,
 * false for anything else.
 */
bool setdesc_counter_parse(const char *digits, uint64_t *out);

/*
 * Checks a stored table (version 3) mapped at table, len bytes, against set
 * s's description (size and XXH64), then with ttab_open (its slab size must
 * be the set's), and points s->table at it. 0, or WEIGHTD_E_INVALID saying
 * what differs.
 */
int setdesc_table_check(struct setdesc_set *s, const unsigned char *table, size_t len, struct wd_error *err);

/* Frees what setdesc_read made (NULL-safe; *d is zeroed). */
void setdesc_free(struct setdesc *d);

#endif
