// Device: a backend plus the bookkeeping that makes every backend obey the same rules.
//
// Drivers differ in what they refuse (CUDA happily releases an allocation that
// is still mapped; the host kernel happily maps over anything). Device checks
// every request against its own records *before* calling the backend, so a bad
// request raises InvalidArgument and changes nothing, on every backend alike.
// It also counts reserved, created and mapped bytes, which tests use to prove
// that nothing leaks, and keeps an estimate of the device's free memory that
// costs no driver call (the last query, less what this Device created since).
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kvcached/device/backend.hpp"

namespace kvcached {

class Device;

// A reserved virtual address range. Move-only; freeing it (explicitly or by
// the destructor) first unmaps whatever is still mapped inside.
class KVCACHED_EXPORT Reservation {
 public:
  Reservation() = default;
  Reservation(std::shared_ptr<Device> device, VirtualAddress base, std::size_t size_bytes);
  Reservation(Reservation&& other) noexcept;
  Reservation& operator=(Reservation&& other) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  ~Reservation();

  VirtualAddress base() const noexcept { return base_; }
  std::size_t size_bytes() const noexcept { return size_bytes_; }
  bool valid() const noexcept { return device_ != nullptr; }
  const std::shared_ptr<Device>& device() const noexcept { return device_; }
  // Unmaps anything still mapped inside, then frees the range. Idempotent.
  void free();

 private:
  std::shared_ptr<Device> device_;
  VirtualAddress base_ = 0;
  std::size_t size_bytes_ = 0;
};

// A physical allocation. Move-only; release() refuses while it is mapped,
// the destructor (which must not throw) unmaps it everywhere first.
class KVCACHED_EXPORT PhysicalAllocation {
 public:
  PhysicalAllocation() = default;
  PhysicalAllocation(std::shared_ptr<Device> device, PhysicalHandle handle, std::size_t size_bytes);
  PhysicalAllocation(PhysicalAllocation&& other) noexcept;
  PhysicalAllocation& operator=(PhysicalAllocation&& other) noexcept;
  PhysicalAllocation(const PhysicalAllocation&) = delete;
  PhysicalAllocation& operator=(const PhysicalAllocation&) = delete;
  ~PhysicalAllocation();

  PhysicalHandle handle() const noexcept { return handle_; }
  std::size_t size_bytes() const noexcept { return size_bytes_; }
  bool valid() const noexcept { return device_ != nullptr; }
  const Device* device() const noexcept { return device_.get(); }
  // Raises InvalidArgument while any mapping of it exists. Idempotent.
  void release();

 private:
  void reset_without_release() noexcept;
  std::shared_ptr<Device> device_;
  PhysicalHandle handle_ = 0;
  std::size_t size_bytes_ = 0;
};

struct DeviceCounters {
  std::size_t reserved_bytes = 0;
  std::size_t created_bytes = 0;
  std::size_t mapped_bytes = 0;
  std::size_t reservations = 0;
  std::size_t allocations = 0;
  std::size_t mappings = 0;
};

class KVCACHED_EXPORT Device : public std::enable_shared_from_this<Device> {
 public:
  static std::shared_ptr<Device> open(std::shared_ptr<VmmBackend> backend);
  ~Device();

  VmmBackend& backend() noexcept { return *backend_; }
  std::string name() const;  // e.g. "cuda:0", "cpu": the ordinal this process sees
  // The physical device, e.g. "cuda-GPU-8f2c...", "hip-pci-0000:c1:00.0", "cpu":
  // the same in every process (device_identity.hpp). Read once at open.
  const std::string& canonical_name() const noexcept { return canonical_name_; }
  std::string backend_name() const { return backend_->name(); }
  int ordinal() const { return backend_->device_ordinal(); }
  DLDeviceType dlpack_device_type() const { return backend_->dlpack_device_type(); }
  Granularity granularity() const { return granularity_; }
  // Asks the driver (cuMemGetInfo: microseconds, so never per page) and
  // resets the estimate below to its answer.
  MemoryInfo memory_info() const;
  // Free device memory without a driver call: the last memory_info() answer,
  // less what this Device created since, plus what it released. Exact for
  // this process's own pools; memory taken by other users of the device shows
  // at the next query (made when a create runs out of memory, and
  // periodically by a pool's background worker).
  std::size_t estimated_free_bytes() const noexcept;
  DeviceCounters counters() const;
  // The calling thread is kvcached's own (a pool's worker): bind the device
  // to it once (VmmBackend::bind_calling_thread).
  void bind_calling_thread() { backend_->bind_calling_thread(); }

  // alignment_bytes 0 means the recommended granularity.
  Reservation reserve(std::size_t size_bytes, std::size_t alignment_bytes = 0);
  PhysicalAllocation create(std::size_t size_bytes);
  // Maps the whole allocation at `address` (inside a live reservation, on
  // free addresses). Not accessible until set_access.
  void map(VirtualAddress address, const PhysicalAllocation& allocation);
  // Unmaps one or more whole, adjacent mappings exactly covering the range.
  void unmap(VirtualAddress address, std::size_t size_bytes);
  // Range must be fully covered by mappings.
  void set_access(VirtualAddress address, std::size_t size_bytes);
  // map + set_access, undone if set_access fails.
  void map_accessible(VirtualAddress address, const PhysicalAllocation& allocation);
  void synchronize() { backend_->synchronize(); }
  // Make mappings made so far visible to device work from now on (may wait;
  // see VmmBackend::fence_new_mappings). Call before handing new memory out.
  void fence_new_mappings() { backend_->fence_new_mappings(); }
  // Whether [address, address + size) lies inside one live reservation: the
  // most any exported tensor may span (a copy across two separately reserved
  // ranges fails on ROCm even where they happen to be adjacent).
  bool inside_one_reservation(VirtualAddress address, std::size_t size_bytes) const;
  // Range must be mapped and accessible.
  void zero_fill(VirtualAddress address, std::size_t size_bytes);
  bool map_free_zero_pages(VirtualAddress address, std::size_t size_bytes);

 private:
  friend class Reservation;
  friend class PhysicalAllocation;
  explicit Device(std::shared_ptr<VmmBackend> backend);

  struct MappingRecord {
    std::size_t size_bytes;
    PhysicalHandle handle;
  };
  struct AllocationRecord {
    std::size_t size_bytes;
    std::size_t mapping_count;
  };

  void free_range(VirtualAddress base, std::size_t size_bytes, bool tolerate_errors);
  void release_allocation(PhysicalHandle handle, bool force);
  void map_locked(VirtualAddress address, const PhysicalAllocation& allocation);
  void set_access_locked(VirtualAddress address, std::size_t size_bytes);
  void check_aligned(const char* what, std::size_t value) const;
  // Returns the reservation containing [address, address+size) or end().
  std::map<VirtualAddress, std::size_t>::const_iterator find_reservation(VirtualAddress address,
                                                                         std::size_t size_bytes) const;
  void unmap_locked(VirtualAddress address, std::size_t size_bytes);

  std::shared_ptr<VmmBackend> backend_;
  Granularity granularity_;
  std::string canonical_name_;
  // Free bytes as of the last query, adjusted by every create and release
  // since; may go negative when others freed memory we then created.
  mutable std::atomic<std::int64_t> free_estimate_bytes_{0};
  mutable std::mutex mutex_;                            // guards the records below and serialises driver calls
  std::map<VirtualAddress, std::size_t> reservations_;  // base -> size
  std::unordered_map<PhysicalHandle, AllocationRecord> allocations_;
  std::map<VirtualAddress, MappingRecord> mappings_;  // address -> mapping
  DeviceCounters counters_;
};

}  // namespace kvcached
