// BlockManager while its engine sleeps (block_manager.hpp: suspend / resume): no page mapped, the null block's neither.
//
// An engine asleep must hold no KV memory at all. Every block but the null block is
// free by then (the engine emptied its cache), but the null block keeps its page
// mapped for the engine's whole life. So suspend gives block 0 back like any block,
// unmaps every page and holds the limit at 0, which keeps alloc from handing out
// block 0 (or anything) while asleep; resume maps page 0 again and takes block 0 back.
#include <string>

#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/error.hpp"

namespace kvcached {

void BlockManager::take_null_block_locked(Lock& lock) {
  const std::vector<std::int64_t> first = {0};
  grow_locked(lock, 1, &first);
  free_slots_[0].remove(0);
  index_.update(0, index_.free_blocks(0) - 1);
  block_state_[0] = kUsed;
  ++used_blocks_;
  report_usage_locked();
}

std::size_t BlockManager::suspend() {
  std::lock_guard<std::mutex> map(map_mutex_);
  Lock lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  if (suspended_) return 0;
  const std::size_t null_blocks = options_.null_block ? 1 : 0;
  if (used_blocks_ > null_blocks || !reserved_.empty()) {
    throw InvalidArgument(std::to_string(used_blocks_ - null_blocks) +
                          " block(s) are in use or reserved: free them before suspending");
  }
  if (options_.null_block) {
    const std::int64_t null_block = 0;
    give_blocks_locked(&null_block, 1);
  }
  suspended_ = true;
  refresh_limit_locked();
  reserve_.trimmed(allocs_);
  const std::size_t unmapped = shrink_locked(lock, index_.empty_pages_to_release(index_.empty_pages()), 0);
  trim_spares_locked(lock, 0);
  report_usage_locked();
  return unmapped;
}

void BlockManager::resume() {
  std::lock_guard<std::mutex> map(map_mutex_);
  Lock lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  if (!suspended_) return;
  suspended_ = false;
  refresh_limit_locked();
  if (!options_.null_block) return;
  try {
    take_null_block_locked(lock);
  } catch (...) {
    suspended_ = true;  // block 0 must stay out of reach until its page is back
    refresh_limit_locked();
    throw;
  }
}

bool BlockManager::suspended() const {
  Lock lock(mutex_);
  return suspended_;
}

}  // namespace kvcached
