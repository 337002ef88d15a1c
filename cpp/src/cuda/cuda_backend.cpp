// The CUDA backend: each VmmBackend call is one cuMem* driver call, made with
// the device's primary context current on the calling thread (made current
// once per thread and kept, so a VMM call normally makes no context call).
//
// The primary context is the one the CUDA runtime (and so PyTorch) uses, so
// memory mapped here is usable by their kernels without any peer set-up.
#include "kvcached/backends/cuda_backend.hpp"

#include <cuda.h>

#include <memory>
#include <string>

#include "cuda/cuda_copies.hpp"
#include "cuda/cuda_driver.hpp"
#include "kvcached/device/device_identity.hpp"

namespace kvcached {
namespace {

using cuda::check;
using cuda::ContextForCall;
using cuda::driver_message;
using cuda::kBackendName;
using cuda::keep_current;
using cuda::lost_context;
using cuda::t_known_current;

// cuInit for the free functions below; the driver makes repeated calls cheap.
CUresult initialise_driver() { return cuInit(0); }

int checked_device_count() {
  int count = 0;
  check("cuDeviceGetCount", cuDeviceGetCount(&count));
  return count;
}

// cuda.h (11.4 and later) maps cuDeviceGetUuid to cuDeviceGetUuid_v2, which
// names a MIG instance by its own UUID rather than its parent GPU's.
std::string physical_name_of(CUdevice device) {
  CUuuid uuid{};
  check("cuDeviceGetUuid", cuDeviceGetUuid(&uuid, device));
  return identity::from_uuid_bytes(kBackendName, reinterpret_cast<const unsigned char*>(uuid.bytes));
}

// cuInit, then the CUdevice of `ordinal`; BackendUnavailable if there is none.
CUdevice open_device_handle(int ordinal) {
  const CUresult init = initialise_driver();
  if (init != CUDA_SUCCESS) {
    throw BackendUnavailable("no CUDA device: cuInit returned " + driver_message(init));
  }
  const int count = checked_device_count();
  if (ordinal < 0 || ordinal >= count) {
    throw BackendUnavailable("no CUDA device " + std::to_string(ordinal) + ": the driver reports " +
                             std::to_string(count) + " device(s)");
  }
  CUdevice device = 0;
  check("cuDeviceGet", cuDeviceGet(&device, ordinal));
  return device;
}

class CudaBackend final : public VmmBackend {
 public:
  CudaBackend(int ordinal, CUdevice device)
      : ordinal_(ordinal), device_(device), physical_name_(physical_name_of(device)) {
    check("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&context_, device_));
    try {
      granularity_ = query_granularity();
    } catch (...) {
      (void)cuDevicePrimaryCtxRelease(device_);
      throw;
    }
  }

  ~CudaBackend() override {
    // At interpreter exit the driver may already be shut down
    // (CUDA_ERROR_DEINITIALIZED); there is nothing left to release then.
    (void)cuDevicePrimaryCtxRelease(device_);
  }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return kBackendName; }
  int device_ordinal() const override { return ordinal_; }
  std::string physical_device_name() const override { return physical_name_; }
  DLDeviceType dlpack_device_type() const override { return DLDeviceType::kCUDA; }
  Granularity granularity() const override { return granularity_; }

  void bind_calling_thread() override { keep_current(context_); }

  MemoryInfo memory_info() const override {
    ContextForCall scope(context_, /*verify=*/true);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    check("cuMemGetInfo", cuMemGetInfo(&free_bytes, &total_bytes));
    return {free_bytes, total_bytes};
  }

  VirtualAddress reserve(std::size_t size_bytes, std::size_t alignment_bytes) override {
    CUdeviceptr base = 0;
    const CUdeviceptr no_fixed_address = 0;
    const unsigned long long no_flags = 0;
    vmm_call("cuMemAddressReserve",
             [&] { return cuMemAddressReserve(&base, size_bytes, alignment_bytes, no_fixed_address, no_flags); });
    return static_cast<VirtualAddress>(base);
  }

  void free_range(VirtualAddress base, std::size_t size_bytes) override {
    vmm_call("cuMemAddressFree", [&] { return cuMemAddressFree(static_cast<CUdeviceptr>(base), size_bytes); });
  }

  PhysicalHandle create(std::size_t size_bytes) override {
    const CUmemAllocationProp prop = device_allocation_prop();
    CUmemGenericAllocationHandle handle = 0;
    const unsigned long long no_flags = 0;
    vmm_call("cuMemCreate", [&] { return cuMemCreate(&handle, size_bytes, &prop, no_flags); });
    return static_cast<PhysicalHandle>(handle);
  }

  void release(PhysicalHandle handle) override {
    vmm_call("cuMemRelease", [&] { return cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)); });
  }

  void map(VirtualAddress address, std::size_t size_bytes, PhysicalHandle handle) override {
    // CUDA refuses non-zero offsets ("operation not supported"): always whole allocations.
    const std::size_t whole_allocation_offset = 0;
    const unsigned long long no_flags = 0;
    vmm_call("cuMemMap", [&] {
      return cuMemMap(static_cast<CUdeviceptr>(address), size_bytes, whole_allocation_offset,
                      static_cast<CUmemGenericAllocationHandle>(handle), no_flags);
    });
  }

  void unmap(VirtualAddress address, std::size_t size_bytes) override {
    vmm_call("cuMemUnmap", [&] { return cuMemUnmap(static_cast<CUdeviceptr>(address), size_bytes); });
  }

  void set_access(VirtualAddress address, std::size_t size_bytes) override {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const std::size_t one_descriptor = 1;
    vmm_call("cuMemSetAccess",
             [&] { return cuMemSetAccess(static_cast<CUdeviceptr>(address), size_bytes, &access, one_descriptor); });
  }

  void zero_fill(VirtualAddress address, std::size_t size_bytes) override {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuMemsetD8", cuMemsetD8(static_cast<CUdeviceptr>(address), 0, size_bytes));
    check("cuCtxSynchronize", cuCtxSynchronize());
  }

  void synchronize() override {
    ContextForCall scope(context_, /*verify=*/true);
    check("cuCtxSynchronize", cuCtxSynchronize());
  }

  void* allocate_host_buffer(std::size_t size_bytes) override { return cuda::allocate_pinned(context_, size_bytes); }
  void free_host_buffer(void* buffer, std::size_t /*size_bytes*/) noexcept override {
    cuda::free_pinned(context_, buffer);
  }
  std::unique_ptr<CopyQueue> open_copy_queue() override { return cuda::make_copy_queue(context_); }

 private:
  // One VMM call: no context call when this thread is known to have ours
  // current; bound and retried once if the driver says it has no context.
  template <typename Call>
  void vmm_call(const char* name, const Call& call) const {
    CUresult result;
    {
      ContextForCall scope(context_, /*verify=*/false);
      result = call();
    }
    if (lost_context(result)) {
      t_known_current = nullptr;
      keep_current(context_);  // the thread had no usable context: bind ours for good
      result = call();
    }
    check(name, result);
  }

  // Pinned device memory with no export handle types: the cheapest kind, and
  // what cuMemGetAllocationGranularity must be asked about too.
  CUmemAllocationProp device_allocation_prop() const {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    return prop;
  }

  Granularity query_granularity() const {
    ContextForCall scope(context_, /*verify=*/true);
    const CUmemAllocationProp prop = device_allocation_prop();
    Granularity result{0, 0};
    check("cuMemGetAllocationGranularity",
          cuMemGetAllocationGranularity(&result.minimum_bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    check("cuMemGetAllocationGranularity",
          cuMemGetAllocationGranularity(&result.recommended_bytes, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    return result;
  }

  const int ordinal_;
  const CUdevice device_;
  const std::string physical_name_;
  CUcontext context_ = nullptr;
  Granularity granularity_{0, 0};
};

}  // namespace

int cuda_device_count() {
  const CUresult init = initialise_driver();
  if (init == CUDA_ERROR_NO_DEVICE) return 0;
  if (init != CUDA_SUCCESS) {
    throw BackendUnavailable("CUDA driver unusable: cuInit returned " + driver_message(init));
  }
  return checked_device_count();
}

bool cuda_vmm_supported(int ordinal) {
  if (initialise_driver() != CUDA_SUCCESS) return false;
  int count = 0;
  if (cuDeviceGetCount(&count) != CUDA_SUCCESS || ordinal < 0 || ordinal >= count) return false;
  CUdevice device = 0;
  if (cuDeviceGet(&device, ordinal) != CUDA_SUCCESS) return false;
  int supported = 0;
  if (cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) !=
      CUDA_SUCCESS) {
    return false;
  }
  return supported != 0;
}

int cuda_driver_version() {
  int version = 0;
  const CUresult result = cuDriverGetVersion(&version);
  if (result != CUDA_SUCCESS) {
    throw BackendUnavailable("CUDA driver unusable: cuDriverGetVersion returned " + driver_message(result));
  }
  return version;
}

std::string cuda_physical_device_name(int ordinal) { return physical_name_of(open_device_handle(ordinal)); }

std::shared_ptr<VmmBackend> make_cuda_backend(int ordinal) {
  const CUdevice device = open_device_handle(ordinal);
  int vmm_supported = 0;
  check("cuDeviceGetAttribute",
        cuDeviceGetAttribute(&vmm_supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device));
  if (vmm_supported == 0) {
    throw BackendUnavailable("CUDA device " + std::to_string(ordinal) + " (" + physical_name_of(device) +
                             ") does not support virtual memory management: "
                             "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0");
  }
  return std::make_shared<CudaBackend>(ordinal, device);
}

}  // namespace kvcached
