// DeviceRegistry: opening a device's registry and the operations on its table.
#include "kvcached/registry/device_registry.hpp"

#include <unistd.h>

#include <cstring>

#include "kvcached/registry/registry_directory.hpp"
#include "registry_lock.hpp"
#include "registry_open.hpp"
#include "registry_os.hpp"
#include "registry_policy.hpp"
#include "registry_table.hpp"

namespace kvcached {

using registry_detail::EntryRecord;
using registry_detail::RegistryLock;
using registry_detail::Segment;

namespace {
void check_budget_plausible(std::size_t budget_bytes) {
  if (budget_bytes > registry_detail::kMaxPlausibleBytes) {
    throw InvalidArgument("a budget of " + std::to_string(budget_bytes) +
                          " bytes is larger than any device (at most 2^56 bytes)");
  }
}

void check_bytes_plausible(const char* what, std::optional<std::size_t> bytes) {
  if (bytes && *bytes > registry_detail::kMaxPlausibleBytes) {
    throw InvalidArgument(std::string(what) + " of " + std::to_string(*bytes) +
                          " bytes is larger than any device (at most 2^56 bytes)");
  }
}

bool entry_matches(const EntryRecord& entry, const std::variant<std::int64_t, std::string>& name_or_pid) {
  if (std::holds_alternative<std::int64_t>(name_or_pid)) return entry.pid.load() == std::get<std::int64_t>(name_or_pid);
  return std::get<std::string>(name_or_pid) == std::string(entry.name, strnlen(entry.name, sizeof entry.name));
}

std::string entry_name(const EntryRecord& entry) {
  return std::string(entry.name, strnlen(entry.name, sizeof entry.name));
}
}  // namespace

std::string DeviceRegistry::segment_path(const std::string& device) {
  registry_device_kind(device);  // validates
  return registry_detail::registry_path(device);
}

std::shared_ptr<DeviceRegistry> DeviceRegistry::open(const std::string& device, std::optional<std::size_t> budget_bytes,
                                                     const std::string& local_device) {
  registry_device_kind(device);
  validate_local_device(local_device);
  if (budget_bytes) check_budget_plausible(*budget_bytes);
  auto segment = registry_detail::open_or_create_segment(device, budget_bytes);
  return std::shared_ptr<DeviceRegistry>(new DeviceRegistry(device, local_device, std::move(segment)));
}

DeviceRegistry::DeviceRegistry(std::string device, std::string local_device, std::shared_ptr<Segment> segment)
    : device_(std::move(device)), local_device_(std::move(local_device)), segment_(std::move(segment)) {}

const std::string& DeviceRegistry::path() const noexcept { return segment_->path(); }

std::size_t DeviceRegistry::budget_bytes() const {
  segment_->check_attached();
  return segment_->header().budget_bytes.load(std::memory_order_relaxed);
}

void DeviceRegistry::set_budget_bytes(std::size_t budget_bytes) {
  check_budget_plausible(budget_bytes);
  RegistryLock lock(*segment_);
  registry_detail::clean_stale_locked(segment_->layout());  // the dead keep no guarantee
  registry_detail::check_guarantees_fit(registry_detail::total_min_bytes(segment_->layout()), budget_bytes,
                                        "a budget of " + std::to_string(budget_bytes) + " bytes");
  segment_->header().budget_bytes.store(budget_bytes, std::memory_order_relaxed);
  lock.confirm();
}

std::size_t DeviceRegistry::mapped_bytes() const {
  // Summed under the lock: read lock-free, one entry's bytes from before a
  // release could be added to another's from after the acquire they paid for,
  // a total above the budget that never existed.
  RegistryLock lock(*segment_);
  const std::size_t total = registry_detail::total_mapped_bytes(segment_->layout());
  lock.confirm();
  return total;
}

std::size_t DeviceRegistry::weights_bytes() const {
  RegistryLock lock(*segment_);
  const std::size_t total = registry_detail::total_weights_bytes(segment_->layout());
  lock.confirm();
  return total;
}

std::size_t DeviceRegistry::available_bytes() const {
  RegistryLock lock(*segment_);
  const std::size_t held = registry_detail::total_held_bytes(segment_->layout());
  const std::size_t budget = segment_->header().budget_bytes.load(std::memory_order_relaxed);
  lock.confirm();
  return registry_detail::saturating_sub(budget, held);
}

std::vector<RegistryEntryInfo> DeviceRegistry::entries() const {
  std::vector<RegistryEntryInfo> snapshot;
  {
    RegistryLock lock(*segment_);
    for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
      const EntryRecord& entry = segment_->entry(slot);
      if (registry_detail::slot_active(entry))
        snapshot.push_back(registry_detail::entry_info(segment_->layout(), slot));
    }
    lock.confirm();
  }
  // /proc is read outside the lock: liveness is a report here, not a decision.
  for (RegistryEntryInfo& info : snapshot) {
    info.alive = registry_detail::process_alive(info.pid, info.start_time_ticks);
  }
  return snapshot;
}

std::size_t DeviceRegistry::set_limit(const std::variant<std::int64_t, std::string>& name_or_pid,
                                      std::optional<std::size_t> limit_bytes) {
  PolicyChange change;
  change.set_max = true;
  change.max_bytes = limit_bytes;
  return set_policy(name_or_pid, change);
}

std::size_t DeviceRegistry::set_policy(const std::variant<std::int64_t, std::string>& name_or_pid,
                                       const PolicyChange& change) {
  if (change.set_max && change.max_bytes && *change.max_bytes >= registry_detail::kNoLimit) {
    throw InvalidArgument("limit is too large");
  }
  check_bytes_plausible("a min", change.min_bytes);
  if (change.priority) registry_detail::check_priority(*change.priority);
  RegistryLock lock(*segment_);
  registry_detail::Layout& layout = segment_->layout();
  if (change.min_bytes) registry_detail::clean_stale_locked(layout);  // the dead keep no guarantee
  // Checked for every match before anything is written: all or nothing.
  std::vector<std::size_t> matched;
  std::size_t mins = registry_detail::total_min_bytes(layout);
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    const EntryRecord& entry = segment_->entry(slot);
    if (!registry_detail::slot_active(entry) || !entry_matches(entry, name_or_pid)) continue;
    const std::size_t min = change.min_bytes.value_or(registry_detail::min_of(entry));
    const auto max = change.set_max ? change.max_bytes : registry_detail::limit_of(entry);
    registry_detail::check_min_within_max(min, max, entry_name(entry));
    mins = registry_detail::saturating_sub(mins, registry_detail::min_of(entry));
    if (__builtin_add_overflow(mins, min, &mins)) mins = SIZE_MAX;
    matched.push_back(slot);
  }
  if (change.min_bytes) {
    registry_detail::check_guarantees_fit(mins, layout.header.budget_bytes.load(std::memory_order_relaxed),
                                          "a min of " + std::to_string(*change.min_bytes) + " bytes");
  }
  for (const std::size_t slot : matched) {
    EntryRecord& entry = segment_->entry(slot);
    if (change.min_bytes) entry.min_bytes.store(*change.min_bytes, std::memory_order_relaxed);
    if (change.set_max) {
      entry.limit_bytes.store(change.max_bytes ? *change.max_bytes : registry_detail::kNoLimit,
                              std::memory_order_relaxed);
    }
    if (change.priority) entry.priority.store(*change.priority, std::memory_order_relaxed);
  }
  lock.confirm();
  return matched.size();
}

std::size_t DeviceRegistry::clean_stale() {
  RegistryLock lock(*segment_);
  const std::size_t freed = registry_detail::clean_stale_locked(segment_->layout());
  lock.confirm();
  return freed;
}

// The live entry of `name`, this pid (same process start) and local device, if one
// exists: another handle on it, its policy replaced by `policy` (all or nothing).
std::shared_ptr<RegistryBudget> DeviceRegistry::join_locked(registry_detail::Layout& layout, const std::string& name,
                                                            std::int64_t pid, std::uint64_t start_ticks,
                                                            const std::string& local_device,
                                                            const InstancePolicy& policy) {
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    EntryRecord& entry = layout.entries[slot];
    if (!registry_detail::slot_active(entry) || entry.pid.load(std::memory_order_relaxed) != pid ||
        entry.start_time_ticks.load(std::memory_order_relaxed) != start_ticks) {
      continue;
    }
    const RegistryEntryInfo info = registry_detail::entry_info(layout, slot);
    if (info.name != name || info.local_device != local_device) continue;
    std::size_t mins =
        registry_detail::saturating_sub(registry_detail::total_min_bytes(layout), registry_detail::min_of(entry));
    if (__builtin_add_overflow(mins, policy.min_bytes, &mins)) mins = SIZE_MAX;
    registry_detail::check_guarantees_fit(
        mins, layout.header.budget_bytes.load(std::memory_order_relaxed),
        "joining '" + name + "' with a min of " + std::to_string(policy.min_bytes) + " bytes");
    entry.min_bytes.store(policy.min_bytes, std::memory_order_relaxed);
    entry.limit_bytes.store(policy.max_bytes ? *policy.max_bytes : registry_detail::kNoLimit,
                            std::memory_order_relaxed);
    entry.priority.store(policy.priority, std::memory_order_relaxed);
    entry.handles.store(entry.handles.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    const std::uint64_t instance_id = entry.instance_id.load(std::memory_order_relaxed);
    return std::make_shared<RegistryBudget>(segment_, slot, instance_id, name);
  }
  return nullptr;
}

std::shared_ptr<RegistryBudget> DeviceRegistry::register_instance(const std::string& name,
                                                                  std::optional<std::int64_t> pid,
                                                                  const InstancePolicy& policy,
                                                                  std::optional<std::string> local_device, bool join) {
  if (policy.max_bytes && *policy.max_bytes >= registry_detail::kNoLimit) {
    throw InvalidArgument("limit is too large");
  }
  validate_instance_name(name);
  check_bytes_plausible("a min", policy.min_bytes);
  registry_detail::check_priority(policy.priority);
  registry_detail::check_min_within_max(policy.min_bytes, policy.max_bytes, name);
  const std::string seen_as = local_device.value_or(local_device_);
  validate_local_device(seen_as);
  const std::int64_t owner_pid = pid ? *pid : static_cast<std::int64_t>(getpid());
  const auto start_ticks = registry_detail::live_process_start_ticks(owner_pid);
  if (!start_ticks) {
    throw InvalidArgument("pid " + std::to_string(owner_pid) + " is not a running process");
  }
  check_registry_keying(device_);
  RegistryLock lock(*segment_);
  registry_detail::Layout& layout = segment_->layout();
  registry_detail::clean_stale_locked(layout);
  if (join) {
    if (auto joined = join_locked(layout, name, owner_pid, *start_ticks, seen_as, policy)) {
      lock.confirm();
      return joined;
    }
  }
  if (policy.min_bytes > 0) {
    std::size_t mins = registry_detail::total_min_bytes(layout);
    if (__builtin_add_overflow(mins, policy.min_bytes, &mins)) mins = SIZE_MAX;
    registry_detail::check_guarantees_fit(
        mins, layout.header.budget_bytes.load(std::memory_order_relaxed),
        "registering '" + name + "' with a min of " + std::to_string(policy.min_bytes) + " bytes");
  }
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    EntryRecord& entry = segment_->entry(slot);
    if (registry_detail::slot_active(entry)) continue;
    const std::uint64_t instance_id = segment_->header().next_instance_id.fetch_add(1) + 1;
    registry_detail::fill_entry(entry, {instance_id, owner_pid, *start_ticks, geteuid(), policy.max_bytes,
                                        policy.min_bytes, policy.priority, name, seen_as});
    lock.confirm();
    return std::make_shared<RegistryBudget>(segment_, slot, instance_id, name);
  }
  throw RegistryError("registry " + segment_->path() + " is full (" + std::to_string(kRegistryCapacity) +
                      " live instances)");
}

void check_instance_policy(const InstancePolicy& policy) {
  if (policy.max_bytes && *policy.max_bytes >= registry_detail::kNoLimit) {
    throw InvalidArgument("limit is too large");
  }
  check_bytes_plausible("a min", policy.min_bytes);
  registry_detail::check_priority(policy.priority);
  if (policy.max_bytes && policy.min_bytes > *policy.max_bytes) {
    throw InvalidArgument("min_bytes " + std::to_string(policy.min_bytes) + " is above max_bytes " +
                          std::to_string(*policy.max_bytes) + ": a guarantee above the cap could never be used");
  }
}

void DeviceRegistry::hold_lock_for_test() {
  // Leaked on purpose, with the mapping: the lock is never released, and this
  // thread's robust-mutex list points into the mapping for good.
  new std::shared_ptr<Segment>(segment_);
  new RegistryLock(*segment_);
}

}  // namespace kvcached
