// The registry's shared-memory format (layout version 4): what every process maps.
//
// One file per device holds a Layout: a header (identity, the process-shared
// robust mutex, the device budget) and a fixed table of instance entries.
// Every mutable field is a lock-free 64-bit atomic: writers hold the mutex,
// hot-path readers read without it. Version 1 differed in the device name
// (31 bytes), had no per-entry local device, uid or worker-error count; it is
// recognised by registry_inspect.cpp, never mapped. Version 2 had no memory policy
// (min, priority, reclaim target) and version 3 no model weights (weights_bytes,
// sleeping): both are refused as another version.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "kvcached/registry/registry_names.hpp"

namespace kvcached::registry_detail {

// "KVCREGST" read as a little-endian integer; says the file is ours.
inline constexpr std::uint64_t kRegistryMagic = 0x545347455243564bULL;
// Bump whenever the layout below changes; other versions are refused, never misread.
inline constexpr std::uint32_t kRegistryLayoutVersion = 4;
// Stored in place of a limit when an instance has none.
inline constexpr std::uint64_t kNoLimit = UINT64_MAX;
inline constexpr std::uint64_t kSlotFree = 0;
inline constexpr std::uint64_t kSlotActive = 1;
// No device has more memory than the largest reservation a KV layout allows
// (2^56 bytes): a budget or byte count above it in the file cannot be true.
inline constexpr std::uint64_t kMaxPlausibleBytes = std::uint64_t{1} << 56;
// More handles on one entry than any engine's processes could hold cannot be true.
inline constexpr std::uint64_t kMaxEntryHandles = std::uint64_t{1} << 20;
// Priorities are stored as 64-bit, accepted as 32-bit: room to grow, none to overflow.
inline constexpr std::int64_t kMinPriority = INT32_MIN;
inline constexpr std::int64_t kMaxPriority = INT32_MAX;
// Times in the table are CLOCK_MONOTONIC readings of the process that wrote them, which on
// one machine (and in one time namespace) every process shares. A time later than the
// reader's own clock by more than this is a lie (a refusal that would never lapse). The
// margin is wide on purpose: a lie within it lasts one second more, while a false alarm
// would make every engine on the device detach.
inline constexpr std::int64_t kClockSkewAllowanceNs = 1'000'000'000;

using Counter = std::atomic<std::uint64_t>;
using SignedCounter = std::atomic<std::int64_t>;
static_assert(Counter::is_always_lock_free, "registry counters must be lock-free in shared memory");
static_assert(SignedCounter::is_always_lock_free);

// One instance's row. `name` and `local_device` are written before `state`
// turns active (release) and never while active.
struct alignas(64) EntryRecord {
  Counter state;
  Counter instance_id;  // unique for the life of the file; slots are reused
  SignedCounter pid;
  Counter start_time_ticks;  // /proc/<pid>/stat field 22: tells a reused pid apart
  Counter owner_uid;         // effective uid of the registering process
  Counter limit_bytes;       // kNoLimit: none
  Counter mapped_bytes;      // taken from the budget: every mapped page
  Counter used_bytes;        // reported by the pool (display only)
  Counter reported_mapped_bytes;
  Counter wanted_bytes;  // last device-wide refusal, less what was granted since; while recent
  SignedCounter wanted_at_ns;
  Counter worker_errors;  // the pool's background worker failures, as reported
  // Memory policy (docs/memory-policy.md): the guaranteed bytes and who gives back first.
  Counter min_bytes;
  SignedCounter priority;  // higher wins
  // Set by a refused higher-priority instance (the requester); kNoLimit: none. In force
  // only while that requester's entry lives, its refusal is recent and its priority is
  // still higher (registry_policy.hpp).
  Counter reclaim_target_bytes;
  Counter reclaim_requester_slot;
  Counter reclaim_requester_id;
  // Model weights charged on this entry (weights/weight_space.hpp): device memory they
  // hold now, beside the KV cache's mapped_bytes, and whether they are asleep (0 / 1).
  Counter weights_bytes;
  Counter sleeping;
  // Handles on this entry (RegistryBudget objects in any process): an engine's weights and
  // its KV cache may register the same rank apart and join one entry; the last one out
  // frees the slot. At least 1 while the slot is active.
  Counter handles;
  char name[kRegistryNameMaxBytes + 1];
  char local_device[kRegistryLocalDeviceMaxBytes + 1];  // e.g. "cuda:1": as its process sees it
};

// The first fields of every layout version, in this order; enough to tell a
// file's version and owner device apart before mapping it.
struct HeaderPrefix {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t capacity;
  std::uint64_t layout_bytes;  // guards against a different pthread ABI or build
};

struct Header {
  HeaderPrefix prefix;
  char device[kRegistryDeviceMaxBytes + 1];
  pthread_mutex_t mutex;
  Counter budget_bytes;
  Counter next_instance_id;
  SignedCounter last_stale_scan_ns;
  SignedCounter lock_owner_pid;  // for the timeout message only
  Counter lock_recoveries;       // times a dead owner's lock was taken over
};

struct Layout {
  Header header;
  EntryRecord entries[kRegistryCapacity];
};

inline constexpr std::size_t kLayoutBytes = sizeof(Layout);

// Builds a fresh layout in `memory` (kLayoutBytes, zeroed): robust mutex,
// budget, device; the magic is written last.
void init_layout(void* memory, const std::string& device, std::size_t budget_bytes);

// Why a file's header does not describe a current registry of `device`;
// nullopt when it does. `header` may be a copy read with pread.
std::optional<std::string> header_mismatch(const Header& header, const std::string& device);

// ---- table rules every caller shares (callers hold the lock to write) ------

inline bool slot_active(const EntryRecord& entry) noexcept {
  return entry.state.load(std::memory_order_acquire) == kSlotActive;
}

inline std::optional<std::size_t> limit_of(const EntryRecord& entry) noexcept {
  const std::uint64_t limit = entry.limit_bytes.load(std::memory_order_relaxed);
  if (limit == kNoLimit) return std::nullopt;
  return static_cast<std::size_t>(limit);
}

inline std::size_t saturating_sub(std::size_t a, std::size_t b) noexcept { return a > b ? a - b : 0; }

// What kvcached itself writes into a byte count: an absurd request (alloc of 2^40 blocks) is
// recorded as the most any device has, never as a value table_lie would refuse the file for.
inline std::size_t plausible_bytes(std::size_t bytes) noexcept {
  return bytes < kMaxPlausibleBytes ? bytes : kMaxPlausibleBytes;
}

// Sum of every active entry's mapped bytes; SIZE_MAX (no room) if the sum
// overflows, so a lock-free reader of a lying table errs on the safe side.
std::size_t total_mapped_bytes(const Layout& layout) noexcept;
// The same for weights_bytes.
std::size_t total_weights_bytes(const Layout& layout) noexcept;
// What an entry holds of the device budget: its KV cache and its weights.
inline std::size_t held_bytes(const EntryRecord& entry) noexcept {
  std::size_t held = 0;
  if (__builtin_add_overflow(entry.mapped_bytes.load(std::memory_order_relaxed),
                             entry.weights_bytes.load(std::memory_order_relaxed), &held)) {
    return SIZE_MAX;
  }
  return held;
}
// Every active entry's KV cache and weights together (saturating).
std::size_t total_held_bytes(const Layout& layout) noexcept;

// The first value in the table that cannot be true on its own (a slot state other than
// free or active, a pid outside pid_t's positive range, a budget or byte count above
// kMaxPlausibleBytes, a priority outside int32, a time in the future or before the clock
// started, a reclaim requester slot beyond the table), described for a message; nullopt
// when none. Never a false alarm, with or without the lock (writers store in-range
// values, an entry's fields before its state), so also read from a private copy.
std::optional<std::string> table_lie(const Layout& layout);

// The first pair of values that contradict each other (a min above the instance's max,
// the mins of the instances awake summing above the budget, a reclaim target asked by its own holder or by an
// instance id never handed out), described for a message; nullopt when none. kvcached
// keeps these relations under the lock but writes their values one at a time, so only a
// reader holding the lock can tell a lie from a change in progress.
std::optional<std::string> table_contradiction(const Layout& layout);

}  // namespace kvcached::registry_detail
