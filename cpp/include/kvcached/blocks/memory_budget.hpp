// MemoryBudget: where a pool's allowance of physical memory comes from.
//
// A pool takes bytes from its budget before it maps a page and gives them back
// only after the page is really unmapped (in every process that maps it). The
// default budget is local to the process; the shared per-device registry
// implements the same interface so that several processes share one device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "kvcached/error.hpp"

namespace kvcached {

class KVCACHED_EXPORT MemoryBudget {
 public:
  virtual ~MemoryBudget() = default;
  // Atomically take `bytes` if the budget allows it; false (nothing taken) otherwise.
  virtual bool try_acquire(std::size_t bytes) = 0;
  // Takes bytes for what a pool keeps ready on its own account (free pages, spare
  // allocations), not for a caller waiting: a refusal says nothing about demand, so
  // a shared budget records no pressure for it (docs/memory-policy.md).
  virtual bool try_acquire_for_reserve(std::size_t bytes) { return try_acquire(bytes); }
  // Return bytes taken earlier, once they are no longer mapped anywhere.
  virtual void release(std::size_t bytes) noexcept = 0;
  // What try_acquire could grant right now (a hint: others may take it first).
  // Must not take a lock another process can hold (it is read on fast paths).
  virtual std::size_t available_bytes() const = 0;
  // The most bytes beyond what this user holds that the budget could ever grant it, were
  // every other user to give back all it may (a shared registry: the instance's max, and
  // the device budget less what the other instances are guaranteed); nullopt when nothing
  // bounds it. A waiting alloc needing more is refused at once instead of waiting. A
  // lock-free hint, like available_bytes.
  virtual std::optional<std::size_t> reachable_bytes() const { return std::nullopt; }
  // Throws the budget's own error if it can no longer grant anything at all
  // (a shared registry that was truncated or damaged), so that a pool refusing
  // an alloc says why instead of reporting the budget as merely full. Called
  // with the pool's state lock held: must not wait on another process.
  virtual void check_usable() const {}
  // Whether try_acquire / release may wait on a lock another process can hold.
  // A block manager calls a budget that cannot block under its own state lock,
  // so its figures stay exact; one that can is called outside that lock.
  virtual bool may_block() const noexcept { return true; }
  // A limit set from outside the pool (e.g. by kvctl) that the pool must
  // respect, shrinking lazily if it is below current use; nullopt when none.
  virtual std::optional<std::size_t> external_limit_bytes() const { return std::nullopt; }
  // Bytes other users of the budget are waiting for right now; a pool seeing
  // pressure gives its free reserve back instead of sitting on it.
  virtual std::size_t pressure_bytes() const noexcept { return 0; }
  // Lets the budget publish the pool's usage (used = bytes of pages with
  // blocks in use; mapped = pages mapped, including free reserve pages).
  virtual void report_usage(std::size_t used_bytes, std::size_t mapped_bytes) noexcept {
    (void)used_bytes;
    (void)mapped_bytes;
  }
  // Lets the budget publish how many rounds of the pool's background worker
  // failed so far (kvctl and kvtop show it beside the instance).
  virtual void report_worker_errors(std::uint64_t worker_errors) noexcept { (void)worker_errors; }
};

}  // namespace kvcached
