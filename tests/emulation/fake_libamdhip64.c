/* EMULATION (test only, never installed): a fake HIP runtime, libamdhip64, with
 * one device whose memory is host memory (see emulated_vmm.h).
 *
 * Implements only what kvcached's HIP backend calls, with the SONAME and the
 * symbol versions (hip_4.2, hip_5.1; see libamdhip64.map) of the library the
 * backend was linked against. Reports the granularity an MI300X does (4 KiB
 * minimum, 2 MiB recommended) and, since concurrent VMM calls have crashed the
 * real runtime, fails any call that overlaps another one in time. */
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "emulated_vmm.h"

static const size_t kMinimumGranularityBytes = (size_t)4 << 10;
static const size_t kRecommendedGranularityBytes = (size_t)2 << 20;
static const int kDeviceCount = 1;
static const char kDeviceName[] = "kvcached emulated HIP device (host memory)";

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_in_call = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_current_device;

static void initialise(void) { evmm_init(kMinimumGranularityBytes); }

/* Every runtime call goes through enter()/leave(). Overlapping calls are the
 * caller's bug (the real runtime has crashed on them): refuse the late one. */
static hipError_t enter(const char* call) {
  pthread_once(&g_init_once, initialise);
  if (pthread_mutex_trylock(&g_in_call) != 0) {
    evmm_trace(call, "another HIP call is in progress on another thread (serialise them)");
    return hipErrorUnknown;
  }
  return hipSuccess;
}

static hipError_t leave(hipError_t result) {
  pthread_mutex_unlock(&g_in_call);
  return result;
}

static hipError_t to_hip(evmm_status status) {
  switch (status) {
    case EVMM_OK: return hipSuccess;
    case EVMM_INVALID_VALUE: return hipErrorInvalidValue;
    case EVMM_OUT_OF_MEMORY: return hipErrorOutOfMemory;
    case EVMM_NOT_SUPPORTED: return hipErrorNotSupported;
    case EVMM_ALREADY_MAPPED: return hipErrorAlreadyMapped;
    case EVMM_NOT_MAPPED: return hipErrorNotMapped;
    case EVMM_STILL_MAPPED: return hipErrorIllegalState;
    case EVMM_UNKNOWN_HANDLE: return hipErrorInvalidHandle;
    case EVMM_OS_ERROR: return hipErrorOperatingSystem;
  }
  return hipErrorUnknown;
}

static int is_this_device(hipMemLocation location) {
  return location.type == hipMemLocationTypeDevice && location.id == 0;
}

static int is_pinned_device_prop(const hipMemAllocationProp* prop) {
  return prop && prop->type == hipMemAllocationTypePinned && is_this_device(prop->location);
}

/* Handles are opaque pointers in HIP; the engine's ids stand in for them. */
static uint64_t handle_id(hipMemGenericAllocationHandle_t handle) {
  return (uint64_t)(uintptr_t)handle;
}

const char* hipGetErrorName(hipError_t error) {
  switch (error) {
#define KVCACHED_NAME(code) case code: return #code;
    KVCACHED_NAME(hipSuccess)
    KVCACHED_NAME(hipErrorInvalidValue)
    KVCACHED_NAME(hipErrorOutOfMemory)
    KVCACHED_NAME(hipErrorInvalidDevice)
    KVCACHED_NAME(hipErrorNoDevice)
    KVCACHED_NAME(hipErrorAlreadyMapped)
    KVCACHED_NAME(hipErrorNotMapped)
    KVCACHED_NAME(hipErrorOperatingSystem)
    KVCACHED_NAME(hipErrorInvalidHandle)
    KVCACHED_NAME(hipErrorIllegalState)
    KVCACHED_NAME(hipErrorNotSupported)
    KVCACHED_NAME(hipErrorUnknown)
#undef KVCACHED_NAME
    default: return "hipErrorUnknown";
  }
}

const char* hipGetErrorString(hipError_t error) {
  switch (error) {
    case hipSuccess: return "no error";
    case hipErrorInvalidValue: return "invalid argument";
    case hipErrorOutOfMemory: return "out of memory";
    case hipErrorInvalidDevice: return "invalid device ordinal";
    case hipErrorNoDevice: return "no ROCm-capable device is detected";
    case hipErrorAlreadyMapped: return "resource already mapped";
    case hipErrorNotMapped: return "resource not mapped";
    case hipErrorOperatingSystem: return "OS call failed or operation not supported on this OS";
    case hipErrorInvalidHandle: return "invalid resource handle";
    case hipErrorIllegalState: return "the operation cannot be performed in the present state";
    case hipErrorNotSupported: return "operation not supported";
    default: return "unknown error";
  }
}

hipError_t hipInit(unsigned int flags) {
  hipError_t result = enter("hipInit");
  if (result != hipSuccess) return result;
  return leave(flags == 0 ? hipSuccess : hipErrorInvalidValue);
}

hipError_t hipDriverGetVersion(int* version) {
  hipError_t result = enter("hipDriverGetVersion");
  if (result != hipSuccess) return result;
  if (!version) return leave(hipErrorInvalidValue);
  *version = HIP_VERSION;
  return leave(hipSuccess);
}

hipError_t hipRuntimeGetVersion(int* version) {
  hipError_t result = enter("hipRuntimeGetVersion");
  if (result != hipSuccess) return result;
  if (!version) return leave(hipErrorInvalidValue);
  *version = HIP_VERSION;
  return leave(hipSuccess);
}

hipError_t hipGetDeviceCount(int* count) {
  hipError_t result = enter("hipGetDeviceCount");
  if (result != hipSuccess) return result;
  if (!count) return leave(hipErrorInvalidValue);
  *count = kDeviceCount;
  return leave(hipSuccess);
}

hipError_t hipSetDevice(int device) {
  hipError_t result = enter("hipSetDevice");
  if (result != hipSuccess) return result;
  if (device < 0 || device >= kDeviceCount) return leave(hipErrorInvalidDevice);
  t_current_device = device;
  return leave(hipSuccess);
}

hipError_t hipGetDevice(int* device) {
  hipError_t result = enter("hipGetDevice");
  if (result != hipSuccess) return result;
  if (!device) return leave(hipErrorInvalidValue);
  *device = t_current_device;
  return leave(hipSuccess);
}

hipError_t hipDeviceGetName(char* name, int length, hipDevice_t device) {
  hipError_t result = enter("hipDeviceGetName");
  if (result != hipSuccess) return result;
  if (!name || length <= 0) return leave(hipErrorInvalidValue);
  if (device != 0) return leave(hipErrorInvalidDevice);
  strncpy(name, kDeviceName, (size_t)length - 1);
  name[length - 1] = '\0';
  return leave(hipSuccess);
}

hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t attribute, int device) {
  hipError_t result = enter("hipDeviceGetAttribute");
  if (result != hipSuccess) return result;
  if (!value) return leave(hipErrorInvalidValue);
  if (device != 0) return leave(hipErrorInvalidDevice);
  *value = 0;
#if HIP_VERSION >= 60000000
  if (attribute == hipDeviceAttributeVirtualMemoryManagementSupported) *value = 1;
#else
  (void)attribute;
#endif
  return leave(hipSuccess);
}

hipError_t hipDeviceSynchronize(void) {
  hipError_t result = enter("hipDeviceSynchronize");
  if (result != hipSuccess) return result;
  return leave(hipSuccess);
}

/* Device memory is host memory here: memset faults like a kernel would if the
   range is not mapped with access. */
hipError_t hipMemset(void* ptr, int value, size_t count) {
  hipError_t result = enter("hipMemset");
  if (result != hipSuccess) return result;
  memset(ptr, value, count);
  return leave(hipSuccess);
}

hipError_t hipMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  hipError_t result = enter("hipMemGetInfo");
  if (result != hipSuccess) return result;
  if (!free_bytes || !total_bytes) return leave(hipErrorInvalidValue);
  evmm_memory_info(free_bytes, total_bytes);
  return leave(hipSuccess);
}

hipError_t hipMemGetAllocationGranularity(size_t* granularity, const hipMemAllocationProp* prop,
                                          hipMemAllocationGranularity_flags option) {
  hipError_t result = enter("hipMemGetAllocationGranularity");
  if (result != hipSuccess) return result;
  if (!granularity || !is_pinned_device_prop(prop)) return leave(hipErrorInvalidValue);
  if (option == hipMemAllocationGranularityMinimum) {
    *granularity = kMinimumGranularityBytes;
  } else if (option == hipMemAllocationGranularityRecommended) {
    *granularity = kRecommendedGranularityBytes;
  } else {
    return leave(hipErrorInvalidValue);
  }
  return leave(hipSuccess);
}

hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr,
                                unsigned long long flags) {
  hipError_t result = enter("hipMemAddressReserve");
  if (result != hipSuccess) return result;
  if (!ptr || addr != NULL || flags != 0) return leave(hipErrorInvalidValue);
  uintptr_t base = 0;
  result = to_hip(evmm_reserve(size, alignment, &base));
  if (result == hipSuccess) *ptr = (void*)base;
  return leave(result);
}

hipError_t hipMemAddressFree(void* ptr, size_t size) {
  hipError_t result = enter("hipMemAddressFree");
  if (result != hipSuccess) return result;
  return leave(to_hip(evmm_free_range((uintptr_t)ptr, size)));
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t* handle, size_t size,
                        const hipMemAllocationProp* prop, unsigned long long flags) {
  hipError_t result = enter("hipMemCreate");
  if (result != hipSuccess) return result;
  if (!handle || !is_pinned_device_prop(prop) || flags != 0) return leave(hipErrorInvalidValue);
  uint64_t id = 0;
  result = to_hip(evmm_create(size, &id));
  if (result == hipSuccess) *handle = (hipMemGenericAllocationHandle_t)(uintptr_t)id;
  return leave(result);
}

hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
  hipError_t result = enter("hipMemRelease");
  if (result != hipSuccess) return result;
  return leave(to_hip(evmm_release(handle_id(handle))));
}

hipError_t hipMemMap(void* ptr, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
  hipError_t result = enter("hipMemMap");
  if (result != hipSuccess) return result;
  if (flags != 0) return leave(hipErrorInvalidValue);
  return leave(to_hip(evmm_map((uintptr_t)ptr, size, offset, handle_id(handle))));
}

hipError_t hipMemUnmap(void* ptr, size_t size) {
  hipError_t result = enter("hipMemUnmap");
  if (result != hipSuccess) return result;
  return leave(to_hip(evmm_unmap((uintptr_t)ptr, size)));
}

hipError_t hipMemSetAccess(void* ptr, size_t size, const hipMemAccessDesc* desc, size_t count) {
  hipError_t result = enter("hipMemSetAccess");
  if (result != hipSuccess) return result;
  if (!desc || count == 0) return leave(hipErrorInvalidValue);
  int access = EVMM_ACCESS_NONE;
  for (size_t i = 0; i < count; i++) {
    if (!is_this_device(desc[i].location)) return leave(hipErrorInvalidDevice);
    switch (desc[i].flags) {
      case hipMemAccessFlagsProtNone: access = EVMM_ACCESS_NONE; break;
      case hipMemAccessFlagsProtRead: access = EVMM_ACCESS_READ; break;
      case hipMemAccessFlagsProtReadWrite: access = EVMM_ACCESS_READ_WRITE; break;
      default: return leave(hipErrorInvalidValue);
    }
  }
  return leave(to_hip(evmm_set_access((uintptr_t)ptr, size, access)));
}
