/* EMULATION (test only, never installed): a fake HIP runtime, libamdhip64,
 * with the emulated machine's GPUs, whose memory is host memory (see
 * emulated_vmm.h and README.md for the configuration).
 *
 * Implements only what kvcached's HIP backend and tests call, with the SONAME
 * and the symbol versions (hip_4.2, hip_5.1; see libamdhip64.map) of the
 * library the backend was linked against. Behaves as ROCm is reported to:
 * 4 KiB minimum / 2 MiB recommended granularity (an MI300X's), devices chosen
 * by ROCR_VISIBLE_DEVICES then HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES),
 * UUIDs as 16 hex characters, copies refused across reservations, optionally
 * fresh mappings invisible to device work for a while or no VMM support at
 * all; and since concurrent VMM calls have crashed the real runtime, it fails
 * any call that overlaps another one in time. */
#define _GNU_SOURCE
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emulated_vmm.h"

static const evmm_face kFace = {(size_t)4 << 10, (size_t)2 << 20, "KVCACHED_EMULATED_HIP_MAPPING_DELAY_US"};
static const char kDeviceName[] = "kvcached emulated HIP device (host memory)";

/* Where ROCm 6 and later number hipDeviceAttributeVirtualMemoryManagementSupported
 * (right after hipDeviceAttributeMemoryPoolsSupported in their hip_runtime_api.h);
 * the HIP 5.2 headers this is compiled against lack the name. */
#if HIP_VERSION >= 60000000
#define EMULATED_VMM_ATTRIBUTE hipDeviceAttributeVirtualMemoryManagementSupported
#else
#define EMULATED_VMM_ATTRIBUTE ((hipDeviceAttribute_t)(hipDeviceAttributeMemoryPoolsSupported + 1))
#endif

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_in_call = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_current_device;
static int g_visible[EVMM_MAX_DEVICES]; /* ordinal -> physical device */
static int g_visible_count;
static int g_has_uuid = 1;

/* The UUID body ROCm reports: 16 hex characters (rocminfo prints "GPU-<body>"). */
static void uuid_body(int physical, char text[17]) {
  unsigned char bytes[EVMM_UUID_BYTES];
  evmm_uuid(physical, bytes);
  for (int i = 0; i < 8; i++) snprintf(text + 2 * i, 3, "%02x", bytes[i]);
}

static void physical_uuid_text(int physical, char* text, size_t size) {
  char body[17];
  uuid_body(physical, body);
  snprintf(text, size, "GPU-%s", body);
}

static int g_rocr_visible[EVMM_MAX_DEVICES];
static void rocr_uuid_text(int candidate, char* text, size_t size) {
  physical_uuid_text(g_rocr_visible[candidate], text, size);
}

/* ROCR_VISIBLE_DEVICES filters the physical devices first (ROCm's runtime),
 * then HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES when it is unset, picks
 * among those (HIP's); both take indices or UUIDs. */
static void initialise(void) {
  evmm_init(&kFace);
  const char* uuid = getenv("KVCACHED_EMULATED_HIP_UUID");
  g_has_uuid = !(uuid && strcmp(uuid, "0") == 0);
  int rocr_count =
      evmm_visible_devices(getenv("ROCR_VISIBLE_DEVICES"), evmm_physical_devices(), physical_uuid_text, g_rocr_visible);
  const char* hip_list = getenv("HIP_VISIBLE_DEVICES");
  if (!hip_list) hip_list = getenv("CUDA_VISIBLE_DEVICES");
  int picked[EVMM_MAX_DEVICES];
  g_visible_count = evmm_visible_devices(hip_list, rocr_count, rocr_uuid_text, picked);
  for (int i = 0; i < g_visible_count; i++) g_visible[i] = g_rocr_visible[picked[i]];
}

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

/* VMM calls on a device without VMM support. */
static hipError_t enter_vmm(const char* call) {
  hipError_t result = enter(call);
  if (result == hipSuccess && !evmm_vmm_supported()) {
    evmm_trace(call, "the device does not support virtual memory management (KVCACHED_EMULATED_VMM=0)");
    return leave(hipErrorNotSupported);
  }
  return result;
}

static int is_visible_ordinal(int ordinal) { return ordinal >= 0 && ordinal < g_visible_count; }

static hipError_t to_hip(evmm_status status) {
  switch (status) {
    case EVMM_OK:
      return hipSuccess;
    case EVMM_INVALID_VALUE:
      return hipErrorInvalidValue;
    case EVMM_OUT_OF_MEMORY:
      return hipErrorOutOfMemory;
    case EVMM_NOT_SUPPORTED:
      return hipErrorNotSupported;
    case EVMM_ALREADY_MAPPED:
      return hipErrorAlreadyMapped;
    case EVMM_NOT_MAPPED:
      return hipErrorNotMapped;
    case EVMM_STILL_MAPPED:
      return hipErrorIllegalState;
    case EVMM_UNKNOWN_HANDLE:
      return hipErrorInvalidHandle;
    case EVMM_ILLEGAL_ADDRESS:
      return hipErrorIllegalAddress;
    case EVMM_OS_ERROR:
      return hipErrorOperatingSystem;
  }
  return hipErrorUnknown;
}

static int is_visible_device(hipMemLocation location) {
  return location.type == hipMemLocationTypeDevice && is_visible_ordinal(location.id);
}

static int is_pinned_device_prop(const hipMemAllocationProp* prop) {
  return prop && prop->type == hipMemAllocationTypePinned && is_visible_device(prop->location);
}

/* Handles are opaque pointers in HIP; the engine's ids stand in for them. */
static uint64_t handle_id(hipMemGenericAllocationHandle_t handle) { return (uint64_t)(uintptr_t)handle; }

const char* hipGetErrorName(hipError_t error) {
  switch (error) {
#define KVCACHED_NAME(code) \
  case code:                \
    return #code;
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
    KVCACHED_NAME(hipErrorIllegalAddress)
    KVCACHED_NAME(hipErrorUnknown)
#undef KVCACHED_NAME
    default:
      return "hipErrorUnknown";
  }
}

const char* hipGetErrorString(hipError_t error) {
  switch (error) {
    case hipSuccess:
      return "no error";
    case hipErrorInvalidValue:
      return "invalid argument";
    case hipErrorOutOfMemory:
      return "out of memory";
    case hipErrorInvalidDevice:
      return "invalid device ordinal";
    case hipErrorNoDevice:
      return "no ROCm-capable device is detected";
    case hipErrorAlreadyMapped:
      return "resource already mapped";
    case hipErrorNotMapped:
      return "resource not mapped";
    case hipErrorOperatingSystem:
      return "OS call failed or operation not supported on this OS";
    case hipErrorInvalidHandle:
      return "invalid resource handle";
    case hipErrorIllegalState:
      return "the operation cannot be performed in the present state";
    case hipErrorNotSupported:
      return "operation not supported";
    case hipErrorIllegalAddress:
      return "an illegal memory access was encountered";
    default:
      return "unknown error";
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
  *count = g_visible_count;
  return leave(g_visible_count > 0 ? hipSuccess : hipErrorNoDevice);
}

hipError_t hipSetDevice(int device) {
  hipError_t result = enter("hipSetDevice");
  if (result != hipSuccess) return result;
  if (!is_visible_ordinal(device)) return leave(hipErrorInvalidDevice);
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

hipError_t hipDeviceGet(hipDevice_t* device, int ordinal) {
  hipError_t result = enter("hipDeviceGet");
  if (result != hipSuccess) return result;
  if (!device) return leave(hipErrorInvalidValue);
  if (!is_visible_ordinal(ordinal)) return leave(hipErrorInvalidDevice);
  *device = ordinal;
  return leave(hipSuccess);
}

hipError_t hipDeviceGetName(char* name, int length, hipDevice_t device) {
  hipError_t result = enter("hipDeviceGetName");
  if (result != hipSuccess) return result;
  if (!name || length <= 0) return leave(hipErrorInvalidValue);
  if (!is_visible_ordinal(device)) return leave(hipErrorInvalidDevice);
  strncpy(name, kDeviceName, (size_t)length - 1);
  name[length - 1] = '\0';
  return leave(hipSuccess);
}

/* ROCm copies the 16 characters after "GPU-" into the bytes, and "XX" for a
 * device without a unique id (KVCACHED_EMULATED_HIP_UUID=0). */
hipError_t hipDeviceGetUuid(hipUUID* uuid, hipDevice_t device) {
  hipError_t result = enter("hipDeviceGetUuid");
  if (result != hipSuccess) return result;
  if (!uuid) return leave(hipErrorInvalidValue);
  if (!is_visible_ordinal(device)) return leave(hipErrorInvalidDevice);
  memset(uuid->bytes, 0, sizeof uuid->bytes);
  if (g_has_uuid) {
    char body[17];
    uuid_body(g_visible[device], body);
    memcpy(uuid->bytes, body, 16);
  } else {
    memcpy(uuid->bytes, "XX", 2);
  }
  return leave(hipSuccess);
}

/* "dddd:bb:dd.f", a distinct bus per physical device. */
hipError_t hipDeviceGetPCIBusId(char* bus_id, int length, int device) {
  hipError_t result = enter("hipDeviceGetPCIBusId");
  if (result != hipSuccess) return result;
  if (!bus_id || length < 13) return leave(hipErrorInvalidValue);
  if (!is_visible_ordinal(device)) return leave(hipErrorInvalidDevice);
  snprintf(bus_id, (size_t)length, "0000:%02x:00.0", 0x0c + 0x20 * g_visible[device]);
  return leave(hipSuccess);
}

hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t attribute, int device) {
  hipError_t result = enter("hipDeviceGetAttribute");
  if (result != hipSuccess) return result;
  if (!value) return leave(hipErrorInvalidValue);
  if (!is_visible_ordinal(device)) return leave(hipErrorInvalidDevice);
  *value = attribute == EMULATED_VMM_ATTRIBUTE ? evmm_vmm_supported() : 0;
  return leave(hipSuccess);
}

hipError_t hipDeviceSynchronize(void) {
  hipError_t result = enter("hipDeviceSynchronize");
  if (result != hipSuccess) return result;
  return leave(hipSuccess);
}

/* Device work: see emulated_device_work.c (reservation spans, visibility window). */
hipError_t hipMemset(void* ptr, int value, size_t count) {
  hipError_t result = enter("hipMemset");
  if (result != hipSuccess) return result;
  if (!evmm_is_device_address((uintptr_t)ptr)) return leave(hipErrorInvalidValue);
  return leave(to_hip(evmm_device_fill((uintptr_t)ptr, value, count)));
}

hipError_t hipMemcpy(void* destination, const void* source, size_t size, hipMemcpyKind kind) {
  hipError_t result = enter("hipMemcpy");
  if (result != hipSuccess) return result;
  if (!destination || !source) return leave(hipErrorInvalidValue);
  int destination_on_device = evmm_is_device_address((uintptr_t)destination);
  int source_on_device = evmm_is_device_address((uintptr_t)source);
  int expected_destination = kind == hipMemcpyHostToDevice || kind == hipMemcpyDeviceToDevice;
  int expected_source = kind == hipMemcpyDeviceToHost || kind == hipMemcpyDeviceToDevice;
  if (kind != hipMemcpyDefault &&
      (destination_on_device != expected_destination || source_on_device != expected_source)) {
    evmm_trace("hipMemcpy", "the copy kind does not match where the pointers live");
    return leave(hipErrorInvalidValue);
  }
  return leave(to_hip(
      evmm_device_copy((uintptr_t)destination, (uintptr_t)source, size, destination_on_device, source_on_device)));
}

hipError_t hipMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  hipError_t result = enter("hipMemGetInfo");
  if (result != hipSuccess) return result;
  if (!free_bytes || !total_bytes) return leave(hipErrorInvalidValue);
  evmm_memory_info(g_visible[t_current_device], free_bytes, total_bytes);
  return leave(hipSuccess);
}

hipError_t hipMemGetAllocationGranularity(size_t* granularity, const hipMemAllocationProp* prop,
                                          hipMemAllocationGranularity_flags option) {
  hipError_t result = enter_vmm("hipMemGetAllocationGranularity");
  if (result != hipSuccess) return result;
  if (!granularity || !is_pinned_device_prop(prop)) return leave(hipErrorInvalidValue);
  if (option == hipMemAllocationGranularityMinimum) {
    *granularity = evmm_minimum_granularity();
  } else if (option == hipMemAllocationGranularityRecommended) {
    *granularity = evmm_recommended_granularity();
  } else {
    return leave(hipErrorInvalidValue);
  }
  return leave(hipSuccess);
}

hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr, unsigned long long flags) {
  hipError_t result = enter_vmm("hipMemAddressReserve");
  if (result != hipSuccess) return result;
  if (!ptr || addr != NULL || flags != 0) return leave(hipErrorInvalidValue);
  uintptr_t base = 0;
  result = to_hip(evmm_reserve(size, alignment, &base));
  if (result == hipSuccess) *ptr = (void*)base;
  return leave(result);
}

hipError_t hipMemAddressFree(void* ptr, size_t size) {
  hipError_t result = enter_vmm("hipMemAddressFree");
  if (result != hipSuccess) return result;
  return leave(to_hip(evmm_free_range((uintptr_t)ptr, size)));
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t* handle, size_t size, const hipMemAllocationProp* prop,
                        unsigned long long flags) {
  hipError_t result = enter_vmm("hipMemCreate");
  if (result != hipSuccess) return result;
  if (!handle || !is_pinned_device_prop(prop) || flags != 0) return leave(hipErrorInvalidValue);
  uint64_t id = 0;
  result = to_hip(evmm_create(g_visible[prop->location.id], size, &id));
  if (result == hipSuccess) *handle = (hipMemGenericAllocationHandle_t)(uintptr_t)id;
  return leave(result);
}

hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
  hipError_t result = enter_vmm("hipMemRelease");
  if (result != hipSuccess) return result;
  return leave(to_hip(evmm_release(handle_id(handle))));
}

hipError_t hipMemMap(void* ptr, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
  hipError_t result = enter_vmm("hipMemMap");
  if (result != hipSuccess) return result;
  if (flags != 0) return leave(hipErrorInvalidValue);
  return leave(to_hip(evmm_map((uintptr_t)ptr, size, offset, handle_id(handle))));
}

hipError_t hipMemUnmap(void* ptr, size_t size) {
  hipError_t result = enter_vmm("hipMemUnmap");
  if (result != hipSuccess) return result;
  return leave(to_hip(evmm_unmap((uintptr_t)ptr, size)));
}

hipError_t hipMemSetAccess(void* ptr, size_t size, const hipMemAccessDesc* desc, size_t count) {
  hipError_t result = enter_vmm("hipMemSetAccess");
  if (result != hipSuccess) return result;
  if (!desc || count == 0) return leave(hipErrorInvalidValue);
  int access = EVMM_ACCESS_NONE;
  for (size_t i = 0; i < count; i++) {
    if (!is_visible_device(desc[i].location)) return leave(hipErrorInvalidDevice);
    switch (desc[i].flags) {
      case hipMemAccessFlagsProtNone:
        access = EVMM_ACCESS_NONE;
        break;
      case hipMemAccessFlagsProtRead:
        access = EVMM_ACCESS_READ;
        break;
      case hipMemAccessFlagsProtReadWrite:
        access = EVMM_ACCESS_READ_WRITE;
        break;
      default:
        return leave(hipErrorInvalidValue);
    }
  }
  return leave(to_hip(evmm_set_access((uintptr_t)ptr, size, access)));
}

/* Streams and copies (model weights). Work runs at once, in the caller's thread,
   through the engine's device-work rules (mapped, accessible, inside one
   reservation, the visibility window of fresh mappings), so a stream is only a
   handle; a query always finds it done. */
struct ihipStream_t {
  int device;
};

hipError_t hipStreamCreateWithFlags(hipStream_t* stream, unsigned int flags) {
  hipError_t result = enter("hipStreamCreateWithFlags");
  if (result != hipSuccess) return result;
  if (!stream || (flags != hipStreamDefault && flags != hipStreamNonBlocking)) return leave(hipErrorInvalidValue);
  struct ihipStream_t* created = malloc(sizeof *created);
  if (!created) return leave(hipErrorOutOfMemory);
  created->device = t_current_device;
  *stream = created;
  return leave(hipSuccess);
}

hipError_t hipStreamDestroy(hipStream_t stream) {
  hipError_t result = enter("hipStreamDestroy");
  if (result != hipSuccess) return result;
  if (!stream) return leave(hipErrorInvalidHandle);
  free(stream);
  return leave(hipSuccess);
}

hipError_t hipStreamQuery(hipStream_t stream) {
  hipError_t result = enter("hipStreamQuery");
  if (result != hipSuccess) return result;
  return leave(stream ? hipSuccess : hipErrorInvalidHandle);
}

hipError_t hipStreamSynchronize(hipStream_t stream) {
  hipError_t result = enter("hipStreamSynchronize");
  if (result != hipSuccess) return result;
  return leave(stream ? hipSuccess : hipErrorInvalidHandle);
}

hipError_t hipMemcpyDtoHAsync(void* dst, hipDeviceptr_t src, size_t size, hipStream_t stream) {
  hipError_t result = enter("hipMemcpyDtoHAsync");
  if (result != hipSuccess) return result;
  if (!dst || !stream || evmm_is_device_address((uintptr_t)dst) || !evmm_is_device_address((uintptr_t)src)) {
    return leave(hipErrorInvalidValue);
  }
  return leave(to_hip(evmm_device_copy((uintptr_t)dst, (uintptr_t)src, size, 0, 1)));
}

hipError_t hipMemcpyHtoDAsync(hipDeviceptr_t dst, void* src, size_t size, hipStream_t stream) {
  hipError_t result = enter("hipMemcpyHtoDAsync");
  if (result != hipSuccess) return result;
  if (!src || !stream || !evmm_is_device_address((uintptr_t)dst) || evmm_is_device_address((uintptr_t)src)) {
    return leave(hipErrorInvalidValue);
  }
  return leave(to_hip(evmm_device_copy((uintptr_t)dst, (uintptr_t)src, size, 1, 0)));
}

hipError_t hipMemsetD8Async(hipDeviceptr_t dst, unsigned char value, size_t count, hipStream_t stream) {
  hipError_t result = enter("hipMemsetD8Async");
  if (result != hipSuccess) return result;
  if (!stream || !evmm_is_device_address((uintptr_t)dst)) return leave(hipErrorInvalidValue);
  return leave(to_hip(evmm_device_fill((uintptr_t)dst, value, count)));
}

/* Page-locked host memory is plain host memory here. */
hipError_t hipHostMalloc(void** buffer, size_t size, unsigned int flags) {
  hipError_t result = enter("hipHostMalloc");
  if (result != hipSuccess) return result;
  if (!buffer || (flags & ~(unsigned)hipHostMallocPortable) != 0) return leave(hipErrorInvalidValue);
  *buffer = malloc(size ? size : 1);
  return leave(*buffer ? hipSuccess : hipErrorOutOfMemory);
}

hipError_t hipHostFree(void* buffer) {
  hipError_t result = enter("hipHostFree");
  if (result != hipSuccess) return result;
  free(buffer);
  return leave(hipSuccess);
}
