// KVSpace: reservation set-up, page-id mapping with rollback, spare allocations.
#include "kvcached/space/kv_space.hpp"

#include <algorithm>
#include <string>
#include <utility>

namespace kvcached {

KVSpace::KVSpace(std::shared_ptr<Device> device, const KVLayout& layout, const KVSpaceOptions& options)
    : layout_(layout), options_(options), memory_(std::make_shared<KVMemory>()) {
  const std::size_t granularity = device->granularity().minimum_bytes;
  if (layout_.config().page_bytes % granularity != 0) {
    throw InvalidArgument("page_bytes (" + std::to_string(layout_.config().page_bytes) +
                          ") must be a multiple of the device granularity (" +
                          std::to_string(granularity) + ")");
  }
  memory_->device = device;
  // Aligning the base to the largest zero chunk keeps chunks aligned to their size.
  const std::size_t alignment = std::max(device->granularity().recommended_bytes,
                                         options_.zero_backing ? options_.zero_chunk_bytes : 0);
  std::size_t aligned = device->granularity().recommended_bytes;
  while (aligned < alignment) aligned <<= 1;
  memory_->reservation = device->reserve(layout_.reservation_bytes(), aligned);
  base_ = memory_->reservation.base();
  mapped_.resize(layout_.num_pages());
  if (options_.zero_backing) {
    memory_->zeros = ZeroBacking::create(device, base_, layout_.allocation_bytes(),
                                         std::max(options_.zero_chunk_bytes, layout_.allocation_bytes()));
    for (const ByteRange& region : layout_.data_regions()) {
      memory_->zeros->cover(base_ + region.offset, region.size);
    }
  }
  prepared_.assign(layout_.num_pages(), 0);
  std::vector<std::int64_t> frontier;
  for (std::size_t p = 0; p < std::min(options_.zero_frontier_pages, layout_.num_pages()); ++p) {
    frontier.push_back(static_cast<std::int64_t>(p));
  }
  prepare_pages(frontier);
}

void KVSpace::prepare_pages(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_ || !memory_->zeros) return;
  for (std::int64_t page : pages) {
    check_page(page);
    if (prepared_[page] || !mapped_[page].empty()) continue;
    for (const ByteRange& range : layout_.page_ranges(page)) {
      memory_->zeros->prepare(base_ + range.offset, range.size);
    }
    prepared_[page] = 1;
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
    throw InvalidArgument("page id " + std::to_string(page) + " is outside [0, " +
                          std::to_string(layout_.num_pages()) + ")");
  }
}

KVSpace::PageBacking KVSpace::take_backing_locked() {
  if (!spares_.empty()) {
    PageBacking backing = std::move(spares_.back());
    spares_.pop_back();
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
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("KV space is closed");
  for (std::size_t i = 0; i < pages.size(); ++i) {
    check_page(pages[i]);
    if (!mapped_[pages[i]].empty()) {
      throw InvalidArgument("page " + std::to_string(pages[i]) + " is already mapped");
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (pages[j] == pages[i]) throw InvalidArgument("page " + std::to_string(pages[i]) + " listed twice");
    }
  }
  // Several pages: uncover their zero chunks together first, so neighbouring
  // pages split a coarse chunk once instead of re-covering the rest page by page.
  const bool batch_uncover = memory_->zeros != nullptr && pages.size() > 1;
  if (batch_uncover) uncover_pages_locked(pages);
  std::size_t done = 0;
  bool inside_map_one = false;
  try {
    for (; done < pages.size(); ++done) {
      PageBacking backing = take_backing_locked();
      inside_map_one = true;
      map_one_locked(pages[done], std::move(backing), batch_uncover);
      inside_map_one = false;
    }
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {
      try {
        unmap_one_locked(pages[i]);
      } catch (...) {
      }
    }
    // map_one_locked restores the zeros of the page it failed on; pages never
    // reached were uncovered by the batch and get theirs back here.
    for (std::size_t i = inside_map_one ? done + 1 : done; batch_uncover && i < pages.size(); ++i) {
      for (const ByteRange& range : layout_.page_ranges(pages[i])) {
        try {
          memory_->zeros->cover(base_ + range.offset, range.size);
        } catch (...) {
        }
      }
    }
    throw;
  }
  // Mapped pages are handed out next: make them visible to device work first.
  if (!pages.empty()) memory_->device->fence_new_mappings();
}

void KVSpace::uncover_pages_locked(const std::vector<std::int64_t>& pages) {
  std::vector<ByteRange> ranges;
  for (std::int64_t page : pages) {
    for (const ByteRange& range : layout_.page_ranges(page)) ranges.push_back(range);
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
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

void KVSpace::unmap_pages(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;  // close() already unmapped everything
  for (std::int64_t page : pages) {
    check_page(page);
    if (mapped_[page].empty()) throw InvalidArgument("page " + std::to_string(page) + " is not mapped");
  }
  if (!pages.empty()) memory_->device->synchronize();
  for (std::int64_t page : pages) unmap_one_locked(page);
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
  }
  return made;
}

void KVSpace::trim_spares(std::size_t keep) {
  std::vector<PageBacking> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (spares_.size() > keep) {
      dropped.push_back(std::move(spares_.back()));
      spares_.pop_back();
    }
  }
  // released here, outside the lock
}

std::size_t KVSpace::spare_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spares_.size();
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
