// The host backend's physical allocations (host_allocations.hpp), and what a fork() leaves of them.
#include "host_allocations.hpp"

#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kvcached/error.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

namespace kvcached {

namespace {

constexpr std::size_t kHugePageBytes = 2u << 20;

void* pointer(VirtualAddress address) { return reinterpret_cast<void*>(address); }

// One move of anonymous pages to a new address, the old range left in place
// (empty) rather than as a hole another thread's mmap could land in.
bool dontunmap_works() {
  const long page = sysconf(_SC_PAGESIZE);
  void* source = mmap(nullptr, 2 * page, PROT_NONE, kHostReservationFlags, -1, 0);
  if (source == MAP_FAILED) return false;
  void* target = static_cast<char*>(source) + page;
  const bool moved = mremap(source, page, page, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, target) == target;
  munmap(source, 2 * page);
  return moved;
}

// Every HostAllocations of the process, for the fork handlers (leaked: they
// may run while static objects are being destroyed at exit).
std::mutex& instances_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<HostAllocations*>& instances() {
  static auto* all = new std::vector<HostAllocations*>;
  return *all;
}

// A memfd mapping is not inherited by a child of fork() (see the header).
void dont_fork(VirtualAddress address, std::size_t size_bytes) {
  madvise(reinterpret_cast<void*>(address), size_bytes, MADV_DONTFORK);  // advisory: the fork handler covers it
}

void protect(VirtualAddress address, std::size_t size_bytes, int protection) {
  if (mprotect(pointer(address), size_bytes, protection) != 0) throw_host_errno("mprotect", errno);
}

// Allocates the memory of a fresh parked range now, on this one thread (two
// threads first-writing fresh huge pages were seen to stall for milliseconds),
// and advises it; the range ends PROT_NONE. A child process of fork() never
// shares (and copies on write) KV memory.
void allocate_parked(VirtualAddress parked, std::size_t size_bytes, bool huge_pages) {
  madvise(pointer(parked), size_bytes, MADV_DONTFORK);  // advisory
  protect(parked, size_bytes, PROT_READ | PROT_WRITE);
  if (huge_pages) madvise(pointer(parked), size_bytes, MADV_HUGEPAGE);  // advisory: the kernel may not have them
  if (madvise(pointer(parked), size_bytes, MADV_POPULATE_WRITE) != 0 && errno != EINVAL) {
    throw_host_errno("madvise(MADV_POPULATE_WRITE)", errno);  // EINVAL: before Linux 5.14, faults on first write
  }
  protect(parked, size_bytes, PROT_NONE);
}

}  // namespace

[[noreturn]] void throw_host_errno(const char* call, int error) {
  if (error == ENOMEM) throw DeviceOutOfMemory("host", call, error, std::strerror(error));
  throw DriverError("host", call, error, std::strerror(error));
}

VirtualAddress reserve_host_range(std::size_t size_bytes, std::size_t alignment_bytes) {
  // Over-reserve, then trim both ends so the base is aligned.
  const std::size_t padded = size_bytes + alignment_bytes;
  void* raw = mmap(nullptr, padded, PROT_NONE, kHostReservationFlags, -1, 0);
  if (raw == MAP_FAILED) throw_host_errno("mmap(PROT_NONE)", errno);
  const auto start = reinterpret_cast<VirtualAddress>(raw);
  const VirtualAddress base = (start + alignment_bytes - 1) / alignment_bytes * alignment_bytes;
  if (base > start) munmap(raw, base - start);
  const VirtualAddress end = start + padded;
  if (end > base + size_bytes) munmap(pointer(base + size_bytes), end - (base + size_bytes));
  return base;
}

HostAllocations::HostAllocations(HostMemory memory)
    : moves_pages_(memory != HostMemory::kSharedFiles && dontunmap_works()),
      huge_pages_(memory == HostMemory::kHugePages) {
  static const int registered = pthread_atfork(lock_all_before_fork, unlock_all_in_parent, detach_all_in_child);
  if (registered != 0) throw_host_errno("pthread_atfork", registered);
  std::lock_guard<std::mutex> lock(instances_mutex());
  instances().push_back(this);
}

HostAllocations::~HostAllocations() {
  {
    std::lock_guard<std::mutex> lock(instances_mutex());
    auto& all = instances();
    all.erase(std::remove(all.begin(), all.end(), this), all.end());
  }
  for (auto& [handle, allocation] : allocations_) {
    if (allocation.parked != 0) munmap(pointer(allocation.parked), allocation.size_bytes);
    if (allocation.fd >= 0) close(allocation.fd);
  }
}

HostAllocations::Allocation& HostAllocations::find_locked(PhysicalHandle handle) {
  auto found = allocations_.find(handle);
  if (found == allocations_.end()) throw InvalidArgument("host: unknown allocation handle");
  return found->second;
}

PhysicalHandle HostAllocations::create(std::size_t size_bytes) {
  Allocation allocation;
  allocation.size_bytes = size_bytes;
  // A memfd descriptor is made under the lock, so a fork never copies one the
  // fork handler does not know of; anonymous memory is allocated without it
  // (slow) and is MADV_DONTFORK before it has any page.
  std::unique_lock<std::mutex> lock(mutex_);
  check_attached_locked("create");
  if (moves_pages_) {
    lock.unlock();
    allocation.parked = reserve_host_range(size_bytes, kHugePageBytes);
    try {
      allocate_parked(allocation.parked, size_bytes, huge_pages_);
    } catch (...) {
      munmap(pointer(allocation.parked), size_bytes);
      throw;
    }
    lock.lock();
  } else {
    allocation.fd = memfd_create("kvcached", MFD_CLOEXEC);
    if (allocation.fd < 0) throw_host_errno("memfd_create", errno);
    if (ftruncate(allocation.fd, static_cast<off_t>(size_bytes)) != 0) {
      const int error = errno;
      close(allocation.fd);
      throw_host_errno("ftruncate", error);
    }
  }
  const PhysicalHandle handle = next_handle_++;
  allocations_.emplace(handle, allocation);
  return handle;
}

std::size_t HostAllocations::release(PhysicalHandle handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  Allocation& allocation = find_locked(handle);
  if (allocation.live != 0) throw InvalidArgument("host: release of a mapped allocation");
  // In a child of fork() detach_in_child_locked cleared the fields: the allocation is only forgotten.
  if (allocation.parked != 0 && munmap(pointer(allocation.parked), allocation.size_bytes) != 0) {
    throw_host_errno("munmap", errno);
  }
  if (allocation.fd >= 0) close(allocation.fd);
  const std::size_t size_bytes = allocation.size_bytes;
  allocations_.erase(handle);
  return size_bytes;
}

void HostAllocations::share_locked(Allocation& allocation) {
  // The live mapping's bytes go into a memfd file, which then replaces it in
  // place with the same access; from here on every mapping maps the file.
  const int fd = memfd_create("kvcached", MFD_CLOEXEC);
  if (fd < 0) throw_host_errno("memfd_create", errno);
  const std::size_t size = allocation.size_bytes;
  void* copy = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
    copy = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (copy == MAP_FAILED) {
    const int error = errno;
    close(fd);
    throw_host_errno("memfd mmap", error);
  }
  protect(allocation.live, size, PROT_READ);  // a fresh mapping is PROT_NONE
  std::memcpy(copy, pointer(allocation.live), size);
  munmap(copy, size);
  void* result = mmap(pointer(allocation.live), size, allocation.accessible ? PROT_READ | PROT_WRITE : PROT_NONE,
                      MAP_SHARED | MAP_FIXED, fd, 0);
  if (result == MAP_FAILED) {
    const int error = errno;
    close(fd);
    protect(allocation.live, size, allocation.accessible ? PROT_READ | PROT_WRITE : PROT_NONE);
    throw_host_errno("mmap(MAP_FIXED)", error);
  }
  dont_fork(allocation.live, size);
  allocation.fd = fd;
  allocation.live = 0;
}

void HostAllocations::map(VirtualAddress address, std::size_t size_bytes, PhysicalHandle handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_attached_locked("map");
  Allocation& allocation = find_locked(handle);
  if (allocation.live != 0) share_locked(allocation);
  if (allocation.fd >= 0) {
    void* result = mmap(pointer(address), size_bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, allocation.fd, 0);
    if (result == MAP_FAILED) throw_host_errno("mmap(MAP_FIXED)", errno);
    dont_fork(address, size_bytes);
  } else {  // the parked range is MADV_DONTFORK already, and the move keeps it so
    // Replaces the reservation at `address` in one step; the parked range
    // (PROT_NONE) becomes free address space.
    void* result =
        mremap(pointer(allocation.parked), size_bytes, size_bytes, MREMAP_MAYMOVE | MREMAP_FIXED, pointer(address));
    if (result == MAP_FAILED) throw_host_errno("mremap", errno);
    allocation.live = address;
    allocation.parked = 0;
    allocation.accessible = false;
  }
  mapped_[address] = handle;
}

void HostAllocations::unmap(VirtualAddress address, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto first = mapped_.lower_bound(address);
  auto last = first;
  if (detached_from_ != 0) {  // a fork()ed child: nothing here is ours to move; the range stays reserved
    while (last != mapped_.end() && last->first < address + size_bytes) ++last;
    if (mmap(pointer(address), size_bytes, PROT_NONE, kHostReservationFlags | MAP_FIXED, -1, 0) == MAP_FAILED) {
      throw_host_errno("mmap(PROT_NONE)", errno);
    }
    mapped_.erase(first, last);
    return;
  }
  std::vector<std::pair<Allocation*, VirtualAddress>> to_park;  // (allocation, its new parking address)
  try {
    for (; last != mapped_.end() && last->first < address + size_bytes; ++last) {
      Allocation& allocation = find_locked(last->second);
      if (allocation.live == last->first) {
        to_park.emplace_back(&allocation, reserve_host_range(allocation.size_bytes, kHugePageBytes));
      }
    }
  } catch (...) {  // out of address space before anything moved
    for (auto& [allocation, parking] : to_park) munmap(pointer(parking), allocation->size_bytes);
    throw;
  }
  std::size_t moved = 0;
  for (; moved < to_park.size(); ++moved) {
    auto& [allocation, parking] = to_park[moved];
    void* result = mremap(pointer(allocation->live), allocation->size_bytes, allocation->size_bytes,
                          MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, pointer(parking));
    if (result == MAP_FAILED) break;
  }
  const int error = errno;
  const bool rereserved = moved == to_park.size() && mmap(pointer(address), size_bytes, PROT_NONE,
                                                          kHostReservationFlags | MAP_FIXED, -1, 0) != MAP_FAILED;
  if (!rereserved) {  // move back what was parked: nothing changed
    const int failure = moved < to_park.size() ? error : errno;
    for (std::size_t i = 0; i < to_park.size(); ++i) {
      auto& [allocation, parking] = to_park[i];
      if (i < moved) {
        mremap(pointer(parking), allocation->size_bytes, allocation->size_bytes, MREMAP_MAYMOVE | MREMAP_FIXED,
               pointer(allocation->live));
      } else {
        munmap(pointer(parking), allocation->size_bytes);
      }
    }
    throw_host_errno(moved < to_park.size() ? "mremap" : "mmap(PROT_NONE)", failure);
  }
  for (auto& [allocation, parking] : to_park) {
    mprotect(pointer(parking), allocation->size_bytes, PROT_NONE);  // inaccessible until mapped again
    allocation->parked = parking;
    allocation->live = 0;
    allocation->accessible = false;
  }
  mapped_.erase(first, last);
}

void HostAllocations::set_access(VirtualAddress address, std::size_t size_bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_attached_locked("set_access");
  }
  protect(address, size_bytes, PROT_READ | PROT_WRITE);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = mapped_.upper_bound(address);
  if (it != mapped_.begin()) --it;  // a mapping that starts before the range may reach into it
  for (; it != mapped_.end() && it->first < address + size_bytes; ++it) {
    auto found = allocations_.find(it->second);
    if (found != allocations_.end() && found->second.live == it->first) found->second.accessible = true;
  }
}

// ---- fork() -------------------------------------------------------------------------

void HostAllocations::check_attached_locked(const char* call) const {
  if (detached_from_ == 0) return;
  throw BackendUnavailable("host: " + std::string(call) + " refused: this process is a child of fork() and the " +
                           "host memory of this device belongs to its parent (pid " + std::to_string(detached_from_) +
                           "); a child inherits no KV memory: open the device and create pools in the child");
}

void HostAllocations::lock_all_before_fork() noexcept {
  instances_mutex().lock();
  for (HostAllocations* instance : instances()) instance->mutex_.lock();
}

void HostAllocations::unlock_all_in_parent() noexcept {
  for (HostAllocations* instance : instances()) instance->mutex_.unlock();
  instances_mutex().unlock();
}

void HostAllocations::detach_all_in_child() noexcept {
  // Only this thread exists in the child; it holds every lock (taken before the fork).
  for (HostAllocations* instance : instances()) {
    instance->detach_in_child_locked();
    instance->mutex_.unlock();
  }
  instances_mutex().unlock();
}

void HostAllocations::detach_in_child_locked() noexcept {
  // System calls only, no allocation: the child of a threaded process.
  for (const auto& [address, handle] : mapped_) {
    const auto found = allocations_.find(handle);
    if (found == allocations_.end()) continue;
    // Read-only zeros where the parent's (not inherited) pages were: still reserved, nothing to free.
    mmap(pointer(address), found->second.size_bytes, PROT_READ, kHostReservationFlags | MAP_FIXED, -1, 0);
  }
  for (auto& [handle, allocation] : allocations_) {
    if (allocation.fd >= 0) close(allocation.fd);  // the child's copy: the file goes with the parent's
    allocation.fd = -1;
    allocation.parked = 0;  // not inherited (MADV_DONTFORK): that address is the child's to reuse
    allocation.live = 0;
  }
  detached_from_ = getppid();
}

}  // namespace kvcached
