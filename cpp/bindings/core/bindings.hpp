// Entry points of the kvcached._core module's parts, one per concern.
#pragma once

#include <nanobind/nanobind.h>

namespace kvcached::bindings {

// Device, Reservation, PhysicalAllocation (the backend contract).
void bind_device(nanobind::module_& m);
// MemoryBudget, DeviceRegistry / RegistryBudget (shared per-device budget), MemoryPolicy.
void bind_registry(nanobind::module_& m);
// MemoryPolicy: an instance's min, max and priority (called by bind_registry).
void bind_memory_policy(nanobind::module_& m);
// parse_size_bytes: the one size grammar, shared with Python (kvcached.sizes).
void bind_sizes(nanobind::module_& m);
// KVLayout and the options values, PageOps, Mirror, KVSpace, BlockManager, FixedBudget.
// Call after bind_registry (needs MemoryBudget).
void bind_kv(nanobind::module_& m);
// WeightsBudget, MemoryBudgetWeights, WeightSpace (model weights that sleep and wake).
// Call after bind_registry (needs MemoryBudget).
void bind_weights(nanobind::module_& m);

}  // namespace kvcached::bindings
