// kvcached._cuda: finds CUDA devices and opens them as VmmBackend capsules for kvcached._core.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>

#include "error_translation.hpp"
#include "gpu/backend_capsule.hpp"
#include "kvcached/backends/cuda_backend.hpp"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cuda, m) {
  kvcached::bindings::install_error_translator();
  m.doc() =
      "CUDA backend of kvcached (CUDA driver API, cuMem*). Linked against libcuda.so.1: on a "
      "machine without the NVIDIA driver, importing this module fails with ImportError.";

  m.def("device_count", &kvcached::cuda_device_count, nb::call_guard<nb::gil_scoped_release>(),
        "Number of CUDA devices; 0 when the driver reports none (CUDA_ERROR_NO_DEVICE).\n\n"
        "Raises BackendUnavailableError when the driver is present but cannot start; the "
        "message carries cuInit's own error.");
  m.def("vmm_supported", &kvcached::cuda_vmm_supported, "ordinal"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Whether CUDA device ``ordinal`` supports virtual memory management (False if absent).");
  m.def("driver_version", &kvcached::cuda_driver_version, nb::call_guard<nb::gil_scoped_release>(),
        "The driver's CUDA version from cuDriverGetVersion, e.g. 13000 for CUDA 13.0.");
  m.def("physical_device_name", &kvcached::cuda_physical_device_name, "ordinal"_a,
        nb::call_guard<nb::gil_scoped_release>(),
        "The physical identity of device ``ordinal``, 'cuda-GPU-<uuid>': the same in every process\n"
        "whatever CUDA_VISIBLE_DEVICES make its ordinal. Works without VMM support;\n"
        "raises BackendUnavailableError when there is no such device.");
  m.def(
      "open_backend",
      [](int ordinal) {
        std::shared_ptr<kvcached::VmmBackend> backend;
        {
          nb::gil_scoped_release unlocked;
          backend = kvcached::make_cuda_backend(ordinal);
        }
        return kvcached::bindings::backend_capsule(std::move(backend));
      },
      "ordinal"_a = 0,
      "Open CUDA device ``ordinal`` (its primary context) and return a PyCapsule named\n"
      "'kvcached.VmmBackend' for kvcached._core. Raises BackendUnavailableError when there is\n"
      "no such device or it lacks virtual memory management.");
}
