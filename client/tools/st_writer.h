/*
 * st_writer.h - writes a Hugging Face safetensors checkpoint directory:
 * model.safetensors, or shards model-00001-of-0000n.safetensors with
 * model.safetensors.index.json, plus companion files such as config.json.
 * `weightctl export` and `weightctl mkcheckpoint` both write through it.
 *
 * The caller describes the tensors, in file order, and supplies their bytes
 * through a fill callback that worker threads call with disjoint ranges; the
 * writer owns everything else:
 *
 *  - Files. Tensors go to files either as the caller assigned them or by
 *    save_pretrained's greedy rule (a new file starts when the next tensor
 *    would push the open one past max_file_bytes, so a tensor larger than
 *    that gets a file of its own). One file is "model.safetensors"; n files
 *    are "model-%05u-of-%0*u.safetensors" with name_digits digits in the
 *    count (5 unless asked for more; DeepSeek-V3 publishes 6).
 *  - Headers. The JSON is {"__metadata__": the caller's string pairs, then
 *    every tensor {"dtype", "shape", "data_offsets"}} in order, unformatted,
 *    integers exact, padded with spaces to a multiple of 8 bytes; a header
 *    over safetensors' 100,000,000-byte limit is refused (WEIGHTD_E_LIMIT).
 *  - The index, for more than one file, as save_pretrained writes it
 *    (json.dumps with indent 2 and sorted keys): metadata.total_size and the
 *    weight_map.
 *  - Atomic replacement. Every file is written as "<name>.tmp" (shards sized
 *    up front), then renamed into place: shards, companions, the index last,
 *    so that a reader that finds the index finds every shard. Files of an
 *    earlier run that this one did not write are removed afterwards; a
 *    failure removes the .tmp files this run created and leaves the final
 *    names as they were. Nothing is fsync()ed.
 *
 * Use: stw_create() checks the description and lays the files out without
 * touching the disk; stw_run() writes them (once); stw_free() releases.
 * stw_progress_get() may be called from any thread while stw_run() runs.
 */
#ifndef WD_ST_WRITER_H
#define WD_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "error.h"

#define STW_INDEX_NAME "model.safetensors.index.json"
/* The most worker threads one run uses. */
#define STW_THREADS_MAX 64u
/* The default job size: every file's data is cut into jobs of at most this many bytes. */
#define STW_CHUNK_DEFAULT ((uint64_t)8 << 20)

/* One tensor. file is read only when the spec's max_file_bytes is 0. */
struct stw_tensor {
  const char *name;
  enum wd_dtype dtype;
  unsigned ndim;
  const uint64_t *shape;
  uint64_t nbytes;
  size_t file;
};

/* A string pair of __metadata__, or a companion file's name and contents. */
struct stw_meta {
  const char *key;
  const char *value;
};

struct stw_companion {
  const char *name; /* one of the names the writer knows: "config.json" */
  const char *text;
  size_t len;
};

/*
 * Produces bytes [offset, offset + len) of tensor number `tensor` (its index
 * in stw_spec.tensors) into dst. Called from worker threads, concurrently,
 * with disjoint ranges. Returns 0, or a negative WEIGHTD_E_* code with err
 * filled; the first failure stops the run and becomes stw_run()'s error.
 */
typedef int (*stw_fill_fn)(void *arg, size_t tensor, uint64_t offset, size_t len, unsigned char *dst,
                           struct wd_error *err);

struct stw_spec {
  const char *dir; /* the output directory; it must exist */
  const struct stw_tensor *tensors;
  size_t ntensors;
  /* Greedy file assignment at this many data bytes per file; 0: each tensor's file field. */
  uint64_t max_file_bytes;
  unsigned name_digits; /* digits of the file count in shard names; 0 means 5 */
  const struct stw_meta *meta; /* __metadata__ of every file, in order; none: no __metadata__ */
  size_t nmeta;
  const struct stw_companion *companions; /* written beside the shards, in this order */
  size_t ncompanions;
  stw_fill_fn fill;
  void *fill_arg;
  unsigned threads;    /* 0: one per usable CPU; at most STW_THREADS_MAX, at most one per job */
  uint64_t chunk_bytes; /* job size; 0: STW_CHUNK_DEFAULT */
  /*
   * Sparse: write only the headers; each file gets its full size, the data
   * being a hole that reads as zeros and takes (almost) no disk. fill is
   * never called. A file system that does not keep holes is refused
   * (WEIGHTD_E_IO) before any large file is made.
   */
  int sparse;
};

struct stw_writer;

/*
 * Checks spec and lays out the files: tensor names unique, dtypes known,
 * byte counts summing without overflow, assigned files starting at 0 and
 * never skipping or going back, companions known and named once. Builds
 * every header and the index. Copies what it needs from spec except the
 * tensors array (with its names and shapes), the companions' text and
 * fill_arg, which must outlive the writer. Returns 0 with *out
 * set, WEIGHTD_E_INVALID, WEIGHTD_E_LIMIT for a header over the limit, or
 * WEIGHTD_E_NOMEM.
 */
int stw_create(const struct stw_spec *spec, struct stw_writer **out, struct wd_error *err);

/*
 * Writes the checkpoint (see the top of this file). Returns 0; the fill
 * callback's error; WEIGHTD_E_IO naming the file for a failed create, write,
 * close or rename; WEIGHTD_E_NOMEM or WEIGHTD_E_INTERNAL (no thread could be
 * started); or WEIGHTD_E_INVALID when called a second time.
 */
int stw_run(struct stw_writer *w, struct wd_error *err);

/* The number of safetensors files, and the name of file i (0-based; NULL past the end). */
size_t stw_file_count(const struct stw_writer *w);
const char *stw_file_name(const struct stw_writer *w, size_t i);

/*
 * Every "DIR/<name>.tmp" path stw_run() may create, NULL-terminated, valid
 * until stw_free(): for a SIGBUS handler that must remove them.
 */
const char *const *stw_tmp_paths(const struct stw_writer *w);

/* Bytes the files take on disk (allocated blocks), measured after stw_run(); 0 before. */
uint64_t stw_disk_bytes(const struct stw_writer *w);

/* Tensor data bytes written so far and in all; safe from any thread. */
void stw_progress_get(const struct stw_writer *w, uint64_t *done, uint64_t *total);

/* Frees the writer; NULL-safe. Files already written stay. */
void stw_free(struct stw_writer *w);

/*
 * Looks for an entry of dir that a writer would neither write nor remove:
 * anything but the file names above, their ".tmp" forms and the known
 * companions. Returns 0 when there is none, 1 with the first one's name
 * copied (cut to cap) into name, or WEIGHTD_E_IO when dir cannot be read.
 */
int stw_dir_find_foreign(const char *dir, char *name, size_t cap, struct wd_error *err);

/* The number of CPUs this process may run on (at least 1). */
unsigned stw_cpus_usable(void);

#endif
