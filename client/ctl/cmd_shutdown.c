/* cmd_shutdown.c - `weightctl shutdown`: ask the daemon to stop. */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

int cmd_shutdown(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else return ctl_usage("shutdown");
  }
  weightd_client *c;
  if (ctl_connect(&c) != 0) return CTL_EXIT_FAIL;
  char *text = NULL;
  int rc = weightd_request(c, "{\"op\":\"shutdown\"}", &text, NULL, NULL);
  /* A daemon that closed the connection after announcing its shutdown did what was asked. */
  if (rc == WEIGHTD_E_SHUTDOWN) rc = 0;
  if (ctl_opts.json && text != NULL) puts(text);
  if (rc != 0) ctl_fail(c, rc, "shutdown");
  else if (!ctl_opts.json) printf("the daemon is stopping\n");
  weightd_free(text);
  weightd_close(c);
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}
