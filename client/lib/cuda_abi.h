/*
 * cuda_abi.h - the part of the CUDA driver API's ABI that libweightd calls.
 *
 * libweightd loads the driver at run time (cuda_import.c) and includes no
 * CUDA header, so it declares the few types and values it needs here. Every
 * name carries a cuabi_ / CUABI_ prefix, so that a file can include both this
 * header and cuda.h: tests/test_cuda_abi.c does, in every build with the CUDA
 * toolkit, and asserts each size, field offset and value below against
 * cuda.h's own (the comment on each names its cuda.h counterpart). Enumerated
 * parameters and fields are ints, as C enums are in the driver's ABI.
 */
#ifndef WD_CUDA_ABI_H
#define WD_CUDA_ABI_H

#include "handles.h"

typedef int cuabi_result;                   /* CUresult */
typedef int cuabi_device;                   /* CUdevice */
typedef void *cuabi_context;                /* CUcontext */
typedef unsigned long long cuabi_deviceptr; /* CUdeviceptr */
typedef unsigned long long cuabi_mem_handle; /* CUmemGenericAllocationHandle */

typedef struct { /* CUuuid */
  char bytes[16];
} cuabi_uuid;

typedef struct { /* CUipcMemHandle */
  char reserved[WD_IPC_HANDLE_BYTES];
} cuabi_ipc_mem_handle;

struct cuabi_mem_location { /* CUmemLocation */
  int type;                 /* CUmemLocationType */
  int id;
};

struct cuabi_mem_access_desc { /* CUmemAccessDesc */
  struct cuabi_mem_location location;
  int flags; /* CUmemAccess_flags */
};

struct cuabi_mem_allocation_prop { /* CUmemAllocationProp */
  int type;                        /* CUmemAllocationType */
  int requested_handle_types;      /* CUmemAllocationHandleType */
  struct cuabi_mem_location location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
};

/* CUresult */
#define CUABI_SUCCESS 0 /* CUDA_SUCCESS */
/* CUipcMem_flags */
#define CUABI_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1 /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
/* CUmemAllocationType */
#define CUABI_MEM_ALLOCATION_TYPE_PINNED 0x1 /* CU_MEM_ALLOCATION_TYPE_PINNED */
/* CUmemAllocationHandleType */
#define CUABI_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1 /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
/* CUmemLocationType */
#define CUABI_MEM_LOCATION_TYPE_DEVICE 0x1 /* CU_MEM_LOCATION_TYPE_DEVICE */
/* CUmemAccess_flags */
#define CUABI_MEM_ACCESS_FLAGS_PROT_READ 0x1      /* CU_MEM_ACCESS_FLAGS_PROT_READ */
#define CUABI_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3 /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
/* CUmemAllocationGranularity_flags */
#define CUABI_MEM_ALLOC_GRANULARITY_MINIMUM 0x0     /* CU_MEM_ALLOC_GRANULARITY_MINIMUM */
#define CUABI_MEM_ALLOC_GRANULARITY_RECOMMENDED 0x1 /* CU_MEM_ALLOC_GRANULARITY_RECOMMENDED */
/* CUdevice_attribute */
#define CUABI_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CUABI_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103

#endif
