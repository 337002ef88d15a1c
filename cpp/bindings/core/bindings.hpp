// The per-topic binding functions that the core module's NB_MODULE(_core) calls.
#pragma once

#include <nanobind/nanobind.h>

namespace kvcached::bindings {

// DeviceRegistry / RegistryBudget (shared per-device budget). Call after any
// binding of MemoryBudget, so RegistryBudget is registered as its subclass.
void bind_registry(nanobind::module_& m);

}  // namespace kvcached::bindings
