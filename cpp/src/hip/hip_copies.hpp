// The HIP backend's copies between host and device memory (model weights): a
// stream of their own, and page-locked host buffers. Needs the HIP headers.
#pragma once

#include <cstddef>
#include <memory>

#include "kvcached/device/backend.hpp"

namespace kvcached::hip {

// A CopyQueue on a new non-blocking stream of device `ordinal`.
std::unique_ptr<CopyQueue> make_copy_queue(int ordinal);

// Page-locked host memory (hipHostMalloc, portable to every device).
void* allocate_pinned(int ordinal, std::size_t size_bytes);
void free_pinned(int ordinal, void* buffer) noexcept;

}  // namespace kvcached::hip
