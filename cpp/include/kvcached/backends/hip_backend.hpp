// The HIP backend: VmmBackend over HIP's virtual memory API (hipMem*), for AMD GPUs.
//
// This header needs no HIP header, so code that only creates the backend
// (the _hip module, the benchmark) compiles without the HIP include path.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "kvcached/device/backend.hpp"

namespace kvcached {

// Number of HIP devices. 0 when the runtime reports none (hipErrorNoDevice);
// throws BackendUnavailable when the runtime cannot start for another reason.
int hip_device_count();

// Whether device `ordinal` supports virtual memory management
// (hipDeviceAttributeVirtualMemoryManagementSupported). False for an ordinal
// that does not exist or when there is no usable runtime.
bool hip_vmm_supported(int ordinal);

// hipDriverGetVersion's value (e.g. 50221153 for HIP 5.2).
int hip_driver_version();

// The physical identity of device `ordinal` ("hip-GPU-<uuid>" or
// "hip-pci-<bus id>", see device_identity.hpp), the same whatever
// ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES make the ordinal. Needs no VMM
// support. Throws BackendUnavailable for a missing device.
std::string hip_physical_device_name(int ordinal);

// Opens device `ordinal`. Throws BackendUnavailable ("no HIP device: ...")
// when there is no such device, and one naming
// hipDeviceAttributeVirtualMemoryManagementSupported and what to check when
// the device lacks virtual memory management. `mapping_settle`: how old the
// newest mapping must be before fresh mappings go to GPU work (see
// fence_new_mappings in hip_backend.cpp; Python passes
// KVCACHED_HIP_MAPPING_SETTLE_US from kvcached.config, 0 turns the fence off).
std::shared_ptr<VmmBackend> make_hip_backend(int ordinal, std::chrono::microseconds mapping_settle);

}  // namespace kvcached
