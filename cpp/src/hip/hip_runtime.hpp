// HIP runtime plumbing shared by the HIP backend's files: the process-wide call
// lock, error translation, and the names this backend needs that older HIP
// headers lack. Needs the HIP headers (include only from cpp/src/hip).
#pragma once

#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>

#include <mutex>
#include <string>

#include "kvcached/error.hpp"

namespace kvcached::hip {

inline constexpr const char* kBackendName = "hip";

// hipDeviceAttributeVirtualMemoryManagementSupported is missing from HIP 5.2's
// headers. ROCm 6 and later number it right after
// hipDeviceAttributeMemoryPoolsSupported (their hip_runtime_api.h); a runtime
// that predates it answers hipErrorInvalidValue, and callers fall back to a
// granularity probe. HIP_VERSION = major*10^7 + minor*10^5 + patch.
#if HIP_VERSION >= 60000000
inline constexpr hipDeviceAttribute_t kVmmSupportedAttribute = hipDeviceAttributeVirtualMemoryManagementSupported;
static_assert(hipDeviceAttributeVirtualMemoryManagementSupported == hipDeviceAttributeMemoryPoolsSupported + 1,
              "the fallback numbering for older headers no longer matches");
#else
inline constexpr hipDeviceAttribute_t kVmmSupportedAttribute =
    static_cast<hipDeviceAttribute_t>(hipDeviceAttributeMemoryPoolsSupported + 1);
#endif
inline constexpr const char* kVmmSupportedAttributeName = "hipDeviceAttributeVirtualMemoryManagementSupported";

// Concurrent VMM calls have crashed the HIP runtime (ROCm 6.x), so every HIP
// call this backend makes, from any thread and any device, takes this lock.
// Driver VMM calls serialise inside the driver anyway, so little is lost.
std::mutex& runtime_mutex();

// "hipErrorOutOfMemory: out of memory", in the runtime's own words.
std::string driver_message(hipError_t code);

// DeviceOutOfMemory for hipErrorOutOfMemory, DriverError otherwise.
[[noreturn]] void throw_driver_error(const char* call, hipError_t code);

inline void check(const char* call, hipError_t code) {
  if (code != hipSuccess) throw_driver_error(call, code);
}

// Holds the runtime lock and makes `ordinal` the calling thread's device for
// one call. On kvcached's own threads (bind_calling_thread) the device stays
// current and no device call is made; on others the current device is read
// (hipGetDevice, a thread-local read in the runtime) and, when it differs,
// switched and restored afterwards, so a PyTorch thread keeps its device.
// HIP has no "no device" state to tell a thread kvcached may keep apart, and
// its VMM calls are not documented as independent of the current device.
class ScopedHipCall {
 public:
  explicit ScopedHipCall(int ordinal);
  ~ScopedHipCall();
  ScopedHipCall(const ScopedHipCall&) = delete;
  ScopedHipCall& operator=(const ScopedHipCall&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  int previous_ = 0;
  bool switched_ = false;
};

// Makes `ordinal` the calling thread's device for good and skips the device
// check of later calls on it (kvcached's own worker threads).
void bind_calling_thread(int ordinal);

// Pinned device memory with no export handle types, the only kind used here.
hipMemAllocationProp device_allocation_prop(int ordinal);

// The rest take the runtime lock themselves.

// Throws BackendUnavailable (message starting "no HIP device") unless
// `ordinal` names a device this process can see.
void require_device(int ordinal);

// Whether the device supports virtual memory management: the attribute, or on
// runtimes that predate it, whether the granularity query answers. Fills
// `why_not` with what to check when it does not.
bool vmm_supported(int ordinal, std::string* why_not);

// "hip-GPU-<uuid>", or "hip-pci-<bus id>" for a device without a UUID.
std::string physical_device_name(int ordinal);

}  // namespace kvcached::hip
