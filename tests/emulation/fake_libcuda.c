/* EMULATION (test only, never installed): a fake CUDA driver, libcuda.so.1,
 * with the emulated machine's GPUs, whose memory is host memory (see
 * emulated_vmm.h and README.md for the configuration).
 *
 * Implements only what kvcached's CUDA backend calls, defined against cuda.h's
 * prototypes so the versioned names (cuMemGetInfo_v2, cuDeviceGetUuid_v2 ...)
 * come out right. Enforces the driver's rules: cuInit first, a current context
 * for memory calls (so a thread that forgot to make the primary context current
 * fails, as on a real GPU), 2 MiB granularity, whole-allocation mappings, and
 * devices chosen and ordered by CUDA_VISIBLE_DEVICES (indices or UUIDs). */
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emulated_vmm.h"

static const evmm_face kFace = {(size_t)2 << 20, (size_t)2 << 20, NULL}; /* an H200's */
static const int kComputeCapabilityMajor = 9;
static const char kDeviceName[] = "kvcached emulated CUDA device (host memory)";

/* One primary context per visible device: CUcontext is an opaque pointer in cuda.h. */
struct CUctx_st {
  int retain_count;
};
static struct CUctx_st g_primary_contexts[EVMM_MAX_DEVICES];
static pthread_mutex_t g_context_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static int g_initialised;
static int g_visible[EVMM_MAX_DEVICES]; /* ordinal -> physical device */
static int g_visible_count;
static __thread CUcontext t_current_context;

/* nvidia-smi's spelling: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx. */
static void uuid_text(int physical, char* text, size_t size) {
  unsigned char b[EVMM_UUID_BYTES];
  evmm_uuid(physical, b);
  snprintf(text, size, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
           b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void initialise(void) {
  evmm_init(&kFace);
  g_visible_count = evmm_visible_devices(getenv("CUDA_VISIBLE_DEVICES"), evmm_physical_devices(), uuid_text, g_visible);
}

static int is_visible_ordinal(int ordinal) { return ordinal >= 0 && ordinal < g_visible_count; }

/* The visible ordinal of the thread's current context. */
static int current_ordinal(void) { return (int)(t_current_context - g_primary_contexts); }

static CUresult to_cuda(evmm_status status) {
  switch (status) {
    case EVMM_OK:
      return CUDA_SUCCESS;
    case EVMM_INVALID_VALUE:
      return CUDA_ERROR_INVALID_VALUE;
    case EVMM_OUT_OF_MEMORY:
      return CUDA_ERROR_OUT_OF_MEMORY;
    case EVMM_NOT_SUPPORTED:
      return CUDA_ERROR_NOT_SUPPORTED;
    case EVMM_ALREADY_MAPPED:
      return CUDA_ERROR_ALREADY_MAPPED;
    case EVMM_NOT_MAPPED:
      return CUDA_ERROR_NOT_MAPPED;
    case EVMM_STILL_MAPPED:
      return CUDA_ERROR_ILLEGAL_STATE;
    case EVMM_UNKNOWN_HANDLE:
      return CUDA_ERROR_INVALID_HANDLE;
    case EVMM_ILLEGAL_ADDRESS:
      return CUDA_ERROR_ILLEGAL_ADDRESS;
    case EVMM_OS_ERROR:
      return CUDA_ERROR_OPERATING_SYSTEM;
  }
  return CUDA_ERROR_UNKNOWN;
}

static CUresult require_initialised(void) {
  return __atomic_load_n(&g_initialised, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* Memory calls need the primary context current on this thread, and alive. */
static CUresult require_context(const char* call) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (t_current_context == NULL) {
    evmm_trace(call, "no current context on this thread");
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  pthread_mutex_lock(&g_context_lock);
  int alive = t_current_context->retain_count > 0;
  pthread_mutex_unlock(&g_context_lock);
  if (!alive) {
    evmm_trace(call, "the current context was released");
    return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  }
  return CUDA_SUCCESS;
}

/* VMM calls on a device without VMM support. */
static CUresult require_vmm(const char* call) {
  CUresult result = require_context(call);
  if (result == CUDA_SUCCESS && !evmm_vmm_supported()) {
    evmm_trace(call, "the device does not support virtual memory management (KVCACHED_EMULATED_VMM=0)");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  return result;
}

static int is_visible_device(CUmemLocation location) {
  return location.type == CU_MEM_LOCATION_TYPE_DEVICE && is_visible_ordinal(location.id);
}

CUresult CUDAAPI cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_once(&g_init_once, initialise);
  if (g_visible_count == 0) return CUDA_ERROR_NO_DEVICE; /* as the driver does */
  __atomic_store_n(&g_initialised, 1, __ATOMIC_RELEASE);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = CUDA_VERSION;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** text) {
  if (!text) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
#define KVCACHED_NAME(code) \
  case code:                \
    *text = #code;          \
    return CUDA_SUCCESS;
    KVCACHED_NAME(CUDA_SUCCESS)
    KVCACHED_NAME(CUDA_ERROR_INVALID_VALUE)
    KVCACHED_NAME(CUDA_ERROR_OUT_OF_MEMORY)
    KVCACHED_NAME(CUDA_ERROR_NOT_INITIALIZED)
    KVCACHED_NAME(CUDA_ERROR_INVALID_DEVICE)
    KVCACHED_NAME(CUDA_ERROR_INVALID_CONTEXT)
    KVCACHED_NAME(CUDA_ERROR_CONTEXT_IS_DESTROYED)
    KVCACHED_NAME(CUDA_ERROR_ALREADY_MAPPED)
    KVCACHED_NAME(CUDA_ERROR_NOT_MAPPED)
    KVCACHED_NAME(CUDA_ERROR_OPERATING_SYSTEM)
    KVCACHED_NAME(CUDA_ERROR_INVALID_HANDLE)
    KVCACHED_NAME(CUDA_ERROR_ILLEGAL_STATE)
    KVCACHED_NAME(CUDA_ERROR_NOT_SUPPORTED)
    KVCACHED_NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
    KVCACHED_NAME(CUDA_ERROR_NO_DEVICE)
    KVCACHED_NAME(CUDA_ERROR_UNKNOWN)
#undef KVCACHED_NAME
    default:
      *text = NULL;
      return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** text) {
  if (!text) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS:
      *text = "no error";
      break;
    case CUDA_ERROR_INVALID_VALUE:
      *text = "invalid argument";
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *text = "out of memory";
      break;
    case CUDA_ERROR_NOT_INITIALIZED:
      *text = "initialization error";
      break;
    case CUDA_ERROR_INVALID_DEVICE:
      *text = "invalid device ordinal";
      break;
    case CUDA_ERROR_INVALID_CONTEXT:
      *text = "invalid device context";
      break;
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
      *text = "context is destroyed";
      break;
    case CUDA_ERROR_ALREADY_MAPPED:
      *text = "resource already mapped";
      break;
    case CUDA_ERROR_NOT_MAPPED:
      *text = "resource not mapped";
      break;
    case CUDA_ERROR_OPERATING_SYSTEM:
      *text = "OS call failed or operation not supported on this OS";
      break;
    case CUDA_ERROR_INVALID_HANDLE:
      *text = "invalid resource handle";
      break;
    case CUDA_ERROR_ILLEGAL_STATE:
      *text = "the operation cannot be performed in the present state";
      break;
    case CUDA_ERROR_NOT_SUPPORTED:
      *text = "operation not supported";
      break;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
      *text = "an illegal memory access was encountered";
      break;
    case CUDA_ERROR_NO_DEVICE:
      *text = "no CUDA-capable device is detected";
      break;
    case CUDA_ERROR_UNKNOWN:
      *text = "unknown error";
      break;
    default:
      *text = NULL;
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int* count) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = g_visible_count;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (!is_visible_ordinal(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char* name, int length, CUdevice device) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!name || length <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!is_visible_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  strncpy(name, kDeviceName, (size_t)length - 1);
  name[length - 1] = '\0';
  return CUDA_SUCCESS;
}

/* cuda.h maps this name to cuDeviceGetUuid_v2. */
CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice device) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  if (!is_visible_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  unsigned char bytes[EVMM_UUID_BYTES];
  evmm_uuid(g_visible[device], bytes);
  memcpy(uuid->bytes, bytes, sizeof uuid->bytes);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem(size_t* total_bytes, CUdevice device) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!total_bytes) return CUDA_ERROR_INVALID_VALUE;
  if (!is_visible_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  *total_bytes = evmm_capacity_bytes();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  if (!is_visible_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      *value = evmm_vmm_supported();
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *value = kComputeCapabilityMajor;
      break;
    default:
      *value = 0;
      break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!context) return CUDA_ERROR_INVALID_VALUE;
  if (!is_visible_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_context_lock);
  g_primary_contexts[device].retain_count++;
  pthread_mutex_unlock(&g_context_lock);
  *context = &g_primary_contexts[device];
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice device) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!is_visible_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_context_lock);
  if (g_primary_contexts[device].retain_count == 0) {
    result = CUDA_ERROR_INVALID_CONTEXT; /* released more often than retained */
  } else {
    g_primary_contexts[device].retain_count--;
  }
  pthread_mutex_unlock(&g_context_lock);
  return result;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext* context) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!context) return CUDA_ERROR_INVALID_VALUE;
  *context = t_current_context;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (context != NULL && (context < g_primary_contexts || context >= g_primary_contexts + g_visible_count)) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  t_current_context = context;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) { return require_context("cuCtxSynchronize"); }

/* Device memory is host memory here: memset faults like a kernel would if the
   range is not mapped with access. */
CUresult CUDAAPI cuMemsetD8(CUdeviceptr ptr, unsigned char value, size_t count) {
  CUresult result = require_context("cuMemsetD8");
  if (result != CUDA_SUCCESS) return result;
  memset((void*)(uintptr_t)ptr, value, count);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  CUresult result = require_context("cuMemGetInfo");
  if (result != CUDA_SUCCESS) return result;
  if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
  evmm_memory_info(g_visible[current_ordinal()], free_bytes, total_bytes);
  return CUDA_SUCCESS;
}

static int is_pinned_device_prop(const CUmemAllocationProp* prop) {
  return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED && is_visible_device(prop->location);
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                               CUmemAllocationGranularity_flags option) {
  CUresult result = require_initialised();
  if (result != CUDA_SUCCESS) return result;
  if (!evmm_vmm_supported()) return CUDA_ERROR_NOT_SUPPORTED;
  if (!granularity || !is_pinned_device_prop(prop)) return CUDA_ERROR_INVALID_VALUE;
  if (option == CU_MEM_ALLOC_GRANULARITY_MINIMUM) {
    *granularity = evmm_minimum_granularity();
  } else if (option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) {
    *granularity = evmm_recommended_granularity();
  } else {
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
  CUresult result = require_vmm("cuMemAddressReserve");
  if (result != CUDA_SUCCESS) return result;
  if (!ptr || addr != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE; /* no fixed addresses */
  uintptr_t base = 0;
  result = to_cuda(evmm_reserve(size, alignment, &base));
  if (result == CUDA_SUCCESS) *ptr = (CUdeviceptr)base;
  return result;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  CUresult result = require_vmm("cuMemAddressFree");
  return result != CUDA_SUCCESS ? result : to_cuda(evmm_free_range((uintptr_t)ptr, size));
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                             unsigned long long flags) {
  CUresult result = require_vmm("cuMemCreate");
  if (result != CUDA_SUCCESS) return result;
  if (!handle || !is_pinned_device_prop(prop) || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t id = 0;
  result = to_cuda(evmm_create(g_visible[prop->location.id], size, &id));
  if (result == CUDA_SUCCESS) *handle = (CUmemGenericAllocationHandle)id;
  return result;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  CUresult result = require_vmm("cuMemRelease");
  return result != CUDA_SUCCESS ? result : to_cuda(evmm_release((uint64_t)handle));
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
  CUresult result = require_vmm("cuMemMap");
  if (result != CUDA_SUCCESS) return result;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  return to_cuda(evmm_map((uintptr_t)ptr, size, offset, (uint64_t)handle));
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CUresult result = require_vmm("cuMemUnmap");
  return result != CUDA_SUCCESS ? result : to_cuda(evmm_unmap((uintptr_t)ptr, size));
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  CUresult result = require_vmm("cuMemSetAccess");
  if (result != CUDA_SUCCESS) return result;
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int access = EVMM_ACCESS_NONE;
  for (size_t i = 0; i < count; i++) {
    if (!is_visible_device(desc[i].location)) return CUDA_ERROR_INVALID_DEVICE;
    switch (desc[i].flags) {
      case CU_MEM_ACCESS_FLAGS_PROT_NONE:
        access = EVMM_ACCESS_NONE;
        break;
      case CU_MEM_ACCESS_FLAGS_PROT_READ:
        access = EVMM_ACCESS_READ;
        break;
      case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
        access = EVMM_ACCESS_READ_WRITE;
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return to_cuda(evmm_set_access((uintptr_t)ptr, size, access));
}

/* Streams and copies (model weights). Work runs at once, in the caller's
   thread, so a stream is only a handle that remembers its context; copies go
   through the engine's device-work rules (mapped, accessible, one reservation). */
struct CUstream_st {
  CUcontext context;
};

CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned int flags) {
  CUresult result = require_context("cuStreamCreate");
  if (result != CUDA_SUCCESS) return result;
  if (!stream || (flags != CU_STREAM_DEFAULT && flags != CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  struct CUstream_st* created = malloc(sizeof *created);
  if (!created) return CUDA_ERROR_OUT_OF_MEMORY;
  created->context = t_current_context;
  *stream = created;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  CUresult result = require_context("cuStreamDestroy");
  if (result != CUDA_SUCCESS) return result;
  if (!stream) return CUDA_ERROR_INVALID_HANDLE;
  free(stream);
  return CUDA_SUCCESS;
}

/* A stream's calls need its own context current, as on a real GPU. */
static CUresult require_stream(const char* call, CUstream stream) {
  CUresult result = require_context(call);
  if (result != CUDA_SUCCESS) return result;
  if (!stream) return CUDA_ERROR_INVALID_HANDLE;
  if (stream->context != t_current_context) {
    evmm_trace(call, "the stream belongs to another context than the current one");
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream stream) { return require_stream("cuStreamSynchronize", stream); }

CUresult CUDAAPI cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t count, CUstream stream) {
  CUresult result = require_stream("cuMemcpyDtoHAsync", stream);
  if (result != CUDA_SUCCESS) return result;
  if (!dst) return CUDA_ERROR_INVALID_VALUE;
  return to_cuda(evmm_device_copy((uintptr_t)dst, (uintptr_t)src, count, 0, 1));
}

CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t count, CUstream stream) {
  CUresult result = require_stream("cuMemcpyHtoDAsync", stream);
  if (result != CUDA_SUCCESS) return result;
  if (!src) return CUDA_ERROR_INVALID_VALUE;
  return to_cuda(evmm_device_copy((uintptr_t)dst, (uintptr_t)src, count, 1, 0));
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream) {
  CUresult result = require_stream("cuMemsetD8Async", stream);
  return result != CUDA_SUCCESS ? result : to_cuda(evmm_device_fill((uintptr_t)dst, value, count));
}

/* Page-locked host memory is plain host memory here. */
CUresult CUDAAPI cuMemHostAlloc(void** buffer, size_t size, unsigned int flags) {
  CUresult result = require_context("cuMemHostAlloc");
  if (result != CUDA_SUCCESS) return result;
  if (!buffer || size == 0 || (flags & ~(unsigned)CU_MEMHOSTALLOC_PORTABLE) != 0) return CUDA_ERROR_INVALID_VALUE;
  *buffer = malloc(size);
  return *buffer ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult CUDAAPI cuMemFreeHost(void* buffer) {
  CUresult result = require_context("cuMemFreeHost");
  if (result != CUDA_SUCCESS) return result;
  free(buffer);
  return CUDA_SUCCESS;
}
