// The host backend: VmmBackend over host memory (mmap reservations, anonymous
// memory or memfd files), the same contract as a GPU's. Always built, so
// kvcached works on a machine with no GPU.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kvcached/device/backend.hpp"

namespace kvcached {

// What the host backend's allocations are (KVCACHED_HOST_MEMORY, docs/configuration.md).
enum class HostMemory {
  kAnonymous,   // 4 KiB pages, allocated at create
  kHugePages,   // 2 MiB pages where the kernel allows them, allocated at create
  kSharedFiles  // memfd files mapped shared
};

// When memfd pages are allocated. `background`: as soon as they are mapped, on a
// thread of their own (host_populator.hpp); `on_touch`: by the first write's faults.
enum class HostPopulate { kBackground, kOnTouch };

// The host backend's settings. The core reads no environment variable: Python
// fills these from kvcached.config (KVCACHED_HOST_CAPACITY_BYTES,
// KVCACHED_HOST_MEMORY, KVCACHED_HOST_POPULATE); C++ callers pass their own.
struct HostBackendOptions {
  std::size_t capacity_bytes;  // 0: machine_host_capacity_bytes()
  HostMemory memory;
  HostPopulate populate;
};

// Half of the machine's or container's (cgroup) memory limit: the capacity used
// when none is given, so that filling kvcached's host pools raises a MemoryError
// long before the kernel's OOM killer would step in.
std::size_t machine_host_capacity_bytes();

// The enum named by kvcached.config's spelling ("shared_files", "on_touch");
// InvalidArgument listing the choices otherwise.
HostMemory parse_host_memory(const std::string& text);
HostPopulate parse_host_populate(const std::string& text);

std::shared_ptr<VmmBackend> make_host_backend(const HostBackendOptions& options);

// Blocks until every host page mapped so far has been populated
// (HostPopulate::kBackground; for tests and benchmarks).
void wait_for_population() noexcept;

}  // namespace kvcached
