/*
 * ipc_handle.h - the size of a legacy CUDA IPC memory handle, written once.
 *
 * The daemon's cuda backend exports cudaIpcMemHandle_t (the runtime's type);
 * libweightd opens it as the driver's CUipcMemHandle, which it declares itself
 * because it loads the driver at run time. Both are 64 opaque bytes; each side
 * asserts its own type's size against this constant, and the handle travels as
 * 2 * WD_IPC_HANDLE_BYTES hex digits.
 */
#ifndef WD_IPC_HANDLE_H
#define WD_IPC_HANDLE_H

#define WD_IPC_HANDLE_BYTES 64

#endif
