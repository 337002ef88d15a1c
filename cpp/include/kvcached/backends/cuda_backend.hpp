// The CUDA backend: VmmBackend over the CUDA driver's virtual memory API (cuMem*).
//
// This header needs no CUDA header, so code that only creates the backend
// (the _cuda module, the benchmark) compiles without cuda.h.
#pragma once

#include <memory>
#include <string>

#include "kvcached/device/backend.hpp"

namespace kvcached {

// Number of CUDA devices. 0 when the driver reports no device
// (CUDA_ERROR_NO_DEVICE); throws BackendUnavailable when the driver cannot
// start at all (too old, broken install), with cuInit's own message.
int cuda_device_count();

// Whether device `ordinal` supports the virtual memory management API.
// False for an ordinal that does not exist or when there is no usable driver.
bool cuda_vmm_supported(int ordinal);

// The driver's CUDA version as cuDriverGetVersion reports it (e.g. 13000).
// Throws BackendUnavailable when the driver library is only the link stub.
int cuda_driver_version();

// The physical identity of device `ordinal` ("cuda-GPU-<uuid>", see
// device_identity.hpp), the same whatever CUDA_VISIBLE_DEVICES makes the
// ordinal. Needs no VMM support. Throws BackendUnavailable for a missing device.
std::string cuda_physical_device_name(int ordinal);

// Opens device `ordinal` through its primary context. Throws
// BackendUnavailable ("no CUDA device: ...") when there is no such device or
// it lacks virtual memory management.
std::shared_ptr<VmmBackend> make_cuda_backend(int ordinal);

}  // namespace kvcached
