// C++ side of the memory policy (docs/memory-policy.md): the budget arithmetic of min,
// max and priority in the registry, with no Python in the way. Prints "N passed, M
// failed"; non-zero exit on failure.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "check.hpp"
#include "kvcached/registry/device_registry.hpp"
#include "kvcached/registry/registry_settings.hpp"

namespace {

using namespace kvcached;
using kvcached_test::throws;

constexpr std::size_t kMiB = std::size_t{1} << 20;

template <typename Exception>
bool throws_saying(const std::function<void()>& body, const std::string& words) {
  try {
    body();
  } catch (const Exception& error) {
    return std::string(error.what()).find(words) != std::string::npos;
  } catch (...) {
    return false;
  }
  return false;
}

std::shared_ptr<DeviceRegistry> fresh_registry(std::size_t budget_bytes) {
  auto registry = DeviceRegistry::open("cpu", budget_bytes, "cpu");
  registry->set_budget_bytes(budget_bytes);  // each test's instances unregister when it ends
  return registry;
}

InstancePolicy policy(std::size_t min_bytes, std::int64_t priority, std::optional<std::size_t> max_bytes = {}) {
  InstancePolicy p;
  p.min_bytes = min_bytes;
  p.priority = priority;
  p.max_bytes = max_bytes;
  return p;
}

// A process that only waits to be killed: a requester whose death the registry must notice.
pid_t spawn_sleeper() {
  const pid_t pid = fork();
  if (pid == 0) {
    pause();
    _exit(0);
  }
  return pid;
}

void test_min_is_kept_free_for_its_owner() {
  auto registry = fresh_registry(100 * kMiB);
  auto guaranteed = registry->register_instance("guaranteed", std::nullopt, policy(40 * kMiB, 0));
  auto other = registry->register_instance("other");
  CHECK(other->available_bytes() == 60 * kMiB);
  CHECK(!other->try_acquire(61 * kMiB));
  CHECK(other->try_acquire(60 * kMiB));
  CHECK(guaranteed->try_acquire(40 * kMiB));  // its min was there all along
  CHECK(!guaranteed->try_acquire(kMiB));      // beyond its min, like anyone else
  guaranteed->release(40 * kMiB);
  CHECK(!other->try_acquire(kMiB));  // what it gave back is still its to claim
  other->release(60 * kMiB);
}

void test_a_min_outranks_a_waiting_higher_priority() {
  auto registry = fresh_registry(100 * kMiB);
  auto guaranteed = registry->register_instance("guaranteed", std::nullopt, policy(30 * kMiB, 0));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 9));
  CHECK(high->try_acquire(70 * kMiB) && !high->try_acquire(kMiB));  // it waits, recently refused
  CHECK(guaranteed->available_bytes() == 30 * kMiB);
  CHECK(guaranteed->try_acquire(30 * kMiB));
  high->release(70 * kMiB);
  guaranteed->release(30 * kMiB);
}

void test_mins_that_cannot_be_honoured_are_refused() {
  auto registry = fresh_registry(100 * kMiB);
  auto first = registry->register_instance("first", std::nullopt, policy(60 * kMiB, 0));
  CHECK(throws_saying<InvalidArgument>(
      [&] { registry->register_instance("second", std::nullopt, policy(50 * kMiB, 0)); },
      "would sum to 115343360 bytes (110 MiB), above the device budget of 104857600 bytes (100 MiB)"));
  CHECK(registry->entries().size() == 1);
  PolicyChange raise;
  raise.min_bytes = 101 * kMiB;
  CHECK(throws<InvalidArgument>([&] { registry->set_policy(std::string("first"), raise); }));
  CHECK(first->min_bytes() == 60 * kMiB);  // unchanged
  CHECK(throws_saying<InvalidArgument>([&] { registry->set_budget_bytes(50 * kMiB); }, "a budget of 52428800 bytes"));
  CHECK(registry->budget_bytes() == 100 * kMiB);
  CHECK(throws_saying<InvalidArgument>([&] { registry->set_limit(std::string("first"), 10 * kMiB); }, "above its max"));
  CHECK(first->limit_bytes() == std::nullopt);
  CHECK(throws_saying<InvalidArgument>(
      [&] { registry->register_instance("capped", std::nullopt, policy(20 * kMiB, 0, 10 * kMiB)); }, "above its max"));
  PolicyChange priority;
  priority.priority = std::int64_t{1} << 40;
  CHECK(throws_saying<InvalidArgument>([&] { registry->set_policy(std::string("first"), priority); }, "out of range"));
}

void test_refusal_asks_lowest_priority_first_never_below_min() {
  auto registry = fresh_registry(100 * kMiB);
  auto lowest = registry->register_instance("lowest", std::nullopt, policy(10 * kMiB, 0));
  auto middle = registry->register_instance("middle", std::nullopt, policy(0, 1));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  CHECK(lowest->try_acquire(50 * kMiB) && middle->try_acquire(50 * kMiB));
  lowest->report_usage(50 * kMiB, 50 * kMiB);  // both busy: nothing free
  middle->report_usage(50 * kMiB, 50 * kMiB);
  CHECK(!high->try_acquire(30 * kMiB));
  CHECK(lowest->reclaim_target_bytes() == 20 * kMiB && lowest->external_limit_bytes() == 20 * kMiB);
  CHECK(!middle->reclaim_target_bytes());
  CHECK(!high->try_acquire(60 * kMiB));  // more than the lowest can give above its min
  CHECK(lowest->reclaim_target_bytes() == 10 * kMiB);
  CHECK(middle->reclaim_target_bytes() == 30 * kMiB);
  // Nobody asks the requester itself, nor anyone of its priority or above.
  CHECK(!high->reclaim_target_bytes());
  lowest->release(40 * kMiB);
  CHECK(!middle->try_acquire(kMiB));  // what the high priority waits for is set aside for it
  CHECK(high->try_acquire(40 * kMiB));
  lowest->release(10 * kMiB);
  middle->release(50 * kMiB);
  high->release(40 * kMiB);
}

void test_free_memory_is_asked_for_before_used_memory() {
  auto registry = fresh_registry(100 * kMiB);
  auto busy = registry->register_instance("busy", std::nullopt, policy(0, 0));
  auto idle = registry->register_instance("idle", std::nullopt, policy(0, 1));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  CHECK(busy->try_acquire(50 * kMiB) && idle->try_acquire(50 * kMiB));
  busy->report_usage(50 * kMiB, 50 * kMiB);
  idle->report_usage(20 * kMiB, 50 * kMiB);  // 30 MiB mapped and free
  CHECK(!high->try_acquire(30 * kMiB));
  CHECK(idle->reclaim_target_bytes() == 20 * kMiB);
  CHECK(!busy->reclaim_target_bytes());  // the idle memory covers it, though of higher priority
  busy->release(50 * kMiB);
  idle->release(50 * kMiB);
}

void test_a_target_lapses_when_the_requester_stops_or_outranks_no_more() {
  auto registry = fresh_registry(100 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  CHECK(low->try_acquire(100 * kMiB));
  low->report_usage(100 * kMiB, 100 * kMiB);
  CHECK(!high->try_acquire(10 * kMiB));
  CHECK(low->reclaim_target_bytes() == 90 * kMiB);
  low->release(10 * kMiB);
  CHECK(high->try_acquire(10 * kMiB));  // it has what it asked for, and may ask again at its next step
  CHECK(low->reclaim_target_bytes() == 90 * kMiB && low->external_limit_bytes() == 90 * kMiB);
  CHECK(!high->try_acquire(10 * kMiB) && low->reclaim_target_bytes() == 80 * kMiB);
  PolicyChange demote;
  demote.priority = -1;
  CHECK(registry->set_policy(std::string("high"), demote) == 1);
  CHECK(!low->reclaim_target_bytes());  // it no longer outranks the holder
  demote.priority = 5;
  registry->set_policy(std::string("high"), demote);
  CHECK(!high->try_acquire(10 * kMiB) && low->reclaim_target_bytes() == 80 * kMiB);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the refusal is no longer recent
  CHECK(!low->reclaim_target_bytes());
  low->release(90 * kMiB);
  high->release(10 * kMiB);
}

// A pool refilling its own reserve waits for nobody: refused, it asks nobody to shrink.
void test_a_reserve_refill_is_no_demand() {
  auto registry = fresh_registry(100 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  CHECK(low->try_acquire(100 * kMiB));
  CHECK(!high->try_acquire_for_reserve(2 * kMiB));
  CHECK(!low->reclaim_target_bytes() && low->pressure_bytes() == 0);
  CHECK(!high->try_acquire(2 * kMiB));  // a real request is
  CHECK(low->reclaim_target_bytes() == 98 * kMiB && low->pressure_bytes() == 2 * kMiB);
  low->release(100 * kMiB);
}

void test_a_dead_requester_leaves_no_shrink_in_force() {
  auto registry = fresh_registry(100 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  const pid_t child = spawn_sleeper();
  auto requester = registry->register_instance("requester", child, policy(0, 5));
  CHECK(low->try_acquire(100 * kMiB));
  CHECK(!requester->try_acquire(40 * kMiB));
  CHECK(low->reclaim_target_bytes() == 60 * kMiB);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  CHECK(registry->clean_stale() == 1);  // what a refused alloc or a new registration does
  CHECK(!low->reclaim_target_bytes() && low->external_limit_bytes() == std::nullopt);
  CHECK(low->available_bytes() == 0);  // and it may grow back: nothing is set aside for the dead
  low->release(100 * kMiB);
}

void test_a_dead_instance_keeps_no_guarantee() {
  auto registry = fresh_registry(100 * kMiB);
  const pid_t child = spawn_sleeper();
  auto guaranteed = registry->register_instance("guaranteed", child, policy(60 * kMiB, 0));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  registry->set_budget_bytes(50 * kMiB);  // its min no longer counts: it is reclaimed first
  CHECK(registry->budget_bytes() == 50 * kMiB && !guaranteed->registered());
}

// A min accepted while others hold the whole budget is there to be claimed: whoever holds
// it, whatever its priority, is asked to give back what the min is owed.
void test_a_min_is_claimed_from_a_higher_priority_holding_everything() {
  auto registry = fresh_registry(64 * kMiB);
  auto holder = registry->register_instance("holder", std::nullopt, policy(0, 5));
  CHECK(holder->try_acquire(64 * kMiB));
  holder->report_usage(64 * kMiB, 64 * kMiB);                                           // busy: nothing free
  auto late = registry->register_instance("late", std::nullopt, policy(32 * kMiB, 0));  // accepted
  CHECK(!late->try_acquire(2 * kMiB));
  CHECK(holder->reclaim_target_bytes() == 62 * kMiB);  // what the min lacks now, no more
  CHECK(!late->try_acquire(40 * kMiB));                // beyond its min: a higher priority owes it only the min
  CHECK(holder->reclaim_target_bytes() == 32 * kMiB);
  holder->release(32 * kMiB);
  CHECK(!holder->try_acquire(2 * kMiB));  // what it gave back is the min's, not its to take again
  CHECK(late->try_acquire(32 * kMiB));
  CHECK(!holder->reclaim_target_bytes());                                  // the min is reached: the claim ends
  CHECK(!late->try_acquire(2 * kMiB) && !holder->reclaim_target_bytes());  // beyond it, no claim
  late->release(32 * kMiB);
  holder->release(32 * kMiB);
}

void test_a_min_claim_leaves_the_asked_their_own_min() {
  auto registry = fresh_registry(64 * kMiB);
  auto first = registry->register_instance("first", std::nullopt, policy(24 * kMiB, 5));
  auto second = registry->register_instance("second", std::nullopt, policy(0, 5));
  CHECK(first->try_acquire(48 * kMiB) && second->try_acquire(16 * kMiB));
  first->report_usage(48 * kMiB, 48 * kMiB);
  second->report_usage(16 * kMiB, 16 * kMiB);
  auto late = registry->register_instance("late", std::nullopt, policy(32 * kMiB, 0));
  CHECK(!late->try_acquire(32 * kMiB));
  const std::size_t first_target = first->reclaim_target_bytes().value_or(48 * kMiB);
  const std::size_t second_target = second->reclaim_target_bytes().value_or(16 * kMiB);
  CHECK(first_target >= 24 * kMiB);                                              // never below its own min
  CHECK((48 * kMiB - first_target) + (16 * kMiB - second_target) == 32 * kMiB);  // the min, no more
  first->release(48 * kMiB);
  second->release(16 * kMiB);
}

// Lower priorities give first, for the whole deficit; equal or higher ones only what the
// requester's min is still owed beyond that.
void test_a_min_claim_asks_lower_priorities_first() {
  auto registry = fresh_registry(64 * kMiB);
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  auto lowest = registry->register_instance("lowest", std::nullopt, policy(0, -1));
  CHECK(high->try_acquire(52 * kMiB) && lowest->try_acquire(12 * kMiB));
  high->report_usage(52 * kMiB, 52 * kMiB);
  lowest->report_usage(12 * kMiB, 12 * kMiB);
  auto late = registry->register_instance("late", std::nullopt, policy(16 * kMiB, 0));
  CHECK(!late->try_acquire(16 * kMiB));
  CHECK(lowest->reclaim_target_bytes() == 0 && high->reclaim_target_bytes() == 48 * kMiB);
  CHECK(!late->try_acquire(24 * kMiB));  // beyond its min: the higher priority still owes only the min
  CHECK(lowest->reclaim_target_bytes() == 0 && high->reclaim_target_bytes() == 48 * kMiB);
  high->release(52 * kMiB);
  lowest->release(12 * kMiB);
}

// A request no giving back could meet (beyond the budget less the others' mins, or beyond
// its own max) is refused without a trace: no pressure, no reclaim target. (A want() is not one
// request but all that an engine's requests may need: test_a_want_beyond_reach_asks_for_the_rest.)
void test_a_request_beyond_reach_asks_nobody() {
  auto registry = fresh_registry(64 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  auto guaranteed = registry->register_instance("guaranteed", std::nullopt, policy(16 * kMiB, 0));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  auto capped = registry->register_instance("capped", std::nullopt, policy(0, 5, 40 * kMiB));
  CHECK(low->try_acquire(48 * kMiB));
  low->report_usage(48 * kMiB, 48 * kMiB);
  CHECK(high->reachable_bytes() == 48 * kMiB && capped->reachable_bytes() == 40 * kMiB);
  CHECK(low->reachable_bytes() == 0);
  const std::pair<RegistryBudget*, std::size_t> beyond[] = {
      {high.get(), 80 * kMiB},    // the whole budget
      {high.get(), 49 * kMiB},    // the budget less the others' mins
      {capped.get(), 41 * kMiB},  // its own max
  };
  for (const auto& [budget, bytes] : beyond) {
    CHECK(!budget->try_acquire(bytes));
    CHECK(!low->reclaim_target_bytes() && low->pressure_bytes() == 0 && guaranteed->pressure_bytes() == 0);
  }
  CHECK(!high->try_acquire(48 * kMiB));  // within reach: asked of the lower priority
  CHECK(low->reclaim_target_bytes() == 0 && low->pressure_bytes() == 48 * kMiB);
  low->release(48 * kMiB);
}

// An engine that waits says all its requests may still need. The part beyond what it could ever
// hold (its max, the budget less the others' mins) is dropped, the rest asked for.
void test_a_want_beyond_reach_asks_for_the_rest() {
  auto registry = fresh_registry(64 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  auto guaranteed = registry->register_instance("guaranteed", std::nullopt, policy(16 * kMiB, 0));
  auto capped = registry->register_instance("capped", std::nullopt, policy(0, 5, 40 * kMiB));
  CHECK(low->try_acquire(48 * kMiB));
  capped->want(41 * kMiB);  // one MiB beyond its max
  CHECK(low->reclaim_target_bytes() == 8 * kMiB && low->pressure_bytes() == 40 * kMiB);
  low->release(48 * kMiB);
}

void test_an_instance_at_its_max_waits_for_nothing() {
  auto registry = fresh_registry(64 * kMiB);
  auto holder = registry->register_instance("holder", std::nullopt, policy(0, 0));
  auto at_max = registry->register_instance("at-max", std::nullopt, policy(0, 5, 8 * kMiB));
  CHECK(at_max->try_acquire(8 * kMiB) && holder->try_acquire(56 * kMiB));
  at_max->want(kMiB);
  CHECK(!holder->reclaim_target_bytes() && holder->pressure_bytes() == 0);
  holder->release(56 * kMiB);
  at_max->release(8 * kMiB);
}

// A wait renewed with a smaller figure (an engine's step) keeps every holder asked for all
// that is still missing, even once another requester's tighter target has lapsed.
void test_a_renewed_wait_asks_for_all_that_is_still_missing() {
  auto registry = fresh_registry(100 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  auto waiting = registry->register_instance("waiting", std::nullopt, policy(0, 5));
  auto urgent = registry->register_instance("urgent", std::nullopt, policy(0, 6));
  CHECK(low->try_acquire(100 * kMiB));
  low->report_usage(100 * kMiB, 100 * kMiB);
  CHECK(!waiting->try_acquire(40 * kMiB) && low->reclaim_target_bytes() == 60 * kMiB);
  CHECK(!urgent->try_acquire(50 * kMiB) && low->reclaim_target_bytes() == 50 * kMiB);
  low->release(50 * kMiB);
  CHECK(urgent->try_acquire(50 * kMiB));  // all it asked for; its target stays while its ask is recent
  CHECK(low->reclaim_target_bytes() == 50 * kMiB);
  waiting->want(2 * kMiB);  // the wait goes on: 40 MiB are still missing
  CHECK(low->reclaim_target_bytes() == 10 * kMiB);
  low->release(40 * kMiB);
  CHECK(waiting->try_acquire(30 * kMiB));  // a partial grant: the rest is still asked for
  waiting->want(2 * kMiB);
  CHECK(low->reclaim_target_bytes() == 10 * kMiB);
  CHECK(waiting->try_acquire(10 * kMiB) && low->reclaim_target_bytes() == 10 * kMiB);
  low->release(10 * kMiB);
  waiting->release(40 * kMiB);
  urgent->release(50 * kMiB);
}

// Each ask says all the requester lacks now: its own earlier target, tighter or not, gives
// way, and one it no longer needs ends, instead of coming back into force with the next ask.
void test_a_new_ask_replaces_the_requesters_own_earlier_targets() {
  auto registry = fresh_registry(100 * kMiB);
  auto low = registry->register_instance("low", std::nullopt, policy(0, 0));
  auto idle = registry->register_instance("idle", std::nullopt, policy(0, 1));
  auto high = registry->register_instance("high", std::nullopt, policy(0, 5));
  CHECK(low->try_acquire(100 * kMiB));
  low->report_usage(100 * kMiB, 100 * kMiB);
  CHECK(!high->try_acquire(40 * kMiB) && low->reclaim_target_bytes() == 60 * kMiB);
  low->release(40 * kMiB);
  CHECK(high->try_acquire(40 * kMiB));  // satisfied
  high->release(40 * kMiB);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // it stopped asking: the target lapsed
  CHECK(!low->reclaim_target_bytes());
  CHECK(low->try_acquire(40 * kMiB));  // the holder grows back
  CHECK(!high->try_acquire(2 * kMiB));
  CHECK(low->reclaim_target_bytes() == 98 * kMiB);  // not the 60 MiB of the old request
  low->release(10 * kMiB);
  CHECK(idle->try_acquire(8 * kMiB));  // all but the 2 MiB set aside for the waiting higher priority
  idle->report_usage(0, 8 * kMiB);     // mapped and free: asked for first
  CHECK(!high->try_acquire(4 * kMiB));
  CHECK(idle->reclaim_target_bytes() == 6 * kMiB && !low->reclaim_target_bytes());
  low->release(90 * kMiB);
  idle->release(8 * kMiB);
}

}  // namespace

int main() {
  char directory[] = "/tmp/kvcached-policy-test-XXXXXX";
  if (mkdtemp(directory) == nullptr) return 2;
  configure_registry({directory, ""});
  test_min_is_kept_free_for_its_owner();
  test_a_min_outranks_a_waiting_higher_priority();
  test_mins_that_cannot_be_honoured_are_refused();
  test_refusal_asks_lowest_priority_first_never_below_min();
  test_free_memory_is_asked_for_before_used_memory();
  test_a_target_lapses_when_the_requester_stops_or_outranks_no_more();
  test_a_reserve_refill_is_no_demand();
  test_a_dead_requester_leaves_no_shrink_in_force();
  test_a_dead_instance_keeps_no_guarantee();
  test_a_min_is_claimed_from_a_higher_priority_holding_everything();
  test_a_min_claim_leaves_the_asked_their_own_min();
  test_a_min_claim_asks_lower_priorities_first();
  test_a_request_beyond_reach_asks_nobody();
  test_a_want_beyond_reach_asks_for_the_rest();
  test_an_instance_at_its_max_waits_for_nothing();
  test_a_renewed_wait_asks_for_all_that_is_still_missing();
  test_a_new_ask_replaces_the_requesters_own_earlier_targets();
  const std::string cleanup = std::string("rm -rf ") + directory;
  if (std::system(cleanup.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", directory);
  return kvcached_test::summary();
}
