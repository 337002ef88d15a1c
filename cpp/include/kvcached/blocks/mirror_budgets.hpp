// MirrorBudgets: the memory budgets a block manager charges, one per mirror
// (a KV space mapping its pages: the local space, or one per rank/stage in
// other processes), and how many pages each currently holds on its budget.
//
// Mirrors may differ in what a page costs (pipeline stages hold different
// layers): mirror i is charged `page_bytes(i)` per page. Taking pages is all
// or nothing across mirrors: if one budget refuses, nothing stays taken on
// the others.
//
// Not thread-safe: the counts are guarded by the block manager's state lock.
// The budget calls themselves (take / give) change no count, so the block
// manager can make them outside that lock when a budget may block.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "kvcached/blocks/memory_budget.hpp"
#include "kvcached/space/kv_layout.hpp"

namespace kvcached {

struct MirrorSpec {
  std::shared_ptr<MemoryBudget> budget;  // null: no budget (pages are still counted)
  // A pipeline stage's own layout (its layers only): one page id costs its
  // page_id_bytes there. It must have the manager's blocks per page and block
  // count. nullopt: the manager's layout.
  std::optional<KVLayout> layout;
};

class KVCACHED_EXPORT MirrorBudgets {
 public:
  MirrorBudgets(std::vector<MirrorSpec> mirrors, std::size_t default_page_bytes);

  std::size_t size() const noexcept { return mirrors_.size(); }
  bool alive(std::size_t i) const noexcept { return mirrors_[i].alive; }
  std::size_t page_bytes(std::size_t i) const noexcept { return mirrors_[i].page_bytes; }
  MemoryBudget* budget(std::size_t i) const noexcept { return mirrors_[i].budget.get(); }
  // Pages held on mirror i's budget, and how many of them are being given back right now.
  std::size_t charged_pages(std::size_t i) const noexcept { return mirrors_[i].charged; }
  std::size_t releasing_pages(std::size_t i) const noexcept { return mirrors_[i].releasing; }
  // The most pages any live mirror holds (0 with none).
  std::size_t max_charged_pages() const noexcept;
  // True when some budget may wait on another process (see MemoryBudget::may_block).
  bool may_block() const noexcept { return may_block_; }

  // ---- counts (under the block manager's state lock) ----
  void add_charge(const std::vector<std::size_t>& pages) noexcept;
  void remove_charge(const std::vector<std::size_t>& pages) noexcept;
  void begin_release(std::size_t i, std::size_t pages) noexcept { mirrors_[i].releasing += pages; }
  void end_release(std::size_t i, std::size_t pages) noexcept;
  // Stop charging mirror i; returns what it held (to give back).
  std::size_t mark_lost(std::size_t i) noexcept;

  // ---- budget calls (no count changes) ----
  // Takes pages[i] pages on every mirror i, all or nothing. Returns the index
  // of the mirror whose budget refused (nothing taken anywhere), or nullopt.
  // A budget that throws leaves nothing taken either, and the error propagates.
  // `for_reserve`: taken for the pool's own reserve (MemoryBudget::try_acquire_for_reserve).
  std::optional<std::size_t> take(const std::vector<std::size_t>& pages, bool for_reserve = false) const;
  void give(std::size_t i, std::size_t pages) const noexcept;

  // ---- what the budgets say ----
  // Pages mirror i's budget would still grant (SIZE_MAX without a budget).
  std::size_t room_pages(std::size_t i) const;
  // Pages mirror i's budget could ever still grant (SIZE_MAX when nothing bounds it).
  std::size_t reachable_pages(std::size_t i) const;
  // The tightest limit set on a live mirror's budget from outside (kvctl):
  // in that mirror's pages, and the bytes it was set as.
  struct ExternalLimit {
    std::size_t pages, bytes;
  };
  std::optional<ExternalLimit> external_limit() const;
  // Some budget reports other pools waiting for memory.
  bool others_waiting() const noexcept;
  // Throws the error of the first live mirror's budget that can no longer
  // grant anything (MemoryBudget::check_usable).
  void check_usable() const;
  // Publishes usage on every live mirror's budget (pages x that mirror's page cost).
  void report_usage(std::size_t used_pages) const noexcept;
  // Publishes the background worker's failure count on every live mirror's budget.
  void report_worker_errors(std::uint64_t worker_errors) const noexcept;

 private:
  struct Mirror {
    std::shared_ptr<MemoryBudget> budget;
    std::size_t page_bytes;
    std::size_t charged = 0, releasing = 0;
    bool alive = true;
  };
  std::vector<Mirror> mirrors_;
  bool may_block_ = false;
};

}  // namespace kvcached
