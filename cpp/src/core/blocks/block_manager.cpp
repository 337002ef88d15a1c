// BlockManager, block side: construction, the fast alloc path, free and reserve.
#include "kvcached/blocks/block_manager.hpp"

#include <algorithm>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include "local_page_mapper.hpp"

namespace kvcached {

namespace {

std::shared_ptr<PageMapper> local_mapper(const std::shared_ptr<KVSpace>& space, const KVLayout& layout) {
  if (!space) throw InvalidArgument("BlockManager needs a KV space (or mirrors)");
  if (space->layout() != layout) {
    throw InvalidArgument("the KV space's layout (" + space->layout().describe() +
                          ") differs from the block "
                          "manager's (" +
                          layout.describe() + ")");
  }
  return std::make_shared<LocalPageMapper>(space);
}

// Mirrors with their own layout (pipeline stages) must share the block geometry.
std::vector<MirrorSpec> checked_mirrors(const std::vector<MirrorSpec>& mirrors, const KVLayout& layout) {
  for (std::size_t i = 0; i < mirrors.size(); ++i) {
    const auto& own = mirrors[i].layout;
    if (own && (own->blocks_per_page() != layout.blocks_per_page() || own->num_blocks() != layout.num_blocks())) {
      throw InvalidArgument("mirror " + std::to_string(i) + "'s layout (" + own->describe() +
                            ") must have the manager's blocks per page (" + std::to_string(layout.blocks_per_page()) +
                            ") and block count (" + std::to_string(layout.num_blocks()) + ")");
    }
  }
  return mirrors;
}

// Refuses the layout if the manager's bookkeeping, with its local space's
// (mirrors keep theirs in their own processes), would pass the cap.
const KVLayout& with_metadata_checked(const KVLayout& layout, const std::shared_ptr<PageMapper>& mapper) {
  const PageMetadataCost own = BlockManager::page_metadata_cost(layout);
  if (dynamic_cast<PageOpLog*>(mapper.get()) != nullptr) {
    check_page_metadata(layout, own, "a block manager");
  } else {
    check_page_metadata(layout, own + KVSpace::page_metadata_cost(), "a block manager with its KV space");
  }
  return layout;
}

}  // namespace

PageMetadataCost BlockManager::page_metadata_cost(const KVLayout& layout) noexcept {
  // state_, free_slots_ (its bitmap while mapped), the best-fit index's free
  // count and bucket links, unmapped_'s bit (a byte, rounded up); block_state_ per block.
  const std::size_t bitmap_bytes = (layout.blocks_per_page() + 63) / 64 * sizeof(std::uint64_t);
  const std::size_t per_page = sizeof(PageState) + sizeof(FreeSlots) + bitmap_bytes + 3 * sizeof(std::uint32_t) + 1;
  return {per_page, sizeof(std::uint8_t)};
}

BlockManager::BlockManager(const KVLayout& layout, const BlockManagerOptions& options, std::shared_ptr<KVSpace> space,
                           std::shared_ptr<MemoryBudget> budget)
    : BlockManager(layout, options, local_mapper(space, layout), {MirrorSpec{std::move(budget), std::nullopt}}) {}

BlockManager::BlockManager(const KVLayout& layout, const BlockManagerOptions& options, std::vector<MirrorSpec> mirrors)
    : BlockManager(layout, options, std::make_shared<PageOpLog>(mirrors.size()), checked_mirrors(mirrors, layout)) {}

BlockManager::BlockManager(const KVLayout& layout, const BlockManagerOptions& options,
                           std::shared_ptr<PageMapper> mapper, std::vector<MirrorSpec> mirrors) try
    : layout_(with_metadata_checked(layout, mapper)),
      options_(options),
      mapper_(std::move(mapper)),
      op_log_(dynamic_cast<PageOpLog*>(mapper_.get())),
      blocks_per_page_(layout.blocks_per_page()),
      index_(layout.num_pages(), layout.blocks_per_page(), layout.blocks_on_page(layout.num_pages() - 1)),
      limit_pages_(layout.num_pages()),
      budgets_(std::move(mirrors), layout.page_id_bytes()),
      reserve_(options.reserve) {
  options_.validate();
  if (!op_log_ && budgets_.size() != 1) throw InvalidArgument("a block manager with a local KV space has one mirror");
  const std::size_t num_pages = layout_.num_pages();
  state_.assign(num_pages, PageState::kUnmapped);
  free_slots_.resize(num_pages);
  block_state_.assign(layout_.num_blocks(), kFree);
  unmapped_.fill(num_pages);
  // The space keeps every allocation it unmaps; the reserve (maintain) decides
  // which go back and when, off the path of frees and allocs.
  mapper_->set_max_spare_pages(layout_.num_pages());
  {
    std::lock_guard<std::mutex> map(map_mutex_);
    Lock lock(mutex_);
    refresh_limit_locked();
    if (options_.null_block) take_null_block_locked(lock);
  }
  if (options_.background_worker) worker_ = std::thread(&BlockManager::worker_loop, this);
} catch (const std::bad_alloc&) {
  throw_page_metadata_exhausted(layout, page_metadata_cost(layout), "a block manager");
}

BlockManager::~BlockManager() {
  try {
    close();
  } catch (...) {
  }
}

// ---- taking and giving blocks (mutex_ held) -------------------------------------

std::size_t BlockManager::new_page_quota_locked() const noexcept {
  const std::size_t used = used_pages_locked();
  return limit_pages_ > used ? limit_pages_ - used : 0;
}

std::size_t BlockManager::takeable_locked() const noexcept {
  const std::size_t partial = index_.free_blocks() - index_.empty_blocks();
  const std::size_t quota = new_page_quota_locked();
  if (quota >= index_.empty_pages()) return partial + index_.empty_blocks();
  return partial + quota * blocks_per_page_;  // at most one empty page is short: `quota` full ones exist
}

void BlockManager::take_blocks_locked(std::size_t n, std::vector<std::int64_t>& out) {
  std::size_t quota = new_page_quota_locked();
  out.reserve(out.size() + n);
  while (n > 0) {
    const std::uint32_t page = index_.choose(n, options_.placement, quota > 0);
    if (page == BestFitIndex::kNone) throw InvalidArgument("internal error: no page to take blocks from");
    const std::size_t free = index_.free_blocks(page);
    if (index_.entirely_free(page)) --quota;
    const std::size_t take = std::min(free, n);
    const std::size_t first = out.size();
    free_slots_[page].take(take, static_cast<std::int64_t>(page) * static_cast<std::int64_t>(blocks_per_page_), out);
    for (std::size_t i = first; i < out.size(); ++i) block_state_[out[i]] = kUsed;
    index_.update(page, free - take);
    used_blocks_ += take;
    n -= take;
  }
}

void BlockManager::take_null_block_locked(Lock& lock) {
  if (state_[0] == PageState::kAwaitingAck || state_[0] == PageState::kUnmapping) {
    throw InvalidArgument("the null block's page is still being unmapped (the mirrors have not acknowledged it)");
  }
  if (state_[0] == PageState::kUnmapped) {
    const std::vector<std::int64_t> first = {0};
    grow_locked(lock, 1, &first);
  }
  free_slots_[0].remove(0);
  index_.update(0, index_.free_blocks(0) - 1);
  block_state_[0] = kUsed;
  ++used_blocks_;
  report_usage_locked();
}

void BlockManager::give_blocks_locked(const std::int64_t* ids, std::size_t count) {
  // Runs of ids on one page (the usual case: alloc hands out page-local runs)
  // move that page between buckets once, not once per block.
  std::size_t i = 0;
  while (i < count) {
    const auto page = static_cast<std::uint32_t>(ids[i] / static_cast<std::int64_t>(blocks_per_page_));
    auto& slots = free_slots_[page];
    std::size_t run = 0;
    for (; i < count && static_cast<std::uint32_t>(ids[i] / static_cast<std::int64_t>(blocks_per_page_)) == page;
         ++i, ++run) {
      block_state_[ids[i]] = kFree;
      slots.give(static_cast<std::uint32_t>(ids[i] % static_cast<std::int64_t>(blocks_per_page_)));
    }
    index_.update(page, index_.free_blocks(page) + run);
    used_blocks_ -= run;
  }
}

BlockManager::AllocPlan BlockManager::plan_alloc_locked(std::size_t n, bool into_reserve) const {
  const std::size_t rest = n - (into_reserve ? 0 : std::min(n, reserved_.size()));
  const std::size_t takeable = takeable_locked();
  if (takeable >= rest) return {AllocPlan::kTake, 0};
  const std::size_t room = growth_room_locked();
  const std::size_t pages = (rest - takeable + blocks_per_page_ - 1) / blocks_per_page_;
  if (takeable + growth_blocks_locked(room) < rest) return {AllocPlan::kRefuse, pages};  // decided up front
  return {AllocPlan::kGrow, pages};
}

void BlockManager::take_locked(std::size_t n, bool into_reserve, std::vector<std::int64_t>& out) {
  const std::size_t from_reserved = into_reserve ? 0 : std::min(n, reserved_.size());
  const std::size_t first = out.size();
  take_blocks_locked(n - from_reserved, out);
  if (into_reserve) {
    for (std::size_t i = first; i < out.size(); ++i) block_state_[out[i]] = kReserved;
    reserved_.insert(reserved_.end(), out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
    return;
  }
  for (std::size_t i = 0; i < from_reserved; ++i) {  // the oldest reservations first
    block_state_[reserved_[i]] = kUsed;
    out.push_back(reserved_[i]);
  }
  reserved_.erase(reserved_.begin(), reserved_.begin() + static_cast<std::ptrdiff_t>(from_reserved));
}

void BlockManager::check_ids_in_range(const std::int64_t* ids, std::size_t count) const {
  for (std::size_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || static_cast<std::size_t>(ids[i]) >= layout_.num_blocks()) {
      throw InvalidArgument("block id " + std::to_string(ids[i]) + " is outside [0, " +
                            std::to_string(layout_.num_blocks()) + ")");
    }
  }
}

// ---- public operations ------------------------------------------------------------

bool BlockManager::try_alloc_mapped(std::size_t n, std::vector<std::int64_t>& out) {
  Lock lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || closed_ || plan_alloc_locked(n, false).action != AllocPlan::kTake) return false;
  take_locked(n, false, out);
  ++allocs_;
  if (options_.background_worker && reserve_.wants_refill(index_.empty_pages())) wake_worker();
  return true;
}

std::vector<std::int64_t> BlockManager::alloc(std::size_t n) { return alloc(n, std::chrono::nanoseconds::zero()); }

std::vector<std::int64_t> BlockManager::alloc(std::size_t n, std::chrono::nanoseconds wait) {
  std::vector<std::int64_t> blocks;
  if (n == 0) return blocks;
  const Clock::time_point deadline =
      wait > std::chrono::nanoseconds::zero() ? Clock::now() + wait : Clock::time_point::min();
  {
    Lock lock(mutex_);
    if (closed_) throw InvalidArgument("the block manager is closed");
    ++allocs_;
    if (plan_alloc_locked(n, false).action == AllocPlan::kTake) {
      take_locked(n, false, blocks);
      // Wake the worker only when the reserve needs it: a wake-up costs a syscall.
      if (options_.background_worker && reserve_.wants_refill(index_.empty_pages())) wake_worker();
      return blocks;
    }
  }
  return alloc_slow(n, false, deadline);
}

void BlockManager::free(const std::int64_t* ids, std::size_t count) {
  bool wake = false;
  {
    Lock lock(mutex_);
    if (closed_) throw InvalidArgument("the block manager is closed");
    check_ids_in_range(ids, count);
    // Mark each id as being freed so a duplicate is caught; undo on error.
    std::size_t checked = 0;
    std::string problem;
    for (; checked < count; ++checked) {
      const std::int64_t id = ids[checked];
      const std::uint8_t state = block_state_[id];
      if (options_.null_block && id == 0) {
        problem = "block 0 is the null block and is never freed";
      } else if (state == kFreeing) {
        problem = "block id " + std::to_string(id) + " is listed twice";
      } else if (state == kReserved) {
        problem = "block id " + std::to_string(id) + " is reserved (release_reserved() gives it back)";
      } else if (state != kUsed) {
        problem = "block id " + std::to_string(id) + " is not allocated (double free or unknown id)";
      }
      if (!problem.empty()) break;
      block_state_[id] = kFreeing;
    }
    if (!problem.empty()) {
      for (std::size_t i = 0; i < checked; ++i) block_state_[ids[i]] = kUsed;
      throw InvalidArgument(problem);
    }
    give_blocks_locked(ids, count);
    ++frees_;
    wake = options_.background_worker &&
           (index_.empty_pages() > reserve_.targets().max_free_pages || index_.pages() + mapping_pages_ > limit_pages_);
  }
  if (wake) wake_worker();
}

bool BlockManager::try_reserve(std::size_t n) {
  if (n == 0) return true;
  {
    Lock lock(mutex_);
    if (closed_) throw InvalidArgument("the block manager is closed");
    ++allocs_;
    if (plan_alloc_locked(n, true).action == AllocPlan::kTake) {
      std::vector<std::int64_t> taken;
      take_locked(n, true, taken);
      return true;
    }
  }
  try {
    alloc_slow(n, true, Clock::time_point::min());
    return true;
  } catch (const BudgetExhausted&) {
    return false;
  } catch (const DeviceOutOfMemory&) {
    return false;
  }
}

std::size_t BlockManager::release_reserved() {
  bool wake = false;
  std::size_t count = 0;
  {
    Lock lock(mutex_);
    if (closed_) return 0;
    count = reserved_.size();
    give_blocks_locked(reserved_.data(), reserved_.size());
    reserved_.clear();
    ++frees_;
    wake = options_.background_worker;
  }
  if (wake) wake_worker();
  return count;
}

std::size_t BlockManager::clear() {
  std::vector<std::int64_t> held;
  {
    Lock lock(mutex_);
    if (closed_) return 0;
    for (std::size_t b = options_.null_block ? 1 : 0; b < block_state_.size(); ++b) {
      if (block_state_[b] == kUsed || block_state_[b] == kReserved) held.push_back(static_cast<std::int64_t>(b));
    }
    give_blocks_locked(held.data(), held.size());
    reserved_.clear();
    ++frees_;
  }
  if (options_.background_worker) wake_worker();
  return held.size();
}

}  // namespace kvcached
