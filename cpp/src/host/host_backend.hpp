// Host backend: the VMM contract over host memory (anonymous memory moved by
// mremap, or memfd files: host_allocations.hpp).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "host_allocations.hpp"
#include "kvcached/device/backend.hpp"

namespace kvcached {

// Half of the machine's or container's (cgroup) memory limit: the capacity used
// when none is given, so that filling kvcached's host pools raises a MemoryError
// long before the kernel's OOM killer would step in.
std::size_t machine_host_capacity_bytes();

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

// The enum named by kvcached.config's spelling ("shared_files", "on_touch");
// InvalidArgument listing the choices otherwise.
HostMemory parse_host_memory(const std::string& text);
HostPopulate parse_host_populate(const std::string& text);

std::shared_ptr<VmmBackend> make_host_backend(const HostBackendOptions& options);

}  // namespace kvcached
