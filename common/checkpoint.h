/*
 * checkpoint.h - a checkpoint: a directory with an index and shards, a
 * directory with one model.safetensors, or a bare .safetensors file.
 *
 * ckpt_open validates every shard's header, the index's paths (relative, no
 * ".." component, no leading '/'; symlinks allowed, such as a Hugging Face
 * cache's snapshots/<rev>/x -> ../../blobs/<sha>), confinement of every
 * resolved file to the configured model roots, that each indexed tensor is
 * in its shard and that no tensor appears in two shards. It keeps each shard
 * open and records its identity (device, inode, size, mtime), so that the
 * daemon maps the very file that was validated and notices a replaced one.
 */
#ifndef WD_CHECKPOINT_H
#define WD_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "error.h"
#include "modelcfg.h"
#include "safetensors.h"

enum ckpt_layout { CKPT_INDEX, CKPT_SINGLE, CKPT_FILE };

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
};

/* A tensor of the checkpoint: which shard and which entry of its header. */
struct ckpt_ref {
  const struct st_tensor *t;
  uint32_t shard;
};

struct ckpt_opts {
  const char *const *model_roots; /* resolved directories; none means no confinement */
  size_t nroots;
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
};

int ckpt_open(const char *path, const struct ckpt_opts *opts, struct ckpt **out,
              struct wd_error *err);

/* The tensor named name, or NULL. */
const struct ckpt_ref *ckpt_tensor_find(const struct ckpt *c, const char *name);

/*
 * Checks that every shard is still the file that was validated: same device,
 * inode, size and mtime at its path. Fails with WEIGHTD_E_STALE naming the shard.
 */
int ckpt_check_unchanged(const struct ckpt *c, struct wd_error *err);

/* A name for the layout ("index", "single", "file"). */
const char *ckpt_layout_name(enum ckpt_layout l);

void ckpt_free(struct ckpt *c);

#endif
