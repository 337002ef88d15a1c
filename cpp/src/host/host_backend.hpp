// Host backend internals: how the backend's settings are read (its public
// face is kvcached/backends/host_backend.hpp; allocations: host_allocations.hpp).
#pragma once

#include <cstddef>
#include <memory>

#include "host_allocations.hpp"
#include "kvcached/backends/host_backend.hpp"

namespace kvcached {

// KVCACHED_HOST_MEMORY: what the host backend's allocations are
// (host_allocations.hpp); an unknown kind is an InvalidArgument naming it.
HostMemory host_memory_requested();

// KVCACHED_HOST_POPULATE: when memfd pages are allocated. `background` (the
// default): as soon as they are mapped, on a thread of their own
// (host_populator.hpp); `on_touch`: by the first write's faults.
enum class HostPopulate { kBackground, kOnTouch };
HostPopulate host_populate_requested();

}  // namespace kvcached
