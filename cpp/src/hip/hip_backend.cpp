// The HIP backend: each VmmBackend call is one hipMem* call, made with this
// backend's device current on the calling thread and under one process-wide lock.
//
// Compiled by the host C++ compiler with __HIP_PLATFORM_AMD__ (no hipcc): only
// the runtime API is used. Written against Debian's HIP 5.2 headers and meant to
// run unchanged on ROCm 7.x (MI300X); names newer than 5.2 sit behind HIP_VERSION.
// Never run on AMD hardware so far: see docs/amd.md for what is emulated, from
// which public report, and what remains unverified.
#include "kvcached/backends/hip_backend.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "hip/hip_copies.hpp"
#include "hip/hip_runtime.hpp"

namespace kvcached {
namespace {

using hip::check;
using hip::ScopedHipCall;
using Clock = std::chrono::steady_clock;

// The page kvcached prefers when the runtime's recommendation is smaller: ROCm
// runtimes before rocm-systems PR #1176 answered the *minimum* granularity
// (4 KiB) to a query for the recommended one. 2 MiB is what ROCm recommends on
// MI300X (rocminfo: "Alloc Recommended Granule: 2048KB").
constexpr std::size_t kPreferredPageFloorBytes = std::size_t{2} << 20;

// How long a fresh mapping may stay invisible to GPU work. On gfx1201 /
// ROCm 7.2.1 a kernel launched right after hipMemMap + hipMemSetAccess read
// zeros and lost its stores; 2 ms of host wall-clock time closed the window
// and no queue operation did (ROCm/rocm-systems#11693, ROCm/clr#288).
// The settle time is given by the caller (KVCACHED_HIP_MAPPING_SETTLE_US through
// kvcached.config; 2000 µs by default there).
hipMemGenericAllocationHandle_t to_hip_handle(PhysicalHandle handle) {
  return reinterpret_cast<hipMemGenericAllocationHandle_t>(static_cast<std::uintptr_t>(handle));
}

void* to_pointer(VirtualAddress address) { return reinterpret_cast<void*>(address); }

class HipBackend final : public VmmBackend {
 public:
  HipBackend(int ordinal, std::chrono::microseconds settle)
      : ordinal_(ordinal),
        physical_name_(hip::physical_device_name(ordinal)),
        granularity_(query_granularity()),
        settle_(settle) {}

  std::string name() const override { return hip::kBackendName; }
  int device_ordinal() const override { return ordinal_; }
  std::string physical_device_name() const override { return physical_name_; }
  DLDeviceType dlpack_device_type() const override { return DLDeviceType::kROCM; }
  Granularity granularity() const override { return granularity_; }

  void bind_calling_thread() override { hip::bind_calling_thread(ordinal_); }

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
    check("hipMemAddressReserve", hipMemAddressReserve(&base, size_bytes, alignment_bytes, no_fixed_address, no_flags));
    return reinterpret_cast<VirtualAddress>(base);
  }

  void free_range(VirtualAddress base, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    check("hipMemAddressFree", hipMemAddressFree(to_pointer(base), size_bytes));
  }

  PhysicalHandle create(std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    const hipMemAllocationProp prop = hip::device_allocation_prop(ordinal_);
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
    check("hipMemMap",
          hipMemMap(to_pointer(address), size_bytes, whole_allocation_offset, to_hip_handle(handle), no_flags));
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
    check("hipMemSetAccess", hipMemSetAccess(to_pointer(address), size_bytes, &access, one_descriptor));
    last_access_set_.store(Clock::now().time_since_epoch().count());
  }

  // Waits until the newest mapping is settle_ old. Wall-clock time, not a
  // queue operation, is what made fresh mappings visible in the public report;
  // with the pool's background worker mapping ahead, the wait is off the
  // allocation path. The runtime lock is not held while waiting.
  void fence_new_mappings() override {
    const Clock::time_point newest{Clock::duration(last_access_set_.load())};
    std::this_thread::sleep_until(newest + settle_);
  }

  void zero_fill(VirtualAddress address, std::size_t size_bytes) override {
    fence_new_mappings();  // the memset is GPU work on a fresh mapping
    ScopedHipCall call(ordinal_);
    check("hipMemset", hipMemset(to_pointer(address), 0, size_bytes));
    check("hipDeviceSynchronize", hipDeviceSynchronize());
  }

  void synchronize() override {
    ScopedHipCall call(ordinal_);
    check("hipDeviceSynchronize", hipDeviceSynchronize());
  }

  void* allocate_host_buffer(std::size_t size_bytes) override { return hip::allocate_pinned(ordinal_, size_bytes); }
  void free_host_buffer(void* buffer, std::size_t /*size_bytes*/) noexcept override {
    hip::free_pinned(ordinal_, buffer);
  }
  std::unique_ptr<CopyQueue> open_copy_queue() override { return hip::make_copy_queue(ordinal_); }

 private:
  // The runtime's minimum, and its recommendation raised to at least
  // kPreferredPageFloorBytes (rounded to a multiple of the minimum): pools
  // default to the recommended size, so nothing maps 4 KiB pages by default.
  Granularity query_granularity() const {
    ScopedHipCall call(ordinal_);
    const hipMemAllocationProp prop = hip::device_allocation_prop(ordinal_);
    Granularity result{0, 0};
    check("hipMemGetAllocationGranularity",
          hipMemGetAllocationGranularity(&result.minimum_bytes, &prop, hipMemAllocationGranularityMinimum));
    check("hipMemGetAllocationGranularity",
          hipMemGetAllocationGranularity(&result.recommended_bytes, &prop, hipMemAllocationGranularityRecommended));
    if (result.minimum_bytes == 0 || result.recommended_bytes % result.minimum_bytes != 0) {
      throw DriverError(hip::kBackendName, "hipMemGetAllocationGranularity", hipErrorInvalidValue,
                        "minimum " + std::to_string(result.minimum_bytes) + " and recommended " +
                            std::to_string(result.recommended_bytes) +
                            " bytes: the recommendation is not a multiple of the minimum");
    }
    if (result.recommended_bytes < kPreferredPageFloorBytes) {
      const std::size_t units = (kPreferredPageFloorBytes + result.minimum_bytes - 1) / result.minimum_bytes;
      result.recommended_bytes = units * result.minimum_bytes;
    }
    return result;
  }

  const int ordinal_;
  const std::string physical_name_;
  const Granularity granularity_;
  const std::chrono::microseconds settle_;
  // When hipMemSetAccess last returned, as Clock ticks (atomic: set under the
  // runtime lock, read by fence_new_mappings without it).
  std::atomic<Clock::rep> last_access_set_{0};
};

}  // namespace

int hip_device_count() {
  std::lock_guard<std::mutex> lock(hip::runtime_mutex());
  int count = 0;
  const hipError_t result = hipGetDeviceCount(&count);
  if (result == hipErrorNoDevice) return 0;
  if (result != hipSuccess) {
    throw BackendUnavailable("HIP runtime unusable: hipGetDeviceCount returned " + hip::driver_message(result));
  }
  return count;
}

bool hip_vmm_supported(int ordinal) {
  try {
    hip::require_device(ordinal);
  } catch (const BackendUnavailable&) {
    return false;
  }
  return hip::vmm_supported(ordinal, nullptr);
}

int hip_driver_version() {
  std::lock_guard<std::mutex> lock(hip::runtime_mutex());
  int version = 0;
  const hipError_t result = hipDriverGetVersion(&version);
  if (result != hipSuccess) {
    throw BackendUnavailable("HIP runtime unusable: hipDriverGetVersion returned " + hip::driver_message(result));
  }
  return version;
}

std::string hip_physical_device_name(int ordinal) {
  hip::require_device(ordinal);
  return hip::physical_device_name(ordinal);
}

std::shared_ptr<VmmBackend> make_hip_backend(int ordinal, std::chrono::microseconds mapping_settle) {
  hip::require_device(ordinal);
  std::string why_not;
  if (!hip::vmm_supported(ordinal, &why_not)) {
    throw BackendUnavailable("HIP device " + std::to_string(ordinal) + " (" + hip::physical_device_name(ordinal) +
                             ") does not support virtual memory management: " + why_not);
  }
  if (mapping_settle.count() < 0) {
    throw InvalidArgument("mapping_settle must not be negative, got " + std::to_string(mapping_settle.count()) + " us");
  }
  return std::make_shared<HipBackend>(ordinal, mapping_settle);
}

}  // namespace kvcached
