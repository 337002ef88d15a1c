// The backend contract: the virtual-memory primitives every device kind provides.
//
// One implementation per folder under cpp/src (host, cuda, hip), each created by
// the factory its header in kvcached/backends/ declares. Implementations
// are thin: they translate each call to the driver and report failures as
// DriverError / DeviceOutOfMemory. Rule checking (alignment, overlaps, release
// while mapped) lives once, in Device (device.hpp), so every backend refuses
// the same misuse with the same message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvcached/error.hpp"

namespace kvcached {

// A virtual address in the device's address space (host pointer on cpu).
using VirtualAddress = std::uintptr_t;
// Opaque driver handle of one physical allocation (CUmemGenericAllocationHandle,
// hipMemGenericAllocationHandle_t, or the host backend's own id).
using PhysicalHandle = std::uint64_t;

// DLPack device type codes (dlpack.h), so tensors can name their device.
enum class DLDeviceType : int { kCPU = 1, kCUDA = 2, kROCM = 10 };

struct Granularity {
  std::size_t minimum_bytes;      // smallest legal size / alignment
  std::size_t recommended_bytes;  // what the driver prefers; kvcached's default page
};

struct MemoryInfo {
  std::size_t free_bytes;
  std::size_t total_bytes;
};

// Copies between host memory and mapped, accessible device memory, run in the
// order queued (a CUDA / HIP stream of its own; at once on the host backend), so
// the caller may go on making driver calls while they run. Moves model weights
// out and back (weights/weight_space.hpp). Not thread-safe: one owner at a time.
class KVCACHED_EXPORT CopyQueue {
 public:
  virtual ~CopyQueue() = default;
  // `host` must stay valid, and the device range mapped, until wait() returns.
  virtual void copy_to_host(void* host, VirtualAddress device, std::size_t size_bytes) = 0;
  virtual void copy_from_host(VirtualAddress device, const void* host, std::size_t size_bytes) = 0;
  virtual void fill_zero(VirtualAddress device, std::size_t size_bytes) = 0;
  // Returns once everything queued so far is done; throws the first failure.
  virtual void wait() = 0;
};

class KVCACHED_EXPORT VmmBackend {
 public:
  virtual ~VmmBackend() = default;

  // "host", "cuda" or "hip".
  virtual std::string name() const = 0;
  // The index this process sees the device under (after CUDA_VISIBLE_DEVICES,
  // HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES).
  virtual int device_ordinal() const = 0;
  // Which physical device this is, the same text in every process whatever
  // ordinal it sees the device under (forms in device_identity.hpp).
  virtual std::string physical_device_name() const = 0;
  virtual DLDeviceType dlpack_device_type() const = 0;
  virtual Granularity granularity() const = 0;
  virtual MemoryInfo memory_info() const = 0;

  // Address ranges. `size_bytes` and `alignment_bytes` are multiples of the
  // minimum granularity. Freeing a range with mappings inside is undefined
  // here; Device guarantees it never happens.
  virtual VirtualAddress reserve(std::size_t size_bytes, std::size_t alignment_bytes) = 0;
  virtual void free_range(VirtualAddress base, std::size_t size_bytes) = 0;

  // Physical allocations. Throws DeviceOutOfMemory when memory runs out.
  virtual PhysicalHandle create(std::size_t size_bytes) = 0;
  virtual void release(PhysicalHandle handle) = 0;

  // Map a whole allocation (offset 0) at `address`, inside a reserved range.
  // A fresh mapping is not accessible until set_access.
  virtual void map(VirtualAddress address, std::size_t size_bytes, PhysicalHandle handle) = 0;
  // Unmap whole mappings; the range stays reserved (not a hole).
  virtual void unmap(VirtualAddress address, std::size_t size_bytes) = 0;
  // Make mapped memory readable and writable by this device.
  virtual void set_access(VirtualAddress address, std::size_t size_bytes) = 0;
  // Make every mapping whose access was set so far visible to device work
  // submitted from now on; may wait. Call once after a batch of mappings,
  // before their memory is handed to kernels. CUDA and host: visible when
  // set_access returns, nothing to do. HIP: see hip_backend.cpp.
  virtual void fence_new_mappings() {}

  // Set mapped, accessible memory to zero and wait until it is done (used once
  // per shared zero allocation, so it need not be fast).
  virtual void zero_fill(VirtualAddress address, std::size_t size_bytes) = 0;

  // Wait until work already queued on the device is done (used before unmap,
  // because unmap does not wait for kernels in flight).
  virtual void synchronize() = 0;

  // Host memory this device copies to and from at full speed: page-locked on
  // GPUs (the DMA engines read it without a bounce buffer), ordinary anonymous
  // memory on the host backend. DeviceOutOfMemory when the host has none left.
  virtual void* allocate_host_buffer(std::size_t size_bytes) = 0;
  virtual void free_host_buffer(void* buffer, std::size_t size_bytes) noexcept = 0;
  // A queue of its own for copies to and from this device (see CopyQueue).
  virtual std::unique_ptr<CopyQueue> open_copy_queue() = 0;

  // The calling thread belongs to kvcached (a pool's background worker): make
  // this device current on it once and keep it so, so that its later calls
  // need no switch. Other threads are never changed behind their owner's back
  // beyond what each backend documents.
  virtual void bind_calling_thread() {}

  // Optional: turn [address, address+size) into read-only zero pages at no
  // physical cost. Only the host backend can (anonymous private mapping);
  // GPU backends return false and callers map a shared zero allocation.
  virtual bool map_free_zero_pages(VirtualAddress address, std::size_t size_bytes) {
    (void)address;
    (void)size_bytes;
    return false;
  }
};

// How a backend module hands its implementation to the core module: a
// PyCapsule named kBackendCapsuleName holding a heap-allocated
// std::shared_ptr<VmmBackend>, freed by the capsule's destructor.
inline constexpr const char* kBackendCapsuleName = "kvcached.VmmBackend";

}  // namespace kvcached
