// The memory policy's arithmetic over the instance table: guarantees (min) and priority reclaim.
//
// Rationale. A shared budget alone lets whoever asks first take everything. The policy
// adds three numbers per instance: `min` (bytes it can always get back to), `max` (its
// limit) and `priority` (higher wins when memory is short).
//
// Approach. Every decision is made under the registry lock from the table alone, so it
// holds across processes. (1) Guarantee: an instance is granted only what leaves room for
// what the other instances may still claim under their min (sum of max(0, min - mapped)),
// and for what a higher-priority instance was recently refused. (2) Reclaim: an instance
// refused for lack of room writes a *reclaim target* into the entries of lower-priority
// instances (lowest priority first, their free mapped memory before their used memory,
// never below their min), and, for what its own min is still owed, into the entries of
// any other instance; each pool reads it as an external limit and shrinks as it does for
// `kvctl set-limit`. A requester's every refusal (and want()) asks for all it still lacks,
// replacing its own earlier targets. (3) A target is in force only while its requester's
// entry lives and its last refusal or want() is recent (kPressureWindowNs), grants since
// notwithstanding: nobody else clears it, so a requester that stopped asking (it got its
// memory, gave up or died) cannot leave a shrink in force for more than that window.
//
// Limitations. A target is a request, not a revocation: a busy engine shrinks as fast as
// it can free blocks (cached prefixes first, then preemption). Liveness of a requester is
// its table entry; a dead requester's entry lapses with its refusal's recency (1 s) or
// when the stale scan frees the slot, whichever comes first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "registry_format.hpp"

namespace kvcached::registry_detail {

inline std::size_t min_of(const EntryRecord& entry) noexcept {
  return static_cast<std::size_t>(entry.min_bytes.load(std::memory_order_relaxed));
}

inline std::int64_t priority_of(const EntryRecord& entry) noexcept {
  return entry.priority.load(std::memory_order_relaxed);
}

// What `slot` may take now: the budget less every held byte (KV and weights), less what the other
// instances' min may still claim (a sleeping instance's claims nothing: docs/sleep.md), less what higher-priority
// instances were recently refused, though never less than what remains of its own min (a guarantee outranks a
// priority). Saturates at 0 (and at "no room" for a table whose sums overflow).
std::size_t room_for(const Layout& layout, std::size_t slot, std::int64_t now_ns) noexcept;

// What model weights charged on `slot` may take now: as room_for, weights counted as held,
// but with no exemption for its own min (a min guarantees KV memory, which the weights
// must leave free) and what higher priorities wait for always set aside.
std::size_t room_for_weights(const Layout& layout, std::size_t slot, std::int64_t now_ns) noexcept;

// The reclaim target in force on `entry` (never below its min), or nullopt: none was
// set, or its requester's entry is gone, its last refusal or want() is no longer recent,
// or it no longer has a claim on this instance (a higher priority, or a min it has not
// reached yet).
std::optional<std::size_t> reclaim_target_of(const Layout& layout, const EntryRecord& entry,
                                             std::int64_t now_ns) noexcept;

// The most `slot` could ever hold while the table stays as it is: its max, and the budget
// less what every other awake instance is guaranteed (the sum of their mins) and every
// model's weights awake. A request that
// would take it beyond this waits for nothing: it is refused at once and asks nobody.
std::size_t holding_ceiling(const Layout& layout, std::size_t slot) noexcept;

// What `requester_slot` asks of others after being refused for want of `deficit_bytes`,
// of which `guaranteed_bytes` (at most the deficit) it is owed by its min.
struct ReclaimRequest {
  std::size_t deficit_bytes;
  std::size_t guaranteed_bytes;
};

// Gives other instances reclaim targets covering the request as far as their surplus
// above their own min allows. Lower priorities cover the whole deficit: free mapped memory
// (reported) first, from every lower priority, then used memory, lowest priority first.
// Instances of equal or higher priority cover only what the requester's min is still owed
// beyond that, in the same order: a min is there to be claimed whoever holds it. The
// request replaces the requester's own earlier targets (ending those it no longer needs);
// another requester's tighter target already in force stays. Returns the bytes asked for.
std::size_t ask_others_to_shrink(Layout& layout, std::size_t requester_slot, const ReclaimRequest& request,
                                 std::int64_t now_ns) noexcept;

// Sum of the mins of the active entries that are awake (saturating): a sleeping one claims none.
std::size_t total_min_bytes(const Layout& layout) noexcept;

// InvalidArgument unless mins summing to `mins_bytes` fit `budget_bytes`; `what` says
// which change was asked ("registering 'a' with min 2 GiB").
void check_guarantees_fit(std::size_t mins_bytes, std::size_t budget_bytes, const std::string& what);

// InvalidArgument unless `priority` is within [kMinPriority, kMaxPriority].
void check_priority(std::int64_t priority);

// InvalidArgument unless min <= max (when there is a max).
void check_min_within_max(std::size_t min_bytes, std::optional<std::size_t> max_bytes, const std::string& name);

}  // namespace kvcached::registry_detail
