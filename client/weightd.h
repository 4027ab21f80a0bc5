/*
 * weightd.h - the public C interface of weightd.
 *
 * This header is the contract between weightd and the programs that link
 * libweightd. Everything else in the source tree is internal.
 *
 * Error codes: every function that can fail returns 0 on success or one of
 * the negative WEIGHTD_E* codes below. weightd_strerror() gives a short
 * message for a code, weightd_err_name() the name that travels on the wire.
 * A code's number never changes and is never reused.
 */
#ifndef WEIGHTD_H
#define WEIGHTD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WEIGHTD_VERSION_MAJOR 0
#define WEIGHTD_VERSION_MINOR 1
#define WEIGHTD_VERSION_PATCH 0
#define WEIGHTD_VERSION_STRING "0.1.0"
/* One number for comparisons: 0xMMmmpp. */
#define WEIGHTD_VERSION_HEX \
  ((WEIGHTD_VERSION_MAJOR << 16) | (WEIGHTD_VERSION_MINOR << 8) | WEIGHTD_VERSION_PATCH)

/*
 * The error table: XX(NAME, number, message). The wire name of a code is
 * NAME as written here ("BAD_HEADER"); the C constant is WEIGHTD_E_NAME.
 */
#define WEIGHTD_ERRNO_MAP(XX)                                                   \
  XX(IO,            1, "input/output error")                                    \
  XX(NOMEM,         2, "out of memory")                                         \
  XX(INVALID,       3, "invalid argument")                                      \
  XX(NOT_FOUND,     4, "not found")                                             \
  XX(BAD_HEADER,    5, "invalid safetensors header")                            \
  XX(BAD_TENSOR,    6, "invalid tensor entry")                                  \
  XX(BAD_SIZE,      7, "file size does not match its header")                   \
  XX(BAD_INDEX,     8, "invalid checkpoint index")                              \
  XX(BAD_CONFIG,    9, "invalid or incomplete model config")                    \
  XX(PATH_DENIED,  10, "path outside the configured model roots")              \
  XX(BAD_REQUEST,  11, "malformed request")                                     \
  XX(PROTOCOL,     12, "protocol error")                                        \
  XX(VERSION,      13, "protocol version not supported")                        \
  XX(PERMISSION,   14, "permission denied")                                     \
  XX(BUSY,         15, "resource busy")                                         \
  XX(CANCELED,     16, "operation canceled")                                    \
  XX(DEVICE,       17, "device error")                                          \
  XX(DEVICE_NOMEM, 18, "device out of memory")                                  \
  XX(STALE,        19, "file changed since it was opened")                      \
  XX(FAULT,        20, "file truncated or unreadable under its mapping")        \
  XX(BAD_PLAN,     21, "plan does not fit the checkpoint")                      \
  XX(CONNECT,      22, "cannot connect to the daemon")                          \
  XX(CLOSED,       23, "connection closed")                                     \
  XX(TIMEOUT,      24, "timed out")                                             \
  XX(UNSUPPORTED,  25, "not supported")                                         \
  XX(SHUTDOWN,     26, "daemon is shutting down")                               \
  XX(LIMIT,        27, "limit exceeded")                                        \
  XX(BAD_CHECKSUM, 28, "bytes differ from the file")                            \
  XX(INTERNAL,     29, "internal error")

enum weightd_errno {
  WEIGHTD_OK = 0,
#define WEIGHTD_XX_(name, num, msg) WEIGHTD_E_##name = -(num),
  WEIGHTD_ERRNO_MAP(WEIGHTD_XX_)
#undef WEIGHTD_XX_
};

/* The message for an error code ("unknown error" for codes not in the table). */
const char *weightd_strerror(int code);
/* The wire name of an error code ("OK" for 0, "UNKNOWN" outside the table). */
const char *weightd_err_name(int code);
/* The library's version, WEIGHTD_VERSION_HEX of the build that is running. */
unsigned weightd_version(void);
/* The library's version as a string, e.g. "0.1.0". */
const char *weightd_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* WEIGHTD_H */
