// The memory policy's arithmetic (registry_policy.hpp): room, reclaim targets, guarantee checks.
#include "registry_policy.hpp"

#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <vector>

#include "kvcached/error.hpp"
#include "registry_table.hpp"

namespace kvcached::registry_detail {

namespace {

// Its last refusal or want() is recent: it still waits, whatever it was granted since.
bool asked_recently(const EntryRecord& entry, std::int64_t now_ns) noexcept {
  return now_ns - entry.wanted_at_ns.load(std::memory_order_relaxed) < kPressureWindowNs;
}

bool refused_recently(const EntryRecord& entry, std::int64_t now_ns) noexcept {
  return entry.wanted_bytes.load(std::memory_order_relaxed) > 0 && asked_recently(entry, now_ns);
}

// "3221225472 bytes (3072 MiB)": exact for scripts, readable for people.
std::string bytes_text(std::size_t bytes) {
  return std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 20) + " MiB)";
}

// Below its min: what it is owed may be claimed from anyone (docs/memory-policy.md).
bool below_min(const EntryRecord& entry) noexcept {
  return entry.mapped_bytes.load(std::memory_order_relaxed) < min_of(entry);
}

constexpr std::size_t kNotAsked = std::numeric_limits<std::size_t>::max();

struct Candidate {
  std::size_t slot;
  std::int64_t priority;
  std::size_t mapped;
  std::size_t free;     // mapped but holding no block in use, as the pool reported
  std::size_t surplus;  // above its min
  std::size_t take = 0;
};

// Spreads `bytes` over the candidates, never beyond one's surplus: memory nobody uses
// first (an idle holder's), from all of them, then used memory, lowest priority first.
// Returns how much of it they cover.
std::size_t share_out(std::vector<Candidate>& candidates, std::size_t bytes) {
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.priority != b.priority ? a.priority < b.priority : a.free > b.free;
  });
  std::size_t remaining = bytes;
  for (Candidate& c : candidates) {
    const std::size_t take = std::min(c.free, remaining);
    c.take += take, remaining -= take;
  }
  for (Candidate& c : candidates) {
    const std::size_t take = std::min(c.surplus - c.take, remaining);
    c.take += take, remaining -= take;
  }
  return bytes - remaining;
}

}  // namespace

namespace {

// The terms of room_for: the budget beyond what is held and what others' mins may
// still claim, what higher priorities wait for, and the slot's own unclaimed min.
struct RoomTerms {
  std::size_t beyond_guarantees = 0;
  std::size_t waiting = 0;
  std::size_t own_unclaimed = 0;
};

RoomTerms room_terms(const Layout& layout, std::size_t slot, std::int64_t now_ns) noexcept {
  const EntryRecord& own = layout.entries[slot];
  const std::int64_t own_priority = priority_of(own);
  std::size_t guaranteed = 0;  // held by all (KV and weights), plus what the others' min may still claim
  std::size_t waiting = 0;     // recently refused to higher priorities
  for (std::size_t other = 0; other < kRegistryCapacity; ++other) {
    const EntryRecord& entry = layout.entries[other];
    if (!slot_active(entry)) continue;
    const std::size_t mapped = entry.mapped_bytes.load(std::memory_order_relaxed);
    // A sleeping instance claims nothing until it wakes (its wake is a request like any other).
    const bool asleep = entry.sleeping.load(std::memory_order_relaxed) != 0;
    const std::size_t claim = other == slot || asleep ? 0 : saturating_sub(min_of(entry), mapped);
    if (__builtin_add_overflow(guaranteed, held_bytes(entry), &guaranteed) ||
        __builtin_add_overflow(guaranteed, claim, &guaranteed)) {
      return {};
    }
    if (other != slot && priority_of(entry) > own_priority && refused_recently(entry, now_ns)) {
      if (__builtin_add_overflow(waiting, entry.wanted_bytes.load(std::memory_order_relaxed), &waiting)) {
        waiting = std::numeric_limits<std::size_t>::max();
      }
    }
  }
  const std::size_t budget = plausible_bytes(layout.header.budget_bytes.load(std::memory_order_relaxed));
  return {saturating_sub(budget, guaranteed), waiting,
          saturating_sub(min_of(own), own.mapped_bytes.load(std::memory_order_relaxed))};
}

}  // namespace

std::size_t room_for(const Layout& layout, std::size_t slot, std::int64_t now_ns) noexcept {
  const RoomTerms terms = room_terms(layout, slot, now_ns);
  // What a higher priority waits for is set aside, except this instance's own unclaimed
  // min: a guarantee outranks every priority.
  return std::max(saturating_sub(terms.beyond_guarantees, terms.waiting),
                  std::min(terms.beyond_guarantees, terms.own_unclaimed));
}

std::size_t room_for_weights(const Layout& layout, std::size_t slot, std::int64_t now_ns) noexcept {
  const RoomTerms terms = room_terms(layout, slot, now_ns);
  // A min guarantees KV memory: the weights leave the instance's own unclaimed min free too.
  return saturating_sub(saturating_sub(terms.beyond_guarantees, terms.own_unclaimed), terms.waiting);
}

std::optional<std::size_t> reclaim_target_of(const Layout& layout, const EntryRecord& entry,
                                             std::int64_t now_ns) noexcept {
  const std::uint64_t target = entry.reclaim_target_bytes.load(std::memory_order_relaxed);
  if (target == kNoLimit) return std::nullopt;
  const std::uint64_t requester_slot = entry.reclaim_requester_slot.load(std::memory_order_relaxed);
  if (requester_slot >= kRegistryCapacity) return std::nullopt;
  const EntryRecord& requester = layout.entries[requester_slot];
  if (&requester == &entry) return std::nullopt;  // nobody asks itself (a lie: table_contradiction)
  if (!owns_entry(requester, entry.reclaim_requester_id.load(std::memory_order_relaxed))) return std::nullopt;
  // Kept while the requester asks, even once grants covered what it asked last: an engine
  // asks a little at a time, and a holder that grew back in between would undo the shrink.
  if (!asked_recently(requester, now_ns)) return std::nullopt;
  // Priorities or mins changed since, or the requester reached its min: no claim is left.
  const bool outranks = priority_of(requester) > priority_of(entry);
  if (!outranks && !below_min(requester)) return std::nullopt;
  return std::max<std::size_t>(target, min_of(entry));
}

std::size_t holding_ceiling(const Layout& layout, std::size_t slot) noexcept {
  std::size_t others_mins = 0;
  for (std::size_t other = 0; other < kRegistryCapacity; ++other) {
    const EntryRecord& entry = layout.entries[other];
    if (other == slot || !slot_active(entry)) continue;
    if (entry.sleeping.load(std::memory_order_relaxed) != 0) continue;  // asleep, it claims nothing
    if (__builtin_add_overflow(others_mins, min_of(entry), &others_mins)) return 0;
  }
  // Model weights awake are given back only by a sleep, which no KV shrink asks for.
  const std::size_t weights = total_weights_bytes(layout);
  const std::size_t budget = plausible_bytes(layout.header.budget_bytes.load(std::memory_order_relaxed));
  const std::size_t ceiling = saturating_sub(saturating_sub(budget, others_mins), weights);
  const auto limit = limit_of(layout.entries[slot]);
  return limit ? std::min(ceiling, *limit) : ceiling;
}

std::size_t ask_others_to_shrink(Layout& layout, std::size_t requester_slot, const ReclaimRequest& request,
                                 std::int64_t now_ns) noexcept {
  const EntryRecord& requester = layout.entries[requester_slot];
  const std::int64_t requester_priority = priority_of(requester);
  std::vector<Candidate> lower, others;  // others: equal or higher priority, asked for a min only
  try {
    for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
      const EntryRecord& entry = layout.entries[slot];
      if (slot == requester_slot || !slot_active(entry)) continue;
      const std::size_t mapped = entry.mapped_bytes.load(std::memory_order_relaxed);
      const std::size_t surplus = saturating_sub(mapped, min_of(entry));
      if (surplus == 0) continue;
      const std::size_t free = saturating_sub(entry.reported_mapped_bytes.load(std::memory_order_relaxed),
                                              entry.used_bytes.load(std::memory_order_relaxed));
      const Candidate candidate{slot, priority_of(entry), mapped, std::min(free, surplus), surplus};
      (candidate.priority < requester_priority ? lower : others).push_back(candidate);
    }
  } catch (...) {
    return 0;  // no memory for the lists: the refusal stands as plain pressure
  }
  const std::size_t from_lower = share_out(lower, request.deficit_bytes);
  const std::size_t owed = saturating_sub(std::min(request.guaranteed_bytes, request.deficit_bytes), from_lower);
  const std::size_t from_others = share_out(others, owed);
  std::array<std::size_t, kRegistryCapacity> asked;  // what each instance is asked to shrink to now
  asked.fill(kNotAsked);
  for (const std::vector<Candidate>* group : {&lower, &others}) {
    for (const Candidate& c : *group) {
      if (c.take > 0) asked[c.slot] = c.mapped - c.take;
    }
  }
  const std::uint64_t requester_id = requester.instance_id.load(std::memory_order_relaxed);
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    EntryRecord& entry = layout.entries[slot];
    if (slot == requester_slot || !slot_active(entry)) continue;
    // This ask says all the requester still lacks: it replaces the requester's own earlier
    // targets, tighter or looser, and ends those it no longer needs (else a target written
    // for an old request would come back into force with the next refusal).
    const bool ours = entry.reclaim_target_bytes.load(std::memory_order_relaxed) != kNoLimit &&
                      entry.reclaim_requester_slot.load(std::memory_order_relaxed) == requester_slot &&
                      entry.reclaim_requester_id.load(std::memory_order_relaxed) == requester_id;
    if (asked[slot] == kNotAsked) {
      if (ours) entry.reclaim_target_bytes.store(kNoLimit, std::memory_order_release);
      continue;
    }
    const auto in_force = reclaim_target_of(layout, entry, now_ns);
    if (!ours && in_force && *in_force <= asked[slot]) continue;  // another's tighter shrink stays
    // Requester first, target last: a lock-free reader never pairs a new target with
    // an old requester for long, and both are checked again on every read.
    entry.reclaim_requester_slot.store(requester_slot, std::memory_order_relaxed);
    entry.reclaim_requester_id.store(requester_id, std::memory_order_relaxed);
    entry.reclaim_target_bytes.store(asked[slot], std::memory_order_release);
  }
  return from_lower + from_others;
}

std::size_t total_min_bytes(const Layout& layout) noexcept {
  std::size_t total = 0;
  for (const EntryRecord& entry : layout.entries) {
    // Asleep, an instance claims no min; its wake takes its weights only where its min fits too
    // (room_for_weights), so the mins of the instances awake always fit the budget.
    if (!slot_active(entry) || entry.sleeping.load(std::memory_order_relaxed) != 0) continue;
    if (__builtin_add_overflow(total, min_of(entry), &total)) return std::numeric_limits<std::size_t>::max();
  }
  return total;
}

void check_guarantees_fit(std::size_t mins_bytes, std::size_t budget_bytes, const std::string& what) {
  if (mins_bytes <= budget_bytes) return;
  throw InvalidArgument(what +
                        " is refused: the guaranteed minimums (min) of the instances on this device would "
                        "sum to " +
                        bytes_text(mins_bytes) + ", above the device budget of " + bytes_text(budget_bytes) +
                        ". Lower a min (kvctl set-policy TARGET --min SIZE) or raise the budget "
                        "(kvctl set-budget SIZE)");
}

void check_priority(std::int64_t priority) {
  if (priority < kMinPriority || priority > kMaxPriority) {
    throw InvalidArgument("priority " + std::to_string(priority) + " is out of range: expected a whole number from " +
                          std::to_string(kMinPriority) + " to " + std::to_string(kMaxPriority));
  }
}

void check_min_within_max(std::size_t min_bytes, std::optional<std::size_t> max_bytes, const std::string& name) {
  if (max_bytes && min_bytes > *max_bytes) {
    throw InvalidArgument("instance '" + name + "': min " + bytes_text(min_bytes) + " is above its max (limit) " +
                          bytes_text(*max_bytes) + "; a guarantee above the cap could never be used");
  }
}

}  // namespace kvcached::registry_detail
