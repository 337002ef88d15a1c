// The CUDA backend's copies (cuda_copies.hpp): async copies on one stream, pinned host buffers.
#include "cuda/cuda_copies.hpp"

#include "cuda/cuda_driver.hpp"

namespace kvcached::cuda {
namespace {

class CudaCopyQueue final : public CopyQueue {
 public:
  explicit CudaCopyQueue(CUcontext context) : context_(context) {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuStreamCreate", cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING));
  }

  ~CudaCopyQueue() override {
    // Best effort: at interpreter exit the driver may be gone; a pending copy
    // is waited for by cuStreamDestroy's own semantics (it completes first).
    ContextScopeNoThrow scope(context_);
    (void)cuStreamDestroy(stream_);
  }

  CudaCopyQueue(const CudaCopyQueue&) = delete;
  CudaCopyQueue& operator=(const CudaCopyQueue&) = delete;

  void copy_to_host(void* host, VirtualAddress device, std::size_t size_bytes) override {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync(host, static_cast<CUdeviceptr>(device), size_bytes, stream_));
  }

  void copy_from_host(VirtualAddress device, const void* host, std::size_t size_bytes) override {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(device), host, size_bytes, stream_));
  }

  void fill_zero(VirtualAddress device, std::size_t size_bytes) override {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuMemsetD8Async", cuMemsetD8Async(static_cast<CUdeviceptr>(device), 0, size_bytes, stream_));
  }

  void wait() override {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuStreamSynchronize", cuStreamSynchronize(stream_));
  }

 private:
  // The context current for the destructor's one call, without throwing.
  class ContextScopeNoThrow {
   public:
    explicit ContextScopeNoThrow(CUcontext context) {
      if (cuCtxGetCurrent(&previous_) == CUDA_SUCCESS && previous_ != context) {
        switched_ = cuCtxSetCurrent(context) == CUDA_SUCCESS;
      }
    }
    ~ContextScopeNoThrow() {
      if (switched_) (void)cuCtxSetCurrent(previous_);
    }

   private:
    CUcontext previous_ = nullptr;
    bool switched_ = false;
  };

  CUcontext context_;
  CUstream stream_ = nullptr;
};

}  // namespace

std::unique_ptr<CopyQueue> make_copy_queue(CUcontext context) { return std::make_unique<CudaCopyQueue>(context); }

void* allocate_pinned(CUcontext context, std::size_t size_bytes) {
  ContextForCall scope(context, /*verify=*/true);
  void* buffer = nullptr;
  check("cuMemHostAlloc", cuMemHostAlloc(&buffer, size_bytes, CU_MEMHOSTALLOC_PORTABLE));
  return buffer;
}

void free_pinned(CUcontext context, void* buffer) noexcept {
  CUcontext previous = nullptr;
  const bool switched =
      cuCtxGetCurrent(&previous) == CUDA_SUCCESS && previous != context && cuCtxSetCurrent(context) == CUDA_SUCCESS;
  (void)cuMemFreeHost(buffer);
  if (switched) (void)cuCtxSetCurrent(previous);
}

}  // namespace kvcached::cuda
