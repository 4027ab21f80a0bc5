/* bench_multi.h - weightd-bench's multi-GPU modes (bench_multi.c). */
#ifndef WD_BENCH_MULTI_H
#define WD_BENCH_MULTI_H

/* Runs `--multi MODE ...` (argv without the program name); returns the exit status. */
int bench_multi_main(int argc, char **argv);

#endif
