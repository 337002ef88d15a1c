// Device: rule checks and bookkeeping in front of a VmmBackend (see device.hpp).
#include "kvcached/device/device.hpp"

#include <cstdio>
#include <utility>

namespace kvcached {

namespace {

// No iostreams anywhere in the library: an extension module can end up with
// its own copy of libstdc++'s locale machinery (static libstdc++ builds), and
// formatting a number through it then crashes. snprintf has no such state.
std::string hex(VirtualAddress address) {
  char text[2 + 2 * sizeof(VirtualAddress) + 1];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

}  // namespace

// ---- Reservation ------------------------------------------------------------

Reservation::Reservation(std::shared_ptr<Device> device, VirtualAddress base, std::size_t size_bytes)
    : device_(std::move(device)), base_(base), size_bytes_(size_bytes) {}

Reservation::Reservation(Reservation&& other) noexcept
    : device_(std::move(other.device_)), base_(other.base_), size_bytes_(other.size_bytes_) {
  other.base_ = 0;
  other.size_bytes_ = 0;
}

Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    try {
      free();
    } catch (...) {
    }
    device_ = std::move(other.device_);
    base_ = other.base_;
    size_bytes_ = other.size_bytes_;
    other.base_ = 0;
    other.size_bytes_ = 0;
  }
  return *this;
}

Reservation::~Reservation() {
  if (device_) device_->free_range(base_, size_bytes_, /*tolerate_errors=*/true);
}

void Reservation::free() {
  if (!device_) return;
  auto device = std::move(device_);
  device_.reset();
  device->free_range(base_, size_bytes_, /*tolerate_errors=*/false);
}

// ---- PhysicalAllocation -----------------------------------------------------

PhysicalAllocation::PhysicalAllocation(std::shared_ptr<Device> device, PhysicalHandle handle, std::size_t size_bytes)
    : device_(std::move(device)), handle_(handle), size_bytes_(size_bytes) {}

PhysicalAllocation::PhysicalAllocation(PhysicalAllocation&& other) noexcept
    : device_(std::move(other.device_)), handle_(other.handle_), size_bytes_(other.size_bytes_) {
  other.reset_without_release();
}

PhysicalAllocation& PhysicalAllocation::operator=(PhysicalAllocation&& other) noexcept {
  if (this != &other) {
    if (device_) device_->release_allocation(handle_, /*force=*/true);
    device_ = std::move(other.device_);
    handle_ = other.handle_;
    size_bytes_ = other.size_bytes_;
    other.reset_without_release();
  }
  return *this;
}

PhysicalAllocation::~PhysicalAllocation() {
  if (device_) device_->release_allocation(handle_, /*force=*/true);
}

void PhysicalAllocation::release() {
  if (!device_) return;
  device_->release_allocation(handle_, /*force=*/false);
  reset_without_release();
}

void PhysicalAllocation::reset_without_release() noexcept {
  device_.reset();
  handle_ = 0;
  size_bytes_ = 0;
}

// ---- Device -----------------------------------------------------------------

std::shared_ptr<Device> Device::open(std::shared_ptr<VmmBackend> backend) {
  if (!backend) throw InvalidArgument("Device::open: no backend given");
  return std::shared_ptr<Device>(new Device(std::move(backend)));
}

Device::Device(std::shared_ptr<VmmBackend> backend)
    : backend_(std::move(backend)),
      granularity_(backend_->granularity()),
      canonical_name_(backend_->physical_device_name()) {
  (void)memory_info();  // the first figure of the estimate
}

MemoryInfo Device::memory_info() const {
  // Under the lock, so no create or release lands between the answer and the reset.
  std::lock_guard<std::mutex> lock(mutex_);
  const MemoryInfo info = backend_->memory_info();
  free_estimate_bytes_.store(static_cast<std::int64_t>(info.free_bytes), std::memory_order_relaxed);
  return info;
}

std::size_t Device::estimated_free_bytes() const noexcept {
  const std::int64_t estimate = free_estimate_bytes_.load(std::memory_order_relaxed);
  return estimate > 0 ? static_cast<std::size_t>(estimate) : 0;
}

Device::~Device() = default;  // every Reservation / PhysicalAllocation holds a shared_ptr to us

std::string Device::name() const {
  const std::string backend = backend_->name();
  if (backend == "host") return "cpu";
  return backend + ":" + std::to_string(backend_->device_ordinal());
}

DeviceCounters Device::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

void Device::check_aligned(const char* what, std::size_t value) const {
  if (value == 0 || value % granularity_.minimum_bytes != 0) {
    throw InvalidArgument(std::string(what) + " must be a positive multiple of the " + backend_->name() +
                          " granularity (" + std::to_string(granularity_.minimum_bytes) + " bytes), got " +
                          std::to_string(value));
  }
}

Reservation Device::reserve(std::size_t size_bytes, std::size_t alignment_bytes) {
  check_aligned("reservation size", size_bytes);
  if (alignment_bytes == 0) alignment_bytes = granularity_.recommended_bytes;
  check_aligned("reservation alignment", alignment_bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  const VirtualAddress base = backend_->reserve(size_bytes, alignment_bytes);
  reservations_.emplace(base, size_bytes);
  counters_.reserved_bytes += size_bytes;
  counters_.reservations += 1;
  return Reservation(shared_from_this(), base, size_bytes);
}

PhysicalAllocation Device::create(std::size_t size_bytes) {
  check_aligned("allocation size", size_bytes);
  std::unique_lock<std::mutex> lock(mutex_);
  PhysicalHandle handle = 0;
  try {
    handle = backend_->create(size_bytes);
  } catch (const DeviceOutOfMemory&) {
    lock.unlock();
    try {
      (void)memory_info();  // the estimate was too high: learn what is really free
    } catch (...) {
    }
    throw;
  }
  allocations_.emplace(handle, AllocationRecord{size_bytes, 0});
  counters_.created_bytes += size_bytes;
  counters_.allocations += 1;
  free_estimate_bytes_.fetch_sub(static_cast<std::int64_t>(size_bytes), std::memory_order_relaxed);
  return PhysicalAllocation(shared_from_this(), handle, size_bytes);
}

std::map<VirtualAddress, std::size_t>::const_iterator Device::find_reservation(VirtualAddress address,
                                                                               std::size_t size_bytes) const {
  auto it = reservations_.upper_bound(address);
  if (it == reservations_.begin()) return reservations_.end();
  --it;
  if (address + size_bytes > it->first + it->second) return reservations_.end();
  return it;
}

bool Device::inside_one_reservation(VirtualAddress address, std::size_t size_bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return size_bytes > 0 && address + size_bytes > address &&
         find_reservation(address, size_bytes) != reservations_.end();
}

void Device::map(VirtualAddress address, const PhysicalAllocation& allocation) {
  if (!allocation.valid() || allocation.device() != this) {
    throw InvalidArgument("map: the allocation is released or belongs to another device");
  }
  check_aligned("mapping address", address);
  std::lock_guard<std::mutex> lock(mutex_);
  map_locked(address, allocation);
}

void Device::map_locked(VirtualAddress address, const PhysicalAllocation& allocation) {
  const std::size_t size = allocation.size_bytes();
  if (find_reservation(address, size) == reservations_.end()) {
    throw InvalidArgument("map: [" + hex(address) + ", +" + std::to_string(size) +
                          ") is not inside one reserved range");
  }
  // Any mapping that starts before our end and ends after our start overlaps.
  auto next = mappings_.lower_bound(address);
  if (next != mappings_.end() && next->first < address + size) {
    throw InvalidArgument("map: " + hex(next->first) + " is already mapped");
  }
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size_bytes > address) {
      throw InvalidArgument("map: " + hex(address) + " overlaps the mapping at " + hex(prev->first));
    }
  }
  backend_->map(address, size, allocation.handle());
  mappings_.emplace(address, MappingRecord{size, allocation.handle()});
  allocations_.at(allocation.handle()).mapping_count += 1;
  counters_.mapped_bytes += size;
  counters_.mappings += 1;
}

void Device::unmap(VirtualAddress address, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  unmap_locked(address, size_bytes);
}

void Device::unmap_locked(VirtualAddress address, std::size_t size_bytes) {
  // The range must be an exact run of whole, adjacent mappings.
  auto first = mappings_.find(address);
  if (first == mappings_.end()) {
    throw InvalidArgument("unmap: no mapping starts at " + hex(address));
  }
  VirtualAddress cursor = address;
  auto it = first;
  while (cursor < address + size_bytes) {
    if (it == mappings_.end() || it->first != cursor) {
      throw InvalidArgument("unmap: [" + hex(address) + ", +" + std::to_string(size_bytes) +
                            ") is not an exact run of whole mappings (gap at " + hex(cursor) + ")");
    }
    cursor += it->second.size_bytes;
    ++it;
  }
  if (cursor != address + size_bytes) {
    throw InvalidArgument("unmap: " + std::to_string(size_bytes) + " bytes would split the mapping ending at " +
                          hex(cursor));
  }
  backend_->unmap(address, size_bytes);
  for (auto m = first; m != it;) {
    allocations_.at(m->second.handle).mapping_count -= 1;
    counters_.mapped_bytes -= m->second.size_bytes;
    counters_.mappings -= 1;
    m = mappings_.erase(m);
  }
}

void Device::set_access(VirtualAddress address, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  set_access_locked(address, size_bytes);
}

void Device::set_access_locked(VirtualAddress address, std::size_t size_bytes) {
  VirtualAddress cursor = address;
  auto it = mappings_.upper_bound(address);
  if (it != mappings_.begin()) --it;
  while (cursor < address + size_bytes) {
    if (it == mappings_.end() || it->first > cursor || it->first + it->second.size_bytes <= cursor) {
      throw InvalidArgument("set_access: " + hex(cursor) + " is not mapped");
    }
    cursor = it->first + it->second.size_bytes;
    ++it;
  }
  backend_->set_access(address, size_bytes);
}

void Device::map_accessible(VirtualAddress address, const PhysicalAllocation& allocation) {
  if (!allocation.valid() || allocation.device() != this) {
    throw InvalidArgument("map: the allocation is released or belongs to another device");
  }
  check_aligned("mapping address", address);
  std::lock_guard<std::mutex> lock(mutex_);  // one lock for the pair: the grow path's common call
  map_locked(address, allocation);
  try {
    set_access_locked(address, allocation.size_bytes());
  } catch (...) {
    try {
      unmap_locked(address, allocation.size_bytes());
    } catch (...) {
    }
    throw;
  }
}

void Device::zero_fill(VirtualAddress address, std::size_t size_bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = mappings_.upper_bound(address);
    if (it == mappings_.begin() || std::prev(it)->first + std::prev(it)->second.size_bytes < address + size_bytes) {
      // Only a single mapping is checked; callers zero one allocation at a time.
      throw InvalidArgument("zero_fill: range is not inside one mapping");
    }
  }
  backend_->zero_fill(address, size_bytes);
}

bool Device::map_free_zero_pages(VirtualAddress address, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (find_reservation(address, size_bytes) == reservations_.end()) {
    throw InvalidArgument("map_free_zero_pages: range is not inside one reservation");
  }
  return backend_->map_free_zero_pages(address, size_bytes);
}

void Device::free_range(VirtualAddress base, std::size_t size_bytes, bool tolerate_errors) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = reservations_.find(base);
  if (found == reservations_.end() || found->second != size_bytes) {
    if (tolerate_errors) return;
    throw InvalidArgument("free_range: no reservation at " + hex(base));
  }
  // Unmap what is still mapped inside, one mapping at a time.
  try {
    for (auto it = mappings_.lower_bound(base); it != mappings_.end() && it->first < base + size_bytes;
         it = mappings_.lower_bound(base)) {
      unmap_locked(it->first, it->second.size_bytes);
    }
    backend_->free_range(base, size_bytes);
  } catch (...) {
    if (!tolerate_errors) throw;
  }
  reservations_.erase(found);
  counters_.reserved_bytes -= size_bytes;
  counters_.reservations -= 1;
}

void Device::release_allocation(PhysicalHandle handle, bool force) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = allocations_.find(handle);
  if (found == allocations_.end()) {
    if (force) return;
    throw InvalidArgument("release: unknown allocation");
  }
  if (found->second.mapping_count > 0) {
    if (!force) {
      throw InvalidArgument("release: the allocation is still mapped " + std::to_string(found->second.mapping_count) +
                            " time(s); unmap it first");
    }
    // Destructor path: unmap every mapping of this allocation, never throw.
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      if (it->second.handle == handle) {
        const auto address = it->first;
        const auto size = it->second.size_bytes;
        ++it;
        try {
          unmap_locked(address, size);
        } catch (...) {
        }
      } else {
        ++it;
      }
    }
  }
  const std::size_t size = found->second.size_bytes;
  bool released = true;
  try {
    backend_->release(handle);
  } catch (...) {
    if (!force) throw;
    released = false;  // e.g. the driver shut down at exit: nothing came back
  }
  allocations_.erase(found);
  counters_.created_bytes -= size;
  counters_.allocations -= 1;
  if (released) free_estimate_bytes_.fetch_add(static_cast<std::int64_t>(size), std::memory_order_relaxed);
}

}  // namespace kvcached
