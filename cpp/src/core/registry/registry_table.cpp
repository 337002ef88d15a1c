// Instance table rules: fill, snapshot and reclaim entries.
#include "registry_table.hpp"

#include <cstring>

#include "registry_os.hpp"
#include "registry_policy.hpp"

namespace kvcached::registry_detail {

namespace {
std::string inline_text(const char* text, std::size_t capacity) { return std::string(text, strnlen(text, capacity)); }
}  // namespace

void fill_entry(EntryRecord& entry, const NewEntry& values) {
  entry.instance_id.store(values.instance_id);
  entry.pid.store(values.pid);
  entry.start_time_ticks.store(values.start_time_ticks);
  entry.owner_uid.store(values.uid);
  entry.limit_bytes.store(values.limit_bytes ? *values.limit_bytes : kNoLimit);
  entry.mapped_bytes.store(0);
  entry.used_bytes.store(0);
  entry.reported_mapped_bytes.store(0);
  entry.wanted_bytes.store(0);
  entry.wanted_at_ns.store(0);
  entry.worker_errors.store(0);
  entry.min_bytes.store(values.min_bytes);
  entry.priority.store(values.priority);
  entry.reclaim_target_bytes.store(kNoLimit);
  entry.reclaim_requester_slot.store(0);
  entry.reclaim_requester_id.store(0);
  entry.weights_bytes.store(0);
  entry.sleeping.store(0);
  entry.handles.store(1);
  std::memset(entry.name, 0, sizeof entry.name);
  std::memcpy(entry.name, values.name.data(), values.name.size());
  std::memset(entry.local_device, 0, sizeof entry.local_device);
  std::memcpy(entry.local_device, values.local_device.data(), values.local_device.size());
  entry.state.store(kSlotActive, std::memory_order_release);  // publish last
}

RegistryEntryInfo entry_info(const Layout& layout, std::size_t slot) {
  const EntryRecord& entry = layout.entries[slot];
  const std::int64_t now = monotonic_now_ns();
  RegistryEntryInfo info;
  info.slot = slot;
  info.instance_id = entry.instance_id.load();
  info.name = inline_text(entry.name, sizeof entry.name);
  info.local_device = inline_text(entry.local_device, sizeof entry.local_device);
  info.pid = entry.pid.load();
  info.start_time_ticks = entry.start_time_ticks.load();
  info.uid = entry.owner_uid.load();
  info.limit_bytes = limit_of(entry);
  info.mapped_bytes = entry.mapped_bytes.load();
  info.used_bytes = entry.used_bytes.load();
  info.reserved_bytes = saturating_sub(entry.reported_mapped_bytes.load(), info.used_bytes);
  const bool wanted_recently = now - entry.wanted_at_ns.load() < kPressureWindowNs;
  info.wanted_bytes = wanted_recently ? entry.wanted_bytes.load() : 0;
  info.worker_errors = entry.worker_errors.load();
  info.min_bytes = min_of(entry);
  info.priority = priority_of(entry);
  info.reclaim_target_bytes = reclaim_target_of(layout, entry, now);
  info.weights_bytes = entry.weights_bytes.load();
  info.sleeping = entry.sleeping.load() != 0;
  return info;
}

std::size_t clean_stale_locked(Layout& layout) {
  std::size_t freed = 0;
  for (EntryRecord& entry : layout.entries) {
    if (!slot_active(entry)) continue;
    if (process_alive(entry.pid.load(std::memory_order_relaxed),
                      entry.start_time_ticks.load(std::memory_order_relaxed))) {
      continue;
    }
    // The owner is gone, so are its mappings: its bytes go back to the budget.
    entry.state.store(kSlotFree, std::memory_order_release);
    entry.mapped_bytes.store(0, std::memory_order_relaxed);
    entry.weights_bytes.store(0, std::memory_order_relaxed);
    ++freed;
  }
  layout.header.last_stale_scan_ns.store(monotonic_now_ns(), std::memory_order_relaxed);
  return freed;
}

}  // namespace kvcached::registry_detail
