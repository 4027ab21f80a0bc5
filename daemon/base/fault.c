/* fault.c - SIGBUS recovery for reads from file mappings (see fault.h). */
#include "fault.h"

#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "error.h"

/* volatile: the stores that arm and disarm it must happen, though only the handler reads it. */
static _Thread_local sigjmp_buf *volatile recovery;

static void on_sigbus(int sig, siginfo_t *info, void *uctx) {
  (void)info;
  (void)uctx;
  sigjmp_buf *r = recovery;
  if (r != NULL) siglongjmp(*r, 1);
  /* Not ours: die as the default action would. */
  signal(sig, SIG_DFL);
  raise(sig);
}

int fault_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  return sigaction(SIGBUS, &sa, NULL);
}

int fault_copy(void *dst, const void *src, size_t n) {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    recovery = NULL;
    return WEIGHTD_E_FAULT;
  }
  recovery = &jb;
  memcpy(dst, src, n);
  recovery = NULL;
  return 0;
}

int fault_touch(const void *p, size_t n) {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    recovery = NULL;
    return WEIGHTD_E_FAULT;
  }
  recovery = &jb;
  const volatile unsigned char *c = p;
  long page = sysconf(_SC_PAGESIZE);
  unsigned sum = 0;
  for (size_t i = 0; i < n; i += (size_t)page) sum += c[i];
  if (n > 0) sum += c[n - 1];
  recovery = NULL;
  (void)sum;
  return 0;
}

int fault_call(int (*fn)(void *arg), void *arg) {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    recovery = NULL;
    return WEIGHTD_E_FAULT;
  }
  recovery = &jb;
  int rc = fn(arg);
  recovery = NULL;
  return rc;
}
