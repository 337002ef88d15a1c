// The CUDA backend's copies between host and device memory (model weights): a
// stream of their own, and page-locked host buffers. Needs cuda.h.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <memory>

#include "kvcached/device/backend.hpp"

namespace kvcached::cuda {

// A CopyQueue on a new non-blocking stream of `context` (so its copies never
// wait for the default stream's kernels, nor they for it).
std::unique_ptr<CopyQueue> make_copy_queue(CUcontext context);

// Page-locked host memory (cuMemHostAlloc), usable by every context.
void* allocate_pinned(CUcontext context, std::size_t size_bytes);
void free_pinned(CUcontext context, void* buffer) noexcept;

}  // namespace kvcached::cuda
