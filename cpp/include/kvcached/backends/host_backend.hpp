// The host backend: VmmBackend over host memory (mmap reservations, anonymous
// memory or memfd files), the same contract as a GPU's. Always built, so
// kvcached works on a machine with no GPU.
#pragma once

#include <cstddef>
#include <memory>

#include "kvcached/device/backend.hpp"

namespace kvcached {

// Capacity used when none is given: KVCACHED_HOST_CAPACITY_BYTES if set, else
// half of the machine's or container's (cgroup) memory limit, so that filling
// kvcached's host pools raises a MemoryError long before the kernel's OOM
// killer would step in.
std::size_t default_host_capacity_bytes();

// capacity_bytes 0 means default_host_capacity_bytes(). Reads
// KVCACHED_HOST_MEMORY and KVCACHED_HOST_POPULATE (docs/configuration.md).
std::shared_ptr<VmmBackend> make_host_backend(std::size_t capacity_bytes = 0);

// Blocks until every host page mapped so far has been populated
// (KVCACHED_HOST_POPULATE=background; for tests and benchmarks).
void wait_for_population() noexcept;

}  // namespace kvcached
