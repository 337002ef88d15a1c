// KVSpace: reservation set-up, page-id mapping with rollback, spare allocations.
#include "kvcached/space/kv_space.hpp"

#include <algorithm>
#include <new>
#include <string>
#include <utility>

namespace kvcached {

namespace {

// Refuses a list naming a page twice (sorted copy: no quadratic scan).
void check_listed_once(const std::vector<std::int64_t>& pages) {
  if (pages.size() < 2) return;
  std::vector<std::int64_t> sorted(pages);
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end()) throw InvalidArgument("page " + std::to_string(*twice) + " listed twice");
}

}  // namespace

PageMetadataCost KVSpace::page_metadata_cost() noexcept { return {sizeof(PageBacking) + sizeof(std::uint8_t), 0}; }

KVSpace::KVSpace(std::shared_ptr<Device> device, const KVLayout& layout, const KVSpaceOptions& options)
    : layout_(layout), options_(options), memory_(std::make_shared<KVMemory>()) {
  check_page_metadata(layout_, page_metadata_cost(), "a KV space");
  const std::size_t granularity = device->granularity().minimum_bytes;
  if (layout_.config().page_bytes % granularity != 0) {
    throw InvalidArgument("page_bytes (" + std::to_string(layout_.config().page_bytes) +
                          ") must be a multiple of the device granularity (" + std::to_string(granularity) + ")");
  }
  memory_->device = device;
  // Aligning the base to the largest zero chunk keeps chunks aligned to their size.
  const std::size_t alignment =
      std::max(device->granularity().recommended_bytes, options_.zero_backing ? options_.zero_chunk_bytes : 0);
  std::size_t aligned = device->granularity().recommended_bytes;
  while (aligned < alignment) aligned <<= 1;
  memory_->reservation = device->reserve(layout_.reservation_bytes(), aligned);
  base_ = memory_->reservation.base();
  try {
    mapped_.resize(layout_.num_pages());
    prepared_.assign(layout_.num_pages(), 0);
  } catch (const std::bad_alloc&) {
    throw_page_metadata_exhausted(layout_, page_metadata_cost(), "a KV space");
  }
  const bool splittable = options_.zero_backing && device->backend_name() != "host";  // host zeros are free
  frontier_pages_ = splittable ? std::min(options_.zero_frontier_pages, layout_.num_pages()) : 0;
  // What the first allocations need is ready at once, within a set-up budget
  // of zero mappings; a block manager's worker prepares the rest of the look-ahead.
  const std::size_t ready_pages =
      std::min(frontier_pages_,
               std::max<std::size_t>(1, KVSpaceOptions::kSetupPrepareAllocations / layout_.allocations_per_page()));
  if (options_.zero_backing) {
    memory_->zeros = ZeroBacking::create(device, base_, layout_.allocation_bytes(),
                                         std::max(options_.zero_chunk_bytes, layout_.allocation_bytes()));
    cover_regions(ready_pages);
  }
}

KVSpace::~KVSpace() {
  try {
    close();
  } catch (...) {
  }
}

void KVSpace::check_page(std::int64_t page) const {
  if (page < 0 || static_cast<std::size_t>(page) >= layout_.num_pages()) {
    throw InvalidArgument("page id " + std::to_string(page) + " is outside [0, " + std::to_string(layout_.num_pages()) +
                          ")");
  }
}

KVSpace::PageBacking KVSpace::take_backing_locked() {
  if (!spares_.empty()) {
    PageBacking backing = std::move(spares_.back());
    spares_.pop_back();  // published by the caller once its batch is done
    return backing;
  }
  PageBacking backing;
  backing.reserve(layout_.allocations_per_page());
  for (std::size_t i = 0; i < layout_.allocations_per_page(); ++i) {
    backing.push_back(memory_->device->create(layout_.allocation_bytes()));
  }
  return backing;
}

void KVSpace::map_one_locked(std::size_t page, PageBacking&& backing, bool already_uncovered) {
  const std::vector<ByteRange> ranges = layout_.page_ranges(page);
  std::size_t done = 0;
  try {
    for (; done < ranges.size(); ++done) {
      const VirtualAddress address = base_ + ranges[done].offset;
      if (memory_->zeros && !already_uncovered) memory_->zeros->uncover(address, ranges[done].size);
      memory_->device->map_accessible(address, backing[done]);
    }
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {
      const VirtualAddress address = base_ + ranges[i].offset;
      try {
        memory_->device->unmap(address, ranges[i].size);
        if (memory_->zeros) memory_->zeros->cover(address, ranges[i].size);
      } catch (...) {
      }
    }
    // Ranges uncovered but never mapped get their zeros back: the one that
    // failed, and with a batch uncover every later one too.
    const std::size_t uncovered_end = already_uncovered ? ranges.size() : std::min(done + 1, ranges.size());
    for (std::size_t i = done; memory_->zeros && i < uncovered_end; ++i) {
      try {
        memory_->zeros->cover(base_ + ranges[i].offset, ranges[i].size);
      } catch (...) {
      }
    }
    spares_.push_back(std::move(backing));
    throw;
  }
  mapped_[page] = std::move(backing);
  prepared_[page] = 0;
  ++mapped_count_;
}

void KVSpace::unmap_one_locked(std::size_t page) {
  const std::vector<ByteRange> ranges = layout_.page_ranges(page);
  for (const ByteRange& range : ranges) {
    const VirtualAddress address = base_ + range.offset;
    memory_->device->unmap(address, range.size);
    if (memory_->zeros) memory_->zeros->cover(address, range.size);
  }
  PageBacking backing = std::move(mapped_[page]);
  mapped_[page].clear();
  prepared_[page] = 1;  // re-covered with unit-sized zero pieces
  --mapped_count_;
  if (spares_.size() < options_.max_spare_pages) spares_.push_back(std::move(backing));
  // else: the allocations are released as `backing` goes out of scope
}

void KVSpace::map_pages(const std::vector<std::int64_t>& pages) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) throw InvalidArgument("KV space is closed");
    for (std::int64_t page : pages) {
      check_page(page);
      if (!mapped_[page].empty()) throw InvalidArgument("page " + std::to_string(page) + " is already mapped");
    }
    check_listed_once(pages);
    map_checked_locked(pages);
  }
  fence_new_mappings(pages.size());
}

void KVSpace::fence_new_mappings(std::size_t mapped_pages) {
  // Mapped pages are handed out next: make them visible to device work first
  // (a no-op on CUDA and host; on HIP it may wait, so never under our lock).
  if (mapped_pages > 0) memory_->device->fence_new_mappings();
}

void KVSpace::map_checked_locked(const std::vector<std::int64_t>& pages) {
  const std::size_t splits_before = memory_->zeros ? memory_->zeros->splits() : 0;
  struct CountSplits {  // also when the map fails: what was split stays split
    KVSpace& space;
    std::size_t before;
    ~CountSplits() {
      if (space.memory_->zeros) space.zero_splits_on_map_ += space.memory_->zeros->splits() - before;
    }
  } count_splits{*this, splits_before};
  // Several pages: uncover their zero chunks together first, so neighbouring
  // pages split a coarse chunk once instead of re-covering the rest page by page.
  // Contiguous pages whose zeros are already unit pieces are uncovered one by
  // one instead, each right before its page is mapped (as the reference does):
  // the same unmaps, and on an H200 the maps and set_access that follow were
  // faster than into a run whose zero mappings were all removed first.
  const bool unit_pieces_only =
      layout_.allocations_per_page() == 1 &&
      std::all_of(pages.begin(), pages.end(), [this](std::int64_t page) { return prepared_[page] != 0; });
  const bool batch_uncover = memory_->zeros != nullptr && pages.size() > 1 && !unit_pieces_only;
  if (batch_uncover) uncover_pages_locked(pages);
  if (pages.size() > 1 && layout_.allocations_per_page() > 1) {
    map_region_major_locked(pages);  // publishes the spare count itself
    return;
  }
  // Every allocation is taken (created if no spare is left) before the first
  // map, as region-major maps do: one order for every batch, and a failed
  // create leaves nothing to unmap. On an H200 it was as fast as creating
  // between the maps or faster (bench/probes/create_overlap_probe.py, bench/RESULTS.md).
  std::vector<PageBacking> backings;
  backings.reserve(pages.size());
  std::size_t done = 0;
  bool inside_map_one = false;
  try {
    for (std::size_t i = 0; i < pages.size(); ++i) backings.push_back(take_backing_locked());
    for (; done < pages.size(); ++done) {
      inside_map_one = true;
      map_one_locked(pages[done], std::move(backings[done]), batch_uncover);
      inside_map_one = false;
    }
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {
      try {
        unmap_one_locked(pages[i]);
      } catch (...) {
      }
    }
    // map_one_locked restores the zeros of the page it failed on (and keeps its
    // backing as a spare); pages never reached were uncovered by the batch and
    // get theirs back here, their backings kept as spares up to the limit.
    const std::size_t untouched = inside_map_one ? done + 1 : done;
    for (std::size_t i = untouched; batch_uncover && i < pages.size(); ++i) {
      for (const ByteRange& range : layout_.page_ranges(pages[i])) {
        try {
          memory_->zeros->cover(base_ + range.offset, range.size);
        } catch (...) {
        }
      }
    }
    for (std::size_t i = untouched; i < backings.size(); ++i) {
      if (spares_.size() < options_.max_spare_pages) spares_.push_back(std::move(backings[i]));
    }
    publish_spare_count_locked();
    throw;
  }
  publish_spare_count_locked();
}

void KVSpace::uncover_pages_locked(const std::vector<std::int64_t>& pages) {
  std::vector<ByteRange> ranges;
  for (std::int64_t page : pages) {
    for (const ByteRange& range : layout_.page_ranges(page)) ranges.push_back(range);
  }
  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> merged;
  for (const ByteRange& range : ranges) {
    if (!merged.empty() && merged.back().offset + merged.back().size == range.offset) {
      merged.back().size += range.size;
    } else {
      merged.push_back(range);
    }
  }
  std::size_t done = 0;
  try {
    for (; done < merged.size(); ++done) memory_->zeros->uncover(base_ + merged[done].offset, merged[done].size);
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {
      try {
        memory_->zeros->cover(base_ + merged[i].offset, merged[i].size);
      } catch (...) {
      }
    }
    throw;
  }
}

void KVSpace::check_unmappable_locked(const std::vector<std::int64_t>& pages) const {
  for (std::int64_t page : pages) {
    check_page(page);
    if (mapped_[page].empty()) throw InvalidArgument("page " + std::to_string(page) + " is not mapped");
  }
  check_listed_once(pages);
}

UnmapResult KVSpace::unmap_checked_locked(const std::vector<std::int64_t>& pages) {
  UnmapResult result;
  if (pages.empty()) return result;
  memory_->device->synchronize();
  const std::size_t spares_before = spares_.size();
  for (std::int64_t page : pages) unmap_one_locked(page);
  result.unmapped_pages = pages.size();
  result.kept_spare_pages = spares_.size() - spares_before;
  publish_spare_count_locked();
  return result;
}

UnmapResult KVSpace::unmap_pages(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return {};  // close() already unmapped everything
  check_unmappable_locked(pages);
  return unmap_checked_locked(pages);
}

std::uint64_t KVSpace::apply(const PageOps& ops) {
  const std::uint64_t seq = apply_locked(ops);
  fence_new_mappings(ops.map_pages.size());
  return seq;
}

std::uint64_t KVSpace::apply_locked(const PageOps& ops) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ops.seq == 0) {
    if (!ops.empty()) throw InvalidArgument("a batch with page operations must have a seq (got 0)");
    return 0;
  }
  if (closed_) throw InvalidArgument("KV space is closed");
  if (ops.seq != applied_seq_ + 1) {
    throw InvalidArgument("page-op batch " + std::to_string(ops.seq) + " arrived after batch " +
                          std::to_string(applied_seq_) +
                          (ops.seq <= applied_seq_ ? " (applied already)" : " (batches in between are missing)"));
  }
  check_unmappable_locked(ops.unmap_pages);
  std::vector<std::int64_t> unmapped_first(ops.unmap_pages);
  std::sort(unmapped_first.begin(), unmapped_first.end());
  for (std::int64_t page : ops.map_pages) {
    check_page(page);
    if (!mapped_[page].empty() && !std::binary_search(unmapped_first.begin(), unmapped_first.end(), page)) {
      throw InvalidArgument("page-op batch " + std::to_string(ops.seq) + " maps page " + std::to_string(page) +
                            ", which is mapped already");
    }
  }
  check_listed_once(ops.map_pages);
  unmap_checked_locked(ops.unmap_pages);
  applied_seq_ = ops.seq;  // the unmaps are done whatever happens to the maps
  if (!ops.map_pages.empty()) map_checked_locked(ops.map_pages);
  return ops.seq;
}

std::uint64_t KVSpace::applied_seq() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return applied_seq_;
}

bool KVSpace::is_mapped(std::int64_t page) const {
  check_page(page);
  std::lock_guard<std::mutex> lock(mutex_);
  return !mapped_[page].empty();
}

std::size_t KVSpace::mapped_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mapped_count_;
}

std::size_t KVSpace::add_spares(std::size_t count) {
  std::size_t made = 0;
  for (; made < count; ++made) {
    PageBacking backing;
    try {
      for (std::size_t i = 0; i < layout_.allocations_per_page(); ++i) {
        backing.push_back(memory_->device->create(layout_.allocation_bytes()));
      }
    } catch (const DeviceOutOfMemory&) {
      break;  // a reserve is best effort; what was made of this page is released
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) break;
    spares_.push_back(std::move(backing));
    publish_spare_count_locked();
  }
  return made;
}

std::size_t KVSpace::trim_spares(std::size_t keep) {
  std::vector<PageBacking> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (spares_.size() > keep) {
      dropped.push_back(std::move(spares_.back()));
      spares_.pop_back();
    }
    publish_spare_count_locked();
  }
  return dropped.size();  // released as `dropped` goes, outside the lock
}

void KVSpace::set_max_spare_pages(std::size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  options_.max_spare_pages = count;
}

void KVSpace::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  if (mapped_count_ > 0) memory_->device->synchronize();
  const std::size_t keep_spares = options_.max_spare_pages;
  options_.max_spare_pages = 0;
  for (std::size_t page = 0; page < mapped_.size(); ++page) {
    if (mapped_[page].empty()) continue;
    try {
      unmap_one_locked(page);
    } catch (...) {
      mapped_[page].clear();  // the allocations release (and unmap) themselves
    }
  }
  spares_.clear();
  publish_spare_count_locked();
  options_.max_spare_pages = keep_spares;
  if (!memory_->zeros) {
    // Tensors may outlive us: make what they see read zeros rather than fault.
    try {
      memory_->zeros = ZeroBacking::create(memory_->device, base_, layout_.allocation_bytes(),
                                           std::max(options_.zero_chunk_bytes, layout_.allocation_bytes()));
      for (const ByteRange& region : layout_.data_regions()) {
        memory_->zeros->cover(base_ + region.offset, region.size);
      }
    } catch (...) {
    }
  }
}

bool KVSpace::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

}  // namespace kvcached
