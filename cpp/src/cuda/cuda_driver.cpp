// CUDA driver plumbing (cuda_driver.hpp): error messages and the context guard.
#include "cuda_driver.hpp"

namespace kvcached::cuda {

std::string driver_message(CUresult code) {
  const char* name = nullptr;
  const char* description = nullptr;
  if (cuGetErrorName(code, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "unknown CUresult";
  }
  if (cuGetErrorString(code, &description) != CUDA_SUCCESS || description == nullptr) {
    description = "no description from the driver";
  }
  return std::string(name) + ": " + description;
}

void throw_driver_error(const char* call, CUresult code) {
  if (code == CUDA_ERROR_OUT_OF_MEMORY) {
    throw DeviceOutOfMemory(kBackendName, call, code, driver_message(code));
  }
  throw DriverError(kBackendName, call, code, driver_message(code));
}

ContextForCall::ContextForCall(CUcontext context, bool verify) {
  if (!verify && t_known_current == context) return;
  CUcontext current = nullptr;
  check("cuCtxGetCurrent", cuCtxGetCurrent(&current));
  t_known_current = current;
  if (current == context) return;
  check("cuCtxSetCurrent", cuCtxSetCurrent(context));
  if (current == nullptr || current == t_kept_context) {
    t_kept_context = t_known_current = context;  // nothing of the caller's was current: keep it
  } else {
    restore_ = current;  // the caller's own context: back after this call
  }
}

void keep_current(CUcontext context) {
  check("cuCtxSetCurrent", cuCtxSetCurrent(context));
  t_kept_context = t_known_current = context;
}

}  // namespace kvcached::cuda
