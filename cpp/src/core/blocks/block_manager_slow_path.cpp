// BlockManager, the slow path: allocs that map pages (waiting for memory others
// give back when asked to), and alloc_ids.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "kvcached/blocks/block_manager.hpp"

namespace kvcached {

namespace {

// A waiting alloc polls the budgets: yielding for this long after each look,
// then sleeping kPollSleep between looks (a hand-over moves memory in slices
// of a fraction of a millisecond).
constexpr auto kPollYield = std::chrono::microseconds(200);
constexpr auto kPollSleep = std::chrono::microseconds(50);
// A waiting alloc records its wait again at least this often (the registry
// forgets pressure after a second).
constexpr auto kPressureRenewal = std::chrono::milliseconds(200);

}  // namespace

std::size_t BlockManager::budget_room_pages_unlocked_poll(
    const std::vector<std::pair<MemoryBudget*, std::size_t>>& budgets) {
  std::size_t room = 0;
  for (const auto& [budget, page_bytes] : budgets) room += budget->available_bytes() / page_bytes;
  return room;
}

void BlockManager::wait_for_budget_locked(Lock& lock, std::size_t room_before, Clock::time_point deadline) {
  std::vector<std::pair<MemoryBudget*, std::size_t>> budgets;  // stable while map_mutex_ is held
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (budgets_.alive(i) && budgets_.budget(i) != nullptr)
      budgets.emplace_back(budgets_.budget(i), budgets_.page_bytes(i));
  }
  lock.unlock();  // frees and fast-path allocs go on meanwhile
  const Clock::time_point yield_until = Clock::now() + kPollYield;
  // Records the wait again now and then: the registry forgets pressure after a second.
  Clock::time_point reprobe = Clock::now() + kPressureRenewal;
  for (Clock::time_point now = Clock::now(); now < deadline; now = Clock::now()) {
    if (budget_room_pages_unlocked_poll(budgets) != room_before || now >= reprobe) break;
    if (now < yield_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollSleep);
    }
  }
  lock.lock();
}

std::vector<std::int64_t> BlockManager::alloc_slow(std::size_t n, bool into_reserve, Clock::time_point deadline) {
  std::lock_guard<std::mutex> map(map_mutex_);  // waits for any map or unmap in flight
  Lock lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  refresh_limit_locked();
  std::vector<std::int64_t> blocks, grown;
  const auto roll_back = [&] {
    std::vector<std::uint32_t> empty;
    for (std::int64_t p : grown) {
      const auto page = static_cast<std::uint32_t>(p);
      if (state_[p] == PageState::kMapped && index_.entirely_free(page)) empty.push_back(page);
    }
    try {
      shrink_locked(lock, empty, reserve_.targets().max_spare_pages);  // nothing held beyond the reserve
    } catch (...) {
    }
  };
  bool rolled_back = false, requeried = false;
  try {
    for (;;) {
      const AllocPlan plan = plan_alloc_locked(n, into_reserve);
      if (plan.action == AllocPlan::kTake) break;
      if (plan.action == AllocPlan::kRefuse && !requeried) {
        requeried = true;  // the device figure is an estimate: ask the driver before refusing
        if (requery_device_locked(lock)) continue;
      }
      const std::size_t rest = n - (into_reserve ? 0 : std::min(n, reserved_.size()));
      const bool ids_and_limit_allow = takeable_locked() + growth_blocks_locked(fixed_room_locked()) >= rest;
      // Beyond what the budgets could ever grant (a max, or the device budget less what the
      // others are guaranteed), nobody giving back helps: refused at once, asking nobody.
      const bool reachable = plan.action != AllocPlan::kRefuse || reachable_budget_pages_locked() >= plan.pages;
      if (plan.action == AllocPlan::kRefuse && reachable && Clock::now() < deadline && ids_and_limit_allow) {
        // Neither the page ids nor a limit stand in the way: map what memory
        // there is now (so these maps overlap the holders' unmaps), then wait
        // for more to come back.
        const std::size_t room = growth_room_locked();
        const std::size_t budget_room = budget_room_pages_locked();  // read with `room`: the poll's baseline
        if (room > 0) {
          try {
            std::vector<std::int64_t> pages_grown = grow_locked(lock, std::min(room, plan.pages), nullptr);
            grown.insert(grown.end(), pages_grown.begin(), pages_grown.end());
            continue;
          } catch (const BudgetExhausted&) {  // taken by someone else first: wait again
          } catch (const DeviceOutOfMemory&) {
          }
        }
        if (budget_room < plan.pages) {  // others' memory it is (not the device's): worth waiting for
          budgets_.check_usable();       // a budget gone bad never gives memory back: no wait
          // Recorded before every wait: the holders decide each round whether anyone waits.
          probe_budget_for_pressure(lock, plan.pages);
          wait_for_budget_locked(lock, budget_room, deadline);  // at once if memory came back meanwhile
          if (closed_) throw InvalidArgument("the block manager is closed");
          refresh_limit_locked();
          requeried = false;
          continue;
        }
      }
      if (plan.action == AllocPlan::kRefuse) {
        budgets_.check_usable();  // a budget gone bad says so, rather than "bound by the memory budget"
        const std::size_t can = available_locked();
        std::string bound_by;
        growth_room_locked(&bound_by);
        if (!reachable && ids_and_limit_allow) reachable_budget_pages_locked(&bound_by);
        roll_back();
        rolled_back = true;
        if (reachable && !asleep_) probe_budget_for_pressure(lock, plan.pages);  // asleep, it wants nobody's memory
        throw BudgetExhausted("cannot allocate " + std::to_string(n) + " blocks: " + std::to_string(can) +
                              " are available (bound by " + bound_by + "; pages of " +
                              std::to_string(layout_.page_id_bytes()) + " bytes, " + std::to_string(index_.pages()) +
                              " mapped)");
      }
      std::vector<std::int64_t> pages_grown = grow_locked(lock, plan.pages, nullptr);
      grown.insert(grown.end(), pages_grown.begin(), pages_grown.end());
    }
    take_locked(n, into_reserve, blocks);
  } catch (...) {
    if (!rolled_back) roll_back();
    throw;
  }
  if (!grown.empty()) ++slow_allocs_;
  report_usage_locked();
  return blocks;
}

void BlockManager::alloc_ids(const std::vector<std::int64_t>& ids) {
  if (ids.empty()) return;
  check_ids_in_range(ids.data(), ids.size());
  std::vector<std::int64_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    throw InvalidArgument("block id " + std::to_string(*twice) + " is listed twice");
  }
  const auto page_of_id = [this](std::int64_t id) {
    return static_cast<std::uint32_t>(id / static_cast<std::int64_t>(blocks_per_page_));
  };
  std::lock_guard<std::mutex> map(map_mutex_);
  Lock lock(mutex_);
  if (closed_) throw InvalidArgument("the block manager is closed");
  refresh_limit_locked();
  // Which pages must be mapped, and how many pages become used (within the limit).
  const auto check = [&](std::vector<std::int64_t>& to_map) {
    std::size_t new_used = 0;
    std::uint32_t last = BestFitIndex::kNone;
    for (std::int64_t id : sorted) {
      const std::uint32_t page = page_of_id(id);
      const PageState state = state_[page];
      if (state == PageState::kMapped) {
        if (block_state_[id] != kFree) throw InvalidArgument("block id " + std::to_string(id) + " is already in use");
        if (page != last && index_.entirely_free(page)) ++new_used;
      } else if (state == PageState::kUnmapped) {
        if (page != last) to_map.push_back(page), ++new_used;
      } else {
        throw InvalidArgument("block id " + std::to_string(id) + " is on page " + std::to_string(page) +
                              ", whose unmap the mirrors have not acknowledged yet");
      }
      last = page;
    }
    if (new_used > new_page_quota_locked()) {
      throw BudgetExhausted("these blocks need " + std::to_string(new_used) + " more page(s); the limit allows " +
                            std::to_string(new_page_quota_locked()));
    }
  };
  std::vector<std::int64_t> to_map;
  check(to_map);
  if (!to_map.empty()) {
    std::string bound_by;
    if (growth_room_locked(&bound_by) < to_map.size()) {
      budgets_.check_usable();
      throw BudgetExhausted("cannot map " + std::to_string(to_map.size()) +
                            " more page(s) for these blocks: " + "bound by " + bound_by);
    }
    grow_locked(lock, to_map.size(), &to_map);
    std::vector<std::int64_t> again;
    try {
      check(again);  // the fast path may have taken some of them while the lock was released
    } catch (...) {
      std::vector<std::uint32_t> empty;
      for (std::int64_t p : to_map) {
        if (index_.entirely_free(static_cast<std::uint32_t>(p))) empty.push_back(static_cast<std::uint32_t>(p));
      }
      shrink_locked(lock, empty, reserve_.targets().max_spare_pages);
      throw;
    }
  }
  for (std::int64_t id : sorted) {
    const std::uint32_t page = page_of_id(id);
    free_slots_[page].remove(static_cast<std::uint32_t>(id % blocks_per_page_));
    index_.update(page, index_.free_blocks(page) - 1);
    block_state_[id] = kUsed;
    ++used_blocks_;
  }
  ++allocs_;
  report_usage_locked();
}

}  // namespace kvcached
