// Bindings of the KV pool layer (filled in with the pool).
#include "bindings.hpp"

namespace kvcached::bindings {

void bind_kv(nanobind::module_& m) { (void)m; }

}  // namespace kvcached::bindings
