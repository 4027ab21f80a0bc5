/*
 * test_sources.c - the source conformance suite (daemon/load/source.h).
 *
 * Every source a load can read through - mmap, direct (O_DIRECT), auto's
 * route of the page cache and O_DIRECT, and a composed route whose first
 * member fails - is driven through ld_fill on the host backend, in each way
 * a host load moves bytes (in place into the slab, through the staging
 * slots, striped over two host devices' links), for every plan family and
 * preset (whole, explicit, dense, qwen3_moe, deepseek_v3 with FP8 block
 * scales; tensor- and expert-parallel ranks, fused and not), and the slab is
 * compared byte for byte with the plan gathered from the files as pread(2)
 * returns them. Then the failures every source reports alike: a file
 * truncated while the load waits at a window (FAULT), a file replaced under
 * the load (STALE), a cancel mid-read (CANCELED, nothing published), a read
 * error (IO naming the shard, or the next member of a route serves the
 * range), a filesystem that refuses O_DIRECT (the load falls back to mmap).
 *
 * The shards hold bytes that depend on the shard and the file offset, so a
 * read from the wrong shard or the wrong place shows. The scratch directory
 * must be on a filesystem that enforces O_DIRECT alignment (ext4 does):
 * test_odirect_alignment checks that it does, so the unaligned heads and
 * tails of every tensor are really exercised.
 */
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fixture.h"
#include "plan.h"
#include "state_env.h"

/* ---- checkpoints ------------------------------------------------------------------------------ */

/* The byte at file offset off of shard s: depends on both, never constant over a row. */
static unsigned char shard_byte(unsigned s, uint64_t off) {
  uint64_t x = (off + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(s + 1) * 0xD6E8FEB86659FD93ull;
  return (unsigned char)(x >> 29);
}

/* Writes a shard holding ts[0..n), its data section filled with shard_byte(s, ...). 0 or -1. */
static int write_shard(const char *path, unsigned s, const struct fx_tensor *ts, size_t n) {
  unsigned char *bytes;
  size_t len;
  if (fx_st_bytes(ts, n, &bytes, &len) != 0) return -1;
  uint64_t hlen;
  memcpy(&hlen, bytes, 8);
  for (size_t k = 8 + (size_t)hlen; k < len; k++) bytes[k] = shard_byte(s, k);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int ok = fd >= 0 && write(fd, bytes, len) == (ssize_t)len && fsync(fd) == 0;
  if (fd >= 0) close(fd);
  free(bytes);
  return ok ? 0 : -1;
}

#define MAXT 128

struct model {
  const char *name;
  const char *config;
  struct fx_tensor t[MAXT];
  char names[MAXT][96];
  size_t n;
  size_t split; /* tensors [0, split) in shard 1, the rest in shard 2 (0: one model.safetensors) */
  const char *const *specs; /* plans to load, NULL-terminated ("" for whole) */
};

static void add(struct model *m, const char *dtype, unsigned eb, uint64_t rows, uint64_t cols, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static void add(struct model *m, const char *dtype, unsigned eb, uint64_t rows, uint64_t cols, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m->names[m->n], sizeof m->names[0], fmt, ap);
  va_end(ap);
  m->t[m->n] = (struct fx_tensor){m->names[m->n], dtype, eb, rows, cols};
  m->n++;
}

/* A dense (llama) model of 2 layers in two shards: hidden 64, 4 heads of 16, 2 kv heads, vocab 250 (padded by plans). */
static const char *const dense_specs[] = {
    "",
    "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}",
    "{\"preset\":\"dense\",\"tp_size\":2,\"tp_rank\":0,\"fuse\":true}",
    "{\"preset\":\"dense\",\"tp_size\":4,\"tp_rank\":3}",
    "{\"outputs\":[{\"name\":\"cols\",\"dtype\":\"BF16\",\"shape\":[64,16],\"pieces\":[{\"tensor\":"
    "\"model.layers.1.mlp.down_proj.weight\",\"dim\":1,\"start\":40,\"end\":56}]},{\"name\":\"rows\",\"dtype\":\"BF16\","
    "\"shape\":[70,64],\"pieces\":[{\"tensor\":\"model.embed_tokens.weight\",\"dim\":0,\"start\":3,\"end\":69},"
    "{\"zeros\":4}]}]}",
    NULL};

static void dense_model(struct model *m) {
  memset(m, 0, sizeof *m);
  m->name = "dense";
  m->config = "{\"model_type\":\"llama\",\"hidden_size\":64,\"num_attention_heads\":4,\"num_key_value_heads\":2}";
  m->specs = dense_specs;
  add(m, "BF16", 2, 250, 64, "model.embed_tokens.weight");
  for (int l = 0; l < 2; l++) {
    add(m, "BF16", 2, 64, 0, "model.layers.%d.input_layernorm.weight", l);
    add(m, "BF16", 2, 64, 64, "model.layers.%d.self_attn.q_proj.weight", l);
    add(m, "BF16", 2, 32, 64, "model.layers.%d.self_attn.k_proj.weight", l);
    add(m, "BF16", 2, 32, 64, "model.layers.%d.self_attn.v_proj.weight", l);
    add(m, "BF16", 2, 64, 64, "model.layers.%d.self_attn.o_proj.weight", l);
    add(m, "BF16", 2, 64, 0, "model.layers.%d.post_attention_layernorm.weight", l);
    add(m, "BF16", 2, 128, 64, "model.layers.%d.mlp.gate_proj.weight", l);
    add(m, "BF16", 2, 128, 64, "model.layers.%d.mlp.up_proj.weight", l);
    add(m, "BF16", 2, 64, 128, "model.layers.%d.mlp.down_proj.weight", l);
    if (l == 0) m->split = m->n;
  }
  add(m, "BF16", 2, 64, 0, "model.norm.weight");
  add(m, "BF16", 2, 250, 64, "lm_head.weight");
}

/* A qwen3_moe model: one layer, 8 experts of [32, 64] / [64, 32], q/k norms, one file. */
static const char *const moe_specs[] = {
    "",
    "{\"preset\":\"auto\",\"ep_size\":2,\"ep_rank\":1,\"fuse\":true}",
    "{\"preset\":\"qwen3_moe\",\"tp_size\":2,\"tp_rank\":0}",
    "{\"preset\":\"qwen3_moe\",\"ep_size\":4,\"experts\":[6,1,3]}",
    NULL};

static void moe_model(struct model *m) {
  memset(m, 0, sizeof *m);
  m->name = "moe";
  m->config = "{\"model_type\":\"qwen3_moe\",\"hidden_size\":64,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
              "\"num_experts\":8}";
  m->specs = moe_specs;
  add(m, "BF16", 2, 256, 64, "model.embed_tokens.weight");
  add(m, "BF16", 2, 64, 0, "model.layers.0.input_layernorm.weight");
  add(m, "BF16", 2, 64, 64, "model.layers.0.self_attn.q_proj.weight");
  add(m, "BF16", 2, 32, 64, "model.layers.0.self_attn.k_proj.weight");
  add(m, "BF16", 2, 32, 64, "model.layers.0.self_attn.v_proj.weight");
  add(m, "BF16", 2, 64, 64, "model.layers.0.self_attn.o_proj.weight");
  add(m, "BF16", 2, 16, 0, "model.layers.0.self_attn.q_norm.weight");
  add(m, "BF16", 2, 16, 0, "model.layers.0.self_attn.k_norm.weight");
  add(m, "BF16", 2, 64, 0, "model.layers.0.post_attention_layernorm.weight");
  add(m, "BF16", 2, 8, 64, "model.layers.0.mlp.gate.weight");
  for (int e = 0; e < 8; e++) {
    add(m, "BF16", 2, 32, 64, "model.layers.0.mlp.experts.%d.gate_proj.weight", e);
    add(m, "BF16", 2, 32, 64, "model.layers.0.mlp.experts.%d.up_proj.weight", e);
    add(m, "BF16", 2, 64, 32, "model.layers.0.mlp.experts.%d.down_proj.weight", e);
  }
  add(m, "BF16", 2, 64, 0, "model.norm.weight");
  add(m, "BF16", 2, 256, 64, "lm_head.weight");
}

/*
 * A deepseek_v3 model: latent attention in both layers, layer 0 a dense MLP,
 * layer 1 four FP8 experts with [16, 16] block scales and a shared expert,
 * in two shards.
 */
static const char *const dsv3_specs[] = {
    "",
    "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}",
    "{\"preset\":\"deepseek_v3\",\"ep_size\":2,\"ep_rank\":0,\"fuse\":true}",
    "{\"preset\":\"deepseek_v3\",\"tp_size\":2,\"tp_rank\":0,\"fuse\":true}",
    NULL};

static void dsv3_model(struct model *m) {
  memset(m, 0, sizeof *m);
  m->name = "dsv3";
  m->config = "{\"model_type\":\"deepseek_v3\",\"hidden_size\":64,\"num_attention_heads\":4,\"q_lora_rank\":32,"
              "\"kv_lora_rank\":32,\"qk_nope_head_dim\":16,\"qk_rope_head_dim\":8,\"v_head_dim\":16,"
              "\"n_routed_experts\":4,\"n_shared_experts\":1,\"first_k_dense_replace\":1,\"moe_intermediate_size\":32,"
              "\"quantization_config\":{\"quant_method\":\"fp8\",\"weight_block_size\":[16,16]}}";
  m->specs = dsv3_specs;
  add(m, "BF16", 2, 256, 64, "model.embed_tokens.weight");
  for (int l = 0; l < 2; l++) {
    add(m, "BF16", 2, 64, 0, "model.layers.%d.input_layernorm.weight", l);
    add(m, "BF16", 2, 32, 64, "model.layers.%d.self_attn.q_a_proj.weight", l);
    add(m, "BF16", 2, 32, 0, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
    add(m, "BF16", 2, 96, 32, "model.layers.%d.self_attn.q_b_proj.weight", l); /* 4 heads x (16 + 8) */
    add(m, "BF16", 2, 40, 64, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
    add(m, "BF16", 2, 32, 0, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
    add(m, "BF16", 2, 128, 32, "model.layers.%d.self_attn.kv_b_proj.weight", l); /* 4 heads x (16 + 16) */
    add(m, "BF16", 2, 64, 64, "model.layers.%d.self_attn.o_proj.weight", l);
    add(m, "BF16", 2, 64, 0, "model.layers.%d.post_attention_layernorm.weight", l);
    if (l == 0) {
      add(m, "BF16", 2, 128, 64, "model.layers.0.mlp.gate_proj.weight");
      add(m, "BF16", 2, 128, 64, "model.layers.0.mlp.up_proj.weight");
      add(m, "BF16", 2, 64, 128, "model.layers.0.mlp.down_proj.weight");
      m->split = m->n;
      continue;
    }
    add(m, "BF16", 2, 4, 64, "model.layers.1.mlp.gate.weight");
    add(m, "F32", 4, 4, 0, "model.layers.1.mlp.gate.e_score_correction_bias");
    for (int e = 0; e < 5; e++) { /* 4 routed experts, then the shared one */
      char pre[64];
      if (e < 4) snprintf(pre, sizeof pre, "model.layers.1.mlp.experts.%d.", e);
      else snprintf(pre, sizeof pre, "model.layers.1.mlp.shared_experts.");
      add(m, "F8_E4M3", 1, 32, 64, "%sgate_proj.weight", pre);
      add(m, "F32", 4, 2, 4, "%sgate_proj.weight_scale_inv", pre);
      add(m, "F8_E4M3", 1, 32, 64, "%sup_proj.weight", pre);
      add(m, "F32", 4, 2, 4, "%sup_proj.weight_scale_inv", pre);
      add(m, "F8_E4M3", 1, 64, 32, "%sdown_proj.weight", pre);
      add(m, "F32", 4, 4, 2, "%sdown_proj.weight_scale_inv", pre);
    }
  }
  add(m, "BF16", 2, 64, 0, "model.norm.weight");
  add(m, "BF16", 2, 256, 64, "lm_head.weight");
}

/* Writes m under dir: one file, or two shards and their index, and config.json. 0 or -1. */
static int model_write(const struct model *m, const char *dir) {
  char p[PATH_MAX];
  if (mkdir(dir, 0755) != 0) return -1;
  if (fx_write_text(dir, "config.json", m->config) != 0) return -1;
  if (m->split == 0) {
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    return write_shard(p, 0, m->t, m->n);
  }
  static const char *const files[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  for (unsigned s = 0; s < 2; s++) {
    snprintf(p, sizeof p, "%s/%s", dir, files[s]);
    if (write_shard(p, s, s == 0 ? m->t : m->t + m->split, s == 0 ? m->split : m->n - m->split) != 0) return -1;
  }
  size_t cap = 64 + m->n * 160, len = 0;
  char *ix = malloc(cap);
  if (ix == NULL) return -1;
  len += (size_t)snprintf(ix + len, cap - len, "{\"weight_map\":{");
  for (size_t i = 0; i < m->n; i++)
    len += (size_t)snprintf(ix + len, cap - len, "%s\"%s\":\"%s\"", i ? "," : "", m->t[i].name, files[i >= m->split]);
  snprintf(ix + len, cap - len, "}}");
  int rc = fx_write_text(dir, "model.safetensors.index.json", ix);
  free(ix);
  return rc;
}

/* ---- the expected bytes ------------------------------------------------------------------------- */

/* The plan gathered from the shards as pread(2) returns them (free it). */
static unsigned char *want_image(const struct ckpt *c, const struct plan *p) {
  unsigned char **files = calloc(c->nshards, sizeof *files);
  const unsigned char **data = calloc(c->nshards, sizeof *data);
  unsigned char *want = calloc(1, p->slab_bytes ? p->slab_bytes : 1);
  for (size_t i = 0; i < c->nshards; i++) {
    files[i] = malloc(c->shards[i].size);
    int fd = open(c->shards[i].real, O_RDONLY);
    CHECK(fd >= 0 && pread(fd, files[i], c->shards[i].size, 0) == (ssize_t)c->shards[i].size);
    if (fd >= 0) close(fd);
    data[i] = files[i] + c->shards[i].hdr->data_start;
  }
  plan_gather(p, data, 0, p->slab_bytes, want);
  for (size_t i = 0; i < c->nshards; i++) free(files[i]);
  free(files);
  free(data);
  return want;
}

/* Reads the sealed slab through an export, as a client maps it, and compares it with want. True when equal. */
static bool slab_equals(struct env *e, struct wd_slab *slab, const unsigned char *want, uint64_t n, const char *what) {
  struct wd_handle h;
  struct wd_error err = {0};
  CHECK_EQ_INT(e->backend.ops->slab_export(e->backend.ctx, slab, &h, &err), 0);
  void *m = mmap(NULL, n ? n : 1, PROT_READ, MAP_SHARED, h.fd, 0);
  CHECK(m != MAP_FAILED);
  bool same = m != MAP_FAILED && memcmp(m, want, n) == 0;
  if (!same && m != MAP_FAILED) {
    for (uint64_t i = 0; i < n; i++)
      if (((const unsigned char *)m)[i] != want[i]) {
        fprintf(stderr, "%s: slab byte %llu is %u, the file's %u\n", what, (unsigned long long)i,
                ((const unsigned char *)m)[i], want[i]);
        break;
      }
  }
  if (m != MAP_FAILED) munmap(m, n ? n : 1);
  close(h.fd);
  return same;
}

/* ---- a failing source: the mmap source, with reads of a chosen range failing ------------------------- */

struct failing {
  const struct ld_source *inner;
  uint32_t shard;
  uint64_t lo, hi; /* reads touching [lo, hi) of shard fail */
  atomic_int failed;
};

static int failing_read(void *ctx, const struct ld_read *rq, struct wd_error *err) {
  struct failing *f = ctx;
  uint64_t end = rq->off + (rq->height - 1) * rq->pitch + rq->width;
  if (rq->shard == f->shard && rq->off < f->hi && end > f->lo) {
    atomic_fetch_add(&f->failed, 1);
    return err_set(err, WEIGHTD_E_IO, "%s: injected read error at %llu", f->inner->ck->shards[rq->shard].rel,
                   (unsigned long long)rq->off);
  }
  return ld_source_read(f->inner, rq, err);
}

static int failing_unchanged(void *ctx, struct wd_error *err) {
  const struct failing *f = ctx;
  return ld_source_unchanged(f->inner, err);
}

static const struct ld_source_ops failing_ops = {
    .kind = LD_SOURCE_MMAP, /* counted as what it wraps */
    .read = failing_read,
    .unchanged = failing_unchanged,
};

/*
 * Tensors of megabytes at unaligned offsets, with a column slice, for the
 * production slot size: windows of 16 MiB cut into fill tasks of 4 MiB
 * (the O_DIRECT source's read_min), so that aligned blocks are split across
 * tasks as they are on a GPU host.
 */
static const char *const big_specs[] = {
    "",
    "{\"outputs\":[{\"name\":\"cols\",\"dtype\":\"BF16\",\"shape\":[1501,700],\"pieces\":[{\"tensor\":"
    "\"b1\",\"dim\":1,\"start\":333,\"end\":1033}]},{\"name\":\"rows\",\"dtype\":\"BF16\","
    "\"shape\":[1000,1703],\"pieces\":[{\"tensor\":\"b2\",\"dim\":0,\"start\":3,\"end\":1003}]},"
    "{\"name\":\"c3\",\"dtype\":\"U8\",\"shape\":[12345],\"pieces\":[{\"tensor\":\"b3\"}]},"
    "{\"name\":\"c4\",\"dtype\":\"BF16\",\"shape\":[2999,1777],\"pieces\":[{\"tensor\":\"b4\"}]}]}",
    NULL};

static void big_model(struct model *m) {
  memset(m, 0, sizeof *m);
  m->name = "big";
  m->config = "{\"model_type\":\"llama\",\"hidden_size\":64,\"num_attention_heads\":4,\"num_key_value_heads\":2}";
  m->specs = big_specs;
  add(m, "U8", 1, 77, 0, "b0");
  add(m, "BF16", 2, 1501, 1700, "b1");
  add(m, "U8", 1, 12345, 0, "b3");
  m->split = m->n;
  add(m, "BF16", 2, 1200, 1703, "b2");
  add(m, "U8", 1, 3, 0, "b5");
  add(m, "BF16", 2, 2999, 1777, "b4");
}

/* ---- loads ------------------------------------------------------------------------------------------- */

enum way { WAY_IN_PLACE, WAY_STAGED, WAY_STRIPED, NWAYS };
static const char *const way_names[NWAYS] = {"in place", "staged", "striped"};

enum reader { RD_MMAP, RD_DIRECT, RD_AUTO, RD_FAILOVER, NREADERS };
static const char *const reader_names[NREADERS] = {"mmap", "direct", "auto (pagecache+direct)", "failing+direct"};

struct fix {
  struct env e;
  char *scratch;
  bool up;
};

/*
 * An env for way w on the host backend: small slots so plans take many
 * windows; big: the production slots (16 MiB, two fill threads).
 */
static bool fix_start_as(struct fix *f, const char *tag, enum way w, const char *gate, bool refuse_odirect, bool big) {
  memset(f, 0, sizeof *f);
  size_t slot = big ? 16u << 20 : 16u << 10;
  struct env_opts o = {.bulk_threads = big ? 2 : 1,
                       .residency = true,
                       .method = w == WAY_STAGED ? CFG_LOAD_STAGED : CFG_LOAD_AUTO,
                       .strided = PLAN_STRIDED_AUTO,
                       .staging_slots = 3,
                       .staging_slot_bytes = slot,
                       .host_devices = w == WAY_STRIPED ? 2 : 1,
                       .striping = w == WAY_STRIPED,
                       .window_bytes = slot,
                       .stripe_min_bytes = big ? 1 : 0,
                       .refuse_odirect = refuse_odirect,
                       .auto_direct_bytes = 1, /* auto always routes: warm ranges from the page cache, the rest O_DIRECT */
                       .load_gate = gate};
  f->scratch = fx_tmpdir(tag);
  f->up = f->scratch != NULL && env_start(&f->e, &o) == 0;
  CHECK(f->up);
  return f->up;
}

static bool fix_start(struct fix *f, const char *tag, enum way w, const char *gate, bool refuse_odirect) {
  return fix_start_as(f, tag, w, gate, refuse_odirect, false);
}

static void fix_stop(struct fix *f) {
  if (f->up) env_stop(&f->e);
  if (f->scratch != NULL) fx_rmtree(f->scratch);
  free(f->scratch);
}

static struct plan *plan_of(const struct ckpt *c, const char *spec_text) {
  cJSON *spec = spec_text != NULL && spec_text[0] ? cJSON_Parse(spec_text) : NULL;
  struct plan *p = NULL;
  struct wd_error err = {0};
  int rc = plan_build(c, spec, &p, &err);
  if (rc != 0) fprintf(stderr, "plan %s: %s\n", spec_text, err.msg);
  CHECK_EQ_INT(rc, 0);
  cJSON_Delete(spec);
  return p;
}

/* A load of plan p of ck through reader rd: the target, and for the failover reader the sources it composed. */
struct load {
  struct ld_target t;
  struct failing fail;
  struct ld_source fail_src, *direct, *route;
};

static void load_init(struct load *l, struct reg_ckpt *ck, const struct plan *p, enum reader rd, int device) {
  memset(l, 0, sizeof *l);
  l->t.plan = p;
  l->t.ck = ck->ck;
  l->t.name = ck->path;
  l->t.mmap = ck->src;
  l->t.device = device;
  l->t.choice = rd == RD_DIRECT ? LD_CHOOSE_DIRECT : rd == RD_AUTO ? LD_CHOOSE_AUTO : LD_CHOOSE_MMAP;
  atomic_init(&l->t.bytes_done, 0);
  atomic_init(&l->t.ready_bytes, 0);
  atomic_init(&l->t.cancel, false);
  if (rd != RD_FAILOVER) return;
  /* The failing member fails every read that touches the first 64 KiB of shard 0's data. */
  const struct ckpt_shard *sh = &ck->ck->shards[0];
  l->fail = (struct failing){.inner = ck->src, .shard = 0, .lo = sh->hdr->data_start, .hi = sh->hdr->data_start + (64u << 10)};
  l->fail_src = (struct ld_source){.ops = &failing_ops, .ctx = &l->fail, .ck = ck->ck, .align = 1, .label = "failing"};
  struct wd_error err = {0};
  CHECK_EQ_INT(ld_source_direct_open(ck->ck, false, &l->direct, &err), 0);
  struct ld_source *members[2] = {&l->fail_src, l->direct};
  CHECK_EQ_INT(ld_source_route_open(members, 2, &l->route, &err), 0);
  l->t.src = l->route;
}

/* Frees what ld_fill left to the caller (the slab) and what load_init composed. */
static void load_fini(struct env *e, struct load *l) {
  if (l->t.slab != NULL) e->backend.ops->slab_free(e->backend.ctx, l->t.slab);
  free(l->t.digests);
  ld_source_close(l->route);
  ld_source_close(l->direct);
}

/*
 * Drops the page cache's copy of ck's last shard (its pages are clean:
 * fsync'd when written). The mmap source's own mapping of it is zapped
 * first: the kernel keeps pages a process maps.
 */
static const struct ckpt_shard *evict_last(const struct reg_ckpt *ck) {
  const struct ckpt_shard *sh = &ck->ck->shards[ck->ck->nshards - 1];
  const unsigned char *map = ld_source_map(ck->src, (uint32_t)(ck->ck->nshards - 1));
  CHECK(map != NULL && madvise((void *)map, (size_t)sh->size, MADV_DONTNEED) == 0);
  int fd = open(sh->real, O_RDONLY);
  CHECK(fd >= 0 && posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
  if (fd >= 0) close(fd);
  return sh;
}

/* Page-cache bytes of a file (mincore over a mapping of it). */
static uint64_t cached_bytes(const char *path) {
  int fd = open(path, O_RDONLY);
  struct stat st;
  uint64_t n = 0;
  if (fd < 0 || fstat(fd, &st) != 0 || st.st_size == 0) {
    if (fd >= 0) close(fd);
    return 0;
  }
  long page = sysconf(_SC_PAGESIZE);
  size_t pages = ((size_t)st.st_size + (size_t)page - 1) / (size_t)page;
  void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  unsigned char *vec = malloc(pages);
  if (m != MAP_FAILED && vec != NULL && mincore(m, (size_t)st.st_size, vec) == 0)
    for (size_t k = 0; k < pages; k++) n += (vec[k] & 1) ? (uint64_t)page : 0;
  if (m != MAP_FAILED) munmap(m, (size_t)st.st_size);
  free(vec);
  close(fd);
  return n;
}

/* ---- every source, every way, every plan --------------------------------------------------------- */

static void conform(enum way w, bool big) {
  void (*const small_models[])(struct model *) = {dense_model, moe_model, dsv3_model};
  void (*const big_models[])(struct model *) = {big_model};
  void (*const *models)(struct model *) = big ? big_models : small_models;
  size_t nmodels = big ? 1 : 3;
  static struct model m;
  struct fix f;
  size_t striped = 0, loads = 0;
  if (!fix_start_as(&f, big ? "src-conform-big" : "src-conform", w, NULL, false, big)) {
    fix_stop(&f);
    return;
  }
  for (size_t mi = 0; mi < nmodels; mi++) {
    models[mi](&m);
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/%s", f.scratch, m.name);
    CHECK_EQ_INT(model_write(&m, dir), 0);
    struct acq a = env_acquire(&f.e, dir);
    CHECK(a.ck != NULL);
    if (a.ck == NULL) {
      fprintf(stderr, "%s: %s\n", m.name, a.err.msg);
      continue;
    }
    for (size_t si = 0; m.specs[si] != NULL; si++) {
      struct plan *p = plan_of(a.ck->ck, m.specs[si]);
      if (p == NULL) continue;
      unsigned char *want = want_image(a.ck->ck, p);
      for (int rd = 0; rd < NREADERS; rd++) {
        /* O_DIRECT readers find the last shard cold (a model of two: the first warm), and must leave it so. */
        const struct ckpt_shard *cold = rd == RD_DIRECT || rd == RD_AUTO ? evict_last(a.ck) : NULL;
        if (cold != NULL) CHECK_EQ_INT(cached_bytes(cold->real), 0);
        struct load l;
        load_init(&l, a.ck, p, (enum reader)rd, 0);
        struct wd_error err = {0};
        int rc = ld_fill(f.e.ld, &l.t, &err);
        char what[256];
        snprintf(what, sizeof what, "%s plan %zu (%s) through %s, %s", m.name, si, m.specs[si][0] ? m.specs[si] : "whole",
                 reader_names[rd], way_names[w]);
        if (rc != 0) fprintf(stderr, "%s: %s\n", what, err.msg);
        CHECK_EQ_INT(rc, 0);
        if (rc == 0) {
          loads++;
          striped += l.t.method == LD_METHOD_STRIPED;
          CHECK(slab_equals(&f.e, l.t.slab, want, p->slab_bytes, what));
          CHECK_EQ_INT(atomic_load(&l.t.ready_bytes), p->slab_bytes);
          enum ld_method want_method = w == WAY_IN_PLACE ? LD_METHOD_MEMCPY
                                       : w == WAY_STAGED ? LD_METHOD_STAGED
                                                         : LD_METHOD_STRIPED;
          /* A plan too small for two windows is not striped: it loads in place, as any host load. */
          if (w == WAY_STRIPED && l.t.method != LD_METHOD_STRIPED) want_method = LD_METHOD_MEMCPY;
          if (l.t.method != want_method) fprintf(stderr, "%s: method %s\n", what, ld_method_name(l.t.method));
          CHECK(l.t.method == want_method);
          uint64_t mm = atomic_load(&l.t.source_bytes[LD_SOURCE_MMAP]),
                   pc = atomic_load(&l.t.source_bytes[LD_SOURCE_PAGECACHE]),
                   dr = atomic_load(&l.t.source_bytes[LD_SOURCE_DIRECT]);
          switch (rd) {
          case RD_MMAP: CHECK(mm > 0 && pc == 0 && dr == 0); break;
          case RD_DIRECT: CHECK(mm == 0 && pc == 0 && dr > 0); break;
          case RD_AUTO:
            CHECK_STR_CONTAINS(l.t.source, "pagecache+direct");
            CHECK(dr > 0 && mm == 0);
            if (a.ck->ck->nshards > 1) CHECK(pc > 0); /* the warm first shard came from the page cache */
            break;
          case RD_FAILOVER:
            CHECK(atomic_load(&l.fail.failed) > 0 && dr > 0); /* the failing member's ranges went to O_DIRECT */
            break;
          }
          if (cold != NULL) CHECK_EQ_INT(cached_bytes(cold->real), 0); /* no page-cache use */
        }
        load_fini(&f.e, &l);
      }
      free(want);
      plan_free(p);
    }
    reg_unref(a.ck);
  }
  CHECK_EQ_INT(loads, (big ? 2 : 13) * NREADERS);
  if (w == WAY_STRIPED) CHECK(striped >= loads / 2); /* most plans take enough windows to stripe */
  fix_stop(&f);
}

static void test_conform_in_place(void) { conform(WAY_IN_PLACE, false); }
static void test_conform_staged(void) { conform(WAY_STAGED, false); }
static void test_conform_striped(void) { conform(WAY_STRIPED, false); }
/* The production slot size: aligned windows cut across fill tasks, two fill threads. */
static void test_conform_production(void) {
  conform(WAY_STAGED, true);
  conform(WAY_STRIPED, true);
}

/* ---- what every source reports alike ------------------------------------------------------------------ */

/* A load run on its own thread, so the test can act while it waits at the gate. */
struct bg {
  pthread_t th;
  struct loader *ld;
  struct load *l;
  int rc;
  struct wd_error err;
};

static void *bg_run(void *arg) {
  struct bg *b = arg;
  b->rc = ld_fill(b->ld, &b->l->t, &b->err);
  return NULL;
}

enum mishap { MISHAP_TRUNCATE, MISHAP_REPLACE, MISHAP_CANCEL, NMISHAPS };
static const char *const mishap_names[NMISHAPS] = {"truncated", "replaced", "canceled"};

/*
 * Starts a whole load through reader rd held at the gate after its first
 * window, does the mishap, lets it go, and checks the code every source must
 * give: FAULT, STALE or CANCELED, and no final watermark.
 */
static void mishap(enum way w, enum reader rd, enum mishap what) {
  struct fix f;
  char gate[PATH_MAX];
  char *tmp = fx_tmpdir("src-gate");
  snprintf(gate, sizeof gate, "%s/gate", tmp);
  CHECK_EQ_INT(mkfifo(gate, 0600), 0);
  int gw = open(gate, O_RDWR | O_NONBLOCK); /* a writer from the start: the gate stays closed until bytes come */
  CHECK(gw >= 0);
  if (!fix_start(&f, "src-mishap", w, gate, false)) {
    fix_stop(&f);
    return;
  }
  static struct model m;
  dense_model(&m);
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/%s", f.scratch, m.name);
  CHECK_EQ_INT(model_write(&m, dir), 0);
  struct acq a = env_acquire(&f.e, dir);
  CHECK(a.ck != NULL);
  struct plan *p = a.ck != NULL ? plan_of(a.ck->ck, "") : NULL;
  if (p != NULL) {
    struct load l;
    load_init(&l, a.ck, p, rd, 0);
    struct bg b = {.ld = f.e.ld, .l = &l};
    /*
     * Staged: the first window goes, and the load waits at the gate for the
     * second once the first has landed. In place: a small plan is one window,
     * so the load waits before it, its source already open.
     */
    if (w == WAY_STAGED) CHECK(write(gw, "x", 1) == 1);
    CHECK_EQ_INT(pthread_create(&b.th, NULL, bg_run, &b), 0);
    if (w == WAY_STAGED) {
      for (int i = 0; i < 5000 && atomic_load(&l.t.ready_bytes) == 0; i++) usleep(1000);
      CHECK(atomic_load(&l.t.ready_bytes) > 0);
    } else {
      usleep(200 * 1000);
      CHECK_EQ_INT(atomic_load(&l.t.bytes_done), 0);
    }
    const struct ckpt_shard *last = &a.ck->ck->shards[a.ck->ck->nshards - 1];
    if (what == MISHAP_TRUNCATE) {
      CHECK_EQ_INT(truncate(last->real, (off_t)last->hdr->data_start), 0);
    } else if (what == MISHAP_REPLACE) {
      char other[PATH_MAX];
      snprintf(other, sizeof other, "%s.new", last->real);
      CHECK_EQ_INT(write_shard(other, 7, m.t + m.split, m.n - m.split), 0);
      CHECK_EQ_INT(rename(other, last->real), 0);
    } else {
      atomic_store(&l.t.cancel, true);
    }
    close(gw); /* the gate opens: every window goes */
    gw = -1;
    pthread_join(b.th, NULL);
    int want = what == MISHAP_TRUNCATE ? WEIGHTD_E_FAULT : what == MISHAP_REPLACE ? WEIGHTD_E_STALE : WEIGHTD_E_CANCELED;
    if (b.rc != want)
      fprintf(stderr, "%s load through %s, %s: %s (%s), expected %s\n", mishap_names[what], reader_names[rd],
              way_names[w], weightd_err_name(b.rc), b.err.msg, weightd_err_name(want));
    CHECK_EQ_INT(b.rc, want);
    CHECK(atomic_load(&l.t.ready_bytes) < p->slab_bytes); /* nothing said it was whole */
    if (what == MISHAP_TRUNCATE) CHECK_STR_CONTAINS(b.err.msg, "truncated");
    if (what == MISHAP_REPLACE) CHECK_STR_CONTAINS(b.err.msg, last->rel);
    load_fini(&f.e, &l);
    plan_free(p);
  }
  if (gw >= 0) close(gw);
  if (a.ck != NULL) reg_unref(a.ck);
  fix_stop(&f);
  unlink(gate);
  fx_rmtree(tmp);
  free(tmp);
}

static void test_mishaps(void) {
  for (int w = WAY_IN_PLACE; w <= WAY_STAGED; w++)
    for (int rd = RD_MMAP; rd <= RD_AUTO; rd++)
      for (int what = 0; what < NMISHAPS; what++) mishap((enum way)w, (enum reader)rd, (enum mishap)what);
}

/*
 * A read error: alone it fails the load naming the shard, read once (a
 * striped load does not try its own link again: the source would fail
 * again); routed, the next source serves the range.
 */
static void test_read_error(void) {
  for (int w = WAY_IN_PLACE; w < NWAYS; w++) {
    struct fix f;
    if (!fix_start(&f, "src-readerr", (enum way)w, NULL, false)) {
      fix_stop(&f);
      continue;
    }
    static struct model m;
    dense_model(&m);
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/%s", f.scratch, m.name);
    CHECK_EQ_INT(model_write(&m, dir), 0);
    struct acq a = env_acquire(&f.e, dir);
    struct plan *p = a.ck != NULL ? plan_of(a.ck->ck, "") : NULL;
    if (p != NULL) {
      struct load l;
      load_init(&l, a.ck, p, RD_FAILOVER, 0);
      l.t.src = &l.fail_src; /* the failing member alone */
      struct wd_error err = {0};
      CHECK_EQ_INT(ld_fill(f.e.ld, &l.t, &err), WEIGHTD_E_IO);
      CHECK_STR_CONTAINS(err.msg, "injected read error");
      CHECK_STR_CONTAINS(err.msg, a.ck->ck->shards[0].rel);
      CHECK_STR_CONTAINS(err.msg, "tensor '");
      CHECK(atomic_load(&l.t.ready_bytes) < p->slab_bytes);
      /*
       * The first failure stops the load: no range is read again, and at most one more read, begun before the
       * failure was seen (a second window's task, or striped the other link's share), fails beside it (seen
       * 2 under ASan's timing; 1 is the usual count).
       */
      unsigned failed = (unsigned)atomic_load(&l.fail.failed);
      CHECK(failed >= 1 && failed <= 2);
      load_fini(&f.e, &l);
      plan_free(p);
    }
    if (a.ck != NULL) reg_unref(a.ck);
    fix_stop(&f);
  }
}

/* A filesystem that refuses O_DIRECT (injected): the load reads through mmap instead, and gets the file's bytes. */
static void test_odirect_refused(void) {
  struct fix f;
  if (!fix_start(&f, "src-refused", WAY_STAGED, NULL, true)) {
    fix_stop(&f);
    return;
  }
  static struct model m;
  moe_model(&m);
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/%s", f.scratch, m.name);
  CHECK_EQ_INT(model_write(&m, dir), 0);
  struct acq a = env_acquire(&f.e, dir);
  struct plan *p = a.ck != NULL ? plan_of(a.ck->ck, moe_specs[1]) : NULL;
  if (p != NULL) {
    unsigned char *want = want_image(a.ck->ck, p);
    for (int rd = RD_DIRECT; rd <= RD_AUTO; rd++) {
      struct load l;
      load_init(&l, a.ck, p, (enum reader)rd, 0);
      struct wd_error err = {0};
      CHECK_EQ_INT(ld_fill(f.e.ld, &l.t, &err), 0);
      CHECK(strcmp(l.t.source, "mmap") == 0);
      CHECK_EQ_INT(atomic_load(&l.t.source_bytes[LD_SOURCE_DIRECT]), 0);
      if (l.t.slab != NULL) CHECK(slab_equals(&f.e, l.t.slab, want, p->slab_bytes, "refused O_DIRECT"));
      load_fini(&f.e, &l);
    }
    free(want);
    plan_free(p);
  }
  if (a.ck != NULL) reg_unref(a.ck);
  fix_stop(&f);
}

/*
 * The scratch filesystem enforces O_DIRECT alignment (ext4: an unaligned
 * read is EINVAL), so the conformance loads exercised the direct source's
 * unaligned heads and tails; and a file replaced before a direct source
 * opens is STALE.
 */
static void test_odirect_alignment(void) {
  char *dir = fx_tmpdir("src-align");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/f", dir);
  int fd = open(p, O_WRONLY | O_CREAT, 0644);
  static unsigned char block[3 * 4096];
  CHECK(fd >= 0 && write(fd, block, sizeof block) == (ssize_t)sizeof block && fsync(fd) == 0);
  if (fd >= 0) close(fd);
  fd = open(p, O_RDONLY | O_DIRECT);
  CHECK(fd >= 0);
  void *buf = NULL;
  CHECK_EQ_INT(posix_memalign(&buf, 4096, 8192), 0);
  if (fd >= 0 && buf != NULL) {
    CHECK_EQ_INT(pread(fd, buf, 4096, 0), 4096);
    errno = 0;
    ssize_t n = pread(fd, (char *)buf + 1, 4096, 1);
    if (n >= 0) fprintf(stderr, "%s: the filesystem accepted an unaligned O_DIRECT read: the direct source's "
                                "alignment is not exercised here (put WD_TEST_TMP on ext4)\n", dir);
    CHECK(n < 0 && errno == EINVAL);
  }
  free(buf);
  if (fd >= 0) close(fd);
  fx_rmtree(dir);
  free(dir);
}

int main(void) {
  fault_install();
  log_set_level(LOG_ERROR);
  RUN(test_odirect_alignment);
  RUN(test_conform_in_place);
  RUN(test_conform_staged);
  RUN(test_conform_striped);
  RUN(test_conform_production);
  RUN(test_mishaps);
  RUN(test_read_error);
  RUN(test_odirect_refused);
  return tu_finish();
}
