// The HIP backend's copies (hip_copies.hpp): async copies on one stream, pinned host buffers.
//
// Every HIP call takes the runtime lock (hip_runtime.hpp). Waiting for a stream
// is done by polling hipStreamQuery, the lock taken for each query only, so a
// long copy never keeps a pool's mapping calls in the same process waiting.
#include "hip/hip_copies.hpp"

#include <chrono>
#include <thread>

#include "hip/hip_runtime.hpp"

namespace kvcached::hip {
namespace {

// How long a wait sleeps between queries: short beside a weights copy (tens of
// milliseconds and more), long beside one runtime call.
constexpr std::chrono::microseconds kStreamPollInterval{100};

void* to_pointer(VirtualAddress address) { return reinterpret_cast<void*>(address); }

class HipCopyQueue final : public CopyQueue {
 public:
  explicit HipCopyQueue(int ordinal) : ordinal_(ordinal) {
    ScopedHipCall call(ordinal_);
    check("hipStreamCreateWithFlags", hipStreamCreateWithFlags(&stream_, hipStreamNonBlocking));
  }

  ~HipCopyQueue() override {
    try {
      ScopedHipCall call(ordinal_);
      (void)hipStreamDestroy(stream_);  // waits for queued work itself
    } catch (...) {
      // Best effort: the runtime may already be gone at interpreter exit.
    }
  }

  HipCopyQueue(const HipCopyQueue&) = delete;
  HipCopyQueue& operator=(const HipCopyQueue&) = delete;

  void copy_to_host(void* host, VirtualAddress device, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    check("hipMemcpyDtoHAsync", hipMemcpyDtoHAsync(host, to_pointer(device), size_bytes, stream_));
  }

  void copy_from_host(VirtualAddress device, const void* host, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    // HIP 5.2 declares the source without const; the runtime only reads it.
    check("hipMemcpyHtoDAsync", hipMemcpyHtoDAsync(to_pointer(device), const_cast<void*>(host), size_bytes, stream_));
  }

  void fill_zero(VirtualAddress device, std::size_t size_bytes) override {
    ScopedHipCall call(ordinal_);
    check("hipMemsetD8Async", hipMemsetD8Async(to_pointer(device), 0, size_bytes, stream_));
  }

  void wait() override {
    for (;;) {
      hipError_t state;
      {
        ScopedHipCall call(ordinal_);
        state = hipStreamQuery(stream_);
      }
      if (state == hipSuccess) return;
      if (state != hipErrorNotReady) throw_driver_error("hipStreamQuery", state);
      std::this_thread::sleep_for(kStreamPollInterval);
    }
  }

 private:
  const int ordinal_;
  hipStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<CopyQueue> make_copy_queue(int ordinal) { return std::make_unique<HipCopyQueue>(ordinal); }

void* allocate_pinned(int ordinal, std::size_t size_bytes) {
  ScopedHipCall call(ordinal);
  void* buffer = nullptr;
  check("hipHostMalloc", hipHostMalloc(&buffer, size_bytes, hipHostMallocPortable));
  return buffer;
}

void free_pinned(int ordinal, void* buffer) noexcept {
  try {
    ScopedHipCall call(ordinal);
    (void)hipHostFree(buffer);
  } catch (...) {
    // Best effort, as a destructor's release: nothing to report to.
  }
}

}  // namespace kvcached::hip
