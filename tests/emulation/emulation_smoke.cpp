// EMULATION (test only): drives the real CUDA / HIP backends against the fake
// driver libraries in this folder and checks that they work and that the
// drivers' rules are enforced. Prints "N passed, M failed"; exit code 1 on failure.
#include <chrono>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvcached/device/backend.hpp"
#ifdef KVCACHED_SMOKE_CUDA
#include <cuda.h>

#include "kvcached/backends/cuda_backend.hpp"
#endif
#ifdef KVCACHED_SMOKE_HIP
#include "kvcached/backends/hip_backend.hpp"
#endif

namespace {

using kvcached::VirtualAddress;
using kvcached::VmmBackend;

constexpr std::size_t kPageBytes = std::size_t{2} << 20;
// Small on purpose: the out-of-memory test fills it.
constexpr std::size_t kEmulatedCapacityPages = 32;
constexpr std::size_t kEmulatedCapacityBytes = kEmulatedCapacityPages * kPageBytes;
constexpr std::size_t kRangePages = 8;
// Misaligned for every granularity (HIP's minimum is 4 KiB).
constexpr std::size_t kUnalignedOffsetBytes = 512;
constexpr int kWorkerThreads = 4;
constexpr int kIterationsPerThread = 50;

int g_passed = 0;
int g_failed = 0;

void expect(bool ok, const std::string& backend, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAILED [%s] %s\n", backend.c_str(), what.c_str());
  }
}

// True when `action` throws DriverError naming `call` (or DeviceOutOfMemory when `oom`).
bool throws_driver_error(const std::function<void()>& action, const std::string& call, bool oom = false) {
  try {
    action();
  } catch (const kvcached::DeviceOutOfMemory& e) {
    return oom && e.call() == call;
  } catch (const kvcached::DriverError& e) {
    return !oom && e.call() == call;
  }
  return false;
}

template <class Exception>
bool throws(const std::function<void()>& action) {
  try {
    action();
  } catch (const Exception&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

// Probing readability by touching memory and catching the fault.
sigjmp_buf g_fault_jump;
void on_fault(int) { siglongjmp(g_fault_jump, 1); }

bool is_readable(VirtualAddress address) {
  struct sigaction handler{}, previous{};
  handler.sa_handler = on_fault;
  sigemptyset(&handler.sa_mask);
  sigaction(SIGSEGV, &handler, &previous);
  // volatile: must not be cached across the longjmp, nor set before the load.
  volatile bool readable = false;
  if (sigsetjmp(g_fault_jump, 1) == 0) {
    volatile const std::uint8_t value = *reinterpret_cast<volatile const std::uint8_t*>(address);
    (void)value;
    readable = true;
  }
  sigaction(SIGSEGV, &previous, nullptr);
  return readable;
}

void fill(VirtualAddress address, std::uint8_t value) {
  std::memset(reinterpret_cast<void*>(address), value, kPageBytes);
}

bool holds(VirtualAddress address, std::uint8_t value) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(address);
  return bytes[0] == value && bytes[kPageBytes / 2] == value && bytes[kPageBytes - 1] == value;
}

void run_contract(VmmBackend& backend, const std::string& mapping_call, const std::string& tag,
                  std::size_t expected_minimum_bytes) {
  const std::string map_call = mapping_call + "Map";
  const std::string unmap_call = mapping_call + "Unmap";
  const std::string release_call = mapping_call + "Release";
  const std::string create_call = mapping_call + "Create";

  const kvcached::Granularity granularity = backend.granularity();
  expect(granularity.minimum_bytes == expected_minimum_bytes && granularity.recommended_bytes == kPageBytes, tag,
         "granularity: the driver's minimum, 2 MiB recommended");
  kvcached::MemoryInfo info = backend.memory_info();
  expect(info.total_bytes == kEmulatedCapacityBytes && info.free_bytes == info.total_bytes, tag,
         "memory_info reports the emulated capacity, all free");

  const VirtualAddress base = backend.reserve(kRangePages * kPageBytes, kPageBytes);
  expect(base % kPageBytes == 0, tag, "reserve returns an aligned base");
  expect(!is_readable(base), tag, "a reserved, unmapped address faults");

  const auto page_a = backend.create(kPageBytes);
  const auto page_b = backend.create(kPageBytes);
  backend.map(base, kPageBytes, page_a);
  expect(!is_readable(base), tag, "a fresh mapping faults until set_access");
  backend.set_access(base, kPageBytes);
  expect(is_readable(base), tag, "set_access makes the mapping readable");
  fill(base, 0xA1);
  backend.map(base + kPageBytes, kPageBytes, page_b);
  backend.set_access(base + kPageBytes, kPageBytes);
  fill(base + kPageBytes, 0xB2);
  expect(holds(base, 0xA1) && holds(base + kPageBytes, 0xB2), tag, "two mapped pages hold their own data");

  // The drivers' rules.
  expect(throws_driver_error([&] { backend.map(base, kPageBytes, page_b); }, map_call), tag,
         "mapping over a mapped address is refused");
  expect(throws_driver_error([&] { backend.map(base + 4 * kPageBytes + kUnalignedOffsetBytes, kPageBytes, page_a); },
                             map_call),
         tag, "mapping at an unaligned address is refused");
  expect(throws_driver_error([&] { backend.map(base + 4 * kPageBytes, 2 * kPageBytes, page_a); }, map_call), tag,
         "mapping with a size other than the allocation's is refused");
  expect(throws_driver_error([&] { backend.unmap(base, kPageBytes / 2); }, unmap_call), tag,
         "unmapping part of a mapping is refused");
  expect(throws_driver_error([&] { backend.release(page_a); }, release_call), tag,
         "releasing a mapped allocation is refused (emulation is stricter than CUDA here)");
  expect(throws_driver_error([&] { backend.create(kPageBytes + 1); }, create_call), tag,
         "creating an unaligned size is refused");
  expect(throws_driver_error([&] { backend.free_range(base, kRangePages * kPageBytes); }, mapping_call + "AddressFree"),
         tag, "freeing a range with mappings inside is refused");

  // Same physical memory at a second address.
  backend.map(base + 2 * kPageBytes, kPageBytes, page_a);
  backend.set_access(base + 2 * kPageBytes, kPageBytes);
  expect(holds(base + 2 * kPageBytes, 0xA1), tag, "one allocation mapped twice shows the same data");
  backend.unmap(base + 2 * kPageBytes, kPageBytes);

  // Out of memory is its own exception, and memory comes back.
  std::vector<kvcached::PhysicalHandle> filler;
  bool out_of_memory = false;
  for (std::size_t i = 0; i < kEmulatedCapacityPages && !out_of_memory; ++i) {
    try {
      filler.push_back(backend.create(kPageBytes));
    } catch (const kvcached::DeviceOutOfMemory&) {
      out_of_memory = true;
    }
  }
  expect(out_of_memory && filler.size() == kEmulatedCapacityPages - 2, tag,
         "create beyond the capacity throws DeviceOutOfMemory");
  expect(throws_driver_error([&] { backend.create(kPageBytes); }, create_call, true), tag,
         "DeviceOutOfMemory names the call");
  for (auto handle : filler) backend.release(handle);

  // Two adjacent mappings unmap in one call; the data survives a remap.
  backend.synchronize();
  backend.unmap(base, 2 * kPageBytes);
  expect(!is_readable(base), tag, "an unmapped address faults again");
  backend.map(base + 5 * kPageBytes, kPageBytes, page_a);
  backend.set_access(base + 5 * kPageBytes, kPageBytes);
  expect(holds(base + 5 * kPageBytes, 0xA1), tag, "physical memory keeps its data across a remap");
  backend.unmap(base + 5 * kPageBytes, kPageBytes);

  // Several threads at once (new threads have no context / device set).
  std::vector<std::thread> workers;
  std::vector<int> worker_failures(kWorkerThreads, 0);
  for (int t = 0; t < kWorkerThreads; ++t) {
    workers.emplace_back([&, t] {
      try {
        const VirtualAddress own = backend.reserve(kPageBytes, kPageBytes);
        for (int i = 0; i < kIterationsPerThread; ++i) {
          const auto handle = backend.create(kPageBytes);
          backend.map(own, kPageBytes, handle);
          backend.set_access(own, kPageBytes);
          const auto marker = static_cast<std::uint8_t>(t * kIterationsPerThread + i);
          fill(own, marker);
          if (!holds(own, marker)) ++worker_failures[t];
          backend.unmap(own, kPageBytes);
          backend.release(handle);
        }
        backend.free_range(own, kPageBytes);
      } catch (const std::exception& e) {
        std::printf("worker %d: %s\n", t, e.what());
        ++worker_failures[t];
      }
    });
  }
  for (auto& worker : workers) worker.join();
  int failures = 0;
  for (int f : worker_failures) failures += f;
  expect(failures == 0, tag, "threads mapping concurrently all succeed");

  backend.release(page_a);
  backend.release(page_b);
  backend.free_range(base, kRangePages * kPageBytes);
  info = backend.memory_info();
  expect(info.free_bytes == info.total_bytes, tag, "everything released: all memory free again");
}

#ifdef KVCACHED_SMOKE_CUDA
void run_cuda() {
  const std::string tag = "cuda";
  expect(kvcached::cuda_device_count() == 1, tag, "one emulated device");
  expect(kvcached::cuda_vmm_supported(0) && !kvcached::cuda_vmm_supported(1), tag, "vmm_supported for device 0 only");
  expect(kvcached::cuda_driver_version() > 0, tag, "driver_version is positive");
  expect(throws<kvcached::BackendUnavailable>([] { kvcached::make_cuda_backend(1); }), tag,
         "opening a missing device throws BackendUnavailable");
  auto backend = kvcached::make_cuda_backend(0);
  expect(backend->name() == "cuda" && backend->dlpack_device_type() == kvcached::DLDeviceType::kCUDA, tag,
         "name and DLPack device type");
  // A thread with no current context gets the primary context once and keeps
  // it (as torch.cuda.set_device would), so later calls need no context call.
  CUcontext before = nullptr;
  CUcontext after = nullptr;
  cuCtxSetCurrent(nullptr);  // opening the backend bound it already
  cuCtxGetCurrent(&before);
  backend->memory_info();
  cuCtxGetCurrent(&after);
  expect(before == nullptr && after != nullptr, tag,
         "a thread with no current context keeps the primary context after a call");
  // Its owner takes the context away again: the next VMM call notices (the
  // driver says there is no context), binds it again and succeeds.
  cuCtxSetCurrent(nullptr);
  bool rebound = false;
  try {
    const kvcached::VirtualAddress range = backend->reserve(kPageBytes, kPageBytes);
    backend->free_range(range, kPageBytes);
    cuCtxGetCurrent(&after);
    rebound = after != nullptr;
  } catch (const std::exception&) {
  }
  expect(rebound, tag, "a VMM call on a thread whose context was taken away binds it again");
  expect(backend->physical_device_name().rfind("cuda-GPU-", 0) == 0 &&
             backend->physical_device_name() == kvcached::cuda_physical_device_name(0),
         tag, "physical_device_name is the device's UUID");
  run_contract(*backend, "cuMem", tag, kPageBytes);
}
#endif

#ifdef KVCACHED_SMOKE_HIP
void run_hip() {
  const std::string tag = "hip";
  expect(kvcached::hip_device_count() == 1, tag, "one emulated device");
  expect(kvcached::hip_vmm_supported(0) && !kvcached::hip_vmm_supported(1), tag, "vmm_supported for device 0 only");
  expect(kvcached::hip_driver_version() > 0, tag, "driver_version is positive");
  // The settle time is the caller's (Python passes KVCACHED_HIP_MAPPING_SETTLE_US); none here.
  const std::chrono::microseconds no_settle{0};
  expect(throws<kvcached::BackendUnavailable>([&] { kvcached::make_hip_backend(1, no_settle); }), tag,
         "opening a missing device throws BackendUnavailable");
  auto backend = kvcached::make_hip_backend(0, no_settle);
  expect(backend->name() == "hip" && backend->dlpack_device_type() == kvcached::DLDeviceType::kROCM, tag,
         "name and DLPack device type");
  expect(backend->physical_device_name().rfind("hip-GPU-", 0) == 0 &&
             backend->physical_device_name() == kvcached::hip_physical_device_name(0),
         tag, "physical_device_name is the device's UUID");
  // The emulation reports 4 KiB minimum / 2 MiB recommended, like an MI300X.
  run_contract(*backend, "hipMem", tag, std::size_t{4} << 10);
}
#endif

}  // namespace

int main() {
  // Read by the fake drivers at their first call.
  setenv("KVCACHED_EMULATED_DEVICE_BYTES", std::to_string(kEmulatedCapacityBytes).c_str(), 1);
  try {
#ifdef KVCACHED_SMOKE_CUDA
    run_cuda();
#endif
#ifdef KVCACHED_SMOKE_HIP
    run_hip();
#endif
  } catch (const std::exception& e) {
    std::printf("FAILED: unexpected exception: %s\n", e.what());
    ++g_failed;
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
