// KVSpace, zeros ahead of use: the zero cover made at set-up (the first page ids
// already in unit pieces) and page ids prepared ahead of a grow.
#include <algorithm>
#include <vector>

#include "kvcached/space/kv_space.hpp"

namespace kvcached {

void KVSpace::cover_regions(std::size_t ready_pages) {
  // Page ids [0, ready_pages) in unit pieces (each region's prefix: pages are
  // laid out in ascending order in every region), everything else in chunks.
  std::vector<ByteRange> ready;
  if (ready_pages > 0) {
    const std::vector<ByteRange> first = layout_.page_ranges(0);
    const std::vector<ByteRange> last = layout_.page_ranges(ready_pages - 1);
    for (std::size_t i = 0; i < first.size(); ++i) {
      ready.push_back({first[i].offset, last[i].offset + last[i].size - first[i].offset});
    }
  }
  for (const ByteRange& region : layout_.data_regions()) {
    std::size_t cursor = region.offset;
    const std::size_t end = region.offset + region.size;
    for (const ByteRange& r : ready) {
      if (r.offset < cursor || r.offset + r.size > end) continue;  // not in this region
      if (r.offset > cursor) memory_->zeros->cover(base_ + cursor, r.offset - cursor);
      memory_->zeros->cover_prepared(base_ + r.offset, r.size);
      cursor = r.offset + r.size;
    }
    if (cursor < end) memory_->zeros->cover(base_ + cursor, end - cursor);
  }
  std::fill(prepared_.begin(), prepared_.begin() + static_cast<std::ptrdiff_t>(ready_pages), 1);
}

void KVSpace::prepare_pages(const std::vector<std::int64_t>& pages) {
  for (std::int64_t page : pages) check_page(page);
  std::vector<std::int64_t> todo;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || !memory_->zeros) return;
    for (std::int64_t page : pages) {
      if (!prepared_[page] && mapped_[page].empty()) todo.push_back(page);
    }
  }
  std::sort(todo.begin(), todo.end());
  // Runs of consecutive page ids are split together (a run's range in each
  // region at once); one run's range per lock hold, so a map of another page
  // waits for one short split at most.
  for (std::size_t first = 0; first < todo.size();) {
    std::size_t end = first + 1;
    while (end < todo.size() && end - first < kPrepareRunPages && todo[end] == todo[end - 1] + 1) ++end;
    const std::vector<ByteRange> low = layout_.page_ranges(static_cast<std::size_t>(todo[first]));
    const std::vector<ByteRange> high = layout_.page_ranges(static_cast<std::size_t>(todo[end - 1]));
    bool done = true;
    for (std::size_t i = 0; i < low.size() && done; ++i) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (std::size_t k = first; k < end; ++k) {
        if (closed_ || !mapped_[todo[k]].empty()) done = false;  // mapped meanwhile: leave the rest
      }
      if (done) memory_->zeros->prepare(base_ + low[i].offset, high[i].offset + high[i].size - low[i].offset);
    }
    if (done) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (std::size_t k = first; k < end; ++k) prepared_[todo[k]] = 1;
    }
    first = end;
  }
}

std::size_t KVSpace::zero_splits_on_map() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return zero_splits_on_map_;
}

}  // namespace kvcached
