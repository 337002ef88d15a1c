// Stand-in for the core module's init until the real one lands (drop on merge).
#include <nanobind/nanobind.h>

#include "core/bindings.hpp"
#include "error_translation.hpp"

NB_MODULE(_core, m) {
  kvcached::bindings::install_error_translator();
  kvcached::bindings::bind_registry(m);
}
