/*
 * ckpt_id.c - a checkpoint's layout id (see checkpoint.h): SHA-256 over a
 * canonical encoding of what its headers and index say, so that headers
 * that differ only in key order or metadata order get the same id, and any
 * difference a reader of the bytes would see gets another. The shard sizes
 * and data-section starts are in it (they place every byte), so the same
 * tensors written with a header of another length get another id.
 *
 * The encoding, version 1: the text "weightd-layout-v1", the layout kind
 * (index, single, file) and the shard count; per shard in the checkpoint's
 * order: its name and size, its data section's start, and its tensors by
 * name (name, dtype name, dimensions, shape, data offsets), then its
 * metadata by key (key, value); then the tensor-to-shard map the index
 * gave, by tensor name. Integers are 8-byte little-endian, strings their
 * length as one and then their bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "sha256.h"

static void put_u64(struct sha256 *h, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
  sha256_update(h, b, sizeof b);
}

static void put_str(struct sha256 *h, const char *s, size_t n) {
  put_u64(h, n);
  sha256_update(h, s, n);
}

static int cmp_meta(const void *a, const void *b) {
  const struct st_meta *x = *(const struct st_meta *const *)a, *y = *(const struct st_meta *const *)b;
  size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
  int c = memcmp(x->key, y->key, n);
  return c != 0 ? c : (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

int ckpt_layout_id(const struct ckpt *c, unsigned char out[CKPT_ID_BYTES]) {
  struct sha256 h;
  sha256_init(&h);
  static const char tag[] = "weightd-layout-v1";
  sha256_update(&h, tag, sizeof tag - 1);
  put_u64(&h, (uint64_t)c->layout);
  put_u64(&h, c->nshards);
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *sh = &c->shards[i];
    const struct st_header *hd = sh->hdr;
    put_str(&h, sh->rel, strlen(sh->rel));
    put_u64(&h, sh->size);
    put_u64(&h, hd->data_start);
    put_u64(&h, hd->ntensors);
    for (size_t k = 0; k < hd->ntensors; k++) {
      const struct st_tensor *t = &hd->tensors[hd->by_name[k]];
      const char *dt = dtype_name(t->dtype);
      put_str(&h, t->name, t->name_len);
      put_str(&h, dt, strlen(dt));
      put_u64(&h, t->ndim);
      for (unsigned d = 0; d < t->ndim; d++) put_u64(&h, t->shape[d]);
      put_u64(&h, t->begin);
      put_u64(&h, t->end);
    }
    const struct st_meta **meta = malloc((hd->nmeta ? hd->nmeta : 1) * sizeof *meta);
    if (meta == NULL) return -1;
    for (size_t k = 0; k < hd->nmeta; k++) meta[k] = &hd->meta[k];
    qsort(meta, hd->nmeta, sizeof *meta, cmp_meta);
    put_u64(&h, hd->nmeta);
    for (size_t k = 0; k < hd->nmeta; k++) {
      put_str(&h, meta[k]->key, meta[k]->key_len);
      put_str(&h, meta[k]->value, meta[k]->value_len);
    }
    free(meta);
  }
  put_u64(&h, c->ntensors);
  for (size_t k = 0; k < c->ntensors; k++) {
    const struct ckpt_ref *r = &c->by_name[k];
    put_str(&h, r->t->name, r->t->name_len);
    put_u64(&h, r->shard);
  }
  sha256_final(&h, out);
  return 0;
}
