// Packs a VmmBackend into the PyCapsule that kvcached._core accepts (see backend.hpp).
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <utility>

#include "kvcached/device/backend.hpp"

namespace kvcached::bindings {

inline void delete_backend_holder(void* holder) noexcept { delete static_cast<std::shared_ptr<VmmBackend>*>(holder); }

// The capsule owns one heap-allocated shared_ptr; the core copies it, so the
// backend lives as long as either holds it. Call with the GIL held.
inline nanobind::capsule backend_capsule(std::shared_ptr<VmmBackend> backend) {
  auto* holder = new std::shared_ptr<VmmBackend>(std::move(backend));
  try {
    return nanobind::capsule(holder, kBackendCapsuleName, &delete_backend_holder);
  } catch (...) {
    delete holder;
    throw;
  }
}

}  // namespace kvcached::bindings
