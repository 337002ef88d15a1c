// FixedBudget: a MemoryBudget of a fixed number of bytes shared by the pools of
// one process (the shared per-device registry does the same across processes).
#pragma once

#include <atomic>
#include <cstddef>

#include "kvcached/blocks/memory_budget.hpp"

namespace kvcached {

class KVCACHED_EXPORT FixedBudget final : public MemoryBudget {
 public:
  explicit FixedBudget(std::size_t total_bytes) : total_bytes_(total_bytes) {}
  bool try_acquire(std::size_t bytes) override {
    std::size_t used = used_bytes_.load();
    do {
      if (used + bytes > total_bytes_) return false;
    } while (!used_bytes_.compare_exchange_weak(used, used + bytes));
    return true;
  }
  void release(std::size_t bytes) noexcept override { used_bytes_ -= bytes; }
  bool may_block() const noexcept override { return false; }  // one atomic, no lock
  std::size_t available_bytes() const override {
    const std::size_t used = used_bytes_.load();
    return used < total_bytes_ ? total_bytes_ - used : 0;
  }
  std::size_t total_bytes() const noexcept { return total_bytes_; }
  std::size_t used_bytes() const noexcept { return used_bytes_.load(); }

 private:
  const std::size_t total_bytes_;
  std::atomic<std::size_t> used_bytes_{0};
};

}  // namespace kvcached
