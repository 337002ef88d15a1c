// BlockManager: block accounting, best-fit page choice, limits, reserve worker.
#include "kvcached/blocks/block_manager.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <utility>

namespace kvcached {

namespace {

// How often the worker re-checks the reserve when nobody wakes it.
constexpr auto kWorkerPeriod = std::chrono::milliseconds(50);
// Worker rounds without any alloc or free after which the pool counts as idle
// and its reserve shrinks to the minimum (well inside the 1 s target).
constexpr int kIdleRounds = 6;
// Unmapped page ids (lowest first: the next to be grown) the worker gets ready
// ahead of use (on GPUs: zero chunks split around them).
constexpr std::size_t kFrontierPages = 8;
constexpr std::size_t kUnlimited = std::numeric_limits<std::size_t>::max();

}  // namespace

BlockManager::BlockManager(const KVLayout& layout, const BlockManagerOptions& options,
                           std::shared_ptr<PageMapper> mapper, std::shared_ptr<MemoryBudget> budget)
    : layout_(layout),
      options_(options),
      mapper_(std::move(mapper)),
      op_log_(dynamic_cast<PageOpLog*>(mapper_.get())),
      budget_(std::move(budget)),
      blocks_per_page_(layout.blocks_per_page()),
      page_bytes_(layout.page_id_bytes()),
      cached_device_free_pages_(kUnlimited) {
  if (!mapper_) throw InvalidArgument("BlockManager needs a page mapper");
  const std::size_t num_pages = layout_.num_pages();
  if (num_pages >= kNoPage) throw InvalidArgument("too many pages for one pool");
  if (options_.reserve.min_free_pages > options_.reserve.max_free_pages ||
      options_.reserve.min_spare_pages > options_.reserve.max_spare_pages) {
    throw InvalidArgument("reserve minimums must not exceed their maximums");
  }
  state_.assign(num_pages, PageState::kUnmapped);
  free_count_.assign(num_pages, 0);
  free_slots_.resize(num_pages);
  block_used_.assign(num_pages * blocks_per_page_, 0);
  bucket_head_.assign(blocks_per_page_ + 1, kNoPage);
  next_.assign(num_pages, kNoPage);
  prev_.assign(num_pages, kNoPage);
  nonempty_bits_.assign((blocks_per_page_ + 1 + 63) / 64, 0);
  for (std::size_t p = 0; p < num_pages; ++p) unmapped_.insert(unmapped_.end(), static_cast<std::int64_t>(p));

  if (options_.null_block) {
    std::lock_guard<std::mutex> grow(grow_mutex_);
    std::unique_lock<std::mutex> lock(mutex_);
    grow_locked(lock, 1);  // page 0: the lowest unmapped id
    std::vector<std::int64_t> first;
    // Slot 0 of page 0 is on top of the page's free stack, so this takes block 0.
    take_blocks_locked(1, first);
  }
  if (options_.background_worker) worker_ = std::thread(&BlockManager::worker_loop, this);
}

BlockManager::~BlockManager() {
  try {
    close();
  } catch (...) {
  }
}

// ---- best-fit buckets -------------------------------------------------------

void BlockManager::bucket_insert(std::uint32_t page, std::size_t free_count) {
  const std::uint32_t head = bucket_head_[free_count];
  next_[page] = head;
  prev_[page] = kNoPage;
  if (head != kNoPage) prev_[head] = page;
  bucket_head_[free_count] = page;
  nonempty_bits_[free_count / 64] |= (1ull << (free_count % 64));
  if (free_count == blocks_per_page_) ++free_pages_;
}

void BlockManager::bucket_remove(std::uint32_t page, std::size_t free_count) {
  if (prev_[page] != kNoPage) {
    next_[prev_[page]] = next_[page];
  } else {
    bucket_head_[free_count] = next_[page];
  }
  if (next_[page] != kNoPage) prev_[next_[page]] = prev_[page];
  next_[page] = prev_[page] = kNoPage;
  if (bucket_head_[free_count] == kNoPage) nonempty_bits_[free_count / 64] &= ~(1ull << (free_count % 64));
  if (free_count == blocks_per_page_) --free_pages_;
}

std::size_t BlockManager::lowest_nonempty_bucket() const {
  // Bucket 0 holds full pages: skip it.
  for (std::size_t word = 0; word < nonempty_bits_.size(); ++word) {
    std::uint64_t bits = nonempty_bits_[word];
    if (word == 0) bits &= ~1ull;
    if (bits != 0) return word * 64 + static_cast<std::size_t>(__builtin_ctzll(bits));
  }
  return 0;
}

void BlockManager::take_blocks_locked(std::size_t n, std::vector<std::int64_t>& out) {
  out.reserve(out.size() + n);
  while (n > 0) {
    const std::size_t free_count = lowest_nonempty_bucket();
    const std::uint32_t page = bucket_head_[free_count];
    const std::size_t take = std::min(free_count, n);
    bucket_remove(page, free_count);
    auto& slots = free_slots_[page];
    for (std::size_t i = 0; i < take; ++i) {
      const std::int64_t block = static_cast<std::int64_t>(page) * blocks_per_page_ + slots.back();
      slots.pop_back();
      block_used_[block] = 1;
      out.push_back(block);
    }
    free_count_[page] = static_cast<std::uint32_t>(free_count - take);
    bucket_insert(page, free_count - take);
    free_mapped_blocks_ -= take;
    used_blocks_ += take;
    n -= take;
  }
}

void BlockManager::give_blocks_locked(const std::int64_t* ids, std::size_t count) {
  // Runs of ids on one page (the usual case: alloc hands out page-local runs)
  // move that page between buckets once, not once per block.
  std::size_t i = 0;
  while (i < count) {
    const auto page = static_cast<std::uint32_t>(ids[i] / blocks_per_page_);
    bucket_remove(page, free_count_[page]);
    auto& slots = free_slots_[page];
    std::size_t run = 0;
    for (; i < count && static_cast<std::uint32_t>(ids[i] / blocks_per_page_) == page; ++i, ++run) {
      block_used_[ids[i]] = 0;
      slots.push_back(static_cast<std::uint32_t>(ids[i] % blocks_per_page_));
    }
    free_count_[page] += static_cast<std::uint32_t>(run);
    bucket_insert(page, free_count_[page]);
    free_mapped_blocks_ += run;
    used_blocks_ -= run;
  }
}

// ---- limits -----------------------------------------------------------------

std::size_t BlockManager::limit_pages_locked() const {
  std::size_t limit = layout_.num_pages();
  if (options_.limit_bytes) limit = std::min(limit, *options_.limit_bytes / page_bytes_);
  if (budget_) {
    if (auto external = budget_->external_limit_bytes()) limit = std::min(limit, *external / page_bytes_);
  }
  return limit;
}

std::size_t BlockManager::growable_pages_locked() const {
  const std::size_t limit = limit_pages_locked();
  const std::size_t committed = mapped_pages_ + pending_pages_;  // spares can become mapped pages
  std::size_t growable = limit > committed ? limit - committed : 0;
  growable = std::min(growable, unmapped_.size());
  if (budget_) growable = std::min(growable, spare_pages_ + budget_->available_bytes() / page_bytes_);
  if (cached_device_free_pages_ != kUnlimited) {
    growable = std::min(growable, spare_pages_ + cached_device_free_pages_);
  }
  return growable;
}

void BlockManager::release_pages_budget(std::size_t pages) noexcept {
  if (budget_ && pages > 0) budget_->release(pages * page_bytes_);
}

void BlockManager::report_usage_locked() noexcept {
  if (!budget_) return;
  const std::size_t used_pages = mapped_pages_ - free_pages_count_locked();
  budget_->report_usage(used_pages * page_bytes_, held_pages_locked() * page_bytes_);
}

std::size_t BlockManager::free_pages_count_locked() const { return free_pages_; }

bool BlockManager::reserve_off_target_locked() const {
  const ReserveTargets& t = options_.reserve;
  if (free_pages_ > t.max_free_pages) return true;
  if (free_pages_ < t.min_free_pages && unmapped_.size() > 0) return true;
  return held_pages_locked() > limit_pages_locked();
}

// ---- growing and shrinking ----------------------------------------------------

std::vector<std::int64_t> BlockManager::grow_locked(std::unique_lock<std::mutex>& lock, std::size_t count,
                                                    const std::vector<std::int64_t>* pages_wanted) {
  std::vector<std::int64_t> pages;
  if (count == 0) return pages;
  const std::size_t spares_before = spare_pages_;
  const std::size_t from_spares = std::min(count, spare_pages_);
  const std::size_t new_pages = count - from_spares;
  if (new_pages > 0 && budget_ && !budget_->try_acquire(new_pages * page_bytes_)) {
    throw BudgetExhausted("the memory budget has no room for " + std::to_string(new_pages) +
                          " more page(s) of " + std::to_string(page_bytes_) + " bytes");
  }
  if (pages_wanted != nullptr) {
    pages = *pages_wanted;
    for (std::int64_t p : pages) unmapped_.erase(p);
  } else {
    auto it = unmapped_.begin();
    for (std::size_t i = 0; i < count; ++i) pages.push_back(*it++);
    unmapped_.erase(unmapped_.begin(), it);
  }
  for (std::int64_t p : pages) state_[p] = PageState::kMapping;
  mapped_pages_ += count;
  spare_pages_ -= from_spares;

  lock.unlock();
  try {
    mapper_->map_pages(pages);
  } catch (...) {
    const std::size_t spares_after = mapper_->spare_pages();
    lock.lock();
    for (std::int64_t p : pages) {
      state_[p] = PageState::kUnmapped;
      unmapped_.insert(p);
    }
    mapped_pages_ -= count;
    // What we held before plus what we took, minus what the mapper kept as spares.
    const std::size_t held = spares_before + new_pages;
    spare_pages_ = std::min(spares_after, held);
    release_pages_budget(held - spare_pages_);
    throw;
  }
  lock.lock();
  for (std::int64_t p : pages) {
    state_[p] = PageState::kMapped;
    auto& slots = free_slots_[p];
    slots.resize(blocks_per_page_);
    for (std::size_t i = 0; i < blocks_per_page_; ++i) {
      slots[i] = static_cast<std::uint32_t>(blocks_per_page_ - 1 - i);  // slot 0 on top
    }
    free_count_[p] = static_cast<std::uint32_t>(blocks_per_page_);
    bucket_insert(static_cast<std::uint32_t>(p), blocks_per_page_);
    free_mapped_blocks_ += blocks_per_page_;
  }
  report_usage_locked();
  return pages;
}

std::size_t BlockManager::shrink_locked(std::unique_lock<std::mutex>& lock, std::size_t count,
                                        const std::vector<std::int64_t>* only) {
  std::vector<std::int64_t> pages;
  if (only != nullptr) {
    for (std::int64_t p : *only) {
      if (pages.size() == count) break;
      if (state_[p] == PageState::kMapped && free_count_[p] == blocks_per_page_) pages.push_back(p);
    }
  } else {
    for (std::uint32_t p = bucket_head_[blocks_per_page_]; p != kNoPage && pages.size() < count; p = next_[p]) {
      pages.push_back(p);
    }
  }
  if (pages.empty()) return 0;
  for (std::int64_t p : pages) {
    bucket_remove(static_cast<std::uint32_t>(p), blocks_per_page_);
    state_[p] = PageState::kUnmapping;
    free_slots_[p].clear();
    free_count_[p] = 0;
    free_mapped_blocks_ -= blocks_per_page_;
  }
  lock.unlock();
  UnmapOutcome outcome;
  try {
    outcome = mapper_->unmap_pages(pages);
  } catch (...) {
    lock.lock();
    for (std::int64_t p : pages) {  // still mapped: put the pages back
      state_[p] = PageState::kMapped;
      auto& slots = free_slots_[p];
      slots.resize(blocks_per_page_);
      for (std::size_t i = 0; i < blocks_per_page_; ++i) slots[i] = static_cast<std::uint32_t>(blocks_per_page_ - 1 - i);
      free_count_[p] = static_cast<std::uint32_t>(blocks_per_page_);
      bucket_insert(static_cast<std::uint32_t>(p), blocks_per_page_);
      free_mapped_blocks_ += blocks_per_page_;
    }
    throw;
  }
  lock.lock();
  mapped_pages_ -= pages.size();
  std::vector<std::uint8_t> pending(pages.size(), 0);
  for (std::int64_t p : outcome.pending_pages) {
    pending[std::find(pages.begin(), pages.end(), p) - pages.begin()] = 1;
  }
  for (std::size_t i = 0; i < pages.size(); ++i) {
    if (pending[i]) continue;  // stays kUnmapping until every mirror acknowledges
    state_[pages[i]] = PageState::kUnmapped;
    unmapped_.insert(pages[i]);
  }
  pending_pages_ += outcome.pending_pages.size();
  spare_pages_ += outcome.spare_pages;
  release_pages_budget(outcome.released_pages);
  report_usage_locked();
  return pages.size();
}

// ---- public operations ----------------------------------------------------------

bool BlockManager::try_alloc_mapped(std::size_t n, std::vector<std::int64_t>& out) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || closed_ || free_mapped_blocks_ < n) return false;
  take_blocks_locked(n, out);
  ++activity_;
  if (options_.background_worker && free_pages_ < options_.reserve.min_free_pages) wake_worker();
  return true;
}

std::vector<std::int64_t> BlockManager::alloc(std::size_t n) {
  std::vector<std::int64_t> blocks;
  if (n == 0) return blocks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) throw InvalidArgument("the block manager is closed");
    if (free_mapped_blocks_ >= n) {
      take_blocks_locked(n, blocks);
      ++activity_;
      // Wake the worker only when the reserve needs it: a wake-up costs a syscall.
      if (options_.background_worker && free_pages_ < options_.reserve.min_free_pages) wake_worker();
      return blocks;
    }
  }
  // Slow path: pages must be mapped first.
  std::lock_guard<std::mutex> grow(grow_mutex_);
  if (auto free_bytes = mapper_->device_free_bytes()) {
    std::lock_guard<std::mutex> lock(mutex_);
    cached_device_free_pages_ = *free_bytes / page_bytes_;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  ++activity_;
  const bool had_to_map = free_mapped_blocks_ < n;
  std::vector<std::int64_t> grown;
  auto roll_back = [&] {
    if (grown.empty()) return;
    try {
      shrink_locked(lock, grown.size(), &grown);
    } catch (...) {
    }
  };
  while (free_mapped_blocks_ < n) {
    const std::size_t needed = (n - free_mapped_blocks_ + blocks_per_page_ - 1) / blocks_per_page_;
    const std::size_t growable = growable_pages_locked();
    if (growable < needed) {
      const std::size_t can = free_mapped_blocks_ + growable * blocks_per_page_;
      if (budget_) {
        // Ask the budget anyway: a refusal there is recorded as pressure, which
        // tells the other pools on the device to give their idle reserve back.
        const std::size_t wanted = (needed - std::min(needed, spare_pages_)) * page_bytes_;
        if (wanted > 0 && budget_->try_acquire(wanted)) budget_->release(wanted);
      }
      roll_back();
      throw BudgetExhausted("cannot allocate " + std::to_string(n) + " blocks: only " +
                            std::to_string(can) + " are available (limit " +
                            std::to_string(limit_pages_locked()) + " pages of " +
                            std::to_string(page_bytes_) + " bytes, " + std::to_string(mapped_pages_) +
                            " mapped)");
    }
    try {
      std::vector<std::int64_t> pages = grow_locked(lock, needed);
      grown.insert(grown.end(), pages.begin(), pages.end());
    } catch (...) {
      roll_back();
      throw;
    }
  }
  take_blocks_locked(n, blocks);
  if (had_to_map) ++slow_allocs_;
  report_usage_locked();  // the fast path leaves this to the worker's next round
  return blocks;
}

void BlockManager::check_ids_in_range(const std::int64_t* ids, std::size_t count) const {
  for (std::size_t i = 0; i < count; ++i) {
    const std::int64_t id = ids[i];
    if (id < 0 || static_cast<std::size_t>(id) >= block_used_.size()) {
      throw InvalidArgument("block id " + std::to_string(id) + " is outside [0, " +
                            std::to_string(block_used_.size()) + ")");
    }
  }
}

void BlockManager::alloc_ids(const std::vector<std::int64_t>& ids) {
  if (ids.empty()) return;
  std::lock_guard<std::mutex> grow(grow_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  check_ids_in_range(ids.data(), ids.size());
  std::vector<std::int64_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw InvalidArgument("block id " + std::to_string(*std::adjacent_find(sorted.begin(), sorted.end())) +
                          " is listed twice");
  }
  std::vector<std::int64_t> to_map;
  for (std::int64_t id : sorted) {
    const std::int64_t page = id / static_cast<std::int64_t>(blocks_per_page_);
    if (state_[page] == PageState::kMapped) {
      if (block_used_[id]) throw InvalidArgument("block id " + std::to_string(id) + " is already in use");
    } else if (state_[page] == PageState::kUnmapped) {
      if (to_map.empty() || to_map.back() != page) to_map.push_back(page);
    } else {
      throw InvalidArgument("block id " + std::to_string(id) + " is on a page being mapped or unmapped");
    }
  }
  if (!to_map.empty()) {
    if (growable_pages_locked() < to_map.size()) {
      throw BudgetExhausted("cannot map " + std::to_string(to_map.size()) + " more page(s) for these blocks");
    }
    grow_locked(lock, to_map.size(), &to_map);
  }
  for (std::int64_t id : sorted) {
    const auto page = static_cast<std::uint32_t>(id / blocks_per_page_);
    const auto slot = static_cast<std::uint32_t>(id % blocks_per_page_);
    auto& slots = free_slots_[page];
    slots.erase(std::find(slots.begin(), slots.end(), slot));
    bucket_remove(page, free_count_[page]);
    --free_count_[page];
    bucket_insert(page, free_count_[page]);
    block_used_[id] = 1;
    --free_mapped_blocks_;
    ++used_blocks_;
  }
}

void BlockManager::free(const std::int64_t* ids, std::size_t count) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) throw InvalidArgument("the block manager is closed");
    check_ids_in_range(ids, count);
    // Mark each id as "seen" (2) so a duplicate is caught; undo on error.
    std::size_t checked = 0;
    std::string problem;
    for (; checked < count; ++checked) {
      const std::int64_t id = ids[checked];
      if (options_.null_block && id == 0) {
        problem = "block 0 is the null block and is never freed";
      } else if (block_used_[id] == 2) {
        problem = "block id " + std::to_string(id) + " is listed twice";
      } else if (block_used_[id] != 1) {
        problem = "block id " + std::to_string(id) + " is not allocated (double free or unknown id)";
      }
      if (!problem.empty()) break;
      block_used_[id] = 2;
    }
    if (!problem.empty()) {
      for (std::size_t i = 0; i < checked; ++i) block_used_[ids[i]] = 1;
      throw InvalidArgument(problem);
    }
    give_blocks_locked(ids, count);
    ++activity_;
    wake = options_.background_worker && reserve_off_target_locked();
  }
  if (wake) wake_worker();
}

std::size_t BlockManager::available() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return 0;
  return free_mapped_blocks_ + growable_pages_locked() * blocks_per_page_;
}

std::size_t BlockManager::free_mapped_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_mapped_blocks_;
}

void BlockManager::resize(std::optional<std::size_t> limit_bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    options_.limit_bytes = limit_bytes;
  }
  // Give back what can be given back now; the rest follows as blocks are freed.
  maintain();
}

void BlockManager::set_reserve(const ReserveTargets& targets) {
  if (targets.min_free_pages > targets.max_free_pages || targets.min_spare_pages > targets.max_spare_pages) {
    throw InvalidArgument("reserve minimums must not exceed their maximums");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    options_.reserve = targets;
  }
  wake_worker();
}

std::size_t BlockManager::trim() {
  std::lock_guard<std::mutex> grow(grow_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) return 0;
  const std::size_t unmapped = shrink_locked(lock, layout_.num_pages());
  lock.unlock();
  const std::size_t released = mapper_->trim_spares(0);
  lock.lock();
  spare_pages_ -= std::min(spare_pages_, released);
  release_pages_budget(released);
  report_usage_locked();
  return unmapped;
}

void BlockManager::maintain() {
  std::lock_guard<std::mutex> grow(grow_mutex_);
  if (auto free_bytes = mapper_->device_free_bytes()) {
    std::lock_guard<std::mutex> lock(mutex_);
    cached_device_free_pages_ = *free_bytes / page_bytes_;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) return;
  const ReserveTargets targets = options_.reserve;

  // 1. A limit below what we hold: give back spares, then free pages. The space
  //    may keep the pages it unmaps as spares, so spares are trimmed once more.
  const std::size_t limit = limit_pages_locked();
  for (int pass = 0; pass < 2; ++pass) {
    if (held_pages_locked() > limit && spare_pages_ > 0) {
      const std::size_t excess = held_pages_locked() - limit;
      const std::size_t keep = spare_pages_ > excess ? spare_pages_ - excess : 0;
      lock.unlock();
      const std::size_t released = mapper_->trim_spares(keep);
      lock.lock();
      spare_pages_ -= std::min(spare_pages_, released);
      release_pages_budget(released);
    }
    if (pass == 0 && held_pages_locked() > limit) shrink_locked(lock, held_pages_locked() - limit);
  }

  // 2. Keep the number of mapped free pages within [min, max]; an idle pool
  //    (no alloc or free for a while) goes down to the minimum.
  if (activity_ != activity_seen_) {
    activity_seen_ = activity_;
    idle_rounds_ = 0;
  } else if (idle_rounds_ < kIdleRounds) {
    ++idle_rounds_;
  }
  const bool others_waiting = budget_ && budget_->pressure_bytes() > 0;
  const std::size_t keep_free =
      (idle_rounds_ >= kIdleRounds || others_waiting) ? targets.min_free_pages : targets.max_free_pages;
  const std::size_t free_pages = free_pages_count_locked();
  if (free_pages > keep_free) {
    shrink_locked(lock, free_pages - keep_free);
  } else if (free_pages < targets.min_free_pages) {
    const std::size_t want = std::min(targets.min_free_pages - free_pages, growable_pages_locked());
    try {
      grow_locked(lock, want);
    } catch (const std::exception&) {
      // Best effort: the next alloc reports the shortage to its caller.
    }
  }

  // 3. Keep the number of pre-created spare allocations within [min, max].
  if (spare_pages_ < targets.min_spare_pages) {
    const std::size_t room = limit_pages_locked() > held_pages_locked() ? limit_pages_locked() - held_pages_locked() : 0;
    std::size_t want = std::min(targets.min_spare_pages - spare_pages_, room);
    if (budget_ && want > 0) want = std::min(want, budget_->available_bytes() / page_bytes_);
    if (want > 0 && (!budget_ || budget_->try_acquire(want * page_bytes_))) {
      spare_pages_ += want;  // held while being made, so nobody else counts on this room
      lock.unlock();
      std::size_t made = 0;
      try {
        made = mapper_->add_spares(want);
      } catch (...) {
      }
      lock.lock();
      spare_pages_ -= want - made;
      release_pages_budget(want - made);
    }
  } else if (spare_pages_ > targets.max_spare_pages) {
    lock.unlock();
    const std::size_t released = mapper_->trim_spares(targets.max_spare_pages);
    lock.lock();
    spare_pages_ -= std::min(spare_pages_, released);
    release_pages_budget(released);
  }
  report_usage_locked();

  // 4. Get the next pages to be grown ready (cheap when already done).
  std::vector<std::int64_t> frontier;
  for (auto it = unmapped_.begin(); it != unmapped_.end() && frontier.size() < kFrontierPages; ++it) {
    frontier.push_back(*it);
  }
  lock.unlock();
  try {
    mapper_->prepare_pages(frontier);
  } catch (...) {
    // Best effort: an unprepared page is still mapped correctly, only slower.
  }
}

void BlockManager::close() {
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(worker_mutex_);
      worker_stop_ = true;
    }
    worker_cv_.notify_all();
    worker_.join();
  }
  std::lock_guard<std::mutex> grow(grow_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  std::vector<std::int64_t> mapped;
  for (std::size_t p = 0; p < state_.size(); ++p) {
    if (state_[p] == PageState::kMapped) mapped.push_back(static_cast<std::int64_t>(p));
  }
  const std::size_t held = held_pages_locked();
  lock.unlock();
  try {
    if (!mapped.empty()) mapper_->unmap_pages(mapped);
    mapper_->trim_spares(0);
  } catch (...) {
    // Closing must not fail; the KV space releases what is left when it goes.
  }
  lock.lock();
  release_pages_budget(held);
  std::fill(bucket_head_.begin(), bucket_head_.end(), kNoPage);
  std::fill(nonempty_bits_.begin(), nonempty_bits_.end(), 0);
  free_pages_ = 0;
  mapped_pages_ = spare_pages_ = pending_pages_ = 0;
  used_blocks_ = free_mapped_blocks_ = 0;
  if (budget_) budget_->report_usage(0, 0);
}

PageOps BlockManager::take_page_ops() {
  if (op_log_ == nullptr) throw InvalidArgument("this pool maps its own pages; it has no page ops for mirrors");
  return op_log_->take_ops();
}

void BlockManager::acknowledge(std::size_t mirror, std::uint64_t seq) {
  if (op_log_ == nullptr) throw InvalidArgument("this pool maps its own pages; it has no mirrors to acknowledge");
  const std::vector<std::int64_t> released = op_log_->acknowledge(mirror, seq);
  if (released.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::int64_t p : released) {
    if (closed_) break;
    state_[p] = PageState::kUnmapped;
    unmapped_.insert(p);
  }
  if (!closed_) {
    pending_pages_ -= released.size();
    release_pages_budget(released.size());
    report_usage_locked();
  }
}

BlockManagerStats BlockManager::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  BlockManagerStats s{};
  s.num_blocks = layout_.num_blocks();
  s.blocks_per_page = blocks_per_page_;
  s.page_bytes = page_bytes_;
  s.block_bytes = layout_.block_id_bytes();
  s.used_blocks = used_blocks_;
  s.free_mapped_blocks = free_mapped_blocks_;
  s.mapped_pages = mapped_pages_;
  s.free_pages = free_pages_count_locked();
  s.used_pages = mapped_pages_ - s.free_pages;
  s.spare_pages = spare_pages_;
  s.pending_pages = pending_pages_;
  s.limit_pages = limit_pages_locked();
  s.limit_bytes = options_.limit_bytes;
  s.slow_allocs = slow_allocs_;
  return s;
}

std::size_t BlockManager::page_of(std::int64_t block) const {
  if (block < 0 || static_cast<std::size_t>(block) >= block_used_.size()) {
    throw InvalidArgument("block id " + std::to_string(block) + " is out of range");
  }
  return static_cast<std::size_t>(block) / blocks_per_page_;
}

// ---- background worker ------------------------------------------------------------

void BlockManager::wake_worker() noexcept {
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    worker_kick_ = true;
  }
  worker_cv_.notify_one();
}

void BlockManager::worker_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(worker_mutex_);
      worker_cv_.wait_for(lock, kWorkerPeriod, [this] { return worker_stop_ || worker_kick_; });
      if (worker_stop_) return;
      worker_kick_ = false;
    }
    try {
      maintain();
    } catch (...) {
      // Keep running: a failed round (e.g. out of memory) is retried next period.
    }
  }
}

}  // namespace kvcached
