// PageOpLog: ordered page-op batches for mirrors, their acknowledgements, and each mirror's peak holding.
#include "kvcached/blocks/page_op_log.hpp"

#include <algorithm>
#include <string>

namespace kvcached {

PageOpLog::PageOpLog(std::size_t num_mirrors) : acked_(num_mirrors, 0), alive_(num_mirrors, 1) {
  if (num_mirrors == 0) throw InvalidArgument("num_mirrors must be at least 1");
}

void PageOpLog::check_mirror(std::size_t mirror) const {
  if (mirror >= acked_.size()) {
    throw InvalidArgument("mirror index " + std::to_string(mirror) + " is outside [0, " +
                          std::to_string(acked_.size()) + ")");
  }
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
      outcome.unmapped.push_back(page);
    } else {
      open_.unmap_pages.push_back(page);
      outcome.awaiting_ack.push_back(page);
    }
  }
  awaiting_ack_ += outcome.awaiting_ack.size();
  return outcome;
}

PageOps PageOpLog::take_ops() {
  std::lock_guard<std::mutex> lock(mutex_);
  PageOps batch;
  if (open_.empty()) return batch;
  batch = std::move(open_);
  open_ = PageOps{};
  batch.seq = next_seq_++;
  batches_.push_back({batch.seq, batch.map_pages.size(), batch.unmap_pages, Clock::now()});
  return batch;
}

std::vector<std::int64_t> PageOpLog::release_acknowledged_locked() {
  std::uint64_t everyone = next_seq_ - 1;  // with no live mirror, nobody is waited for
  for (std::size_t i = 0; i < acked_.size(); ++i) {
    if (alive_[i]) everyone = std::min(everyone, acked_[i]);
  }
  std::vector<std::int64_t> released;
  while (!batches_.empty() && batches_.front().seq <= everyone) {
    const auto& pages = batches_.front().unmaps;
    released.insert(released.end(), pages.begin(), pages.end());
    batches_.pop_front();
  }
  awaiting_ack_ -= released.size();
  return released;
}

std::vector<std::int64_t> PageOpLog::acknowledge(std::size_t mirror, std::uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_mirror(mirror);
  if (seq >= next_seq_) {
    throw InvalidArgument("acknowledged seq " + std::to_string(seq) +
                          " was never handed out (last: " + std::to_string(next_seq_ - 1) + ")");
  }
  if (!alive_[mirror]) return {};
  acked_[mirror] = std::max(acked_[mirror], seq);
  return release_acknowledged_locked();
}

std::vector<std::int64_t> PageOpLog::mirror_lost(std::size_t mirror) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_mirror(mirror);
  alive_[mirror] = 0;
  return release_acknowledged_locked();
}

std::size_t PageOpLog::peak_pages(std::size_t mirror, std::size_t pages_after_open, std::size_t extra_maps) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_mirror(mirror);
  // Walk back from the open batch: before batch b a mirror held what it holds
  // after b, plus b's unmaps, minus b's maps.
  std::int64_t held = static_cast<std::int64_t>(pages_after_open);
  std::int64_t peak = held;
  held += static_cast<std::int64_t>(open_.unmap_pages.size()) -
          static_cast<std::int64_t>(open_.map_pages.size() + extra_maps);
  std::uint64_t state = next_seq_ - 1;  // `held` is the holding after batch `state`
  for (auto batch = batches_.rbegin();; ++batch) {
    if (state < acked_[mirror]) break;
    peak = std::max(peak, held);
    if (batch == batches_.rend() || batch->seq != state) break;
    held += static_cast<std::int64_t>(batch->unmaps.size()) - static_cast<std::int64_t>(batch->maps);
    --state;
  }
  return static_cast<std::size_t>(std::max<std::int64_t>(peak, 0));
}

bool PageOpLog::alive(std::size_t mirror) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_mirror(mirror);
  return alive_[mirror] != 0;
}

MirrorProgress PageOpLog::progress(std::size_t mirror) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_mirror(mirror);
  MirrorProgress p;
  p.alive = alive_[mirror] != 0;
  p.acked_seq = acked_[mirror];
  p.unacked_batches = static_cast<std::size_t>(next_seq_ - 1 - acked_[mirror]);
  for (const Batch& batch : batches_) {
    if (batch.seq > acked_[mirror]) {
      p.oldest_unacked_age_s = std::chrono::duration<double>(Clock::now() - batch.taken_at).count();
      break;
    }
  }
  return p;
}

std::uint64_t PageOpLog::last_seq() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_seq_ - 1;
}

std::size_t PageOpLog::pages_awaiting_ack() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return awaiting_ack_;
}

}  // namespace kvcached
