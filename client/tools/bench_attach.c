/*
 * bench_attach.c - weightd-bench's fresh processes: --attach-probe times a
 * context, a raw attach round trip, opening the handle alone (legacy IPC or
 * VMM) and the whole attach through libweightd; --early-probe times an
 * early attach to the first layer and the whole set. The parent runs them
 * with run_probe and takes medians.
 */
#include <cjson/cJSON.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_attach.h"
#include "bench_daemon.h"
#include "bench_report.h"
#include "clock.h"
#include "msg.h"
#include "weightd.h"
#include "wire.h"

/* ---- attach from a fresh process ------------------------------------------------------- */

/* A raw protocol connection (proto/wire.h): the handle's parts are timed without libweightd. */
static int raw_connect(const char *sock) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) bench_die("connect", strerror(errno));
  return fd;
}

/* Sends json and returns the final reply (skipping events); f keeps the reply's descriptors. */
static cJSON *raw_call(int fd, const char *json, struct wire_frame *f) {
  struct wd_error err = {0};
  if (wire_send_frame(fd, json, strlen(json), NULL, 0, &err) != 0) bench_die("send", err.msg);
  for (;;) {
    memset(f, 0, sizeof *f);
    if (wire_recv_frame(fd, 60000, f, &err) != 0) bench_die("receive", err.msg);
    cJSON *m = cJSON_Parse(f->json);
    if (m != NULL && cJSON_GetObjectItemCaseSensitive(m, "event") == NULL) return m;
    cJSON_Delete(m);
    wire_frame_clear(f);
  }
}

/* A driver entry point through the runtime (the bench links no libcuda). */
static void *driver_fn(const char *sym) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(sym, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess || fn == NULL)
    bench_die("driver entry point", sym);
  return fn;
}

#define CU_OK(call)                                    \
  do {                                                 \
    CUresult r_ = (call);                              \
    if (r_ != CUDA_SUCCESS) {                          \
      char n_[32];                                     \
      snprintf(n_, sizeof n_, "CUresult %d", (int)r_); \
      bench_die(#call, n_);                            \
    }                                                  \
  } while (0)

/*
 * What libweightd does with a cuda_vmm descriptor, timed alone: import,
 * reserve an address range, map, grant this device read access (read-write
 * where the driver refuses read-only); then undone, untimed.
 */
static double vmm_open_time(int fd, uint64_t bytes, int device) {
  PFN_cuDeviceGet_v2000 device_get = (PFN_cuDeviceGet_v2000)driver_fn("cuDeviceGet");
  PFN_cuMemImportFromShareableHandle_v10020 import =
      (PFN_cuMemImportFromShareableHandle_v10020)driver_fn("cuMemImportFromShareableHandle");
  PFN_cuMemAddressReserve_v10020 reserve = (PFN_cuMemAddressReserve_v10020)driver_fn("cuMemAddressReserve");
  PFN_cuMemMap_v10020 map = (PFN_cuMemMap_v10020)driver_fn("cuMemMap");
  PFN_cuMemRelease_v10020 release = (PFN_cuMemRelease_v10020)driver_fn("cuMemRelease");
  PFN_cuMemSetAccess_v10020 set_access = (PFN_cuMemSetAccess_v10020)driver_fn("cuMemSetAccess");
  PFN_cuMemUnmap_v10020 unmap = (PFN_cuMemUnmap_v10020)driver_fn("cuMemUnmap");
  PFN_cuMemAddressFree_v10020 address_free = (PFN_cuMemAddressFree_v10020)driver_fn("cuMemAddressFree");
  CUdevice dev;
  CU_OK(device_get(&dev, device));
  CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
                            .flags = CU_MEM_ACCESS_FLAGS_PROT_READ};
  CUmemGenericAllocationHandle h;
  CUdeviceptr va = 0;
  double t0 = clock_s();
  CU_OK(import(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CU_OK(reserve(&va, (size_t)bytes, 0, 0, 0));
  CU_OK(map(va, (size_t)bytes, 0, h, 0));
  CU_OK(release(h));
  if (set_access(va, (size_t)bytes, &access, 1) != CUDA_SUCCESS) {
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(set_access(va, (size_t)bytes, &access, 1));
  }
  double t = clock_s() - t0;
  CU_OK(unmap(va, (size_t)bytes));
  CU_OK(address_free(va, (size_t)bytes));
  return t;
}

/*
 * The fresh process: context creation, then attach, each timed; prints
 * "ctx_s attach_s roundtrip_s open_s kind tensors": the round trip and the open split
 * the attach into a bare request/reply (with its descriptor, if any) and
 * opening the handle alone.
 */
int bench_attach_probe(const char *set, const char *sock, int device) {
  double t0 = clock_s();
  CUDA_OK(cudaSetDevice(device));
  CUDA_OK(cudaFree(0));
  double t_ctx = clock_s() - t0;
  /* The parts: one raw attach (reply only), then opening its handle alone. */
  int raw = raw_connect(sock);
  struct wire_frame f;
  /* The binary tensor table, as libweightd asks for it: the reply's size does not grow with the tensors. */
  cJSON_Delete(raw_call(raw,
                        "{\"op\":\"hello\",\"id\":1,\"protocol\":1,\"handles\":[\"fd\",\"cuda_ipc\",\"cuda_vmm\"],"
                        "\"features\":[\"tensor_table\"]}",
                        &f));
  wire_frame_clear(&f);
  char req[128];
  snprintf(req, sizeof req, "{\"op\":\"attach\",\"id\":2,\"set\":\"%s\"}", set);
  t0 = clock_s();
  cJSON *reply = raw_call(raw, req, &f);
  double t_rt = clock_s() - t0;
  const cJSON *h = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(reply, "handles"), 0);
  const cJSON *kind = cJSON_GetObjectItemCaseSensitive(h, "kind");
  const cJSON *lease = cJSON_GetObjectItemCaseSensitive(reply, "lease");
  const cJSON *hbytes = cJSON_GetObjectItemCaseSensitive(h, "bytes");
  const cJSON *fdi = cJSON_GetObjectItemCaseSensitive(h, "fd_index");
  if (!cJSON_IsString(kind) || !cJSON_IsString(lease) || !cJSON_IsNumber(hbytes)) bench_die("attach", f.json);
  char kind_name[16];
  snprintf(kind_name, sizeof kind_name, "%s", kind->valuestring);
  double t_open = -1;
  if (strcmp(kind_name, "cuda_ipc") == 0) {
    const cJSON *hex = cJSON_GetObjectItemCaseSensitive(h, "handle");
    cudaIpcMemHandle_t ih;
    if (!cJSON_IsString(hex) || msg_hex_decode(hex->valuestring, &ih, sizeof ih) != 0)
      bench_die("attach", "bad handle");
    void *p = NULL;
    t0 = clock_s();
    CUDA_OK(cudaIpcOpenMemHandle(&p, ih, cudaIpcMemLazyEnablePeerAccess));
    t_open = clock_s() - t0;
    CUDA_OK(cudaIpcCloseMemHandle(p));
  } else if (strcmp(kind_name, "cuda_vmm") == 0) {
    int i = cJSON_IsNumber(fdi) ? fdi->valueint : 0;
    if (i < 0 || (size_t)i >= f.nfds) bench_die("attach", "a cuda_vmm reply without its descriptor");
    t_open = vmm_open_time(f.fds[i], (uint64_t)hbytes->valuedouble, device);
  }
  wire_frame_clear(&f); /* closes the descriptor */
  snprintf(req, sizeof req, "{\"op\":\"release\",\"id\":3,\"lease\":\"%s\"}", lease->valuestring);
  cJSON_Delete(reply);
  cJSON_Delete(raw_call(raw, req, &f));
  wire_frame_clear(&f);
  close(raw);
  /* The whole attach through libweightd, to pointers the process can use. */
  weightd_client *c = bench_connect_or_die(sock);
  weightd_set *s = NULL;
  t0 = clock_s();
  if (weightd_attach(c, set, &s) != 0) bench_die("attach", weightd_last_error(c));
  size_t ntensors = weightd_set_tensor_count(s);
  weightd_tensor t = {.struct_size = sizeof t};
  if (weightd_set_tensor(s, ntensors / 2, &t) != 0 || t.data == NULL) bench_die("attach", "no usable pointer");
  double t_attach = clock_s() - t0;
  /* Touch the memory through the pointer to show it is usable. */
  unsigned char byte;
  CUDA_OK(cudaMemcpy(&byte, t.data, 1, cudaMemcpyDeviceToHost));
  printf("%.6f %.6f %.6f %.6f %s %zu\n", t_ctx, t_attach, t_rt, t_open, kind_name, ntensors);
  weightd_release(s);
  weightd_close(c);
  return 0;
}

/*
 * Runs this program as a fresh process, `self flag arg --socket S --device D
 * [--plan P]`, and reads what it prints into buf (NUL-terminated; empty when
 * it printed nothing).
 */
static void run_probe(const char *self, const char *flag, const char *arg, const char *sock, int device, char *buf,
                      size_t len) {
  int p[2];
  if (pipe(p) != 0) bench_die("pipe", strerror(errno));
  pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], 1);
    char dev[16];
    snprintf(dev, sizeof dev, "%d", device);
    if (bench_cfg.plan_json != NULL)
      execl(self, self, flag, arg, "--socket", sock, "--device", dev, "--plan", bench_cfg.plan_json, (char *)NULL);
    else
      execl(self, self, flag, arg, "--socket", sock, "--device", dev, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  size_t got = 0;
  for (;;) { /* until the probe closes its end: one line, perhaps in pieces */
    ssize_t n = read(p[0], buf + got, len - 1 - got);
    if (n > 0 && (got += (size_t)n) < len - 1) continue;
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  buf[got] = '\0';
  close(p[0]);
  int st;
  waitpid(pid, &st, 0);
}

void bench_probe_attach(const char *self, const char *sock, const char *set, int device, double *ctx, double *att,
                        double *rt, double *opn, char kind[16], size_t *ntensors) {
  char buf[160];
  run_probe(self, "--attach-probe", set, sock, device, buf, sizeof buf);
  if (sscanf(buf, "%lf %lf %lf %lf %15s %zu", ctx, att, rt, opn, kind, ntensors) != 6)
    bench_die("attach probe", "no result");
}

/* ---- early attach ------------------------------------------------------------------- */

/*
 * The fresh process of an early attach: a context, then attach the
 * checkpoint early (the parent evicted its set, so the load starts with
 * the attach); prints "ctx_s attach_s first_layer_s all_s tensors
 * first_layer_tensors", every time from the attach call.
 */
int bench_early_probe(const char *path, const char *sock, int device) {
  double t0 = clock_s();
  CUDA_OK(cudaSetDevice(device));
  CUDA_OK(cudaFree(0));
  double t_ctx = clock_s() - t0;
  weightd_client *c = bench_connect_or_die(sock);
  char dev[16];
  snprintf(dev, sizeof dev, "%d", device);
  struct weightd_load_options o = {
      .struct_size = sizeof o, .device = dev, .plan_json = bench_cfg.plan_json, .flags = WEIGHTD_ATTACH_EARLY};
  weightd_set *s = NULL;
  t0 = clock_s();
  if (weightd_attach_path(c, path, &o, &s) != 0) bench_die("early attach", weightd_last_error(c));
  double t_attach = clock_s() - t0;
  size_t n = weightd_set_tensor_count(s), last = 0;
  weightd_tensor t = {.struct_size = sizeof t};
  for (size_t i = 0; i < n; i++)
    if (weightd_set_tensor(s, i, &t) == 0 && strstr(t.name, ".layers.0.") != NULL) last = i;
  int rc = weightd_set_wait_tensor(s, last, 600000);
  if (rc != 0) bench_die("waiting for the first layer", weightd_strerror(rc));
  weightd_set_tensor(s, last, &t);
  unsigned char byte;
  CUDA_OK(cudaMemcpy(&byte, t.data, 1, cudaMemcpyDeviceToHost)); /* usable: a read through its pointer */
  double t_first = clock_s() - t0;
  if ((rc = weightd_set_wait(s, NULL, 600000)) != 0) bench_die("waiting for the set", weightd_strerror(rc));
  double t_all = clock_s() - t0;
  printf("%.6f %.6f %.6f %.6f %zu %zu\n", t_ctx, t_attach, t_first, t_all, n, last + 1);
  weightd_release(s);
  weightd_close(c);
  return 0;
}

/* The early phase: evicts the device's sets, then times fresh processes attaching the checkpoint early (medians). */
void bench_phase_early(const char *self, const char *abs) {
  double att[16], first[16], all[16], ctx;
  size_t tensors = 0, first_tensors = 0;
  int probes = bench_cfg.runs < 16 ? bench_cfg.runs : 16;
  for (int i = 0; i < probes; i++) {
    bench_evict_all(bench_cfg.device);
    if (bench_cfg.settle_ms > 0) usleep((useconds_t)bench_cfg.settle_ms * 1000);
    char buf[256];
    run_probe(self, "--early-probe", abs, bench_daemons[0].sock, bench_cfg.device, buf, sizeof buf);
    if (sscanf(buf, "%lf %lf %lf %lf %zu %zu", &ctx, &att[i], &first[i], &all[i], &tensors, &first_tensors) != 6)
      bench_die("early probe", "no result");
  }
  double a = bench_median(att, probes), f = bench_median(first, probes), w = bench_median(all, probes);
  bench_put_num(bench_result, "early_attach_s", a);
  bench_put_num(bench_result, "early_first_layer_s", f);
  bench_put_num(bench_result, "early_all_s", w);
  bench_put_num(bench_result, "early_tensors", (double)tensors);
  bench_put_num(bench_result, "early_first_layer_tensors", (double)first_tensors);
  bench_put_num(bench_result, "early_first_layer_ratio", w > 0 ? f / w : 0);
  bench_put_num(bench_result, "early_probes", probes);
  fprintf(bench_out, "%-46s %8.3f ms   (the set still loading; median of %d)\n", "early attach: attach returns",
          a * 1e3, probes);
  char label[64];
  snprintf(label, sizeof label, "early attach: first layer usable (%zu tensors)", first_tensors);
  fprintf(bench_out, "%-46s %8.1f ms   (%.1f%% of the whole load; target <= 10%%)\n", label, f * 1e3,
          w > 0 ? 100 * f / w : 0);
  snprintf(label, sizeof label, "early attach: whole set ready (%zu tensors)", tensors);
  fprintf(bench_out, "%-46s %8.1f ms   (from the attach call: plan, allocation and load)\n", label, w * 1e3);
}
