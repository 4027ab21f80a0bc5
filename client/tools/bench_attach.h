/* bench_attach.h - weightd-bench's fresh processes that attach (bench_attach.c). */
#ifndef WD_BENCH_ATTACH_H
#define WD_BENCH_ATTACH_H

#include <stddef.h>

/* The fresh process of --attach-probe and --early-probe: each prints one line of figures. */
int bench_attach_probe(const char *set, const char *sock, int device);
int bench_early_probe(const char *path, const char *sock, int device);
/* Runs `self --attach-probe set` and reads its figures. */
void bench_probe_attach(const char *self, const char *sock, const char *set, int device, double *ctx, double *att,
                        double *rt, double *opn, char kind[16], size_t *ntensors);
/* The early phase: evicts the device's sets, then times fresh processes attaching the checkpoint early (medians). */
void bench_phase_early(const char *self, const char *abs);

#endif
