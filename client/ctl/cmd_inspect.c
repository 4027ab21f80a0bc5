/* cmd_inspect.c - `weightctl inspect PATH [--json]`: validate and summarise a checkpoint (no daemon). */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "ctl.h"

/* A JSON string of exactly len bytes: names may hold U+0000, which C strings cannot. */
static cJSON *json_bytes(const char *s, size_t len) {
  char *buf = malloc(len * 6 + 3);
  if (buf == NULL) return NULL;
  size_t o = 0;
  buf[o++] = '"';
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') {
      buf[o++] = '\\';
      buf[o++] = (char)c;
    } else if (c < 0x20) {
      o += (size_t)snprintf(buf + o, 7, "\\u%04x", c);
    } else {
      buf[o++] = (char)c;
    }
  }
  buf[o++] = '"';
  buf[o] = '\0';
  cJSON *r = cJSON_CreateRaw(buf);
  free(buf);
  return r;
}

/* __metadata__ as raw JSON: keys and values may hold U+0000 too. */
static cJSON *json_meta(const struct st_header *h) {
  size_t cap = 3, o = 0;
  for (size_t k = 0; k < h->nmeta; k++) cap += 6 * (h->meta[k].key_len + h->meta[k].value_len) + 8;
  char *buf = malloc(cap);
  if (buf == NULL) return NULL;
  buf[o++] = '{';
  for (size_t k = 0; k < h->nmeta; k++) {
    cJSON *kj = json_bytes(h->meta[k].key, h->meta[k].key_len);
    cJSON *vj = json_bytes(h->meta[k].value, h->meta[k].value_len);
    if (kj != NULL && vj != NULL)
      o += (size_t)snprintf(buf + o, cap - o, "%s%s:%s", k ? "," : "", kj->valuestring, vj->valuestring);
    cJSON_Delete(kj);
    cJSON_Delete(vj);
  }
  buf[o++] = '}';
  buf[o] = '\0';
  cJSON *r = cJSON_CreateRaw(buf);
  free(buf);
  return r;
}

static cJSON *json_shape(const struct st_tensor *t) {
  cJSON *a = cJSON_CreateArray();
  for (unsigned d = 0; a != NULL && d < t->ndim; d++) cJSON_AddItemToArray(a, json_u64_create(t->shape[d]));
  return a;
}

static cJSON *json_config(const struct mcfg *m) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return NULL;
  if (m->model_type) cJSON_AddStringToObject(o, "model_type", m->model_type);
  if (m->architecture) cJSON_AddStringToObject(o, "architecture", m->architecture);
  for (int f = 0; f < MCFG_NFIELDS; f++)
    if (m->present[f]) cJSON_AddItemToObject(o, mcfg_field_key((enum mcfg_field)f), json_u64_create((uint64_t)m->value[f]));
  if (m->has_quant) {
    cJSON *q = cJSON_AddObjectToObject(o, "quantization_config");
    if (q && m->quant_method) cJSON_AddStringToObject(q, "quant_method", m->quant_method);
    if (q && m->weight_block_size[0]) {
      cJSON *bs = cJSON_AddArrayToObject(q, "weight_block_size");
      cJSON_AddItemToArray(bs, json_u64_create((uint64_t)m->weight_block_size[0]));
      cJSON_AddItemToArray(bs, json_u64_create((uint64_t)m->weight_block_size[1]));
    }
  }
  return o;
}

static uint64_t dtype_bytes_sum(const struct ckpt *c, enum wd_dtype t, size_t *count) {
  uint64_t sum = 0;
  *count = 0;
  for (size_t i = 0; i < c->ntensors; i++) {
    const struct st_tensor *x = c->by_name[i].t;
    if (x->dtype != t) continue;
    sum += x->end - x->begin;
    (*count)++;
  }
  return sum;
}

static int print_json(const struct ckpt *c) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return -1;
  cJSON_AddStringToObject(o, "path", c->path);
  cJSON_AddStringToObject(o, "layout", ckpt_layout_name(c->layout));
  cJSON *shards = cJSON_AddArrayToObject(o, "shards");
  cJSON *tensors = cJSON_CreateArray();
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    const struct st_header *h = s->hdr;
    cJSON *so = cJSON_CreateObject();
    cJSON_AddStringToObject(so, "file", s->rel);
    cJSON_AddItemToObject(so, "tensors", json_u64_create(h->ntensors));
    cJSON_AddItemToObject(so, "header_bytes", json_u64_create(h->header_len));
    cJSON_AddItemToObject(so, "data_start", json_u64_create(h->data_start));
    cJSON_AddItemToObject(so, "data_bytes", json_u64_create(h->data_len));
    cJSON_AddItemToObject(so, "file_bytes", json_u64_create(s->size));
    if (h->has_metadata) {
      cJSON_AddItemToObject(so, "metadata", json_meta(h));
    } else {
      cJSON_AddNullToObject(so, "metadata");
    }
    cJSON_AddItemToArray(shards, so);
    for (size_t k = 0; k < h->ntensors; k++) {
      const struct st_tensor *t = &h->tensors[k];
      cJSON *to = cJSON_CreateObject();
      cJSON_AddItemToObject(to, "name", json_bytes(t->name, t->name_len));
      cJSON_AddStringToObject(to, "dtype", dtype_name(t->dtype));
      cJSON_AddItemToObject(to, "shape", json_shape(t));
      cJSON_AddItemToObject(to, "shard", json_u64_create(i));
      cJSON *off = cJSON_AddArrayToObject(to, "data_offsets");
      cJSON_AddItemToArray(off, json_u64_create(t->begin));
      cJSON_AddItemToArray(off, json_u64_create(t->end));
      cJSON_AddItemToArray(tensors, to);
    }
  }
  cJSON_AddItemToObject(o, "tensor_count", json_u64_create(c->ntensors));
  cJSON_AddItemToObject(o, "total_bytes", json_u64_create(c->total_bytes));
  cJSON *bd = cJSON_AddObjectToObject(o, "bytes_by_dtype");
  for (int t = 0; t < WD_DTYPE_COUNT; t++) {
    size_t count;
    uint64_t sum = dtype_bytes_sum(c, (enum wd_dtype)t, &count);
    if (count > 0) cJSON_AddItemToObject(bd, dtype_name((enum wd_dtype)t), json_u64_create(sum));
  }
  cJSON_AddItemToObject(o, "tensors", tensors);
  if (c->config) cJSON_AddItemToObject(o, "config", json_config(c->config));
  else cJSON_AddNullToObject(o, "config");
  ctl_json_print(o);
  return 0;
}

static void print_human(const struct ckpt *c) {
  char hb[32];
  ctl_human_bytes(c->total_bytes, hb, sizeof hb);
  printf("checkpoint  %s\n", c->layout == CKPT_FILE ? c->path : c->dir);
  printf("layout      %s, %zu shard%s, %zu tensors, %" PRIu64 " payload bytes (%s)\n",
         ckpt_layout_name(c->layout), c->nshards, c->nshards == 1 ? "" : "s", c->ntensors,
         c->total_bytes, hb);
  if (c->config) {
    const struct mcfg *m = c->config;
    printf("model       %s (%s)\n", m->model_type ? m->model_type : "?",
           m->architecture ? m->architecture : "?");
    int shown = 0;
    for (int f = 0; f < MCFG_NFIELDS; f++) {
      if (!m->present[f]) continue;
      printf("%s%s=%" PRId64, shown % 4 == 0 ? "\n            " : "  ",
             mcfg_field_key((enum mcfg_field)f), m->value[f]);
      shown++;
    }
    if (m->has_quant)
      printf("\n            quantization=%s block=%" PRId64 "x%" PRId64,
             m->quant_method ? m->quant_method : "?", m->weight_block_size[0],
             m->weight_block_size[1]);
    printf("\n");
  } else {
    printf("model       (no config.json)\n");
  }
  printf("shards\n");
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    ctl_human_bytes(s->hdr->data_len, hb, sizeof hb);
    printf("  %-40s %6zu tensors  %10s  header %" PRIu64 " B\n", s->rel, s->hdr->ntensors, hb,
           s->hdr->header_len);
  }
  printf("dtypes\n");
  for (int t = 0; t < WD_DTYPE_COUNT; t++) {
    size_t count;
    uint64_t sum = dtype_bytes_sum(c, (enum wd_dtype)t, &count);
    if (count == 0) continue;
    ctl_human_bytes(sum, hb, sizeof hb);
    printf("  %-12s %6zu tensors  %" PRIu64 " bytes (%s)\n", dtype_name((enum wd_dtype)t), count,
           sum, hb);
  }
}

static int run_inspect(const struct ctl_args *a) {
  const char *path = a->pos[0];
  struct wd_error err = {0};
  struct ckpt *c = NULL;
  if (ckpt_open(path, NULL, &c, &err) != 0) {
    ctl_errorc(weightd_err_name(err.code), "%s", err.msg);
    return CTL_EXIT_FAIL;
  }
  int rc = CTL_EXIT_OK;
  if (ctl_opts.json) {
    if (print_json(c) != 0) {
      ctl_errorf("inspect: out of memory");
      rc = CTL_EXIT_FAIL;
    }
  } else {
    print_human(c);
  }
  ckpt_free(c);
  return rc;
}

const struct ctl_cmd ctl_cmd_inspect = {
    .name = "inspect",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "validate a safetensors file or checkpoint directory and summarise it (no daemon)",
    .description =
        "Validates a .safetensors file or a checkpoint directory here, without the daemon, as strictly as the "
        "reference safetensors implementation, and summarises it: layout, shards, tensors, bytes by dtype and "
        "the model's config. An invalid file fails with one line naming the shard and the rule it breaks. "
        "--json prints every shard and tensor.",
    .run = run_inspect,
    .flags = CTL_CMD_LOCAL,
};
