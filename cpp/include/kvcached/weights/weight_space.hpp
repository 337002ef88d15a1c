// WeightSpace: a model's weights in one reserved range whose physical memory is
// given back while the model sleeps and mapped again, at the same addresses,
// when it wakes.
//
// Rationale. On a device shared by several models most memory is weights, held
// for an engine's whole life. Releasing them while a model is idle (sleep) and
// restoring them on demand (wake) frees that memory for other models, but only
// if every pointer into the weights stays valid: views, compiled kernels and
// CUDA graphs captured before the sleep all hold raw addresses. So the weights
// move once into a reservation of their own, and from then on only the
// physical memory behind it comes and goes.
//
// Approach. The range is backed by a few large allocations ("chunks"): driver
// costs follow the number of allocations, not bytes, so an 8 GiB model costs
// tens of driver calls instead of the 4,096 of 2 MiB pages. Level 1 sleep
// copies the contents into a host buffer (page-locked on GPUs, kept for the next
// sleep) on a copy queue of its own, then unmaps and releases every chunk; level
// 2 only releases, keeping just the byte ranges asked for (an engine's buffers,
// which a weight update does not rewrite), packed in the host buffer. Wake
// charges the budget for everything first, then creates, maps and fences each
// chunk and queues its copy back (or zero fill, then the kept ranges) at once,
// so the next chunk's driver calls overlap the previous chunk's copy.
//
// Limitations. Touching the range while asleep is the caller's bug: on GPUs the
// addresses are unmapped (an illegal address), on the host they read as zeros
// and writes fault. One sleep or wake at a time (a mutex serialises them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvcached/device/device.hpp"
#include "kvcached/space/kv_layout.hpp"  // ByteRange
#include "kvcached/weights/weights_budget.hpp"

namespace kvcached {

struct WeightSpaceOptions {
  // Bytes of each physical allocation (the last may be smaller); rounded up to
  // the device's recommended granularity. 0: kDefaultChunkBytes.
  std::size_t chunk_bytes = 0;
  static constexpr std::size_t kDefaultChunkBytes = std::size_t{256} << 20;
};

// 0 while awake; otherwise how the model sleeps.
enum class SleepLevel : int { kAwake = 0, kKeepContents = 1, kDiscardContents = 2 };

struct WeightSpaceStats {
  std::size_t size_bytes = 0;         // the range (whole granules)
  std::size_t mapped_bytes = 0;       // device memory held now
  std::size_t chunks = 0;             // physical allocations while awake
  std::size_t chunk_bytes = 0;        // size of each but the last
  std::size_t host_buffer_bytes = 0;  // host memory held for the contents kept while asleep
  std::size_t kept_bytes = 0;         // of the range, kept while asleep (level 1: all of it)
  int sleep_level = 0;
  std::uint64_t sleeps = 0;
  std::uint64_t wakes = 0;
};

// The range, kept alive by exported tensors after the space is closed.
struct KVCACHED_EXPORT WeightMemory {
  std::shared_ptr<Device> device;
  Reservation reservation;
};

class KVCACHED_EXPORT WeightSpace {
 public:
  // Reserves `size_bytes` (rounded up to the granularity) and maps it, awake:
  // charges `budget` (null: no budget) first. BudgetExhausted when the budget
  // refuses, DeviceOutOfMemory when the device does; nothing is left behind.
  WeightSpace(std::shared_ptr<Device> device, std::size_t size_bytes, std::shared_ptr<WeightsBudget> budget,
              const WeightSpaceOptions& options = {});
  ~WeightSpace();
  WeightSpace(const WeightSpace&) = delete;
  WeightSpace& operator=(const WeightSpace&) = delete;

  const std::shared_ptr<Device>& device() const noexcept { return device_; }
  VirtualAddress base() const noexcept { return base_; }
  std::size_t size_bytes() const noexcept { return size_bytes_; }
  // The range, for exported tensors to keep reserved; null once closed (the
  // range is then freed when the last tensor holding it goes).
  std::shared_ptr<WeightMemory> memory() const;
  SleepLevel sleep_level() const;
  WeightSpaceStats stats() const;

  // Releases the device memory (level 1: after copying the contents to the host
  // buffer; level 2: only the `keep` ranges, offsets from base()). Synchronises
  // the device first: kernels still reading the weights finish. A no-op when
  // already asleep. InvalidArgument (nothing changed) for another level, or a
  // range outside the space; a failed copy (or no host memory for the buffer)
  // leaves the model awake.
  void sleep(SleepLevel level, const std::vector<ByteRange>& keep = {});
  // Maps the memory back at the same addresses, contents restored (level 1) or
  // zero (level 2). False, and still asleep with nothing half-mapped, when the
  // budget refuses; a device out of memory or a failed copy throws, likewise
  // leaving the model asleep. True (and a no-op) when awake.
  bool try_wake();
  // Frees the host buffer kept for the next sleep (InvalidArgument while it holds
  // contents kept asleep).
  void release_host_buffer();
  // Copies `size` bytes kept asleep, from `offset` of the range, to `destination`
  // (host memory). InvalidArgument unless asleep with [offset, offset+size) kept.
  void copy_kept_contents(std::size_t offset, void* destination, std::size_t size) const;
  // Unmaps and releases everything, credits the budget; the range stays
  // reserved while tensors hold what memory() gave them. Idempotent.
  void close();
  bool closed() const;

 private:
  struct Chunk {
    std::size_t offset;
    std::size_t size_bytes;
  };
  // What the memory of chunks just mapped should hold.
  // kRestored: every chunk copied back whole (level 1); kZeroThenKept: zeros, then the kept ranges.
  enum class Contents { kUninitialised, kRestored, kZeroThenKept };
  void map_all_locked(Contents contents);
  void queue_kept_into_locked(const Chunk& chunk);
  void unmap_all_locked() noexcept;
  void cover_unmapped_locked() noexcept;
  void ensure_host_buffer_locked(std::size_t bytes);
  void free_host_buffer_locked() noexcept;

  std::shared_ptr<Device> device_;
  VirtualAddress base_ = 0;
  std::size_t size_bytes_ = 0;
  std::shared_ptr<WeightMemory> memory_;  // reset at close
  std::shared_ptr<WeightsBudget> budget_;
  std::vector<Chunk> chunks_;
  std::size_t chunk_bytes_ = 0;
  mutable std::mutex mutex_;
  std::vector<PhysicalAllocation> allocations_;  // one per chunk while awake
  std::unique_ptr<CopyQueue> copies_;
  void* host_buffer_ = nullptr;
  std::size_t host_buffer_bytes_ = 0;
  // While asleep: the ranges kept, sorted and disjoint, packed in this order in the host buffer.
  std::vector<ByteRange> kept_;
  SleepLevel level_ = SleepLevel::kAwake;
  bool closed_ = false;
  std::uint64_t sleeps_ = 0;
  std::uint64_t wakes_ = 0;
};

}  // namespace kvcached
