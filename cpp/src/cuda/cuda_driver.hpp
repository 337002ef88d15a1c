// CUDA driver plumbing shared by the CUDA backend's files: error translation and
// the per-thread context bookkeeping. Needs cuda.h (include only from cpp/src/cuda).
#pragma once

#include <cuda.h>

#include <string>

#include "kvcached/error.hpp"

namespace kvcached::cuda {

inline constexpr const char* kBackendName = "cuda";

// "CUDA_ERROR_OUT_OF_MEMORY: out of memory", in the driver's own words.
std::string driver_message(CUresult code);

// DeviceOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY, DriverError otherwise.
[[noreturn]] void throw_driver_error(const char* call, CUresult code);

inline void check(const char* call, CUresult code) {
  if (code != CUDA_SUCCESS) throw_driver_error(call, code);
}

// Which context is current on each thread, as far as kvcached knows, so that
// a VMM call needs no context call at all once the device's primary context
// is current (the common case: an engine thread after torch.cuda.set_device,
// or a thread kvcached bound itself).
//  * t_known_current: the context last seen or made current on this thread;
//  * t_kept_context: the context kvcached made current and left current here
//    (on a thread that had none, or one of kvcached's own threads).
// The cuMem* VMM calls name their device explicitly (allocation properties,
// access descriptors, addresses in the process-wide unified address space);
// the driver asks only for an initialised context on the thread. So a stale
// t_known_current (the caller switched contexts since) is harmless for them,
// and a thread left without any context is noticed by the driver's answer
// (CUDA_ERROR_INVALID_CONTEXT), which makes the call bind and retry once.
// Calls whose meaning depends on the current context (synchronize, memset,
// memory info, streams) always look first.
inline thread_local CUcontext t_known_current = nullptr;
inline thread_local CUcontext t_kept_context = nullptr;

// Makes `context` current for one driver call. `verify`: ask the driver what
// is current instead of trusting t_known_current. A caller's own, different
// context is restored when the guard goes; a thread with no context (or only
// one kvcached left there) keeps `context`.
class ContextForCall {
 public:
  ContextForCall(CUcontext context, bool verify);
  ~ContextForCall() {
    // Best effort: a failure here cannot be reported from a destructor.
    if (restore_ != nullptr) (void)cuCtxSetCurrent(restore_);
  }
  ContextForCall(const ContextForCall&) = delete;
  ContextForCall& operator=(const ContextForCall&) = delete;

 private:
  CUcontext restore_ = nullptr;
};

// Binds `context` to the calling thread for good (kvcached's own threads).
void keep_current(CUcontext context);

inline bool lost_context(CUresult code) {
  return code == CUDA_ERROR_INVALID_CONTEXT || code == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

}  // namespace kvcached::cuda
