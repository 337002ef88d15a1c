// The HIP backend: each VmmBackend call is one hipMem* call, made with this
// backend's device current on the calling thread and under one process-wide lock.
//
// Compiled by the host C++ compiler with __HIP_PLATFORM_AMD__ (no hipcc): only
// the runtime API is used. Written against Debian's HIP 5.2 headers and meant to
// run unchanged on ROCm 7.x (MI300X); names newer than 5.2 sit behind HIP_VERSION.
// Never run on AMD hardware so far: see docs/gpu-backends.md.
#include "hip/hip_backend.hpp"

#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>

#include <cstdint>
#include <mutex>
#include <string>

namespace kvcached {
namespace {

constexpr const char* kBackendName = "hip";

// hipDeviceAttributeVirtualMemoryManagementSupported is missing from HIP 5.2's
// headers; every ROCm 6 release has it (HIP_VERSION = major*10^7 + minor*10^5 + patch).
#define KVCACHED_HIP_HAS_VMM_ATTRIBUTE (HIP_VERSION >= 60000000)

// Concurrent VMM calls have crashed the HIP runtime (ROCm 6.x), so every HIP
// call this backend makes, from any thread and any device, takes this lock.
// Driver VMM calls serialise inside the driver anyway, so little is lost.
std::mutex& hip_runtime_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::string driver_message(hipError_t code) {
  const char* name = hipGetErrorName(code);
  const char* description = hipGetErrorString(code);
  return std::string(name != nullptr ? name : "unknown hipError_t") + ": " +
         (description != nullptr ? description : "no description from the runtime");
}

[[noreturn]] void throw_driver_error(const char* call, hipError_t code) {
  if (code == hipErrorOutOfMemory) {
    throw DeviceOutOfMemory(kBackendName, call, code, driver_message(code));
  }
  throw DriverError(kBackendName, call, code, driver_message(code));
}

void check(const char* call, hipError_t code) {
  if (code != hipSuccess) throw_driver_error(call, code);
}

// Holds the runtime lock and makes `ordinal` the calling thread's device,
// restoring the caller's device afterwards (PyTorch threads keep theirs).
class ScopedHipCall {
 public:
  explicit ScopedHipCall(int ordinal) : lock_(hip_runtime_mutex()) {
    check("hipGetDevice", hipGetDevice(&previous_));
    if (previous_ != ordinal) {
      check("hipSetDevice", hipSetDevice(ordinal));
      switched_ = true;
    }
  }
  ~ScopedHipCall() {
    // Best effort: a failure here cannot be reported from a destructor.
    if (switched_) (void)hipSetDevice(previous_);
  }
  ScopedHipCall(const ScopedHipCall&) = delete;
  ScopedHipCall& operator=(const ScopedHipCall&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  int previous_ = 0;
  bool switched_ = false;
};

hipMemGenericAllocationHandle_t to_hip_handle(PhysicalHandle handle) {
  return reinterpret_cast<hipMemGenericAllocationHandle_t>(static_cast<std::uintptr_t>(handle));
}

void* to_pointer(VirtualAddress address) { return reinterpret_cast<void*>(address); }

// Pinned device memory with no export handle types, the only kind used here.
hipMemAllocationProp device_allocation_prop(int ordinal) {
  hipMemAllocationProp prop{};
  prop.type = hipMemAllocationTypePinned;
  prop.location.type = hipMemLocationTypeDevice;
  prop.location.id = ordinal;
  return prop;
}

// Caller holds the runtime lock.
bool vmm_supported_locked(int ordinal) {
#if KVCACHED_HIP_HAS_VMM_ATTRIBUTE
  int supported = 0;
  if (hipDeviceGetAttribute(&supported, hipDeviceAttributeVirtualMemoryManagementSupported,
                            ordinal) != hipSuccess) {
    return false;
  }
  return supported != 0;
#else
  // No attribute to ask: a device whose runtime answers the granularity query has the API.
  const hipMemAllocationProp prop = device_allocation_prop(ordinal);
  std::size_t granularity_bytes = 0;
  return hipMemGetAllocationGranularity(&granularity_bytes, &prop,
                                        hipMemAllocationGranularityRecommended) == hipSuccess &&
         granularity_bytes != 0;
#endif
}

class HipBackend final : public VmmBackend {
 public:
  explicit HipBackend(int ordinal) : ordinal_(ordinal), granularity_(query_granularity()) {}

  std::string name() const override { return kBackendName; }
  int device_ordinal() const override { return ordinal_; }
  DLDeviceType dlpack_device_type() const override { return DLDeviceType::kROCM; }
  Granularity granularity() const override { return granularity_; }

  MemoryInfo memory_info() const override {
    ScopedHipCall call(ordinal_);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    check("hipMemGetInfo", hipMemGetInfo(&free_bytes, &total_bytes));
    return {free_bytes, total_bytes};
  }

  VirtualAddress reserve(std::size_t size_bytes, std::size_t alignment_bytes) override {
    ScopedHipCall call(ordinal_);
    void* base = nullptr;
    void* const no_fixed_address = nullptr;
    const unsigned long long no_flags = 0;
    check("hipMemAddressReserve",
          hipMemAddressReserve(&base, size_bytes, alignment_bytes, no_fixed_address, no_flags));
    return reinterpret_cast<VirtualAddress>(base);
  }

  void free_range(VirtualAddress base, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    check("hipMemAddressFree", hipMemAddressFree(to_pointer(base), size_bytes));
  }

  PhysicalHandle create(std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    const hipMemAllocationProp prop = device_allocation_prop(ordinal_);
    hipMemGenericAllocationHandle_t handle = nullptr;
    const unsigned long long no_flags = 0;
    check("hipMemCreate", hipMemCreate(&handle, size_bytes, &prop, no_flags));
    return static_cast<PhysicalHandle>(reinterpret_cast<std::uintptr_t>(handle));
  }

  void release(PhysicalHandle handle) override {
    ScopedHipCall call(ordinal_);
    check("hipMemRelease", hipMemRelease(to_hip_handle(handle)));
  }

  void map(VirtualAddress address, std::size_t size_bytes, PhysicalHandle handle) override {
    ScopedHipCall call(ordinal_);
    const std::size_t whole_allocation_offset = 0;
    const unsigned long long no_flags = 0;
    check("hipMemMap", hipMemMap(to_pointer(address), size_bytes, whole_allocation_offset,
                                 to_hip_handle(handle), no_flags));
  }

  void unmap(VirtualAddress address, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    check("hipMemUnmap", hipMemUnmap(to_pointer(address), size_bytes));
  }

  void set_access(VirtualAddress address, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    hipMemAccessDesc access{};
    access.location.type = hipMemLocationTypeDevice;
    access.location.id = ordinal_;
    access.flags = hipMemAccessFlagsProtReadWrite;
    const std::size_t one_descriptor = 1;
    check("hipMemSetAccess",
          hipMemSetAccess(to_pointer(address), size_bytes, &access, one_descriptor));
  }

  void zero_fill(VirtualAddress address, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    check("hipMemset", hipMemset(to_pointer(address), 0, size_bytes));
    check("hipDeviceSynchronize", hipDeviceSynchronize());
  }

  void synchronize() override {
    ScopedHipCall call(ordinal_);
    check("hipDeviceSynchronize", hipDeviceSynchronize());
  }

 private:
  // HIP may report a 4 KiB minimum next to a 2 MiB recommendation. Small
  // mappings are slow and have been unreliable on ROCm, so the recommended
  // size is reported as the minimum too: nothing above ever maps less.
  Granularity query_granularity() const {
    ScopedHipCall call(ordinal_);
    const hipMemAllocationProp prop = device_allocation_prop(ordinal_);
    std::size_t recommended_bytes = 0;
    check("hipMemGetAllocationGranularity",
          hipMemGetAllocationGranularity(&recommended_bytes, &prop,
                                         hipMemAllocationGranularityRecommended));
    return {recommended_bytes, recommended_bytes};
  }

  const int ordinal_;
  const Granularity granularity_;
};

}  // namespace

int hip_device_count() {
  std::lock_guard<std::mutex> lock(hip_runtime_mutex());
  int count = 0;
  const hipError_t result = hipGetDeviceCount(&count);
  if (result == hipErrorNoDevice) return 0;
  if (result != hipSuccess) {
    throw BackendUnavailable("HIP runtime unusable: hipGetDeviceCount returned " +
                             driver_message(result));
  }
  return count;
}

bool hip_vmm_supported(int ordinal) {
  std::lock_guard<std::mutex> lock(hip_runtime_mutex());
  int count = 0;
  if (hipGetDeviceCount(&count) != hipSuccess || ordinal < 0 || ordinal >= count) return false;
  return vmm_supported_locked(ordinal);
}

int hip_driver_version() {
  std::lock_guard<std::mutex> lock(hip_runtime_mutex());
  int version = 0;
  const hipError_t result = hipDriverGetVersion(&version);
  if (result != hipSuccess) {
    throw BackendUnavailable("HIP runtime unusable: hipDriverGetVersion returned " +
                             driver_message(result));
  }
  return version;
}

std::shared_ptr<VmmBackend> make_hip_backend(int ordinal) {
  {
    std::lock_guard<std::mutex> lock(hip_runtime_mutex());
    int count = 0;
    const hipError_t result = hipGetDeviceCount(&count);
    if (result != hipSuccess) {
      throw BackendUnavailable("no HIP device: hipGetDeviceCount returned " +
                               driver_message(result));
    }
    if (ordinal < 0 || ordinal >= count) {
      throw BackendUnavailable("no HIP device " + std::to_string(ordinal) +
                               ": the runtime reports " + std::to_string(count) + " device(s)");
    }
    if (!vmm_supported_locked(ordinal)) {
      throw BackendUnavailable("HIP device " + std::to_string(ordinal) +
                               " does not support virtual memory management (hipMemMap)");
    }
  }
  return std::make_shared<HipBackend>(ordinal);
}

}  // namespace kvcached
