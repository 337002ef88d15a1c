// ReservePolicy as a specification: busy, idle, under pressure, trimmed.
#include "check.hpp"
#include "kvcached/blocks/reserve_policy.hpp"

namespace {

using kvcached::ReserveGoal;
using kvcached::ReservePolicy;
using kvcached::ReserveTargets;

ReserveTargets targets() { return {1, 4, 1, 2}; }

void test_busy_pools_keep_the_configured_targets() {
  ReservePolicy policy(targets());
  std::uint64_t allocs = 0;
  for (int round = 0; round < 20; ++round) {
    const ReserveGoal goal = policy.round(++allocs, 0, false);
    CHECK(goal.min_free_pages == 1 && goal.max_free_pages == 4);
    CHECK(goal.min_spare_pages == 1 && goal.max_spare_pages == 2);
  }
}

void test_idle_pools_shrink_to_the_minimum() {
  ReservePolicy policy(targets());
  policy.round(5, 5, false);
  for (int round = 0; round < ReservePolicy::kIdleRounds - 1; ++round) {
    CHECK(policy.round(5, 5, false).max_free_pages == 4);
  }
  CHECK(policy.round(5, 5, false).max_free_pages == 1);  // idle now
  CHECK(policy.round(5, 6, false).max_free_pages == 4);  // a free is activity too
}

void test_pressure_from_other_pools_shrinks_at_once() {
  ReservePolicy policy(targets());
  const ReserveGoal goal = policy.round(1, 0, true);
  CHECK(goal.max_free_pages == 1);
  // Spares are memory others wait for: none kept, and what is unmapped goes back in the same round.
  CHECK(goal.min_spare_pages == 0 && goal.max_spare_pages == 0 && goal.release_now);
}

void test_busy_pools_keep_what_they_unmap_until_the_next_round() {
  ReservePolicy policy(targets());
  CHECK(!policy.round(1, 0, false).release_now);
  policy.trimmed(1);
  CHECK(policy.round(1, 1, false).release_now);  // a trimmed pool gives everything back at once
}

void test_trim_holds_nothing_until_allocation_resumes() {
  ReservePolicy policy(targets());
  policy.round(3, 3, false);
  policy.trimmed(3);
  for (int round = 0; round < 3 * ReservePolicy::kIdleRounds; ++round) {
    const ReserveGoal goal = policy.round(3, round < 2 ? 3 : 4, false);  // frees do not end it
    CHECK(goal.min_free_pages == 0 && goal.max_free_pages == 0 && goal.min_spare_pages == 0 &&
          goal.max_spare_pages == 0 && goal.release_now);
  }
  CHECK(policy.holding_nothing());
  const ReserveGoal goal = policy.round(4, 4, false);  // an alloc: the reserve refills
  CHECK(goal.min_free_pages == 1 && goal.max_free_pages == 4 && !policy.holding_nothing());
}

void test_refill_wake_up_and_validation() {
  ReservePolicy policy(targets());
  CHECK(policy.wants_refill(0) && !policy.wants_refill(1));
  CHECK(kvcached_test::throws<kvcached::InvalidArgument>([&] { policy.set_targets({3, 2, 0, 0}); }));
  CHECK(policy.targets().max_free_pages == 4);  // unchanged
  CHECK(kvcached_test::throws<kvcached::InvalidArgument>([] { ReservePolicy({0, 0, 2, 1}); }));
}

}  // namespace

int main() {
  test_busy_pools_keep_the_configured_targets();
  test_idle_pools_shrink_to_the_minimum();
  test_pressure_from_other_pools_shrinks_at_once();
  test_busy_pools_keep_what_they_unmap_until_the_next_round();
  test_trim_holds_nothing_until_allocation_resumes();
  test_refill_wake_up_and_validation();
  return kvcached_test::summary();
}
