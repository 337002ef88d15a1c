// WeightsBudget: where a model's weights are charged while they hold device memory.
//
// Weights are all or nothing (a model is awake or asleep), so the budget is asked
// for all of their bytes at once when they are mapped, and credited with all of
// them when they are unmapped, saying whether the model is now asleep (so that a
// shared registry shows it) or gone. The per-device registry implements it on an
// instance's entry (weights_bytes, sleeping); MemoryBudgetWeights puts weights on
// any MemoryBudget (a FixedBudget shared with KV pools of one process).
#pragma once

#include <cstddef>
#include <memory>

#include "kvcached/blocks/memory_budget.hpp"

namespace kvcached {

class KVCACHED_EXPORT WeightsBudget {
 public:
  virtual ~WeightsBudget() = default;
  // Takes `bytes` for weights being mapped (the model is awake from then on);
  // false, nothing taken, when the budget has no room. A shared budget records
  // the refusal as demand, so idle holders give memory back.
  virtual bool try_charge(std::size_t bytes) = 0;
  // Gives back `bytes` of weights just unmapped; `sleeping`: the model is
  // asleep (it will ask again on waking), not gone.
  virtual void credit(std::size_t bytes, bool sleeping) noexcept = 0;
};

// Weights on a plain MemoryBudget: what it grants, no sleeping flag to show.
class KVCACHED_EXPORT MemoryBudgetWeights final : public WeightsBudget {
 public:
  explicit MemoryBudgetWeights(std::shared_ptr<MemoryBudget> budget) : budget_(std::move(budget)) {}
  bool try_charge(std::size_t bytes) override { return budget_->try_acquire(bytes); }
  void credit(std::size_t bytes, bool /*sleeping*/) noexcept override { budget_->release(bytes); }

 private:
  std::shared_ptr<MemoryBudget> budget_;
};

}  // namespace kvcached
