// Building and checking the registry layout (registry_format.hpp).
#include "registry_format.hpp"

#include <cstddef>
#include <cstring>
#include <limits>
#include <new>

#include "kvcached/registry/registry_directory.hpp"
#include "registry_os.hpp"

namespace kvcached::registry_detail {

void init_layout(void* memory, const std::string& device, std::size_t budget_bytes) {
  Layout* layout = new (memory) Layout();
  Header& header = layout->header;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  // Relocking from the owning thread is an error (EDEADLK), not a silent hang.
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
  const int rc = pthread_mutex_init(&header.mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) throw_os_error("pthread_mutex_init", rc);
  header.prefix.version = kRegistryLayoutVersion;
  header.prefix.capacity = kRegistryCapacity;
  header.prefix.layout_bytes = kLayoutBytes;
  std::strncpy(header.device, device.c_str(), kRegistryDeviceMaxBytes);
  header.budget_bytes.store(budget_bytes);
  std::atomic_thread_fence(std::memory_order_release);
  header.prefix.magic = kRegistryMagic;
}

std::optional<std::string> header_mismatch(const Header& header, const std::string& device) {
  const HeaderPrefix& prefix = header.prefix;
  if (prefix.magic != kRegistryMagic) return "is not a kvcached registry";
  if (prefix.version != kRegistryLayoutVersion) {
    return "has layout version " + std::to_string(prefix.version) + ", expected " +
           std::to_string(kRegistryLayoutVersion);
  }
  if (prefix.capacity != kRegistryCapacity || prefix.layout_bytes != kLayoutBytes) {
    return "has a different table size (made by another kvcached build)";
  }
  // Compared in place: this runs on every locked operation.
  const std::size_t owner_bytes = strnlen(header.device, sizeof header.device);
  if (owner_bytes != device.size() || std::memcmp(header.device, device.data(), owner_bytes) != 0) {
    return "belongs to device '" + std::string(header.device, owner_bytes) + "'";
  }
  return std::nullopt;
}

std::size_t total_mapped_bytes(const Layout& layout) noexcept {
  std::size_t total = 0;
  for (const EntryRecord& entry : layout.entries) {
    if (!slot_active(entry)) continue;
    if (__builtin_add_overflow(total, entry.mapped_bytes.load(std::memory_order_relaxed), &total)) {
      return std::numeric_limits<std::size_t>::max();
    }
  }
  return total;
}

std::size_t total_weights_bytes(const Layout& layout) noexcept {
  std::size_t total = 0;
  for (const EntryRecord& entry : layout.entries) {
    if (!slot_active(entry)) continue;
    if (__builtin_add_overflow(total, entry.weights_bytes.load(std::memory_order_relaxed), &total)) {
      return std::numeric_limits<std::size_t>::max();
    }
  }
  return total;
}

std::size_t total_held_bytes(const Layout& layout) noexcept {
  std::size_t total = 0;
  if (__builtin_add_overflow(total_mapped_bytes(layout), total_weights_bytes(layout), &total)) {
    return std::numeric_limits<std::size_t>::max();
  }
  return total;
}

namespace {

constexpr std::size_t kHeaderSlot = kRegistryCapacity;

// The latest time the table holds, and where (a slot's wanted_at_ns, or the header's last
// stale scan), compared with the clock once; no string is built unless it lies.
struct LatestTime {
  std::int64_t ns = 0;
  std::size_t slot = kHeaderSlot;
  void see(std::int64_t time_ns, std::size_t where) {
    if (time_ns > ns) ns = time_ns, slot = where;
  }
  std::string describe(std::int64_t now_ns) const {
    const std::string field =
        slot == kHeaderSlot ? "last_stale_scan_ns " : "slot " + std::to_string(slot) + ": wanted_at_ns ";
    return field + std::to_string(ns) + ", " + std::to_string((ns - now_ns) / 1'000'000) + " ms in the future";
  }
};

std::optional<std::string> entry_lie(const EntryRecord& entry, std::size_t slot, LatestTime& latest) {
  const std::uint64_t state = entry.state.load(std::memory_order_acquire);
  if (state != kSlotFree && state != kSlotActive) return "state " + std::to_string(state);
  if (state != kSlotActive) return std::nullopt;
  const std::int64_t pid = entry.pid.load(std::memory_order_relaxed);
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return "pid " + std::to_string(pid);
  const std::pair<const char*, const Counter*> counts[] = {
      {"mapped_bytes", &entry.mapped_bytes},
      {"used_bytes", &entry.used_bytes},
      {"reported mapped_bytes", &entry.reported_mapped_bytes},
      {"wanted_bytes", &entry.wanted_bytes},
      {"min_bytes", &entry.min_bytes},
      {"weights_bytes", &entry.weights_bytes},
  };
  for (const auto& [field, counter] : counts) {
    const std::uint64_t bytes = counter->load(std::memory_order_relaxed);
    if (bytes > kMaxPlausibleBytes) return std::string(field) + " " + std::to_string(bytes);
  }
  const std::uint64_t sleeping = entry.sleeping.load(std::memory_order_relaxed);
  if (sleeping > 1) return "sleeping " + std::to_string(sleeping);
  const std::uint64_t handles = entry.handles.load(std::memory_order_relaxed);
  if (handles == 0 || handles > kMaxEntryHandles) return "handles " + std::to_string(handles);
  const std::int64_t priority = entry.priority.load(std::memory_order_relaxed);
  if (priority < kMinPriority || priority > kMaxPriority) return "priority " + std::to_string(priority);
  const std::int64_t wanted_at = entry.wanted_at_ns.load(std::memory_order_relaxed);
  if (wanted_at < 0) return "wanted_at_ns " + std::to_string(wanted_at);
  latest.see(wanted_at, slot);
  const std::uint64_t target = entry.reclaim_target_bytes.load(std::memory_order_relaxed);
  if (target != kNoLimit && target > kMaxPlausibleBytes) return "reclaim_target_bytes " + std::to_string(target);
  const std::uint64_t requester = entry.reclaim_requester_slot.load(std::memory_order_relaxed);
  if (requester >= kRegistryCapacity) return "reclaim_requester_slot " + std::to_string(requester);
  return std::nullopt;
}

std::string bytes_words(std::uint64_t bytes) { return std::to_string(bytes) + " bytes"; }

}  // namespace

std::optional<std::string> table_lie(const Layout& layout) {
  const std::uint64_t budget = layout.header.budget_bytes.load(std::memory_order_relaxed);
  if (budget > kMaxPlausibleBytes) return "budget_bytes " + std::to_string(budget);
  LatestTime latest;
  const std::int64_t last_scan = layout.header.last_stale_scan_ns.load(std::memory_order_relaxed);
  if (last_scan < 0) return "last_stale_scan_ns " + std::to_string(last_scan);
  latest.see(last_scan, kHeaderSlot);
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    if (auto lie = entry_lie(layout.entries[slot], slot, latest)) return "slot " + std::to_string(slot) + ": " + *lie;
  }
  // The clock is read after every time in the table: whatever a writer stored before is not later.
  const std::int64_t now = monotonic_now_ns();
  if (latest.ns > now && latest.ns - now > kClockSkewAllowanceNs) return latest.describe(now);
  return std::nullopt;
}

std::optional<std::string> table_contradiction(const Layout& layout) {
  const std::uint64_t issued_ids = layout.header.next_instance_id.load(std::memory_order_relaxed);
  std::uint64_t mins = 0;
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    const EntryRecord& entry = layout.entries[slot];
    if (!slot_active(entry)) continue;
    const auto where = [slot] { return "slot " + std::to_string(slot) + ": "; };
    const std::uint64_t id = entry.instance_id.load(std::memory_order_relaxed);
    if (id == 0 || id > issued_ids) {
      return where() + "instance_id " + std::to_string(id) + ", never handed out (the last was " +
             std::to_string(issued_ids) + ")";
    }
    const std::uint64_t min = entry.min_bytes.load(std::memory_order_relaxed);
    const std::uint64_t limit = entry.limit_bytes.load(std::memory_order_relaxed);
    if (limit != kNoLimit && min > limit) {
      return where() + "min_bytes " + std::to_string(min) + " above its limit of " + bytes_words(limit);
    }
    const bool asleep = entry.sleeping.load(std::memory_order_relaxed) != 0;  // claims no min
    if (!asleep && __builtin_add_overflow(mins, min, &mins)) mins = std::numeric_limits<std::uint64_t>::max();
    if (entry.reclaim_target_bytes.load(std::memory_order_relaxed) == kNoLimit) continue;
    const std::uint64_t requester = entry.reclaim_requester_slot.load(std::memory_order_relaxed);
    const std::uint64_t requester_id = entry.reclaim_requester_id.load(std::memory_order_relaxed);
    if (requester == slot) return where() + "a reclaim target asked by itself";
    if (requester_id == 0 || requester_id > issued_ids) {
      return where() + "a reclaim target asked by instance " + std::to_string(requester_id) +
             ", never handed out (the last was " + std::to_string(issued_ids) + ")";
    }
  }
  const std::uint64_t budget = layout.header.budget_bytes.load(std::memory_order_relaxed);
  if (mins > budget) return "mins summing to " + bytes_words(mins) + ", above the budget of " + bytes_words(budget);
  return std::nullopt;
}

}  // namespace kvcached::registry_detail

namespace kvcached {

std::vector<std::pair<std::string, std::size_t>> registry_layout_offsets() {
  using registry_detail::EntryRecord;
  using registry_detail::Header;
  using registry_detail::Layout;
  // offsetof on these standard-layout-in-practice types: what the bytes are.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
  return {
      {"layout_bytes", sizeof(Layout)},
      {"header.magic", offsetof(Header, prefix.magic)},
      {"header.version", offsetof(Header, prefix.version)},
      {"header.device", offsetof(Header, device)},
      {"header.budget_bytes", offsetof(Header, budget_bytes)},
      {"entries", offsetof(Layout, entries)},
      {"entry_bytes", sizeof(EntryRecord)},
      {"entry.state", offsetof(EntryRecord, state)},
      {"entry.pid", offsetof(EntryRecord, pid)},
      {"entry.start_time_ticks", offsetof(EntryRecord, start_time_ticks)},
      {"entry.mapped_bytes", offsetof(EntryRecord, mapped_bytes)},
      {"entry.name", offsetof(EntryRecord, name)},
      {"entry.local_device", offsetof(EntryRecord, local_device)},
      {"header.next_instance_id", offsetof(Header, next_instance_id)},
      {"header.last_stale_scan_ns", offsetof(Header, last_stale_scan_ns)},
      {"entry.instance_id", offsetof(EntryRecord, instance_id)},
      {"entry.limit_bytes", offsetof(EntryRecord, limit_bytes)},
      {"entry.wanted_bytes", offsetof(EntryRecord, wanted_bytes)},
      {"entry.wanted_at_ns", offsetof(EntryRecord, wanted_at_ns)},
      {"entry.min_bytes", offsetof(EntryRecord, min_bytes)},
      {"entry.priority", offsetof(EntryRecord, priority)},
      {"entry.reclaim_target_bytes", offsetof(EntryRecord, reclaim_target_bytes)},
      {"entry.weights_bytes", offsetof(EntryRecord, weights_bytes)},
      {"entry.sleeping", offsetof(EntryRecord, sleeping)},
      {"entry.handles", offsetof(EntryRecord, handles)},
      {"entry.reclaim_requester_slot", offsetof(EntryRecord, reclaim_requester_slot)},
      {"entry.reclaim_requester_id", offsetof(EntryRecord, reclaim_requester_id)},
  };
#pragma GCC diagnostic pop
}

}  // namespace kvcached
