// The instance table's rules: filling, reading and reclaiming entries (callers hold the lock to write).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "kvcached/registry/device_registry.hpp"
#include "registry_format.hpp"

namespace kvcached::registry_detail {

// How often a refused try_acquire may rescan /proc for dead owners, so a pool
// hammering a full budget does not read 64 files per page.
inline constexpr std::int64_t kStaleScanIntervalNs = 100'000'000;
// How long a refused request counts as pressure on the other instances.
inline constexpr std::int64_t kPressureWindowNs = 1'000'000'000;

struct NewEntry {
  std::uint64_t instance_id;
  std::int64_t pid;
  std::uint64_t start_time_ticks;
  std::uint64_t uid;
  std::optional<std::size_t> limit_bytes;
  std::size_t min_bytes;
  std::int64_t priority;
  const std::string& name;
  const std::string& local_device;
};

// Fills a free slot and publishes it (state turns active last).
void fill_entry(EntryRecord& entry, const NewEntry& values);

// A snapshot of one active entry (alive is left false: /proc is read outside the lock).
RegistryEntryInfo entry_info(const Layout& layout, std::size_t slot);

// Frees the entries of dead processes (their bytes return to the budget);
// returns how many. Records the scan time for try_acquire's rate limit.
std::size_t clean_stale_locked(Layout& layout);

// The entry is active and still the one created with `instance_id` (slots are reused).
inline bool owns_entry(const EntryRecord& entry, std::uint64_t instance_id) noexcept {
  return slot_active(entry) && entry.instance_id.load() == instance_id;
}

}  // namespace kvcached::registry_detail
