// ReservePolicy: the reserve targets of one maintenance round (busy, idle, trimmed).
#include "kvcached/blocks/reserve_policy.hpp"

namespace kvcached {

ReservePolicy::ReservePolicy(const ReserveTargets& targets) : targets_(targets) { targets_.validate(); }

void ReservePolicy::set_targets(const ReserveTargets& targets) {
  targets.validate();
  targets_ = targets;
}

void ReservePolicy::trimmed(std::uint64_t allocs) noexcept {
  trimmed_ = true;
  allocs_at_trim_ = allocs;
}

ReserveGoal ReservePolicy::round(std::uint64_t allocs, std::uint64_t frees, bool others_waiting) noexcept {
  if (trimmed_ && allocs != allocs_at_trim_) trimmed_ = false;  // allocation resumed
  const std::uint64_t activity = allocs + frees;
  if (!seen_activity_ || activity != last_activity_) {
    seen_activity_ = true;
    last_activity_ = activity;
    idle_rounds_ = 0;
  } else if (idle_rounds_ < kIdleRounds) {
    ++idle_rounds_;
  }
  ReserveGoal goal;
  goal.release_now = true;
  if (trimmed_) return goal;  // give everything back and keep it so
  goal.min_free_pages = targets_.min_free_pages;
  goal.max_free_pages =
      (idle_rounds_ >= kIdleRounds || others_waiting) ? targets_.min_free_pages : targets_.max_free_pages;
  if (others_waiting) return goal;  // spares are memory others wait for
  goal.release_now = false;
  goal.min_spare_pages = targets_.min_spare_pages;
  goal.max_spare_pages = targets_.max_spare_pages;
  return goal;
}

}  // namespace kvcached
