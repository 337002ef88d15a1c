// BlockManager, page side: mapping and unmapping pages (with rollback), spare
// allocations, and the mirrors' acknowledgements.
#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "kvcached/blocks/block_manager.hpp"

namespace kvcached {

namespace {

// Allocations unmapped between two settlements of the budgets: small enough
// that memory moves to a waiting pool while the rest is still being unmapped
// (8 compound pages contiguous, one page id per-layer with 4+ layers), large
// enough that the device is synchronised rarely.
constexpr std::size_t kShrinkSliceAllocations = 8;
// Grows remembered for the look-ahead (zero chunks split ahead of use).
constexpr std::size_t kRecentGrows = 16;

}  // namespace

// ---- mapping and unmapping (map_mutex_ held) ----------------------------------------

void BlockManager::with_mapper(Lock& lock, const std::function<void()>& call) {
  if (op_log_ != nullptr) {
    call();  // recording for mirrors: a leaf lock that never waits, so page states change with it
    return;
  }
  // While the call runs, memory moves between the device's free memory, the
  // spares and the pages in transit one allocation at a time: the room as it
  // will be once the call is done (what it maps taken off) holds throughout.
  const std::optional<std::size_t> room = device_room_locked();
  if (room) device_room_in_flight_ = *room - std::min(*room, mapping_pages_);
  lock.unlock();  // a local space calls the driver
  struct Relock {
    BlockManager& manager;
    Lock& lock;
    ~Relock() {
      lock.lock();
      manager.device_room_in_flight_.reset();
    }
  } relock{*this, lock};
  call();
}

void BlockManager::undo_grow_locked(const std::vector<std::int64_t>& pages) {
  for (std::int64_t p : pages) {
    state_[p] = PageState::kUnmapped;
    unmapped_.give(static_cast<std::uint32_t>(p));
    mapping_blocks_ -= index_.capacity(static_cast<std::uint32_t>(p));
  }
  mapping_pages_ -= pages.size();
}

std::vector<std::int64_t> BlockManager::grow_locked(Lock& lock, std::size_t count,
                                                    const std::vector<std::int64_t>* wanted, bool for_reserve) {
  std::vector<std::int64_t> pages;
  if (count == 0) return pages;
  if (wanted != nullptr) {
    pages = *wanted;
    for (std::int64_t p : pages) unmapped_.remove(static_cast<std::uint32_t>(p));
  } else {
    unmapped_.take(count, 0, pages);
  }
  for (std::int64_t p : pages) {
    state_[p] = PageState::kMapping;
    mapping_blocks_ += index_.capacity(static_cast<std::uint32_t>(p));
  }
  mapping_pages_ += count;
  try {
    charge_locked(lock, count, 0, for_reserve);
  } catch (...) {
    undo_grow_locked(pages);
    throw;
  }
  try {
    with_mapper(lock, [&] { mapper_->map_pages(pages); });
  } catch (...) {
    undo_grow_locked(pages);
    settle_locked(lock);  // what the failed map kept as spares stays charged; the rest goes back
    throw;
  }
  note_grow_locked(count);
  for (std::int64_t p : pages) {
    const auto page = static_cast<std::uint32_t>(p);
    const std::size_t capacity = index_.capacity(page);
    free_slots_[p].fill(capacity);
    state_[p] = PageState::kMapped;
    index_.insert(page, capacity);
    mapping_blocks_ -= capacity;
  }
  mapping_pages_ -= count;
  report_usage_locked();
  return pages;
}

std::size_t BlockManager::shrink_slice_pages() const noexcept {
  return std::max<std::size_t>(1, kShrinkSliceAllocations / layout_.allocations_per_page());
}

std::size_t BlockManager::shrink_locked(Lock& lock, const std::vector<std::uint32_t>& pages,
                                        std::optional<std::size_t> release_beyond) {
  if (pages.empty()) return 0;
  for (std::uint32_t p : pages) {  // all of them leave the allocatable set now
    index_.erase(p);
    state_[p] = PageState::kUnmapping;
    free_slots_[p].clear();
  }
  unmapping_pages_ += pages.size();
  // Mirrors get one batch; a local space is unmapped a slice at a time.
  const std::size_t slice = op_log_ != nullptr ? pages.size() : shrink_slice_pages();
  for (std::size_t first = 0; first < pages.size(); first += slice) {
    const std::size_t end = std::min(pages.size(), first + slice);
    std::vector<std::int64_t> ids(pages.begin() + static_cast<std::ptrdiff_t>(first),
                                  pages.begin() + static_cast<std::ptrdiff_t>(end));
    UnmapOutcome outcome;
    try {
      with_mapper(lock, [&] {
        outcome = mapper_->unmap_pages(ids);
        if (release_beyond && mapper_->spare_pages() > *release_beyond) mapper_->trim_spares(*release_beyond);
      });
    } catch (...) {
      for (std::size_t i = first; i < pages.size(); ++i) {  // still mapped: put the pages back
        const std::uint32_t p = pages[i];
        if (state_[p] != PageState::kUnmapping) continue;
        const std::size_t capacity = index_.capacity(p);
        free_slots_[p].fill(capacity);
        state_[p] = PageState::kMapped;
        index_.insert(p, capacity);
        --unmapping_pages_;
      }
      settle_locked(lock);
      throw;
    }
    for (std::int64_t p : outcome.unmapped) {
      state_[p] = PageState::kUnmapped;
      unmapped_.give(static_cast<std::uint32_t>(p));
    }
    for (std::int64_t p : outcome.awaiting_ack) state_[p] = PageState::kAwaitingAck;
    awaiting_ack_pages_ += outcome.awaiting_ack.size();
    unmapping_pages_ -= ids.size();
    settle_locked(lock);  // this slice's memory goes back now, not after the whole batch
  }
  report_usage_locked();
  return pages.size();
}

void BlockManager::note_grow_locked(std::size_t pages) {
  recent_grows_.push_back(pages);
  if (recent_grows_.size() > kRecentGrows) recent_grows_.pop_front();
}

void BlockManager::trim_spares_locked(Lock& lock, std::size_t keep) {
  with_mapper(lock, [&] { mapper_->trim_spares(keep); });
  settle_locked(lock);
}

void BlockManager::add_spares_locked(Lock& lock, std::size_t count) {
  charge_locked(lock, 0, count, /*for_reserve=*/true);  // BudgetExhausted: nothing made, nothing charged
  try {
    with_mapper(lock, [&] { mapper_->add_spares(count); });  // best effort: stops early when the device is full
  } catch (...) {
  }
  settle_locked(lock);  // what was not made goes back
}

// ---- mirrors ------------------------------------------------------------------------

PageOps BlockManager::take_page_ops() {
  if (op_log_ == nullptr) throw InvalidArgument("this pool maps its own pages; it has no page ops for mirrors");
  return op_log_->take_ops();
}

void BlockManager::make_reusable_locked(const std::vector<std::int64_t>& pages) {
  for (std::int64_t p : pages) {
    if (state_[p] != PageState::kAwaitingAck) continue;  // defensive: only what the log handed out
    state_[p] = PageState::kUnmapped;
    unmapped_.give(static_cast<std::uint32_t>(p));
    --awaiting_ack_pages_;
  }
}

void BlockManager::acknowledge(std::size_t mirror, std::uint64_t seq) {
  if (op_log_ == nullptr) throw InvalidArgument("this pool maps its own pages; it has no mirrors to acknowledge");
  Lock lock(mutex_);
  const std::vector<std::int64_t> reusable = op_log_->acknowledge(mirror, seq);
  if (closed_) return;
  make_reusable_locked(reusable);
  settle_locked(lock);  // mirror `mirror` may now hold less: give that back on its budget
  report_usage_locked();
}

void BlockManager::mirror_lost(std::size_t mirror) {
  if (op_log_ == nullptr) throw InvalidArgument("this pool maps its own pages; it has no mirrors to lose");
  Lock lock(mutex_);
  const std::vector<std::int64_t> reusable = op_log_->mirror_lost(mirror);
  if (closed_) return;
  make_reusable_locked(reusable);
  if (budgets_.alive(mirror)) {
    const std::size_t held = budgets_.mark_lost(mirror);
    budgets_.begin_release(mirror, held);
    give_back_locked(lock, {{mirror, held}});
    if (MemoryBudget* budget = budgets_.budget(mirror)) budget->report_usage(0, 0);
  }
  settle_locked(lock);
  report_usage_locked();
}

}  // namespace kvcached
