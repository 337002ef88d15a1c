// Model weights on a registry entry: RegistryBudget::weights_budget() charges them beside the KV cache.
//
// Weights share the device budget with every KV cache: waking a model takes all of its
// weight bytes at once, under the registry lock, if the budget has room once what others
// hold, what their mins may still claim, the model's own unclaimed min and what higher
// priorities wait for are set aside (room_for_weights). A refusal is demand like a KV
// refusal (pressure, reclaim targets), so idle and lower-priority holders give memory
// back for the next try. min and max bound the KV cache only (docs/memory-policy.md).
#include <string>

#include "kvcached/registry/device_registry.hpp"
#include "registry_lock.hpp"
#include "registry_os.hpp"
#include "registry_policy.hpp"
#include "registry_table.hpp"

namespace kvcached {

using registry_detail::EntryRecord;
using registry_detail::RegistryLock;
using registry_detail::saturating_sub;

class RegistryWeights final : public WeightsBudget {
 public:
  explicit RegistryWeights(std::shared_ptr<RegistryBudget> entry) : entry_(std::move(entry)) {}

  bool try_charge(std::size_t bytes) override {
    RegistryBudget& owner = *entry_;
    RegistryLock lock(*owner.segment_, registry_detail::LockCheck::attached);
    EntryRecord* entry = owner.owned_entry();
    if (entry == nullptr) {
      lock.confirm();
      throw BackendUnavailable("registry entry '" + owner.name_ + "' in " + owner.segment_->path() +
                               " is gone (unregistered, or reclaimed because its pid was judged dead)");
    }
    registry_detail::Layout& layout = owner.segment_->layout();
    const auto room = [&] {
      return registry_detail::room_for_weights(layout, owner.slot_, registry_detail::monotonic_now_ns());
    };
    bool granted = bytes <= room();
    if (!granted) {
      const std::int64_t now = registry_detail::monotonic_now_ns();
      if (now - layout.header.last_stale_scan_ns.load() >= registry_detail::kStaleScanIntervalNs &&
          registry_detail::clean_stale_locked(layout) > 0) {
        granted = bytes <= room();
      }
    }
    if (!granted) {
      owner.segment_->check_table();  // refused because an entry lies? Say so instead.
      owner.record_refusal_locked(*entry, bytes, /*keep_larger=*/true);
      lock.confirm();
      return false;
    }
    entry->weights_bytes.store(entry->weights_bytes.load(std::memory_order_relaxed) + bytes, std::memory_order_relaxed);
    entry->sleeping.store(0, std::memory_order_relaxed);
    entry->wanted_bytes.store(saturating_sub(entry->wanted_bytes.load(std::memory_order_relaxed), bytes),
                              std::memory_order_relaxed);
    lock.confirm();
    return true;
  }

  void credit(std::size_t bytes, bool sleeping) noexcept override {
    RegistryBudget& owner = *entry_;
    try {
      // No file check: returning bytes to a file that is gone harms nobody.
      RegistryLock lock(*owner.segment_, registry_detail::LockCheck::attached);
      EntryRecord* entry = owner.owned_entry();
      if (entry == nullptr) return;
      entry->weights_bytes.store(saturating_sub(entry->weights_bytes.load(std::memory_order_relaxed), bytes),
                                 std::memory_order_relaxed);
      entry->sleeping.store(sleeping ? 1 : 0, std::memory_order_relaxed);
    } catch (...) {
      // The lock timed out or the registry is unusable: the bytes stay counted,
      // erring on the safe side, until this process exits.
    }
  }

 private:
  std::shared_ptr<RegistryBudget> entry_;
};

std::shared_ptr<WeightsBudget> RegistryBudget::weights_budget() {
  return std::make_shared<RegistryWeights>(shared_from_this());
}

std::size_t RegistryBudget::weights_bytes() const noexcept {
  const EntryRecord* entry = owned_entry();
  return entry ? entry->weights_bytes.load(std::memory_order_relaxed) : 0;
}

bool RegistryBudget::sleeping() const noexcept {
  const EntryRecord* entry = owned_entry();
  return entry != nullptr && entry->sleeping.load(std::memory_order_relaxed) != 0;
}

}  // namespace kvcached
