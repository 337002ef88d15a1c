// KVSpace: the mapping side of a KV cache. Owns a reservation laid out by a
// KVLayout and maps / unmaps page ids on one device when told to. It decides
// nothing: which pages to map comes from a BlockManager, in this process or
// (as ordered page-op lists) in another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvcached/device/device.hpp"
#include "kvcached/space/kv_layout.hpp"
#include "kvcached/space/zero_backing.hpp"

namespace kvcached {

// Memory that must outlive the KVSpace while exported tensors point into it:
// the reservation and the zero pages covering it. Tensor owners hold a
// shared_ptr to it; the KVSpace unmaps its pages at close, so a surviving
// tensor reads zeros instead of faulting.
struct KVCACHED_EXPORT KVMemory {
  std::shared_ptr<Device> device;
  Reservation reservation;
  std::unique_ptr<ZeroBacking> zeros;  // declared after the reservation: destroyed first
};

struct KVSpaceOptions {
  bool zero_backing = true;
  std::size_t zero_chunk_bytes = 256u << 20;  // largest shared zero allocation on GPUs
  std::size_t max_spare_pages = 0;           // unmapped allocations kept for reuse
  std::size_t zero_frontier_pages = 4;       // page ids whose zero chunks are split at set-up
};

class KVCACHED_EXPORT KVSpace {
 public:
  KVSpace(std::shared_ptr<Device> device, const KVLayout& layout, const KVSpaceOptions& options);
  ~KVSpace();
  KVSpace(const KVSpace&) = delete;
  KVSpace& operator=(const KVSpace&) = delete;

  const KVLayout& layout() const noexcept { return layout_; }
  const std::shared_ptr<Device>& device() const noexcept { return memory_->device; }
  VirtualAddress base() const noexcept { return base_; }
  std::size_t size_bytes() const noexcept { return layout_.reservation_bytes(); }
  std::shared_ptr<KVMemory> memory() const noexcept { return memory_; }

  // Maps every page (all or nothing: on failure the pages this call mapped are
  // unmapped again and the error is rethrown). Already-mapped pages are refused.
  void map_pages(const std::vector<std::int64_t>& pages);
  // Waits for the device (unmap does not wait for kernels), then unmaps.
  // Unmapped allocations are kept as spares up to max_spare_pages.
  void unmap_pages(const std::vector<std::int64_t>& pages);
  bool is_mapped(std::int64_t page) const;
  // Split coarse zero chunks around these (unmapped) pages ahead of use, so
  // mapping them later is one zero page swapped for real memory. No-op on host.
  void prepare_pages(const std::vector<std::int64_t>& pages);
  std::size_t mapped_pages() const;

  // Pre-create physical allocations for `count` more page ids (stops early,
  // without error, when the device runs out). Returns how many were made.
  std::size_t add_spares(std::size_t count);
  // Release spares beyond `keep`.
  void trim_spares(std::size_t keep);
  std::size_t spare_pages() const;
  void set_max_spare_pages(std::size_t count);

  // Unmaps everything and releases spares; the reservation lives on (reading
  // zeros) while exported tensors still hold memory(). Idempotent.
  void close();
  bool closed() const;

 private:
  using PageBacking = std::vector<PhysicalAllocation>;  // allocations_per_page() entries
  void check_page(std::int64_t page) const;
  PageBacking take_backing_locked();
  // `already_uncovered`: the caller removed the zero backing of this page's ranges.
  void map_one_locked(std::size_t page, PageBacking&& backing, bool already_uncovered);
  // Remove the zero backing of every range of these pages, merged where adjacent.
  void uncover_pages_locked(const std::vector<std::int64_t>& pages);
  void unmap_one_locked(std::size_t page);

  KVLayout layout_;
  KVSpaceOptions options_;
  std::shared_ptr<KVMemory> memory_;
  VirtualAddress base_;
  mutable std::mutex mutex_;
  std::vector<PageBacking> mapped_;  // by page id; empty when unmapped
  std::vector<std::uint8_t> prepared_;  // by page id: zero chunks already split
  std::vector<PageBacking> spares_;
  std::size_t mapped_count_ = 0;
  bool closed_ = false;
};

}  // namespace kvcached
