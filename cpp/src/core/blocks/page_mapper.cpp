// Page mappers: apply decisions locally, or record them for mirrors.
#include "kvcached/blocks/page_mapper.hpp"

#include <algorithm>
#include <string>

namespace kvcached {

UnmapOutcome LocalPageMapper::unmap_pages(const std::vector<std::int64_t>& pages) {
  const std::size_t spares_before = space_->spare_pages();
  space_->unmap_pages(pages);
  UnmapOutcome outcome;
  const std::size_t spares_after = space_->spare_pages();
  outcome.spare_pages = spares_after > spares_before ? spares_after - spares_before : 0;
  outcome.released_pages = pages.size() - outcome.spare_pages;
  return outcome;
}

std::size_t LocalPageMapper::trim_spares(std::size_t keep) {
  const std::size_t before = space_->spare_pages();
  space_->trim_spares(keep);
  return before - space_->spare_pages();
}

PageOpLog::PageOpLog(std::size_t num_mirrors) : acked_(num_mirrors, 0) {
  if (num_mirrors == 0) throw InvalidArgument("num_mirrors must be at least 1");
}

void PageOpLog::map_pages(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_.map_pages.insert(open_.map_pages.end(), pages.begin(), pages.end());
}

UnmapOutcome PageOpLog::unmap_pages(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  UnmapOutcome outcome;
  for (std::int64_t page : pages) {
    auto queued = std::find(open_.map_pages.begin(), open_.map_pages.end(), page);
    if (queued != open_.map_pages.end()) {
      open_.map_pages.erase(queued);  // no mirror has mapped it yet: nothing to undo
      ++outcome.released_pages;
    } else {
      open_.unmap_pages.push_back(page);
      outcome.pending_pages.push_back(page);
    }
  }
  pending_pages_ += outcome.pending_pages.size();
  return outcome;
}

PageOps PageOpLog::take_ops() {
  std::lock_guard<std::mutex> lock(mutex_);
  PageOps batch;
  if (open_.map_pages.empty() && open_.unmap_pages.empty()) return batch;
  batch = std::move(open_);
  open_ = PageOps{};
  batch.seq = next_seq_++;
  if (!batch.unmap_pages.empty()) unacked_.emplace_back(batch.seq, batch.unmap_pages);
  return batch;
}

std::vector<std::int64_t> PageOpLog::acknowledge(std::size_t mirror, std::uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (mirror >= acked_.size()) {
    throw InvalidArgument("mirror index " + std::to_string(mirror) + " is outside [0, " +
                          std::to_string(acked_.size()) + ")");
  }
  if (seq >= next_seq_) {
    throw InvalidArgument("acknowledged seq " + std::to_string(seq) + " was never handed out");
  }
  acked_[mirror] = std::max(acked_[mirror], seq);
  const std::uint64_t everyone = *std::min_element(acked_.begin(), acked_.end());
  std::vector<std::int64_t> released;
  while (!unacked_.empty() && unacked_.front().first <= everyone) {
    const auto& pages = unacked_.front().second;
    released.insert(released.end(), pages.begin(), pages.end());
    unacked_.pop_front();
  }
  pending_pages_ -= released.size();
  return released;
}

std::size_t PageOpLog::pending_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_pages_;
}

}  // namespace kvcached
