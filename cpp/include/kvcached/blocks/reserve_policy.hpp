// ReservePolicy: how many mapped free pages and pre-created spare allocations
// a pool keeps ready, given what its users are doing. Pure decisions, no I/O:
// the block manager asks it once per maintenance round and carries out the goal.
//
//  * busy (allocs or frees since the last rounds): the configured targets;
//  * idle for kIdleRounds rounds: free pages down to the minimum;
//  * other pools short of memory: free pages down to the minimum, no spare
//    allocation at all, and what is unmapped is released at once;
//  * after trim(): nothing at all — no free page, no spare — until the next
//    alloc, so an idle pool that was told to give everything back stays empty;
//    the reserve refills once allocation resumes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcached/blocks/block_manager_options.hpp"

namespace kvcached {

struct ReserveGoal {
  std::size_t min_free_pages = 0, max_free_pages = 0;
  std::size_t min_spare_pages = 0, max_spare_pages = 0;
  // Allocations unmapped in this round go back to the device in this round
  // (others wait for the memory, or the pool was trimmed); otherwise they
  // stay as spares until the next round, off the path of frees and allocs.
  bool release_now = false;
};

class KVCACHED_EXPORT ReservePolicy {
 public:
  // Rounds without any alloc or free after which the pool counts as idle
  // (with the worker's 50 ms period: 0.3 s, well inside the 1 s target).
  static constexpr int kIdleRounds = 6;

  explicit ReservePolicy(const ReserveTargets& targets);
  const ReserveTargets& targets() const noexcept { return targets_; }
  void set_targets(const ReserveTargets& targets);
  // The pool was trimmed with `allocs` allocs so far: hold nothing until the next one.
  void trimmed(std::uint64_t allocs) noexcept;
  bool holding_nothing() const noexcept { return trimmed_; }
  // One maintenance round. `allocs`, `frees`: calls so far (monotonic);
  // `others_waiting`: the budget says other pools were refused memory.
  ReserveGoal round(std::uint64_t allocs, std::uint64_t frees, bool others_waiting) noexcept;
  // After an alloc leaves `free_pages` free pages: should the worker refill?
  bool wants_refill(std::size_t free_pages) const noexcept { return free_pages < targets_.min_free_pages; }

 private:
  ReserveTargets targets_;
  bool trimmed_ = false;
  std::uint64_t allocs_at_trim_ = 0;
  std::uint64_t last_activity_ = 0;
  bool seen_activity_ = false;
  int idle_rounds_ = 0;
};

}  // namespace kvcached
