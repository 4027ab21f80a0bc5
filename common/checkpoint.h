/*
 * checkpoint.h - a checkpoint: a directory with an index and shards, a
 * directory with one model.safetensors, or a bare .safetensors file.
 *
 * ckpt_open validates every shard's header, the index's paths (relative, no
 * ".." component, no leading '/'; symlinks allowed, such as a Hugging Face
 * cache's snapshots/<rev>/x -> ../../blobs/<sha>), that each indexed tensor is
 * in its shard, that every tensor is indexed exactly once and that no tensor
 * appears in two shards. It keeps each shard open and records its identity
 * (device, inode, size, mtime), so that the daemon maps the very file that
 * was validated and notices a replaced one.
 *
 * Confinement. Every file it reads (shards, the index, config.json) is first
 * resolved and checked against the model roots, and only then opened
 * (path_open_confined: never a FIFO or device, never through a symlink
 * swapped in after the check, never blocking); what a file outside the roots
 * holds, or whether it exists, never shows in a message.
 *
 * Whose access. The daemon reads with its own rights for clients of other
 * uids, so an open made for one is given that client's check (ckpt_opts'
 * access, access.h): the checkpoint directory must be searchable by the
 * client before any name in it is looked up, and each file readable by it
 * (walked as open(2) walks it) before a byte of it is read, so that a
 * refusal is PERMISSION naming the part and never a message about what the
 * file holds; a failure of the daemon's own resolution of a file (missing,
 * outside the roots, not a regular file) below a directory the client may
 * not search is that directory's refusal (acc_check_failure), so nothing
 * behind it shows. ckpt_access_check makes the same check of a checkpoint
 * opened earlier (for whoever).
 */
#ifndef WD_CHECKPOINT_H
#define WD_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "access.h"
#include "error.h"
#include "modelcfg.h"
#include "safetensors.h"

enum ckpt_layout { CKPT_INDEX, CKPT_SINGLE, CKPT_FILE };

/* Bytes of a layout or content id (SHA-256). */
#define CKPT_ID_BYTES 32

struct ckpt_shard {
  char *rel;  /* the name in the index, or the file's name */
  char *path; /* dir/rel, possibly a symlink */
  char *real; /* the resolved file */
  int fd;     /* open read-only; -1 after ckpt_shards_close */
  struct st_header *hdr;
  dev_t dev;
  ino_t ino;
  uint64_t size;
  int64_t mtime_ns;
  int64_t ctime_ns; /* part of the identity remembered verdicts are keyed by */
};

/* A tensor of the checkpoint: which shard and which entry of its header. */
struct ckpt_ref {
  const struct st_tensor *t;
  uint32_t shard;
};

struct ckpt_verdicts;
struct mf_manifest;

struct ckpt_opts {
  const char *const *model_roots; /* resolved directories; none means no confinement */
  size_t nroots;
  struct ckpt_verdicts *verdicts; /* remembered failures of the consistency check, or NULL */
  bool *remembered;               /* set to true when the open fails from a remembered verdict, or NULL */
  struct acc_check *access;       /* the client's check, made of each file before it is read; NULL: none */
  bool manifest;                  /* read the manifest beside the index (manifest.h) into ckpt's manifest */
};

/* The identity of a file of the directory the open read besides the shards (the index, config.json, the manifest). */
struct ckpt_member_id {
  bool present; /* the open read it */
  dev_t dev;
  ino_t ino;
};

struct ckpt {
  char *path; /* as given */
  char *dir;  /* the resolved directory holding the shards */
  enum ckpt_layout layout;
  size_t nshards;
  struct ckpt_shard *shards;
  size_t ntensors;
  struct ckpt_ref *by_name; /* sorted by tensor name */
  uint64_t total_bytes;     /* payload: the sum of all tensors' bytes */
  struct mcfg *config;      /* config.json, or NULL when there is none */
  /* The manifest beside the index (ckpt_opts' manifest), checked against the headers; NULL when there is none. */
  struct mf_manifest *manifest;
  struct ckpt_member_id index_id, config_id, manifest_id; /* the files the index, config and manifest came from */
  /*
   * The layout id (ckpt_layout_id), computed at open from the headers and
   * the index alone: it names the layout, not the bytes (fine-tunes of one
   * architecture share it); a content id adds each file's payload identity.
   */
  unsigned char layout_id[CKPT_ID_BYTES];
};

/*
 * Opens and validates the checkpoint at path (see above). 0 with *out, or an
 * error whose message starts with path and, for a shard, names the shard
 * ("/models/x: model-00002-of-00003.safetensors: not a safetensors file
 * ..."; a checkpoint that is one file is named once).
 */
int ckpt_open(const char *path, const struct ckpt_opts *opts, struct ckpt **out,
              struct wd_error *err);

/*
 * A checkpoint's files wherever they are (an object store, an HTTP server):
 * what ckpt_open_fetched reads them through. Each call names the file in its
 * errors.
 *   small  the whole of a small file of the directory (the index,
 *          config.json, the manifest): 1 with *text (malloc'd) and *len, 0
 *          when there is none, LIMIT when it is longer than max, or a failure
 *   size   the size of shard `shard` (its name rel): 0, NOT_FOUND, or a failure
 *   read   exactly len bytes of shard `shard` from off: 0 or a failure
 */
struct ckpt_fetch {
  int (*small)(void *arg, const char *name, size_t max, char **text, size_t *len, struct wd_error *err);
  int (*size)(void *arg, uint32_t shard, const char *rel, uint64_t *size, struct wd_error *err);
  int (*read)(void *arg, uint32_t shard, uint64_t off, void *buf, size_t len, struct wd_error *err);
  void *arg;
};

/*
 * Opens a checkpoint whose files are read through f, validated exactly as
 * ckpt_open validates local ones (the same header validator and limits,
 * the same index and table checks, config.json, the manifest when asked),
 * and without a descriptor: shards' fd is -1, their identity their size
 * (the fetcher keeps what else identifies them). name is how messages and
 * the shards' paths name it (a URL); layout says which files to read:
 * CKPT_INDEX the index and the shards it names, CKPT_SINGLE
 * model.safetensors, CKPT_FILE the one file `file_name`. 0 with *out, or an
 * error naming the checkpoint and the file.
 */
int ckpt_open_fetched(const char *name, enum ckpt_layout layout, const char *file_name, const struct ckpt_fetch *f,
                      bool manifest, struct ckpt **out, struct wd_error *err);

/*
 * Makes err's message name the checkpoint at path ("/models/x:
 * model-00002.safetensors: ..."), unless it starts with that path already:
 * what ckpt_open and ckpt_check_unchanged do to their own errors, for
 * callers whose later errors about the checkpoint should read the same.
 * Returns err->code.
 */
int ckpt_err_name(struct wd_error *err, const char *path);

/* ---- the index ----------------------------------------------------------- */

/* One weight_map entry: a tensor name and its shard file. */
struct ckpt_index_entry {
  const char *name; /* NUL-terminated (owned by the index) */
  size_t name_len;
  const char *path; /* the shard file as written */
  uint32_t file;    /* the same as an index into files */
};

/* A parsed model.safetensors.index.json. */
struct ckpt_index {
  size_t nentries;
  struct ckpt_index_entry *entries; /* sorted by name; no name twice */
  size_t nfiles;
  char **files; /* the distinct shard paths, sorted; each passed path_rel_is_safe */
  void *json;   /* the parsed document, which owns the strings */
};

/* The largest index read; the largest published ones are a few MiB. */
#define CKPT_INDEX_MAX_BYTES (256u << 20)

/*
 * Parses index text: an object whose "weight_map" is a non-empty object of
 * tensor name to shard path; a path that is not relative or holds a ".."
 * component is WEIGHTD_E_PATH_DENIED, a name listed twice or anything else
 * malformed WEIGHTD_E_BAD_INDEX. O(n log n).
 */
int ckpt_index_parse(const char *text, size_t len, struct ckpt_index **out, struct wd_error *err);
void ckpt_index_free(struct ckpt_index *ix);

/*
 * Builds c's name table from its shards' headers (each shards[i].hdr set) and,
 * when ix is not NULL (shards[i] holding ix->files[i]), checks the index against
 * it: every entry's tensor is in the shard it names, every tensor is indexed.
 * A tensor in two shards, or any disagreement, is WEIGHTD_E_BAD_INDEX naming
 * the tensor and the files. O(n log n) in the number of tensors, whatever the
 * verdict; sums of counts and bytes are overflow-checked (WEIGHTD_E_BAD_SIZE).
 */
int ckpt_tables_build(struct ckpt *c, const struct ckpt_index *ix, struct wd_error *err);

/* ---- remembered verdicts ---------------------------------------------------- */

/*
 * A bounded memory of failed consistency checks (ckpt_tables_build), keyed by
 * the identity of the index and of every shard: device, inode, size, mtime and
 * ctime, in order. An open whose files match a remembered failure answers it
 * at once, without reading a header; any change to any of those files (a
 * write, a rename, a touch) makes a new key. At most `capacity` verdicts are
 * kept (the oldest is forgotten first), each about 1 KiB. Thread-safe.
 */
struct ckpt_verdicts *ckpt_verdicts_create(size_t capacity);
void ckpt_verdicts_free(struct ckpt_verdicts *v);
/* How many opens a remembered verdict answered (for tests and status). */
uint64_t ckpt_verdicts_hits(struct ckpt_verdicts *v);

/* The tensor named name, or NULL. */
const struct ckpt_ref *ckpt_tensor_find(const struct ckpt *c, const char *name);

/*
 * Checks that every shard is still the file that was validated: same device,
 * inode, size and mtime at its path. Fails with WEIGHTD_E_STALE naming the shard.
 */
int ckpt_check_unchanged(const struct ckpt *c, struct wd_error *err);

/*
 * Checks that k's caller may read what c was opened from, as the files are
 * at their paths now: search on the checkpoint's directory, read on the
 * index, every shard and config.json (each walked as open(2) walks it),
 * the directories shared by several files walked once. With same_files,
 * each file the open read (every shard, the index and config.json: all that
 * a client's bytes come from) must still be the file that was opened, and
 * a file that is gone is WEIGHTD_E_STALE too (the checkpoint is to be
 * reopened, or, for a set that outlives its files, the access cannot be
 * shown). Returns 0,
 * WEIGHTD_E_PERMISSION naming what the caller may not search or read, or
 * acc_check_path's other failures. A stat per directory and file; no byte is read.
 */
int ckpt_access_check(const struct ckpt *c, struct acc_check *k, bool same_files, struct wd_error *err);

/*
 * The layout id of an opened checkpoint: SHA-256 over the canonical form of
 * every shard's header (tensors by name with dtype, shape and offsets,
 * metadata by key, the data section's start), the shard names and sizes and
 * the index's tensor-to-shard map (ckpt_id.c gives the encoding). 0, or -1
 * when memory runs out.
 */
int ckpt_layout_id(const struct ckpt *c, unsigned char out[CKPT_ID_BYTES]);

/* A name for the layout ("index", "single", "file"). */
const char *ckpt_layout_name(enum ckpt_layout l);

void ckpt_free(struct ckpt *c);

#endif
