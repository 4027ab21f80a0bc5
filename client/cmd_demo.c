/*
 * cmd_demo.c - `weightctl demo [--dir DIR] [--keep]`: a guided tour that
 * generates a small Qwen3-layout checkpoint and inspects it.
 */
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctl.h"

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int step(const char *title, int (*fn)(int, char **), int argc, char **argv) {
  printf("\n$ weightctl");
  for (int i = 0; i < argc; i++) printf(" %s", argv[i]);
  printf("    # %s\n", title);
  fflush(stdout);
  int rc = fn(argc, argv);
  fflush(stdout);
  if (rc != 0) ctl_errorf("demo: step '%s' failed (exit %d)", title, rc);
  return rc;
}

int cmd_demo(int argc, char **argv) {
  const char *dir = NULL;
  int keep = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) dir = argv[++i];
    else if (strcmp(argv[i], "--keep") == 0) keep = 1;
    else return ctl_usage("demo");
  }
  char tmpl[] = "/tmp/weightd-demo-XXXXXX";
  char ckpt[PATH_MAX];
  if (dir == NULL) {
    if (mkdtemp(tmpl) == NULL) {
      ctl_errorf("demo: cannot create a temporary directory");
      return CTL_EXIT_FAIL;
    }
    dir = tmpl;
  }
  snprintf(ckpt, sizeof ckpt, "%s/qwen3-4b-2layers", dir);
  printf("weightd demo: a synthetic checkpoint with Qwen3-4B's exact tensor layout\n"
         "(2 of its 36 layers, 3 shards like the published one), then validated and\n"
         "summarised the way the daemon reads it.\n");
  char *gen[] = {"mkcheckpoint", "--preset", "qwen3-4b", "--layers", "2", "--seed", "1", "--out", ckpt};
  char *ins[] = {"inspect", ckpt};
  int rc = step("write the checkpoint", cmd_mkcheckpoint, 9, gen);
  if (rc == 0) rc = step("validate every shard and summarise", cmd_inspect, 2, ins);
  if (!keep && dir == tmpl) {
    if (nftw(tmpl, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
      ctl_errorf("demo: could not remove %s", tmpl);
  } else {
    printf("\nkept %s\n", ckpt);
  }
  if (rc == 0) printf("\ndemo finished: the checkpoint is valid.\n");
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}
