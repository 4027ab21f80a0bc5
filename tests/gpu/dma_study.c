/*
 * dma_study.c - measurements behind the loader's and libweightd's choices:
 * host-to-device copy rates by source (pinned buffers, a registered file
 * mapping), copy size and stream count, into a destination as large as a
 * resident set; and cudaIpcOpenMemHandle time by allocation size. Not part of
 * the product; docs/benchmarks.md quotes its output.
 *
 *   dma_study SHARD_FILE...
 */
#include <cuda_runtime.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                      \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

struct src {
  char *p;
  size_t len;
};

/* Copies every source into dst back to back in `chunk` pieces over nstreams streams. */
static double copy_all(struct src *s, int n, char *dst, size_t dst_len, size_t chunk, int nstreams,
                       cudaStream_t *st) {
  CK(cudaDeviceSynchronize());
  double t0 = now();
  size_t off = 0, k = 0;
  for (int i = 0; i < n; i++)
    for (size_t o = 0; o < s[i].len; o += chunk, k++) {
      size_t m = s[i].len - o < chunk ? s[i].len - o : chunk;
      CK(cudaMemcpyAsync(dst + (off % dst_len), s[i].p + o, m, cudaMemcpyHostToDevice, st[k % (size_t)nstreams]));
      off += m;
    }
  CK(cudaDeviceSynchronize());
  return now() - t0;
}

/* Frees *p, allocates len again, optionally pauses, then copies: the daemon's evict + load. */
static double realloc_copy(char **p, size_t len, useconds_t pause, struct src *s, int n, size_t chunk,
                           cudaStream_t *st) {
  CK(cudaFree(*p));
  CK(cudaMalloc((void **)p, len));
  if (pause) usleep(pause);
  return copy_all(s, n, *p, len, chunk, 2, st);
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double med3(double a, double b, double c) {
  double v[3] = {a, b, c};
  qsort(v, 3, sizeof *v, cmpd);
  return v[1];
}

static void ipc_child(int rd) {
  CK(cudaFree(0));
  cudaIpcMemHandle_t h;
  size_t size;
  while (read(rd, &size, sizeof size) == sizeof size && read(rd, &h, sizeof h) == sizeof h) {
    void *p;
    double t[3];
    for (int i = 0; i < 3; i++) {
      double t0 = now();
      CK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
      t[i] = now() - t0;
      CK(cudaIpcCloseMemHandle(p));
    }
    printf("ipc open %12zu B (%6.3f GiB): %8.3f ms, %8.3f ms, %8.3f ms\n", size, (double)size / (1 << 30), t[0] * 1e3,
           t[1] * 1e3, t[2] * 1e3);
    fflush(stdout);
  }
  exit(0);
}

int main(int argc, char **argv) {
  int pfd[2];
  if (pipe(pfd) != 0) return 1;
  pid_t child = fork();
  if (child == 0) {
    close(pfd[1]);
    ipc_child(pfd[0]);
  }
  close(pfd[0]);
  int n = argc - 1;
  struct src *s = calloc((size_t)n, sizeof *s);
  size_t total = 0;
  for (int i = 0; i < n; i++) {
    int fd = open(argv[i + 1], O_RDONLY);
    struct stat sb;
    fstat(fd, &sb);
    s[i].len = (size_t)sb.st_size;
    s[i].p = mmap(NULL, s[i].len, PROT_READ, MAP_SHARED, fd, 0);
    for (size_t o = 0; o < s[i].len; o += 4096) (void)((volatile char *)s[i].p)[o];
    total += s[i].len;
  }
  cudaStream_t st[4];
  for (int i = 0; i < 4; i++) CK(cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking));
  char *dst;
  CK(cudaMalloc((void **)&dst, total));
  /* Pinned sources: as many 64 MiB buffers as needed, reused. */
  struct src pin[2];
  for (int i = 0; i < 2; i++) {
    pin[i].len = 64u << 20;
    CK(cudaHostAlloc((void **)&pin[i].p, pin[i].len, cudaHostAllocPortable));
    memset(pin[i].p, 1, pin[i].len);
  }
  size_t reps = total / (2 * pin[0].len);
  struct src *pins = calloc(reps * 2, sizeof *pins);
  for (size_t i = 0; i < reps * 2; i++) pins[i] = pin[i & 1];
  double gib = (double)(reps * 2 * pin[0].len) / (1 << 30), tg = (double)total / (1 << 30);
#define RUN3(label, bytes_gib, expr) \
  do { \
    double a = expr, b = expr, c = expr, m = med3(a, b, c); \
    printf("%-58s %8.1f ms %6.1f GiB/s\n", label, m * 1e3, (bytes_gib) / m); \
    fflush(stdout); \
  } while (0)
  RUN3("pinned 64 MiB copies, 2 streams, dst cycling 2 GiB", gib, copy_all(pins, (int)(reps * 2), dst, 2ull << 30, 64u << 20, 2, st));
  RUN3("pinned 64 MiB copies, 2 streams, dst whole set", gib, copy_all(pins, (int)(reps * 2), dst, total, 64u << 20, 2, st));
  RUN3("pinned 64 MiB copies, 1 stream, dst whole set", gib, copy_all(pins, (int)(reps * 2), dst, total, 64u << 20, 1, st));
  double t0 = now();
  for (int i = 0; i < n; i++) CK(cudaHostRegister(s[i].p, s[i].len, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
  printf("%-58s %8.1f ms\n", "cudaHostRegister of the mappings", (now() - t0) * 1e3);
  RUN3("registered mmap, one copy per shard, 1 stream", tg, copy_all(s, n, dst, total, (size_t)-1, 1, st));
  RUN3("registered mmap, 256 MiB copies, 1 stream", tg, copy_all(s, n, dst, total, 256u << 20, 1, st));
  RUN3("registered mmap, 256 MiB copies, 2 streams", tg, copy_all(s, n, dst, total, 256u << 20, 2, st));
  RUN3("registered mmap, 64 MiB copies, 2 streams", tg, copy_all(s, n, dst, total, 64u << 20, 2, st));
  RUN3("registered mmap, 16 MiB copies, 1 stream", tg, copy_all(s, n, dst, total, 16u << 20, 1, st));
  RUN3("registered mmap, 4 MiB copies, 4 streams", tg, copy_all(s, n, dst, total, 4u << 20, 4, st));
  /* cudaMalloc'd on the default stream while copies run: what fresh slabs cost. */
  double ta = now();
  char *fresh;
  CK(cudaMalloc((void **)&fresh, total));
  printf("%-58s %8.1f ms\n", "cudaMalloc of the set's size", (now() - ta) * 1e3);
  RUN3("registered mmap, 256 MiB copies, 2 streams, fresh dst", tg, copy_all(s, n, fresh, total, 256u << 20, 2, st));
  CK(cudaFree(fresh));
  /* What the daemon does between timed loads: free the last slab, allocate the next. */
  CK(cudaMalloc((void **)&fresh, total));
  RUN3("registered mmap, 256 MiB copies, dst = freed + reallocated", tg,
       realloc_copy(&fresh, total, 0, s, n, 256u << 20, st));
  RUN3("  same, 200 ms pause after the reallocation", tg, realloc_copy(&fresh, total, 200000, s, n, 256u << 20, st));
  RUN3("pinned 64 MiB copies, dst = freed + reallocated", gib,
       realloc_copy(&fresh, total, 0, pins, (int)(reps * 2), 64u << 20, st));
  CK(cudaFree(fresh));
  /* IPC: export allocations of growing size to the child. */
  size_t two = 2u << 20;
  size_t sizes[] = {64u << 20, (1ull << 30) + 4096, 4ull << 30, (4ull << 30) + two, (4ull << 30) + 4096,
                    6ull << 30, 8ull << 30, (total + two - 1) / two * two, total};
  for (int i = 0; i < (int)(sizeof sizes / sizeof sizes[0]); i++) {
    void *p;
    CK(cudaMalloc(&p, sizes[i]));
    cudaIpcMemHandle_t h;
    CK(cudaIpcGetMemHandle(&h, p));
    if (write(pfd[1], &sizes[i], sizeof sizes[i]) < 0 || write(pfd[1], &h, sizeof h) < 0) return 1;
    usleep(300000 + (useconds_t)(sizes[i] >> 20) * 200);
    /* keep p alive until the child is done with it */
  }
  close(pfd[1]);
  int stt;
  waitpid(child, &stt, 0);
  return 0;
}
