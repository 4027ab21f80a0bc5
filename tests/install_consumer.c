/* install_consumer.c - a program built against an installed libweightd (tests/install_check.sh). */
#include <stdio.h>
#include <weightd.h>

int main(void) {
  if (weightd_version() != WEIGHTD_VERSION_HEX) return 1; /* header and library from one build */
  printf("weightd %s: %s\n", weightd_version_string(), weightd_strerror(WEIGHTD_E_BAD_PLAN));
  return 0;
}
