// RegistryBudget: one instance's share of the device budget (a MemoryBudget over the registry).
#include <unistd.h>

#include <algorithm>
#include <limits>

#include "kvcached/registry/device_registry.hpp"
#include "registry_lock.hpp"
#include "registry_os.hpp"
#include "registry_policy.hpp"
#include "registry_table.hpp"

namespace kvcached {

using registry_detail::EntryRecord;
using registry_detail::RegistryLock;
using registry_detail::saturating_sub;
using registry_detail::Segment;

RegistryBudget::RegistryBudget(std::shared_ptr<Segment> segment, std::size_t slot, std::uint64_t instance_id,
                               std::string name)
    : segment_(std::move(segment)),
      slot_(slot),
      instance_id_(instance_id),
      name_(std::move(name)),
      creator_pid_(getpid()) {}

RegistryBudget::~RegistryBudget() { unregister(); }

EntryRecord* RegistryBudget::owned_entry() const noexcept {
  if (unregistered_.load() || segment_->detached()) return nullptr;
  EntryRecord& entry = segment_->entry(slot_);
  return registry_detail::owns_entry(entry, instance_id_) ? &entry : nullptr;
}

bool RegistryBudget::registered() const noexcept { return owned_entry() != nullptr; }

bool RegistryBudget::try_acquire(std::size_t bytes) { return take(bytes, /*record_refusal=*/true); }

bool RegistryBudget::try_acquire_for_reserve(std::size_t bytes) { return take(bytes, /*record_refusal=*/false); }

bool RegistryBudget::take(std::size_t bytes, bool record_refusal) {
  if (bytes == 0) return true;
  // Checked after the section (confirm) rather than before: one fstat per page.
  RegistryLock lock(*segment_, registry_detail::LockCheck::attached);
  EntryRecord* entry = owned_entry();
  if (entry == nullptr) {
    lock.confirm();  // a truncated or wiped file also reads as "no entry": say which
    throw BackendUnavailable("registry entry '" + name_ + "' in " + segment_->path() +
                             " is gone (unregistered, or reclaimed because its pid was "
                             "judged dead); register again");
  }
  registry_detail::Layout& layout = segment_->layout();
  // The one lie that would grant rather than refuse: a budget no device has.
  if (layout.header.budget_bytes.load(std::memory_order_relaxed) > registry_detail::kMaxPlausibleBytes) {
    segment_->check_table();
  }
  const std::size_t own_mapped = entry->mapped_bytes.load(std::memory_order_relaxed);
  const auto limit = registry_detail::limit_of(*entry);
  if (limit && bytes > saturating_sub(*limit, own_mapped)) {
    lock.confirm();
    return false;
  }
  const auto device_has_room = [&] {
    return bytes <= registry_detail::room_for(layout, slot_, registry_detail::monotonic_now_ns());
  };
  bool granted = device_has_room();
  if (!granted) {
    const std::int64_t now = registry_detail::monotonic_now_ns();
    const std::int64_t last_scan = layout.header.last_stale_scan_ns.load();
    if (now - last_scan >= registry_detail::kStaleScanIntervalNs && registry_detail::clean_stale_locked(layout) > 0) {
      granted = device_has_room();
    }
  }
  if (!granted) {
    segment_->check_table_locked();  // refused because an entry lies? Say so instead.
    // Only a device-wide refusal is pressure on others; one's own limit is not, nor a
    // request that nothing anybody gives back could ever meet.
    const bool reachable = bytes <= saturating_sub(registry_detail::holding_ceiling(layout, slot_), own_mapped);
    if (record_refusal && reachable) record_refusal_locked(*entry, bytes, /*keep_larger=*/false);
    lock.confirm();
    return false;
  }
  entry->mapped_bytes.store(own_mapped + bytes, std::memory_order_relaxed);
  // A grant covers that much of what was wanted, not all of it: a pool that
  // waits and takes memory as it comes back stays pressure on the others.
  entry->wanted_bytes.store(saturating_sub(entry->wanted_bytes.load(std::memory_order_relaxed), bytes),
                            std::memory_order_relaxed);
  lock.confirm();  // a fault mid-way means nothing was really taken: refuse loudly
  return true;
}

void RegistryBudget::release(std::size_t bytes) noexcept {
  if (bytes == 0) return;
  try {
    // No file check: returning bytes to a file that is gone harms nobody.
    RegistryLock lock(*segment_, registry_detail::LockCheck::attached);
    EntryRecord* entry = owned_entry();
    if (entry == nullptr) return;
    const std::size_t own_mapped = entry->mapped_bytes.load(std::memory_order_relaxed);
    entry->mapped_bytes.store(saturating_sub(own_mapped, bytes), std::memory_order_relaxed);
  } catch (...) {
    // The lock timed out, or the registry is no longer usable: the bytes stay
    // counted, which errs on the safe side (the budget looks fuller than it
    // is) until this process exits.
  }
}

std::size_t RegistryBudget::available_bytes() const {
  const EntryRecord* entry = owned_entry();
  if (entry == nullptr) return 0;
  std::size_t available = registry_detail::room_for(segment_->layout(), slot_, registry_detail::monotonic_now_ns());
  if (const auto limit = registry_detail::limit_of(*entry)) {
    available = std::min(available, saturating_sub(*limit, entry->mapped_bytes.load(std::memory_order_relaxed)));
  }
  return available;
}

void RegistryBudget::check_usable() const {
  if (unregistered_.load()) return;  // unregistered on purpose: nothing to report
  segment_->check_intact(/*check_path=*/false);
  segment_->check_table();
  if (owned_entry() == nullptr) {
    throw BackendUnavailable("registry entry '" + name_ + "' in " + segment_->path() +
                             " is gone (reclaimed because its pid was judged dead); register again");
  }
}

std::optional<std::size_t> RegistryBudget::reachable_bytes() const {
  const EntryRecord* entry = owned_entry();
  if (entry == nullptr) return 0;
  // Read without the lock, like available_bytes: a hint the locked try_acquire confirms.
  return saturating_sub(registry_detail::holding_ceiling(segment_->layout(), slot_),
                        entry->mapped_bytes.load(std::memory_order_relaxed));
}

std::optional<std::size_t> RegistryBudget::external_limit_bytes() const {
  const EntryRecord* entry = owned_entry();
  if (entry == nullptr) return std::nullopt;
  const registry_detail::Layout& layout = segment_->layout();
  std::optional<std::size_t> limit = registry_detail::limit_of(*entry);
  if (const auto target = registry_detail::reclaim_target_of(layout, *entry, registry_detail::monotonic_now_ns())) {
    limit = limit ? std::min(*limit, *target) : *target;
  }
  const std::size_t budget = layout.header.budget_bytes.load(std::memory_order_relaxed);
  const std::size_t total = registry_detail::total_held_bytes(layout);
  if (total > budget) {
    // The KV cache's share: what the others hold and this entry's own weights leave.
    const std::size_t others = total - entry->mapped_bytes.load(std::memory_order_relaxed);
    const std::size_t share = saturating_sub(budget, others);
    limit = limit ? std::min(*limit, share) : share;
  }
  return limit;
}

void RegistryBudget::report_usage(std::size_t used_bytes, std::size_t mapped_bytes) noexcept {
  EntryRecord* entry = owned_entry();
  if (entry == nullptr) return;
  // Display-only fields, each written by its owner alone: no lock needed.
  entry->used_bytes.store(registry_detail::plausible_bytes(used_bytes), std::memory_order_relaxed);
  entry->reported_mapped_bytes.store(registry_detail::plausible_bytes(mapped_bytes), std::memory_order_relaxed);
}

void RegistryBudget::report_worker_errors(std::uint64_t worker_errors) noexcept {
  EntryRecord* entry = owned_entry();
  if (entry != nullptr) entry->worker_errors.store(worker_errors, std::memory_order_relaxed);
}

std::size_t RegistryBudget::pressure_bytes() const noexcept {
  if (segment_->detached()) return 0;
  const std::int64_t now = registry_detail::monotonic_now_ns();
  std::size_t wanted = 0;
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    if (slot == slot_) continue;
    const EntryRecord& entry = segment_->entry(slot);
    if (!registry_detail::slot_active(entry)) continue;
    if (now - entry.wanted_at_ns.load(std::memory_order_relaxed) < registry_detail::kPressureWindowNs) {
      // Read without the lock: a lying entry saturates (the next locked call refuses the file).
      if (__builtin_add_overflow(wanted, entry.wanted_bytes.load(std::memory_order_relaxed), &wanted)) {
        return std::numeric_limits<std::size_t>::max();
      }
    }
  }
  return wanted;
}

void RegistryBudget::record_refusal_locked(EntryRecord& entry, std::size_t bytes, bool keep_larger) noexcept {
  registry_detail::Layout& layout = segment_->layout();
  const std::int64_t now = registry_detail::monotonic_now_ns();
  const bool recent = now - entry.wanted_at_ns.load(std::memory_order_relaxed) < registry_detail::kPressureWindowNs;
  const std::size_t wanted = entry.wanted_bytes.load(std::memory_order_relaxed);
  const std::size_t recorded =
      registry_detail::plausible_bytes(keep_larger && recent ? std::max(wanted, bytes) : bytes);
  entry.wanted_bytes.store(recorded, std::memory_order_relaxed);
  entry.wanted_at_ns.store(now, std::memory_order_relaxed);
  // Others are asked for all that is still missing, not only this call's bytes: a wait
  // renewed with a smaller figure keeps its holders shrinking to the size of the whole.
  const std::size_t room = registry_detail::room_for(layout, slot_, now);
  const std::size_t deficit = saturating_sub(recorded, room);
  // Below its min, what the min still lacks may be asked of anyone (docs/memory-policy.md).
  const std::size_t unclaimed_min =
      saturating_sub(registry_detail::min_of(entry), entry.mapped_bytes.load(std::memory_order_relaxed));
  const registry_detail::ReclaimRequest request{deficit, std::min(deficit, saturating_sub(unclaimed_min, room))};
  registry_detail::ask_others_to_shrink(layout, slot_, request, now);
}

void RegistryBudget::want(std::size_t bytes) noexcept {
  if (bytes == 0 || owned_entry() == nullptr) return;
  try {
    RegistryLock lock(*segment_, registry_detail::LockCheck::attached);
    EntryRecord* entry = owned_entry();
    if (entry == nullptr) return;
    const std::size_t own_mapped = entry->mapped_bytes.load(std::memory_order_relaxed);
    const registry_detail::Layout& layout = segment_->layout();
    // Its own max, or the budget less the others' mins, bounds what anyone could give it. An
    // engine's figure is all that its requests may still need: it waits for the part within
    // reach (asking for nothing because of the rest would leave it short for good).
    bytes = std::min(bytes, saturating_sub(registry_detail::holding_ceiling(layout, slot_), own_mapped));
    if (bytes == 0) return;
    if (bytes <= registry_detail::room_for(layout, slot_, registry_detail::monotonic_now_ns())) return;
    // A recent larger refusal stays what is wanted: this only says the wait goes on.
    record_refusal_locked(*entry, bytes, /*keep_larger=*/true);
  } catch (...) {
    // The lock timed out or the file is no longer usable: the next alloc says so.
  }
}

std::optional<std::size_t> RegistryBudget::limit_bytes() const noexcept {
  const EntryRecord* entry = owned_entry();
  return entry ? registry_detail::limit_of(*entry) : std::nullopt;
}

std::size_t RegistryBudget::min_bytes() const noexcept {
  const EntryRecord* entry = owned_entry();
  return entry ? registry_detail::min_of(*entry) : 0;
}

std::int64_t RegistryBudget::priority() const noexcept {
  const EntryRecord* entry = owned_entry();
  return entry ? registry_detail::priority_of(*entry) : 0;
}

std::optional<std::size_t> RegistryBudget::reclaim_target_bytes() const noexcept {
  const EntryRecord* entry = owned_entry();
  if (entry == nullptr) return std::nullopt;
  return registry_detail::reclaim_target_of(segment_->layout(), *entry, registry_detail::monotonic_now_ns());
}

std::size_t RegistryBudget::mapped_bytes() const noexcept {
  const EntryRecord* entry = owned_entry();
  return entry ? entry->mapped_bytes.load(std::memory_order_relaxed) : 0;
}

void RegistryBudget::unregister() noexcept {
  if (unregistered_ || getpid() != creator_pid_) return;
  try {
    RegistryLock lock(*segment_, registry_detail::LockCheck::file);
    EntryRecord& entry = segment_->entry(slot_);
    if (registry_detail::owns_entry(entry, instance_id_)) {
      const std::uint64_t handles = entry.handles.load(std::memory_order_relaxed);
      if (handles > 1) {
        entry.handles.store(handles - 1, std::memory_order_relaxed);  // another handle keeps the entry
      } else {
        entry.state.store(registry_detail::kSlotFree, std::memory_order_release);
        entry.mapped_bytes.store(0, std::memory_order_relaxed);
        entry.weights_bytes.store(0, std::memory_order_relaxed);
      }
    }
    unregistered_ = true;
  } catch (const RegistryUnusable&) {
    unregistered_ = true;  // nothing of ours is left in a file we no longer use
  } catch (...) {
    // Lock timed out: the entry stays and is reclaimed as stale once this
    // process exits.
  }
}

}  // namespace kvcached
