// ZeroBacking implementations: free anonymous zero pages on host, coarse
// shared zero allocations split on first use on GPUs.
#include "kvcached/space/zero_backing.hpp"

#include <iterator>
#include <mutex>
#include <utility>

namespace kvcached {

namespace {

class HostZeroPages final : public ZeroBacking {
 public:
  explicit HostZeroPages(std::shared_ptr<Device> device) : device_(std::move(device)) {}
  void cover(VirtualAddress address, std::size_t size_bytes) override {
    device_->map_free_zero_pages(address, size_bytes);
  }
  void cover_prepared(VirtualAddress address, std::size_t size_bytes) override { cover(address, size_bytes); }
  void uncover(VirtualAddress, std::size_t) override {}  // a fixed mapping replaces it
  void prepare(VirtualAddress, std::size_t) override {}  // nothing to split
  std::size_t mapping_count() const override { return 0; }

 private:
  std::shared_ptr<Device> device_;
};

// Zero-filled allocations by (device, size), shared by the KV spaces of a
// process: zero memory costs one set of chunks per device, not per pool. Weak
// references, so the last KV space using a size releases it.
class ZeroAllocationCache {
 public:
  std::shared_ptr<PhysicalAllocation> find(const Device* device, std::size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find({device, size});
    return it == entries_.end() ? nullptr : it->second.lock();
  }
  void remember(const Device* device, std::size_t size, const std::shared_ptr<PhysicalAllocation>& chunk) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_[{device, size}] = chunk;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<const Device*, std::size_t>, std::weak_ptr<PhysicalAllocation>> entries_;
};

ZeroAllocationCache& shared_zero_allocations() {
  static ZeroAllocationCache* cache = new ZeroAllocationCache();  // never destroyed: used at exit
  return *cache;
}

class SharedZeroChunks final : public ZeroBacking {
 public:
  SharedZeroChunks(std::shared_ptr<Device> device, VirtualAddress base, std::size_t unit_bytes,
                   std::size_t max_chunk_bytes)
      : device_(std::move(device)), base_(base), unit_bytes_(unit_bytes) {
    std::size_t levels = 1;
    while ((unit_bytes_ << levels) <= max_chunk_bytes) ++levels;
    zero_chunks_.resize(levels);
  }

  ~SharedZeroChunks() override {
    // Unmap before the shared allocations go; never throw from here.
    for (const auto& [address, level] : mappings_) {
      try {
        device_->unmap(address, unit_bytes_ << level);
      } catch (...) {
      }
    }
  }

  void cover(VirtualAddress address, std::size_t size_bytes) override {
    cover_up_to(address, size_bytes, zero_chunks_.size() - 1);
  }

  void cover_prepared(VirtualAddress address, std::size_t size_bytes) override { cover_up_to(address, size_bytes, 0); }

  // Greedy buddy decomposition: at each step the largest chunk up to
  // `max_level` that is aligned (relative to the reservation base) and fits.
  // Access is granted once for the whole run, not per chunk.
  void cover_up_to(VirtualAddress address, std::size_t size_bytes, std::size_t max_level) {
    VirtualAddress cursor = address;
    const VirtualAddress end = address + size_bytes;
    try {
      while (cursor < end) {
        std::size_t level = max_level;
        while (level > 0) {
          const std::size_t chunk = unit_bytes_ << level;
          if ((cursor - base_) % chunk == 0 && cursor + chunk <= end) break;
          --level;
        }
        map_chunk(cursor, level);
        cursor += unit_bytes_ << level;
      }
      device_->set_access(address, size_bytes);
    } catch (...) {
      // Leave no half-covered run behind: unmap what this call mapped.
      for (auto it = mappings_.lower_bound(address); it != mappings_.end() && it->first < cursor;) {
        try {
          device_->unmap(it->first, unit_bytes_ << it->second);
        } catch (...) {
        }
        it = mappings_.erase(it);
      }
      throw;
    }
  }

  void uncover(VirtualAddress address, std::size_t size_bytes) override {
    const VirtualAddress end = address + size_bytes;
    auto it = mappings_.upper_bound(address);
    if (it != mappings_.begin()) --it;
    while (it != mappings_.end() && it->first < end) {
      const VirtualAddress chunk_start = it->first;
      const VirtualAddress chunk_end = chunk_start + (unit_bytes_ << it->second);
      if (chunk_end <= address) {
        ++it;
        continue;
      }
      if (chunk_start >= address && chunk_end <= end) {
        // Adjacent chunks wholly inside the range go with one unmap call: a
        // run of page ids grown together (and the worker thread, which pays a
        // context switch per driver call) makes one call instead of one each.
        auto last = it;
        VirtualAddress run_end = chunk_end;
        for (auto next = std::next(it); next != mappings_.end() && next->first == run_end; ++next) {
          const VirtualAddress next_end = next->first + (unit_bytes_ << next->second);
          if (next_end > end) break;
          last = next;
          run_end = next_end;
        }
        device_->unmap(chunk_start, run_end - chunk_start);
        it = mappings_.erase(it, std::next(last));
        continue;
      }
      // A chunk across an edge of the range: unmap it, keep zeros outside.
      device_->unmap(chunk_start, chunk_end - chunk_start);
      ++splits_;
      it = mappings_.erase(it);
      // Keep zeros on the parts of the chunk outside the requested range.
      if (chunk_start < address) cover(chunk_start, address - chunk_start);
      if (chunk_end > end) cover(end, chunk_end - end);
      it = mappings_.lower_bound(chunk_end);  // the next chunk; re-covered parts lie outside the range
    }
  }

  void prepare(VirtualAddress address, std::size_t size_bytes) override {
    // Each maximal run of units still under coarse chunks is uncovered at once
    // (splitting at most the chunks across its two edges) and re-covered unit
    // by unit with one set_access: not a split per unit.
    const VirtualAddress end = address + size_bytes;
    VirtualAddress run_start = 0;
    bool in_run = false;
    for (VirtualAddress unit = address; unit <= end; unit += unit_bytes_) {
      bool coarse = false;
      if (unit < end) {
        auto it = mappings_.upper_bound(unit);
        if (it != mappings_.begin()) {
          --it;
          coarse = it->second != 0 && it->first + (unit_bytes_ << it->second) > unit;  // not real memory, not a unit
        }
      }
      if (coarse && !in_run) {
        run_start = unit;
        in_run = true;
      } else if (!coarse && in_run) {
        split_into_units(run_start, unit - run_start);
        in_run = false;
      }
    }
  }

  std::size_t mapping_count() const override { return mappings_.size(); }
  std::size_t splits() const override { return splits_; }

 private:
  void split_into_units(VirtualAddress address, std::size_t size_bytes) {
    uncover(address, size_bytes);
    try {
      cover_up_to(address, size_bytes, 0);
    } catch (...) {
      try {
        cover(address, size_bytes);  // never leave the range without zeros
      } catch (...) {
      }
      throw;
    }
  }

  // Maps (without access; cover grants it for the whole run).
  void map_chunk(VirtualAddress address, std::size_t level) {
    PhysicalAllocation& zeros = zero_chunk(level, address);
    if (mappings_.count(address) != 0) return;  // zero_chunk mapped it while filling it
    device_->map(address, zeros);
    mappings_.emplace(address, level);
  }

  // The zero allocation of this level: shared with every other KV space of
  // this device in the process, else created and zero-filled through its
  // first mapping (at `address`).
  PhysicalAllocation& zero_chunk(std::size_t level, VirtualAddress address) {
    std::shared_ptr<PhysicalAllocation>& chunk = zero_chunks_[level];
    const std::size_t size = unit_bytes_ << level;
    if (!chunk) chunk = shared_zero_allocations().find(device_.get(), size);
    if (!chunk) {
      PhysicalAllocation fresh = device_->create(size);
      device_->map_accessible(address, fresh);
      try {
        device_->zero_fill(address, size);
      } catch (...) {
        device_->unmap(address, size);
        throw;
      }
      mappings_.emplace(address, level);
      chunk = std::make_shared<PhysicalAllocation>(std::move(fresh));
      shared_zero_allocations().remember(device_.get(), size, chunk);
    }
    return *chunk;
  }

  std::shared_ptr<Device> device_;
  VirtualAddress base_;
  std::size_t unit_bytes_;
  std::vector<std::shared_ptr<PhysicalAllocation>> zero_chunks_;  // index: level (size unit << level)
  std::map<VirtualAddress, std::size_t> mappings_;                // address -> level
  std::size_t splits_ = 0;
};

}  // namespace

std::unique_ptr<ZeroBacking> ZeroBacking::create(std::shared_ptr<Device> device, VirtualAddress base,
                                                 std::size_t unit_bytes, std::size_t max_chunk_bytes) {
  if (device->backend_name() == "host") return std::make_unique<HostZeroPages>(std::move(device));
  return std::make_unique<SharedZeroChunks>(std::move(device), base, unit_bytes, max_chunk_bytes);
}

}  // namespace kvcached
