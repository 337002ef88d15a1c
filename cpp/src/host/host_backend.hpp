// Host backend: the VMM contract over host memory (anonymous memory moved by
// mremap, or memfd files: host_allocations.hpp).
#pragma once

#include <cstddef>
#include <memory>

#include "host_allocations.hpp"
#include "kvcached/device/backend.hpp"

namespace kvcached {

// Capacity used when none is given: KVCACHED_HOST_CAPACITY_BYTES if set, else
// half of the machine's or container's (cgroup) memory limit, so that filling
// kvcached's host pools raises a MemoryError long before the kernel's OOM
// killer would step in.
std::size_t default_host_capacity_bytes();

// KVCACHED_HOST_MEMORY: what the host backend's allocations are
// (host_allocations.hpp); an unknown kind is an InvalidArgument naming it.
HostMemory host_memory_requested();

// KVCACHED_HOST_POPULATE: when memfd pages are allocated. `background` (the
// default): as soon as they are mapped, on a thread of their own
// (host_populator.hpp); `on_touch`: by the first write's faults.
enum class HostPopulate { kBackground, kOnTouch };
HostPopulate host_populate_requested();

// capacity_bytes 0 means default_host_capacity_bytes().
std::shared_ptr<VmmBackend> make_host_backend(std::size_t capacity_bytes = 0);

}  // namespace kvcached
