/*
 * libweightd.c - the client library engines link.
 *
 * Today it carries the error table and the version functions; the daemon
 * client (connect, load, attach) lands with the daemon.
 */
#include "weightd.h"
