// kvcached._hip: finds HIP (AMD) devices and opens them as VmmBackend capsules for kvcached._core.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "error_translation.hpp"
#include "gpu/backend_capsule.hpp"
#include "kvcached/backends/hip_backend.hpp"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_hip, m) {
  kvcached::bindings::install_error_translator();
  m.doc() =
      "HIP backend of kvcached (hipMem*, for AMD GPUs). Linked against libamdhip64: on a "
      "machine without the HIP runtime, importing this module fails with ImportError.";

  m.def("device_count", &kvcached::hip_device_count, nb::call_guard<nb::gil_scoped_release>(),
        "Number of HIP devices; 0 when the runtime reports none (hipErrorNoDevice).\n\n"
        "Raises BackendUnavailableError when the runtime is present but cannot start; the "
        "message carries its own error.");
  m.def("vmm_supported", &kvcached::hip_vmm_supported, "ordinal"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Whether HIP device ``ordinal`` supports virtual memory management (False if absent).");
  m.def("driver_version", &kvcached::hip_driver_version, nb::call_guard<nb::gil_scoped_release>(),
        "hipDriverGetVersion's value, e.g. 50221153 for HIP 5.2.");
  m.def("physical_device_name", &kvcached::hip_physical_device_name, "ordinal"_a,
        nb::call_guard<nb::gil_scoped_release>(),
        "The physical identity of device ``ordinal``, 'hip-GPU-<uuid>' (or 'hip-pci-<bus id>' without a UUID): the "
        "same in every process\n"
        "whatever ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES make its ordinal. Works without VMM support;\n"
        "raises BackendUnavailableError when there is no such device.");
  m.def(
      "open_backend",
      [](int ordinal, std::int64_t mapping_settle_us) {
        if (mapping_settle_us < 0) {
          throw kvcached::InvalidArgument("mapping_settle_us must not be negative, got " +
                                          std::to_string(mapping_settle_us));
        }
        std::shared_ptr<kvcached::VmmBackend> backend;
        {
          nb::gil_scoped_release unlocked;
          backend = kvcached::make_hip_backend(ordinal, std::chrono::microseconds(mapping_settle_us));
        }
        return kvcached::bindings::backend_capsule(std::move(backend));
      },
      "ordinal"_a, "mapping_settle_us"_a,
      "Open HIP device ``ordinal`` and return a PyCapsule named 'kvcached.VmmBackend' for\n"
      "kvcached._core. Raises BackendUnavailableError when there is no such device or it\n"
      "lacks virtual memory management. ``mapping_settle_us``: how old the newest mapping must be\n"
      "before fresh ones go to GPU work (kvcached.devices passes KVCACHED_HIP_MAPPING_SETTLE_US).");
}
