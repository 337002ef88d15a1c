// BlockManager, accounting: what is available, stats, and the mirrors' budget
// charges (taken all or nothing before a map, given back once no longer needed).
#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "kvcached/blocks/block_manager.hpp"

namespace kvcached {

// ---- what is there ----------------------------------------------------------------

std::size_t BlockManager::growth_room_locked(std::string* bound_by) const {
  const std::size_t committed = index_.pages() + mapping_pages_;  // mapped or being mapped
  std::size_t room = std::numeric_limits<std::size_t>::max();
  // `what` builds the bound's words only when the caller asks for them: available() runs
  // this on every call, and each string would be a heap allocation.
  const auto bound = [&](std::size_t pages, const auto& what) {
    if (pages >= room) return;
    room = pages;
    if (bound_by != nullptr) *bound_by = what();
  };
  if (asleep_) bound(0, [] { return std::string("the pool's sleep (wake_up() first)"); });
  // Ids: unmapped ones, and those being unmapped (alloc waits for that).
  bound(unmapped_.size() + unmapping_pages_, [] { return std::string("the virtual capacity (page ids)"); });
  bound(limit_pages_ > committed ? limit_pages_ - committed : 0,
        [&] { return "the limit of " + std::to_string(limit_pages_) + " page(s)"; });
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (!budgets_.alive(i) || budgets_.budget(i) == nullptr) continue;
    // Pages already charged but not mapped (being unmapped, spares, unmaps the
    // mirror has not acknowledged) count: a new page reuses their charge.
    const auto slack = static_cast<std::int64_t>(budgets_.charged_pages(i)) - static_cast<std::int64_t>(committed);
    const auto budget_pages =
        static_cast<std::int64_t>(std::min<std::size_t>(budgets_.room_pages(i), KVLayout::kMaxPages));
    bound(static_cast<std::size_t>(std::max<std::int64_t>(budget_pages + slack, 0)), [&] {
      return budgets_.size() > 1 ? "the memory budget of mirror " + std::to_string(i)
                                 : std::string("the memory budget");
    });
  }
  if (const auto device = device_room_locked()) bound(*device, [] { return std::string("the device's free memory"); });
  return room;
}

std::optional<std::size_t> BlockManager::device_room_locked() const {
  // Read fresh (an atomic estimate), so available() and alloc apply the same bound.
  const auto device = device_free_pages();
  if (!device) return std::nullopt;
  const std::size_t room = *device + unmapping_pages_ + mapper_->spare_pages();
  return device_room_in_flight_ ? std::min(room, *device_room_in_flight_) : room;
}

std::size_t BlockManager::fixed_room_locked() const {
  const std::size_t committed = index_.pages() + mapping_pages_;
  const std::size_t ids = unmapped_.size() + unmapping_pages_;
  return std::min(ids, limit_pages_ > committed ? limit_pages_ - committed : 0);
}

std::size_t BlockManager::reachable_budget_pages_locked(std::string* words) const {
  const std::size_t committed = index_.pages() + mapping_pages_;
  std::size_t reachable = std::numeric_limits<std::size_t>::max();
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (!budgets_.alive(i) || budgets_.budget(i) == nullptr) continue;
    const std::size_t pages = budgets_.reachable_pages(i);
    if (pages == std::numeric_limits<std::size_t>::max()) continue;
    // As in growth_room_locked: pages charged but not mapped are reused by a new page.
    const auto slack = static_cast<std::int64_t>(budgets_.charged_pages(i)) - static_cast<std::int64_t>(committed);
    const auto more =
        std::max<std::int64_t>(static_cast<std::int64_t>(std::min<std::size_t>(pages, KVLayout::kMaxPages)) + slack, 0);
    if (static_cast<std::size_t>(more) >= reachable) continue;
    reachable = static_cast<std::size_t>(more);
    if (words != nullptr) {
      *words = "the memory budget" + (budgets_.size() > 1 ? " of mirror " + std::to_string(i) : std::string()) +
               ", which could never grant more than " + std::to_string(reachable) +
               " more page(s) to this pool (its max, or the device budget less what the other instances are "
               "guaranteed by their min)";
    }
  }
  return reachable;
}

std::size_t BlockManager::budget_room_pages_locked() const {
  std::size_t room = 0;
  bool any = false;
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (!budgets_.alive(i) || budgets_.budget(i) == nullptr) continue;
    room += budgets_.room_pages(i);  // the same sum wait_for_budget_locked polls
    any = true;
  }
  return any ? room : std::numeric_limits<std::size_t>::max();  // no budget: nothing to wait for
}

std::size_t BlockManager::growth_blocks_locked(std::size_t pages) const noexcept {
  // Pages grow lowest id first; only the last page can be short, and it is the highest id.
  const std::size_t ids = unmapped_.size() + unmapping_pages_;
  const std::uint32_t last = static_cast<std::uint32_t>(layout_.num_pages() - 1);
  const bool short_last_candidate = state_[last] == PageState::kUnmapped || state_[last] == PageState::kUnmapping;
  std::size_t blocks = pages * blocks_per_page_;
  if (pages >= ids && short_last_candidate) blocks -= blocks_per_page_ - index_.capacity(last);
  return blocks;
}

std::size_t BlockManager::available() const {
  Lock lock(mutex_);
  if (!closed_) refresh_limit_locked();  // a limit set from outside (kvctl) shows at once
  return available_locked();
}

std::size_t BlockManager::available_locked() const {
  if (closed_) return 0;
  const std::size_t partial_free = index_.free_blocks() - index_.empty_blocks();
  const std::size_t empty = index_.empty_pages() + mapping_pages_;
  const std::size_t ids = unmapped_.size() + unmapping_pages_;
  const std::size_t pages = std::min(empty + growth_room_locked(), new_page_quota_locked());
  std::size_t blocks;
  if (pages >= empty + ids) {  // every candidate page: add up their real sizes
    blocks = index_.empty_blocks() + mapping_blocks_ + growth_blocks_locked(ids);
  } else {
    blocks = pages * blocks_per_page_;  // at most one candidate is short: `pages` full ones exist
  }
  return reserved_.size() + partial_free + blocks;
}

std::size_t BlockManager::free_mapped_blocks() const {
  Lock lock(mutex_);
  return index_.free_blocks();
}

bool BlockManager::closed() const {
  Lock lock(mutex_);
  return closed_;
}

std::size_t BlockManager::page_of(std::int64_t block) const {
  check_ids_in_range(&block, 1);
  return static_cast<std::size_t>(block) / blocks_per_page_;
}

BlockManagerStats BlockManager::stats() const {
  Lock lock(mutex_);
  if (!closed_) refresh_limit_locked();  // a limit set from outside (kvctl) shows at once
  BlockManagerStats s{};
  s.num_blocks = layout_.num_blocks();
  s.num_pages = layout_.num_pages();
  s.blocks_per_page = blocks_per_page_;
  s.page_id_bytes = layout_.page_id_bytes();
  s.block_id_bytes = layout_.block_id_bytes();
  s.used_blocks = used_blocks_;
  s.reserved_blocks = reserved_.size();
  s.free_mapped_blocks = index_.free_blocks();
  s.free_pages = index_.empty_pages();
  s.used_pages = index_.pages() - s.free_pages;
  s.mapped_pages = index_.pages();
  s.mapping_pages = mapping_pages_;
  s.unmapping_pages = unmapping_pages_;
  s.pending_pages = awaiting_ack_pages_;
  s.unmapped_pages = unmapped_.size();
  s.spare_pages = mapper_->spare_pages();
  s.held_pages = budgets_.max_charged_pages();
  s.limit_pages = limit_pages_;
  s.limit_bytes = limit_bytes_;
  s.asleep = asleep_;
  s.slow_allocs = slow_allocs_;
  s.worker_errors = worker_errors_;
  s.last_worker_error = last_worker_error_;
  s.last_seq = op_log_ ? op_log_->last_seq() : 0;
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    MirrorStats m;
    if (op_log_) {
      m.progress = op_log_->progress(i);
    } else {
      m.progress.alive = budgets_.alive(i);
    }
    m.page_bytes = budgets_.page_bytes(i);
    m.charged_pages = budgets_.charged_pages(i);
    s.mirrors.push_back(m);
  }
  return s;
}

// ---- budgets ----------------------------------------------------------------------

void BlockManager::refresh_limit_locked() const {
  if (asleep_) {  // nothing may be mapped until wake_up()
    limit_pages_ = 0;
    limit_bytes_ = 0;
    return;
  }
  std::size_t limit = layout_.num_pages();
  std::optional<std::size_t> limit_bytes;
  if (options_.limit_bytes) {
    limit = std::min(limit, *options_.limit_bytes / layout_.page_id_bytes());
    limit_bytes = options_.limit_bytes;
  }
  if (auto external = budgets_.external_limit(); external && (!limit_bytes || external->pages < limit)) {
    limit = std::min(limit, external->pages);
    limit_bytes = external->bytes;
  }
  limit_pages_ = limit;
  limit_bytes_ = limit_bytes;
}

std::optional<std::size_t> BlockManager::device_free_pages(bool query) const {
  try {
    if (auto bytes = mapper_->device_free_bytes(query)) return *bytes / layout_.page_id_bytes();
  } catch (...) {
    // A failed query keeps the last figure; the map itself reports a real shortage.
  }
  return std::nullopt;
}

bool BlockManager::requery_device_locked(Lock& lock) {
  const std::optional<std::size_t> estimated = device_free_pages();
  if (!estimated) return false;  // no device (mirrors): nothing to learn
  lock.unlock();
  const std::optional<std::size_t> queried = device_free_pages(/*query=*/true);  // resets the estimate
  lock.lock();
  return queried && *queried > *estimated;
}

void BlockManager::report_usage_locked() const noexcept { budgets_.report_usage(used_pages_locked()); }

std::size_t BlockManager::required_pages_locked(std::size_t i, std::size_t maps, std::size_t new_spares) const {
  const std::size_t committed = index_.pages() + mapping_pages_;
  if (op_log_) return op_log_->peak_pages(i, committed, maps);
  // Here: what is physically held once the operation is done. A map uses
  // spares first, so those pages are already held.
  const std::size_t spares = mapper_->spare_pages();
  return committed + unmapping_pages_ + spares + new_spares - std::min(maps, spares);
}

void BlockManager::charge_locked(Lock& lock, std::size_t maps, std::size_t new_spares, bool for_reserve) {
  std::vector<std::size_t> need(budgets_.size(), 0);
  bool any = false;
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (!budgets_.alive(i)) continue;
    const std::size_t required = required_pages_locked(i, maps, new_spares);
    const std::size_t held = budgets_.charged_pages(i) - budgets_.releasing_pages(i);
    if (required > held) need[i] = required - held, any = true;
  }
  if (!any) return;
  budgets_.add_charge(need);  // counted first, so nobody else plans with this room
  std::optional<std::size_t> refused;
  try {
    if (budgets_.may_block()) {
      lock.unlock();
      try {
        refused = budgets_.take(need, for_reserve);
      } catch (...) {
        lock.lock();
        throw;
      }
      lock.lock();
    } else {
      refused = budgets_.take(need, for_reserve);  // cannot wait on anyone: keeps the figures exact
    }
  } catch (...) {
    budgets_.remove_charge(need);
    throw;
  }
  if (refused) {
    budgets_.remove_charge(need);
    const std::size_t i = *refused;
    throw BudgetExhausted("the memory budget" + (budgets_.size() > 1 ? " of mirror " + std::to_string(i) : "") +
                          " has no room for " + std::to_string(need[i]) + " more page(s) of " +
                          std::to_string(budgets_.page_bytes(i)) + " bytes");
  }
}

void BlockManager::give_back_locked(Lock& lock, std::vector<std::pair<std::size_t, std::size_t>> releases) {
  if (releases.empty()) return;
  if (budgets_.may_block()) {
    lock.unlock();
    for (const auto& [i, pages] : releases) budgets_.give(i, pages);
    lock.lock();
  } else {
    for (const auto& [i, pages] : releases) budgets_.give(i, pages);
  }
  for (const auto& [i, pages] : releases) budgets_.end_release(i, pages);
}

void BlockManager::settle_locked(Lock& lock) {
  std::vector<std::pair<std::size_t, std::size_t>> releases;
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (!budgets_.alive(i)) continue;
    const std::size_t required = required_pages_locked(i, 0, 0);
    const std::size_t held = budgets_.charged_pages(i) - budgets_.releasing_pages(i);
    if (held > required) {
      budgets_.begin_release(i, held - required);
      releases.emplace_back(i, held - required);
    }
  }
  give_back_locked(lock, std::move(releases));
}

void BlockManager::probe_budget_for_pressure(Lock& lock, std::size_t pages) {
  // Ask the budgets anyway: a refusal there is recorded as pressure, which
  // tells the other pools on the device to give their idle reserve back.
  std::vector<std::size_t> probe(budgets_.size(), 0);
  for (std::size_t i = 0; i < budgets_.size(); ++i) probe[i] = budgets_.alive(i) ? pages : 0;
  lock.unlock();
  try {
    if (!budgets_.take(probe)) {
      for (std::size_t i = 0; i < probe.size(); ++i) budgets_.give(i, probe[i]);
    }
  } catch (...) {
  }
  lock.lock();
}

}  // namespace kvcached
