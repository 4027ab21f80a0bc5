/*
 * cmd_demo.c - `weightctl demo [--dir DIR] [--keep]`: a guided tour. It
 * starts a private daemon on a socket in a temporary directory, generates a
 * small Qwen3-layout checkpoint there, inspects it, loads it, attaches it and
 * compares every byte with the files, shows the daemon's status and shuts the
 * daemon down. Every step is printed as the command a user would type.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ctl.h"

#define START_TIMEOUT_MS 20000
#define EXIT_TIMEOUT_MS 20000

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int step(const char *title, const struct ctl_cmd *cmd, int argc, char **argv) {
  printf("\n$ weightctl");
  if (cmd->flags & CTL_CMD_DAEMON) printf(" --socket %s", ctl_opts.socket);
  for (int i = 0; i < argc; i++) printf(" %s", argv[i]);
  printf("    # %s\n", title);
  fflush(stdout);
  int rc = ctl_run_argv(cmd, argc, argv);
  fflush(stdout);
  if (rc != 0) ctl_errorf("demo: step '%s' failed (exit %d)", title, rc);
  return rc;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* The weightd next to this weightctl, else "weightd" for a PATH search. */
static void find_daemon(char *buf, size_t len) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash != NULL) {
      *slash = '\0';
      snprintf(buf, len, "%s/weightd", self);
      if (access(buf, X_OK) == 0) return;
    }
  }
  snprintf(buf, len, "weightd");
}

/*
 * Starts the daemon with its output in log; returns its pid or -1. Its metrics
 * endpoints are off: the port is for the host's own weightd (and demos run
 * side by side in the tests).
 */
static pid_t daemon_start(const char *exe, const char *sock, const char *root, const char *log) {
  printf("\n$ %s --foreground --backend auto --socket %s --model-root %s --set metrics_address= >%s 2>&1 &"
         "    # a private daemon\n",
         exe, sock, root, log);
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    execlp(exe, exe, "--foreground", "--backend", "auto", "--socket", sock, "--model-root", root, "--set",
           "metrics_address=", (char *)NULL);
    fprintf(stderr, "weightctl demo: cannot run %s: %s\n", exe, strerror(errno));
    _exit(127);
  }
  return pid;
}

/* Waits until the daemon answers hello; 0, or -1 when it exited or took too long. */
static int daemon_wait_ready(pid_t pid, const char *sock) {
  for (int waited = 0; waited < START_TIMEOUT_MS; waited += 50) {
    weightd_client *c = NULL;
    int rc = weightd_connect(sock, &c);
    if (rc == 0) {
      printf("daemon ready (pid %ld, %s backend)\n", (long)pid, weightd_backend(c));
      weightd_close(c);
      return 0;
    }
    weightd_close(c);
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      ctl_errorf("demo: the daemon exited before it was ready (%s %d)",
                 WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      return -2;
    }
    sleep_ms(50);
  }
  ctl_errorf("demo: the daemon did not accept connections within %d s", START_TIMEOUT_MS / 1000);
  return -1;
}

/* Waits for the daemon to exit; 0 when it exited with status 0. Kills it after the timeout. */
static int daemon_wait_exit(pid_t pid) {
  int status;
  for (int waited = 0; waited < EXIT_TIMEOUT_MS; waited += 50) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        printf("daemon exited cleanly (status 0)\n");
        return 0;
      }
      ctl_errorf("demo: the daemon ended with %s %d", WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      return -1;
    }
    if (r < 0) return -1;
    sleep_ms(50);
  }
  ctl_errorf("demo: the daemon did not exit within %d s; killing it", EXIT_TIMEOUT_MS / 1000);
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

static void show_log(const char *log) {
  FILE *f = fopen(log, "r");
  if (f == NULL) return;
  char line[512];
  int n = 0;
  printf("\nthe daemon's log (%s):\n", log);
  while (fgets(line, sizeof line, f) != NULL && n++ < 60) printf("  | %s", line);
  fclose(f);
}

/*
 * The directory the demo works in: DIR (created when missing; its parent must
 * exist) or a new temporary one. Returns 0, or CTL_EXIT_FAIL after saying why.
 */
static int demo_dir(const char *given, char *tmpl, const char **dir) {
  if (given == NULL) {
    if (mkdtemp(tmpl) == NULL) {
      ctl_errorf("demo: cannot create a temporary directory under /tmp: %s", strerror(errno));
      return CTL_EXIT_FAIL;
    }
    *dir = tmpl;
    return 0;
  }
  struct stat st;
  if (mkdir(given, 0755) != 0 && errno != EEXIST) {
    ctl_errorf("demo: --dir %s: cannot create the directory: %s", given, strerror(errno));
    return CTL_EXIT_FAIL;
  }
  if (stat(given, &st) != 0 || !S_ISDIR(st.st_mode)) {
    ctl_errorf("demo: --dir %s: not a directory", given);
    return CTL_EXIT_FAIL;
  }
  *dir = given;
  return 0;
}

static const struct optab_opt demo_opts[] = {
    {CTL_OPT_DIR, "dir", 0, OPTAB_VALUE, "DIR",
     "Work in DIR (created if missing) and keep it: the socket, the daemon's log and the checkpoint.", 0, "@dir"},
    {CTL_OPT_KEEP, "keep", 0, OPTAB_SWITCH, NULL, "Keep the temporary directory instead of removing it.", 0, NULL},
};

static int run_demo(const struct ctl_args *a) {
  const char *dir = NULL;
  int keep = ctl_has(a, CTL_OPT_KEEP);
  char tmpl[] = "/tmp/weightd-demo-XXXXXX";
  if (demo_dir(ctl_val(a, CTL_OPT_DIR), tmpl, &dir) != 0) return CTL_EXIT_FAIL;
  /* With --json the tour's text goes nowhere: one object says how it went. */
  int json = ctl_opts.json, saved_stdout = -1;
  if (json) {
    fflush(stdout);
    saved_stdout = dup(STDOUT_FILENO);
    int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (saved_stdout >= 0 && devnull >= 0) dup2(devnull, STDOUT_FILENO);
    if (devnull >= 0) close(devnull);
  }
  char ckpt[PATH_MAX], sock[PATH_MAX], log[PATH_MAX], exe[PATH_MAX];
  snprintf(ckpt, sizeof ckpt, "%s/qwen3-4b-2layers", dir);
  snprintf(sock, sizeof sock, "%s/weightd.sock", dir);
  snprintf(log, sizeof log, "%s/weightd.log", dir);
  find_daemon(exe, sizeof exe);
  printf("weightd demo: a private daemon on a socket in %s, a synthetic checkpoint with\n"
         "Qwen3-4B's exact tensor layout (2 of its 36 layers, 3 shards like the published one),\n"
         "loaded into device memory (a GPU when the daemon finds one, else a sealed memfd),\n"
         "attached the way an engine attaches, and compared byte for byte with the files.\n",
         dir);

  const char *saved_socket = ctl_opts.socket;
  ctl_opts.socket = sock;
  ctl_opts.json = 0;
  int rc = CTL_EXIT_FAIL, daemon_ok = -1;
  pid_t pid = daemon_start(exe, sock, dir, log);
  if (pid < 0) {
    ctl_errorf("demo: cannot start %s: %s", exe, strerror(errno));
    goto done;
  }
  int ready = daemon_wait_ready(pid, sock);
  if (ready != 0) {
    show_log(log);
    if (ready == -1) {
      kill(pid, SIGKILL);
      waitpid(pid, NULL, 0);
    }
    goto done;
  }

  char *gen[] = {"mkcheckpoint", "--preset", "qwen3-4b", "--layers", "2", "--seed", "1", "--out", ckpt};
  char *ins[] = {"inspect", ckpt};
  char *load[] = {"load", ckpt};
  char *att[] = {"attach", ckpt, "--verify"};
  char *show[] = {"status"};
  char *stop[] = {"shutdown"};
  rc = step("write the checkpoint", &ctl_cmd_mkcheckpoint, 9, gen);
  if (rc == 0) rc = step("validate every shard and summarise", &ctl_cmd_inspect, 2, ins);
  if (rc == 0) rc = step("load it into device memory (one slab, a resident set)", &ctl_cmd_load, 2, load);
  if (rc == 0) rc = step("lease the set, map it here, compare every byte with the files", &ctl_cmd_attach, 3, att);
  if (rc == 0) rc = step("what the daemon holds now (the lease ended when attach exited)", &ctl_cmd_status, 1, show);
  int stop_rc = step("stop the daemon", &ctl_cmd_shutdown, 1, stop);
  if (stop_rc != 0) kill(pid, SIGTERM);
  daemon_ok = daemon_wait_exit(pid);
  if (rc == 0 && (stop_rc != 0 || daemon_ok != 0)) rc = CTL_EXIT_FAIL;
  if (rc != 0) show_log(log);

done:
  ctl_opts.socket = saved_socket;
  bool kept = keep || dir != tmpl;
  if (!kept) {
    if (nftw(tmpl, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) ctl_errorf("demo: could not remove %s", tmpl);
  } else {
    printf("\nkept %s\n", dir);
  }
  if (rc == 0)
    printf("\ndemo finished: loaded, attached and verified; the daemon stopped cleanly.\n"
           "next: README.md, \"Next steps\": install, run it as a service, load and attach from the CLI,\n"
           "use it from C and Python, prewarm from an autoscaler.\n");
  fflush(stdout);
  if (saved_stdout >= 0) {
    dup2(saved_stdout, STDOUT_FILENO);
    close(saved_stdout);
  }
  ctl_opts.json = json;
  if (json && rc == 0) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddTrueToObject(o, "ok");
    cJSON_AddStringToObject(o, "dir", dir);
    cJSON_AddBoolToObject(o, "kept", kept);
    cJSON_AddStringToObject(o, "checkpoint", ckpt);
    ctl_json_print(o);
  }
  return rc == 0 ? CTL_EXIT_OK : rc;
}

const struct ctl_cmd ctl_cmd_demo = {
    .name = "demo",
    .args = "",
    .summary = "start a private daemon, then load, attach and verify a small checkpoint (a guided tour)",
    .description =
        "A guided tour: starts a private weightd (the one beside this weightctl) on a socket in a temporary "
        "directory, writes a small checkpoint with Qwen3-4B's exact layout there, inspects it, loads it, "
        "attaches it and compares every byte with the files, shows the daemon's status and stops the daemon. "
        "Every step is printed as the command a user would type.",
    .opts = CTL_OPTS(demo_opts),
    .run = run_demo,
};
