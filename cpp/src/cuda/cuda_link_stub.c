/* Link stub for libcuda: lets the CUDA backend link on a machine without the
 * NVIDIA driver (the driver, not the toolkit, ships libcuda).
 *
 * Built with SONAME libcuda.so.1 in the build tree only; never installed and
 * never on an RPATH, so at run time the loader finds the real driver's
 * libcuda.so.1. If this stub is loaded anyway, every call fails with
 * CUDA_ERROR_STUB_LIBRARY, as NVIDIA's own stubs do. Defining the functions
 * against cuda.h's prototypes picks up its versioned names (cuMemGetInfo_v2 ...).
 * Keep in step with the calls cuda_backend.cpp makes: a missing one is a link error. */
#include <cuda.h>
#include <stddef.h>

static const char kStubErrorName[] = "CUDA_ERROR_STUB_LIBRARY";
static const char kStubErrorText[] =
    "the build-time libcuda link stub was loaded instead of the NVIDIA driver's libcuda.so.1";

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** text) {
  (void)error;
  *text = kStubErrorName;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorString(CUresult error, const char** text) {
  (void)error;
  *text = kStubErrorText;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuInit(unsigned int flags) {
  (void)flags;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDriverGetVersion(int* version) {
  (void)version;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDeviceGetCount(int* count) {
  (void)count;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  (void)device;
  (void)ordinal;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  (void)value;
  (void)attribute;
  (void)device;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice device) {
  (void)uuid;
  (void)device;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  (void)context;
  (void)device;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice device) {
  (void)device;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuCtxGetCurrent(CUcontext* context) {
  (void)context;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) {
  (void)context;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuCtxSynchronize(void) { return CUDA_ERROR_STUB_LIBRARY; }
CUresult CUDAAPI cuMemsetD8(CUdeviceptr ptr, unsigned char value, size_t count) {
  (void)ptr;
  (void)value;
  (void)count;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  (void)free_bytes;
  (void)total_bytes;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                               CUmemAllocationGranularity_flags option) {
  (void)granularity;
  (void)prop;
  (void)option;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
  (void)ptr;
  (void)size;
  (void)alignment;
  (void)addr;
  (void)flags;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  (void)ptr;
  (void)size;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                             unsigned long long flags) {
  (void)handle;
  (void)size;
  (void)prop;
  (void)flags;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  (void)handle;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
  (void)ptr;
  (void)size;
  (void)offset;
  (void)handle;
  (void)flags;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  (void)ptr;
  (void)size;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  (void)ptr;
  (void)size;
  (void)desc;
  (void)count;
  return CUDA_ERROR_STUB_LIBRARY;
}

/* Copies for model weights (cuda_copies.cpp). */
CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned int flags) {
  (void)stream;
  (void)flags;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  (void)stream;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
  (void)stream;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t count, CUstream stream) {
  (void)dst;
  (void)src;
  (void)count;
  (void)stream;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t count, CUstream stream) {
  (void)dst;
  (void)src;
  (void)count;
  (void)stream;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream) {
  (void)dst;
  (void)value;
  (void)count;
  (void)stream;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemHostAlloc(void** buffer, size_t size, unsigned int flags) {
  (void)buffer;
  (void)size;
  (void)flags;
  return CUDA_ERROR_STUB_LIBRARY;
}
CUresult CUDAAPI cuMemFreeHost(void* buffer) {
  (void)buffer;
  return CUDA_ERROR_STUB_LIBRARY;
}
