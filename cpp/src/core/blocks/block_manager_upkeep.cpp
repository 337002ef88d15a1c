// BlockManager, upkeep: the reserve (maintain, trim, resize), sleep and wake-up, closing, and the background worker.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

#include "kvcached/blocks/block_manager.hpp"

namespace kvcached {

// ---- keeping the reserve ------------------------------------------------------------

void BlockManager::maintain() {
  ReserveGoal goal;
  {
    Lock lock(mutex_);
    if (closed_) return;
    goal = reserve_.round(allocs_, frees_, budgets_.others_waiting());
  }
  release_spares_beyond(goal.max_spare_pages);  // kept by earlier rounds: off every alloc's path
  {
    std::lock_guard<std::mutex> map(map_mutex_);
    Lock lock(mutex_);
    if (closed_) return;
    refresh_limit_locked();
    keep_within_limit_locked(lock);
    keep_reserve_locked(lock, goal);
    report_usage_locked();
  }
}

void BlockManager::release_spares_beyond(std::size_t keep) {
  // A slice at a time, each under the map lock: an alloc that needs it waits for one slice at most.
  for (;;) {
    std::lock_guard<std::mutex> map(map_mutex_);
    Lock lock(mutex_);
    const std::size_t spares = mapper_->spare_pages();
    if (closed_ || spares <= keep) return;
    trim_spares_locked(lock, std::max(keep, spares - std::min(spares, shrink_slice_pages())));
    if (mapper_->spare_pages() >= spares) return;  // nothing went: never spin
  }
}

void BlockManager::keep_within_limit_locked(Lock& lock) {
  // Holding more than the limit: give back spares, then free pages (whose
  // allocations the space keeps as spares, so spares are trimmed again).
  for (int pass = 0; pass < 2; ++pass) {
    const std::size_t spares = mapper_->spare_pages();
    const std::size_t committed = index_.pages() + mapping_pages_;
    if (committed + spares > limit_pages_ && spares > 0) {
      const std::size_t excess = committed + spares - limit_pages_;
      trim_spares_locked(lock, spares > excess ? spares - excess : 0);
    }
    if (pass == 0 && index_.pages() > limit_pages_) {
      shrink_locked(lock, index_.empty_pages_to_release(index_.pages() - limit_pages_));
    }
  }
}

void BlockManager::keep_reserve_locked(Lock& lock, const ReserveGoal& goal) {
  // Mapped free pages within the goal. What is unmapped stays as spares for a
  // round (the next alloc may want it back) unless the goal says release now.
  const std::size_t empty = index_.empty_pages();
  if (empty > goal.max_free_pages) {
    const std::optional<std::size_t> release_beyond =
        goal.release_now ? std::optional<std::size_t>(goal.max_spare_pages) : std::nullopt;
    shrink_locked(lock, index_.empty_pages_to_release(empty - goal.max_free_pages), release_beyond);
  } else if (empty < goal.min_free_pages) {
    const std::size_t want = std::min(goal.min_free_pages - empty, growth_room_locked());
    try {
      grow_locked(lock, want, nullptr, /*for_reserve=*/true);
    } catch (const BudgetExhausted&) {
      // Best effort: the next alloc reports a real shortage to its caller.
    } catch (const DeviceOutOfMemory&) {
    }
  }
  // Pre-created spare allocations up to the goal's minimum (released above
  // its maximum by the next round, or now when the goal says so).
  const std::size_t spares = mapper_->spare_pages();
  if (spares < goal.min_spare_pages) {
    const std::size_t held = index_.pages() + mapping_pages_ + spares;
    const std::size_t want = std::min(goal.min_spare_pages - spares, limit_pages_ > held ? limit_pages_ - held : 0);
    if (want > 0) {
      try {
        add_spares_locked(lock, want);
      } catch (const BudgetExhausted&) {
      }
    }
  } else if (goal.release_now && spares > goal.max_spare_pages) {
    trim_spares_locked(lock, goal.max_spare_pages);
  }
}

std::size_t BlockManager::trim() {
  std::lock_guard<std::mutex> map(map_mutex_);
  Lock lock(mutex_);
  if (closed_) return 0;
  reserve_.trimmed(allocs_);  // and the worker keeps it so until the next alloc
  const std::size_t unmapped = shrink_locked(lock, index_.empty_pages_to_release(index_.empty_pages()), 0);
  trim_spares_locked(lock, 0);
  report_usage_locked();
  return unmapped;
}

std::size_t BlockManager::sleep() {
  std::lock_guard<std::mutex> map(map_mutex_);  // no map or unmap in flight
  Lock lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  if (asleep_) return 0;
  const std::size_t held = used_blocks_ - (options_.null_block ? 1 : 0);
  if (held > 0) {
    throw InvalidArgument("cannot sleep with " + std::to_string(held) +
                          " block(s) handed out or reserved: free them first (clear())");
  }
  if (options_.null_block) {
    const std::int64_t null_block = 0;
    give_blocks_locked(&null_block, 1);
  }
  asleep_ = true;
  refresh_limit_locked();
  reserve_.trimmed(allocs_);
  const std::size_t unmapped = shrink_locked(lock, index_.empty_pages_to_release(index_.empty_pages()), 0);
  trim_spares_locked(lock, 0);
  report_usage_locked();
  return unmapped;
}

void BlockManager::wake_up() {
  std::lock_guard<std::mutex> map(map_mutex_);
  Lock lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  if (!asleep_) return;
  asleep_ = false;
  refresh_limit_locked();
  if (!options_.null_block) return;
  try {
    take_null_block_locked(lock);
  } catch (...) {
    asleep_ = true;
    refresh_limit_locked();
    throw;
  }
}

bool BlockManager::asleep() const {
  Lock lock(mutex_);
  return asleep_;
}

bool BlockManager::resize(std::optional<std::size_t> limit_bytes) {
  {
    Lock lock(mutex_);
    if (closed_) throw InvalidArgument("the block manager is closed");
    options_.limit_bytes = limit_bytes;
    refresh_limit_locked();
    if (used_pages_locked() > limit_pages_ && !reserved_.empty()) {
      // A shrink that has to wait for frees does not wait for reserved blocks.
      give_blocks_locked(reserved_.data(), reserved_.size());
      reserved_.clear();
      ++frees_;
    }
  }
  maintain();  // give back what can be given back now; the rest follows frees
  Lock lock(mutex_);
  return used_pages_locked() <= limit_pages_;
}

void BlockManager::set_reserve(const ReserveTargets& targets) {
  targets.validate();
  {
    Lock lock(mutex_);
    reserve_.set_targets(targets);
    options_.reserve = targets;
  }
  wake_worker();
}

// ---- closing ------------------------------------------------------------------------

void BlockManager::close() {
  std::lock_guard<std::mutex> closing(close_mutex_);  // a second caller waits, then finds it closed
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(worker_mutex_);
      worker_stop_ = true;
    }
    worker_cv_.notify_all();
    worker_.join();
  }
  std::lock_guard<std::mutex> map(map_mutex_);
  Lock lock(mutex_);
  if (closed_) return;
  closed_ = true;
  std::vector<std::int64_t> mapped;
  for (std::size_t p = 0; p < state_.size(); ++p) {
    if (state_[p] == PageState::kMapped) mapped.push_back(static_cast<std::int64_t>(p));
  }
  lock.unlock();
  try {
    if (!mapped.empty()) mapper_->unmap_pages(mapped);
    mapper_->trim_spares(0);
  } catch (...) {
    // Closing must not fail; the KV space releases what is left when it goes.
  }
  lock.lock();
  std::vector<std::pair<std::size_t, std::size_t>> releases;  // everything, acknowledged or not
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (!budgets_.alive(i)) continue;
    const std::size_t held = budgets_.charged_pages(i) - budgets_.releasing_pages(i);
    budgets_.begin_release(i, held);
    releases.emplace_back(i, held);
  }
  give_back_locked(lock, std::move(releases));
  for (std::size_t p = 0; p < state_.size(); ++p) {
    if (index_.contains(static_cast<std::uint32_t>(p))) index_.erase(static_cast<std::uint32_t>(p));
    state_[p] = PageState::kUnmapped;
    free_slots_[p].clear();
  }
  unmapped_.fill(state_.size());
  std::fill(block_state_.begin(), block_state_.end(), kFree);
  reserved_.clear();
  used_blocks_ = mapping_pages_ = mapping_blocks_ = unmapping_pages_ = awaiting_ack_pages_ = 0;
  budgets_.report_usage(0);
}

}  // namespace kvcached
