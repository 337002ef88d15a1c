// kvcached._core: the allocator and the host backend; GPU backends plug in as capsules.
#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "error_translation.hpp"

NB_MODULE(_core, m) {
  m.doc() = "kvcached core: VMM contract, host backend, KV pools (low-level API)";
  kvcached::bindings::install_error_translator();
  // Tensors exported through DLPack keep a KVMemoryOwner alive and may still
  // be held by torch when the interpreter shuts down; that is not a leak.
  nanobind::set_leak_warnings(false);
  kvcached::bindings::bind_sizes(m);
  kvcached::bindings::bind_device(m);
  kvcached::bindings::bind_registry(m);
  kvcached::bindings::bind_kv(m);
  kvcached::bindings::bind_weights(m);
}
