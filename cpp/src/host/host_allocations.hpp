// The host backend's physical allocations and where each one is mapped.
//
// An allocation is a memfd file mapped shared (HostMemory::kSharedFiles, the
// default: its pages are faulted in by their first use) or private anonymous
// memory allocated when it is created, as cuMemCreate does on a GPU, and parked
// at an address of its own; map moves it (not copies) to the address it is
// mapped at, release frees it at once. Allocated at create, no fault lands in
// the engine's forward pass (SGLang's CPU engine ran at 0.72x with anonymous
// pages faulted in there) and a machine out of memory is an exception at
// create; anonymous memory can also use transparent huge pages. Mapping an
// anonymous allocation a second time while it is mapped (the contract allows
// it; kvcached's pools never do) turns it into a memfd file mapped shared at
// both addresses, as on a GPU. Kernels without MREMAP_DONTUNMAP (before Linux
// 5.7) get memfd files whatever was asked.
//
// fork(): a child keeps none of this memory, so none outlives what the
// registry counts. Every mapping is MADV_DONTFORK (not copied into the child),
// and a fork handler closes the child's copies of the memfd descriptors and
// puts read-only zeros where the parent's pages were mapped (the range stays
// reserved: nothing of the child's lands in it, and it reads as a closed
// pool's does). In the child the object is detached: map and create raise,
// unmap and release only forget.
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>

#include "kvcached/backends/host_backend.hpp"  // HostMemory
#include "kvcached/device/backend.hpp"

namespace kvcached {

class HostAllocations {
 public:
  explicit HostAllocations(HostMemory memory);
  ~HostAllocations();
  HostAllocations(const HostAllocations&) = delete;
  HostAllocations& operator=(const HostAllocations&) = delete;

  PhysicalHandle create(std::size_t size_bytes);
  // Frees it; returns its size. Never while mapped (Device checks).
  std::size_t release(PhysicalHandle handle);
  // Maps the whole allocation at `address`, inaccessible until set_access.
  void map(VirtualAddress address, std::size_t size_bytes, PhysicalHandle handle);
  // Unmaps every mapping inside [address, address+size) (each whole), leaving
  // the range reserved.
  void unmap(VirtualAddress address, std::size_t size_bytes);
  void set_access(VirtualAddress address, std::size_t size_bytes);

 private:
  // fork() handlers (pthread_atfork): every instance's lock is held across the
  // fork, so the child sees whole tables; the child then detaches its copies.
  static void lock_all_before_fork() noexcept;
  static void unlock_all_in_parent() noexcept;
  static void detach_all_in_child() noexcept;
  void detach_in_child_locked() noexcept;
  void check_attached_locked(const char* call) const;
  struct Allocation {
    std::size_t size_bytes = 0;
    VirtualAddress parked = 0;  // where its pages wait while unmapped (anonymous)
    VirtualAddress live = 0;    // where it is mapped (anonymous, at most one place)
    bool accessible = false;    // set_access done on the live mapping
    int fd = -1;                // memfd once shared by two mappings
  };
  void share_locked(Allocation& allocation);
  Allocation& find_locked(PhysicalHandle handle);

  const bool moves_pages_;  // anonymous memory (MREMAP_DONTUNMAP works, no memfd asked for)
  const bool huge_pages_;
  std::mutex mutex_;
  std::unordered_map<PhysicalHandle, Allocation> allocations_;
  std::map<VirtualAddress, PhysicalHandle> mapped_;  // mapping start -> allocation
  PhysicalHandle next_handle_ = 1;
  pid_t detached_from_ = 0;  // in a child of fork(): the parent's pid (nothing here is ours)
};

// How the host backend reserves address space: nothing committed, nothing shared.
inline constexpr int kHostReservationFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

// A PROT_NONE range of `size_bytes` at an `alignment_bytes`-aligned address
// that nothing else can be placed in (the host form of a VA reservation).
VirtualAddress reserve_host_range(std::size_t size_bytes, std::size_t alignment_bytes);

[[noreturn]] void throw_host_errno(const char* call, int error);

}  // namespace kvcached
