// KVSpace: the mapping side of a KV cache. Owns a reservation laid out by a
// KVLayout and maps / unmaps page ids on one device when told to. It decides
// nothing: which pages to map comes from a BlockManager, in this process or
// (as ordered PageOps batches) in another.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvcached/device/device.hpp"
#include "kvcached/space/kv_layout.hpp"
#include "kvcached/space/page_metadata.hpp"
#include "kvcached/space/page_ops.hpp"
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
  std::size_t max_spare_pages = 0;            // unmapped allocations kept for reuse
  // Unmapped page ids kept split ahead of use (GPU zero backing): set-up
  // splits the first ones (at most kSetupPrepareAllocations allocations'
  // worth) and a block manager's worker keeps at least this many ready.
  std::size_t zero_frontier_pages = 64;
  // Set-up splits at most this many allocations' worth of page ids ahead (each
  // costs a zero mapping given access, ~30 us on an H200): 64 page ids of the
  // contiguous layout, 8 per-layer with 32 layers; the worker does the rest.
  static constexpr std::size_t kSetupPrepareAllocations = 512;
};

// What an unmap did: every page listed was unmapped; of their allocations,
// `kept_spare_pages` page ids' worth were kept as spares, the rest released.
struct UnmapResult {
  std::size_t unmapped_pages = 0;
  std::size_t kept_spare_pages = 0;
  std::size_t released_pages() const noexcept { return unmapped_pages - kept_spare_pages; }
};

class KVCACHED_EXPORT KVSpace {
 public:
  // InvalidArgument when the layout's bookkeeping would pass the cap (page_metadata.hpp).
  KVSpace(std::shared_ptr<Device> device, const KVLayout& layout, const KVSpaceOptions& options);
  ~KVSpace();
  // What a space keeps per page id (its mapping record and zero-split flag).
  static PageMetadataCost page_metadata_cost() noexcept;
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
  // Unmapped allocations are kept as spares up to max_spare_pages. Every page
  // must be mapped (checked first: nothing changes otherwise).
  UnmapResult unmap_pages(const std::vector<std::int64_t>& pages);
  // Applies a batch from a BlockManager: unmaps (device synchronised first),
  // then maps. Batches must arrive in order (seq = applied_seq() + 1; an empty
  // batch, seq 0, is a no-op). Everything is checked before anything changes;
  // the maps are all or nothing. Returns the seq to acknowledge.
  std::uint64_t apply(const PageOps& ops);
  // The seq of the last batch applied (0: none yet).
  std::uint64_t applied_seq() const;
  bool is_mapped(std::int64_t page) const;
  // Split coarse zero chunks around these (unmapped) pages ahead of use, so
  // mapping them later is one zero page swapped for real memory. No-op on host.
  // Takes the lock one range at a time, so a map waits for one split at most.
  void prepare_pages(const std::vector<std::int64_t>& pages);
  // Page ids a block manager should keep prepared ahead of use (0 without GPU zero backing).
  std::size_t zero_frontier_pages() const noexcept { return frontier_pages_; }
  // Zero chunks split while mapping (the grow path): 0 when look-ahead kept up.
  std::size_t zero_splits_on_map() const;
  std::size_t mapped_pages() const;

  // Pre-create physical allocations for `count` more page ids (stops early,
  // without error, when the device runs out). Returns how many were made.
  std::size_t add_spares(std::size_t count);
  // Release spares beyond `keep`; returns how many page ids' worth were released.
  std::size_t trim_spares(std::size_t keep);
  // Read without the lock: the count changes only under it, and a reader
  // holding other locks (the block manager's) must never wait for a driver call.
  std::size_t spare_pages() const noexcept { return spare_count_.load(std::memory_order_acquire); }
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
  void check_unmappable_locked(const std::vector<std::int64_t>& pages) const;
  // Set-up: zeros over every data region, the first `ready_pages` page ids in unit pieces.
  void cover_regions(std::size_t ready_pages);
  // Consecutive page ids prepared together (one zero split per run and region).
  static constexpr std::size_t kPrepareRunPages = 8;
  UnmapResult unmap_checked_locked(const std::vector<std::int64_t>& pages);
  void map_checked_locked(const std::vector<std::int64_t>& pages);
  // Several pages of a layout with several allocations per page: every page's
  // backing first, then one region (layer, K/V) at a time. Zeros, if any,
  // already removed from every range by the caller.
  void map_region_major_locked(const std::vector<std::int64_t>& pages);
  std::uint64_t apply_locked(const PageOps& ops);
  // Called without the lock after pages were mapped (see Device::fence_new_mappings).
  void fence_new_mappings(std::size_t mapped_pages);
  void publish_spare_count_locked() noexcept { spare_count_.store(spares_.size(), std::memory_order_release); }

  KVLayout layout_;
  KVSpaceOptions options_;
  std::shared_ptr<KVMemory> memory_;
  VirtualAddress base_;
  mutable std::mutex mutex_;
  std::vector<PageBacking> mapped_;     // by page id; empty when unmapped
  std::vector<std::uint8_t> prepared_;  // by page id: zero chunks already split
  std::vector<PageBacking> spares_;
  std::atomic<std::size_t> spare_count_{0};  // spares_.size(), for lock-free readers
  std::size_t mapped_count_ = 0;
  std::size_t frontier_pages_ = 0;      // zero_frontier_pages when zero chunks can be split, else 0
  std::size_t zero_splits_on_map_ = 0;  // chunk splits on the map path
  std::uint64_t applied_seq_ = 0;
  bool closed_ = false;
};

}  // namespace kvcached
