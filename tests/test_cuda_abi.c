/*
 * test_cuda_abi.c - libweightd's own declarations of the CUDA driver ABI
 * (client/lib/cuda_abi.h) against the toolkit's cuda.h.
 *
 * libweightd loads the driver at run time and includes no CUDA header, so a
 * wrong struct layout or enum value there would pass every host test and
 * corrupt memory on a GPU. Every size, field offset and value it declares is
 * checked here at compile time; the build fails on a mismatch. Built wherever
 * the CUDA toolkit is (no driver or GPU needed); the run only reports.
 */
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>

#include "cuda_abi.h"

#define SAME_SIZE(ours, theirs) _Static_assert(sizeof(ours) == sizeof(theirs), #ours " has the size of " #theirs)
#define SAME_FIELD(ours, of, theirs, tf)                                                              \
  _Static_assert(offsetof(ours, of) == offsetof(theirs, tf) &&                                        \
                     sizeof(((ours *)0)->of) == sizeof(((theirs *)0)->tf),                            \
                 #ours "." #of " lies where " #theirs "." #tf " does")
#define SAME_VALUE(ours, theirs) _Static_assert((long long)(ours) == (long long)(theirs), #ours " is " #theirs)

/* Scalars and opaque handles. */
SAME_SIZE(cuabi_result, CUresult);
SAME_SIZE(cuabi_device, CUdevice);
SAME_SIZE(cuabi_context, CUcontext);
SAME_SIZE(cuabi_deviceptr, CUdeviceptr);
SAME_SIZE(cuabi_mem_handle, CUmemGenericAllocationHandle);
SAME_SIZE(cuabi_uuid, CUuuid);
SAME_FIELD(cuabi_uuid, bytes, CUuuid, bytes);
SAME_SIZE(cuabi_ipc_mem_handle, CUipcMemHandle);
SAME_FIELD(cuabi_ipc_mem_handle, reserved, CUipcMemHandle, reserved);
_Static_assert(sizeof(CUipcMemHandle) == WD_IPC_HANDLE_BYTES, "the IPC handle travels as 64 bytes");

/* Enumerations are passed and stored as int. */
SAME_SIZE(int, CUmemLocationType);
SAME_SIZE(int, CUmemAccess_flags);
SAME_SIZE(int, CUmemAllocationType);
SAME_SIZE(int, CUmemAllocationHandleType);
SAME_SIZE(int, CUmemAllocationGranularity_flags);
SAME_SIZE(int, CUdevice_attribute);

/* VMM structures. */
SAME_SIZE(struct cuabi_mem_location, CUmemLocation);
SAME_FIELD(struct cuabi_mem_location, type, CUmemLocation, type);
SAME_FIELD(struct cuabi_mem_location, id, CUmemLocation, id);
SAME_SIZE(struct cuabi_mem_access_desc, CUmemAccessDesc);
SAME_FIELD(struct cuabi_mem_access_desc, location, CUmemAccessDesc, location);
SAME_FIELD(struct cuabi_mem_access_desc, flags, CUmemAccessDesc, flags);
SAME_SIZE(struct cuabi_mem_allocation_prop, CUmemAllocationProp);
SAME_FIELD(struct cuabi_mem_allocation_prop, type, CUmemAllocationProp, type);
SAME_FIELD(struct cuabi_mem_allocation_prop, requested_handle_types, CUmemAllocationProp, requestedHandleTypes);
SAME_FIELD(struct cuabi_mem_allocation_prop, location, CUmemAllocationProp, location);
SAME_FIELD(struct cuabi_mem_allocation_prop, win32_handle_meta_data, CUmemAllocationProp, win32HandleMetaData);
SAME_FIELD(struct cuabi_mem_allocation_prop, alloc_flags, CUmemAllocationProp, allocFlags);
SAME_FIELD(struct cuabi_mem_allocation_prop, alloc_flags.compression_type, CUmemAllocationProp,
           allocFlags.compressionType);
SAME_FIELD(struct cuabi_mem_allocation_prop, alloc_flags.gpu_direct_rdma_capable, CUmemAllocationProp,
           allocFlags.gpuDirectRDMACapable);
SAME_FIELD(struct cuabi_mem_allocation_prop, alloc_flags.usage, CUmemAllocationProp, allocFlags.usage);
SAME_FIELD(struct cuabi_mem_allocation_prop, alloc_flags.reserved, CUmemAllocationProp, allocFlags.reserved);

/* Values. */
SAME_VALUE(CUABI_SUCCESS, CUDA_SUCCESS);
SAME_VALUE(CUABI_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
SAME_VALUE(CUABI_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_ALLOCATION_TYPE_PINNED);
SAME_VALUE(CUABI_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
SAME_VALUE(CUABI_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_DEVICE);
SAME_VALUE(CUABI_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READ);
SAME_VALUE(CUABI_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
SAME_VALUE(CUABI_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
SAME_VALUE(CUABI_MEM_ALLOC_GRANULARITY_RECOMMENDED, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
SAME_VALUE(CUABI_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
           CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
SAME_VALUE(CUABI_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
           CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);

int main(void) {
  printf("cuda_abi.h agrees with cuda.h %d.%d (checked at compile time)\n", CUDA_VERSION / 1000,
         CUDA_VERSION % 1000 / 10);
  return 0;
}
