// Host backend: reservations are PROT_NONE anonymous mappings; physical
// allocations are memfd files mapped shared (the default) or anonymous memory
// moved into place by mremap (KVCACHED_HOST_MEMORY, host_allocations.hpp).
#include "kvcached/backends/host_backend.hpp"

#include "host_allocations.hpp"
#include "host_populator.hpp"

#include "kvcached/device/device_identity.hpp"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kvcached/error.hpp"

namespace kvcached {

namespace {

constexpr std::size_t kRecommendedGranularityBytes = 2u << 20;  // matches CUDA's 2 MiB pages

// Smallest of the cgroup v2 / v1 memory limit and MemTotal, in bytes.
std::size_t machine_memory_limit_bytes() {
  std::size_t limit =
      static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    // stdio rather than iostreams: see device.cpp on libstdc++ locale state.
    std::FILE* file = std::fopen(path, "r");
    if (file == nullptr) continue;
    char text[64] = {};
    const bool read = std::fgets(text, sizeof text, file) != nullptr;
    std::fclose(file);
    char* end = nullptr;
    const unsigned long long cgroup_limit = read ? std::strtoull(text, &end, 10) : 0;
    // "max" (no limit) parses as 0 and is skipped.
    if (cgroup_limit > 0 && cgroup_limit < limit) limit = static_cast<std::size_t>(cgroup_limit);
  }
  return limit;
}

// Host "device" memory is host memory: a copy is a memcpy, done when queued.
class HostCopyQueue final : public CopyQueue {
 public:
  void copy_to_host(void* host, VirtualAddress device, std::size_t size_bytes) override {
    std::memcpy(host, reinterpret_cast<const void*>(device), size_bytes);
  }
  void copy_from_host(VirtualAddress device, const void* host, std::size_t size_bytes) override {
    std::memcpy(reinterpret_cast<void*>(device), host, size_bytes);
  }
  void fill_zero(VirtualAddress device, std::size_t size_bytes) override {
    std::memset(reinterpret_cast<void*>(device), 0, size_bytes);
  }
  void wait() override {}
};

class HostBackend final : public VmmBackend {
 public:
  HostBackend(std::size_t capacity_bytes, HostMemory memory, HostPopulate populate)
      : capacity_bytes_(capacity_bytes),
        page_bytes_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))),
        // Anonymous memory is allocated (populated) when created: nothing left to do.
        populate_in_background_(populate == HostPopulate::kBackground && memory == HostMemory::kSharedFiles),
        allocations_(memory) {}

  std::string name() const override { return "host"; }
  int device_ordinal() const override { return 0; }
  std::string physical_device_name() const override { return identity::kHost; }
  DLDeviceType dlpack_device_type() const override { return DLDeviceType::kCPU; }
  Granularity granularity() const override { return Granularity{page_bytes_, kRecommendedGranularityBytes}; }
  MemoryInfo memory_info() const override {
    const std::size_t used = created_bytes_.load();
    return MemoryInfo{capacity_bytes_ > used ? capacity_bytes_ - used : 0, capacity_bytes_};
  }

  VirtualAddress reserve(std::size_t size_bytes, std::size_t alignment_bytes) override {
    return reserve_host_range(size_bytes, alignment_bytes);
  }

  void free_range(VirtualAddress base, std::size_t size_bytes) override {
    if (munmap(reinterpret_cast<void*>(base), size_bytes) != 0) throw_host_errno("munmap", errno);
  }

  PhysicalHandle create(std::size_t size_bytes) override {
    // Capacity is checked and taken atomically so concurrent creates cannot overshoot.
    std::size_t used = created_bytes_.load();
    do {
      if (used + size_bytes > capacity_bytes_) {
        throw DeviceOutOfMemory("host", "create", ENOMEM,
                                "host backend capacity exhausted: " + std::to_string(used) + " of " +
                                    std::to_string(capacity_bytes_) + " bytes in use, " + std::to_string(size_bytes) +
                                    " more requested (set KVCACHED_HOST_CAPACITY_BYTES to change the capacity)");
      }
    } while (!created_bytes_.compare_exchange_weak(used, used + size_bytes));
    try {
      return allocations_.create(size_bytes);
    } catch (...) {
      created_bytes_ -= size_bytes;
      throw;
    }
  }

  void release(PhysicalHandle handle) override { created_bytes_ -= allocations_.release(handle); }

  void map(VirtualAddress address, std::size_t size_bytes, PhysicalHandle handle) override {
    allocations_.map(address, size_bytes, handle);  // PROT_NONE until set_access, like a fresh GPU mapping
  }

  void unmap(VirtualAddress address, std::size_t size_bytes) override {
    allocations_.unmap(address, size_bytes);  // the range stays reserved: nothing else can land in it
  }

  void set_access(VirtualAddress address, std::size_t size_bytes) override {
    allocations_.set_access(address, size_bytes);
    // A spare mapped again too: its pages exist, but each would still take a fault to be mapped.
    if (populate_in_background_) populate_in_background(address, size_bytes);
  }

  void zero_fill(VirtualAddress address, std::size_t size_bytes) override {
    std::memset(reinterpret_cast<void*>(address), 0, size_bytes);
  }

  void synchronize() override {}  // host work is synchronous

  void* allocate_host_buffer(std::size_t size_bytes) override {
    void* buffer = mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buffer == MAP_FAILED) {
      const int error = errno;
      if (error == ENOMEM) {
        throw DeviceOutOfMemory("host", "mmap", error,
                                "no host memory for a " + std::to_string(size_bytes) + "-byte host buffer");
      }
      throw_host_errno("mmap", error);
    }
    return buffer;
  }

  void free_host_buffer(void* buffer, std::size_t size_bytes) noexcept override { (void)munmap(buffer, size_bytes); }

  std::unique_ptr<CopyQueue> open_copy_queue() override { return std::make_unique<HostCopyQueue>(); }

  bool map_free_zero_pages(VirtualAddress address, std::size_t size_bytes) override {
    // Reads of a private anonymous read-only mapping hit the kernel's shared
    // zero page: zeros at no physical cost and no per-page bookkeeping.
    void* result =
        mmap(reinterpret_cast<void*>(address), size_bytes, PROT_READ, kHostReservationFlags | MAP_FIXED, -1, 0);
    if (result == MAP_FAILED) throw_host_errno("mmap(PROT_READ)", errno);
    return true;
  }

 private:
  const std::size_t capacity_bytes_;
  const std::size_t page_bytes_;
  const bool populate_in_background_;
  std::atomic<std::size_t> created_bytes_{0};
  HostAllocations allocations_;
};

}  // namespace

std::size_t machine_host_capacity_bytes() { return machine_memory_limit_bytes() / 2; }

HostMemory parse_host_memory(const std::string& text) {
  if (text == "anonymous") return HostMemory::kAnonymous;
  if (text == "huge_pages") return HostMemory::kHugePages;
  if (text == "shared_files") return HostMemory::kSharedFiles;
  throw InvalidArgument("'" + text + "' is not a host memory kind: expected anonymous, huge_pages or shared_files");
}

HostPopulate parse_host_populate(const std::string& text) {
  if (text == "background") return HostPopulate::kBackground;
  if (text == "on_touch") return HostPopulate::kOnTouch;
  throw InvalidArgument("'" + text + "' is not a way to populate host pages: expected background or on_touch");
}

std::shared_ptr<VmmBackend> make_host_backend(const HostBackendOptions& options) {
  const std::size_t capacity_bytes =
      options.capacity_bytes != 0 ? options.capacity_bytes : machine_host_capacity_bytes();
  return std::make_shared<HostBackend>(capacity_bytes, options.memory, options.populate);
}

}  // namespace kvcached
