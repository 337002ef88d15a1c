// BlockManager: the deciding side of a KV cache. Hands out block ids, tracks
// which page ids must be mapped, enforces the pool's limit and its memory
// budget, and keeps a reserve of mapped free pages with a background worker.
// It never touches a device itself: a PageMapper applies its decisions.
//
// Locking: `grow_mutex_` serialises everything that calls the mapper (grow,
// shrink, spares), `mutex_` guards the block tables. Order: grow_mutex_, then
// mutex_. The fast path (alloc from mapped pages, free) takes mutex_ only and
// never waits on a driver call. No Python code runs under either lock.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "kvcached/space/kv_layout.hpp"
#include "kvcached/blocks/memory_budget.hpp"
#include "kvcached/blocks/page_mapper.hpp"

namespace kvcached {

struct ReserveTargets {
  std::size_t min_free_pages = 0;  // mapped pages with no block in use, kept ready
  std::size_t max_free_pages = 0;  // beyond this, free pages are unmapped
  std::size_t min_spare_pages = 0; // pre-created, unmapped allocations kept ready
  std::size_t max_spare_pages = 0;
};

struct BlockManagerOptions {
  bool null_block = false;                  // block 0 reserved (engines point padding at it)
  std::optional<std::size_t> limit_bytes;   // physical bytes this pool may hold
  ReserveTargets reserve;
  bool background_worker = false;           // keep `reserve` with a thread
};

struct BlockManagerStats {
  std::size_t num_blocks, blocks_per_page, page_bytes, block_bytes;
  std::size_t used_blocks, free_mapped_blocks;
  std::size_t mapped_pages, used_pages, free_pages, spare_pages, pending_pages;
  std::size_t limit_pages;
  std::optional<std::size_t> limit_bytes;
  std::size_t slow_allocs;  // allocs that had to map pages themselves (reserve missed)
};

class KVCACHED_EXPORT BlockManager {
 public:
  BlockManager(const KVLayout& layout, const BlockManagerOptions& options,
               std::shared_ptr<PageMapper> mapper, std::shared_ptr<MemoryBudget> budget);
  ~BlockManager();
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;

  // `n` block ids, best fit (fullest pages first). Maps pages when needed.
  // Throws BudgetExhausted / DeviceOutOfMemory and rolls back what it mapped.
  std::vector<std::int64_t> alloc(std::size_t n);
  // The fast path alone: succeeds only if `n` free blocks sit on mapped pages
  // and the lock is free right now; never blocks (callers holding the GIL use
  // it first and fall back to alloc() with the GIL released).
  bool try_alloc_mapped(std::size_t n, std::vector<std::int64_t>& out);
  // Take exactly these free block ids (all or nothing).
  void alloc_ids(const std::vector<std::int64_t>& ids);
  // All ids must be in use and distinct; otherwise nothing is freed.
  void free(const std::vector<std::int64_t>& ids) { free(ids.data(), ids.size()); }
  void free(const std::int64_t* ids, std::size_t count);
  // Blocks that alloc could return right now.
  std::size_t available() const;
  std::size_t free_mapped_blocks() const;
  // New limit in bytes (nullopt: none). A limit below current use is not an
  // error: pages are given back as their blocks are freed.
  void resize(std::optional<std::size_t> limit_bytes);
  // Unmap every free page and release every spare now. Returns pages unmapped.
  std::size_t trim();
  // One round of reserve keeping (what the worker does); also usable by hand.
  void maintain();
  void set_reserve(const ReserveTargets& targets);
  // Unmap everything, release the budget, stop the worker. Idempotent.
  void close();

  // Mirrors (only with a PageOpLog mapper).
  PageOps take_page_ops();
  void acknowledge(std::size_t mirror, std::uint64_t seq);

  BlockManagerStats stats() const;
  const KVLayout& layout() const noexcept { return layout_; }
  std::size_t page_of(std::int64_t block) const;
  bool null_block() const noexcept { return options_.null_block; }

 private:
  enum class PageState : std::uint8_t { kUnmapped, kMapping, kMapped, kUnmapping };
  static constexpr std::uint32_t kNoPage = 0xFFFFFFFFu;

  // Bucket lists of mapped pages by number of free blocks (best-fit choice).
  void bucket_insert(std::uint32_t page, std::size_t free_count);
  void bucket_remove(std::uint32_t page, std::size_t free_count);
  std::size_t lowest_nonempty_bucket() const;
  void take_blocks_locked(std::size_t n, std::vector<std::int64_t>& out);
  void give_blocks_locked(const std::int64_t* ids, std::size_t count);
  void check_ids_in_range(const std::int64_t* ids, std::size_t count) const;

  std::size_t limit_pages_locked() const;
  std::size_t held_pages_locked() const { return mapped_pages_ + spare_pages_ + pending_pages_; }
  std::size_t growable_pages_locked() const;
  // Map `count` unmapped pages (grow_mutex_ held, mutex_ held on entry and exit).
  // With `pages_wanted`, exactly those (unmapped) pages.
  std::vector<std::int64_t> grow_locked(std::unique_lock<std::mutex>& lock, std::size_t count,
                                        const std::vector<std::int64_t>* pages_wanted = nullptr);
  // Unmap up to `count` free pages (same locking). Returns pages unmapped.
  std::size_t shrink_locked(std::unique_lock<std::mutex>& lock, std::size_t count,
                            const std::vector<std::int64_t>* only = nullptr);
  void release_pages_budget(std::size_t pages) noexcept;
  void report_usage_locked() noexcept;
  std::size_t free_pages_count_locked() const;
  // True when the worker has something to do (reserve outside its bounds, over the limit).
  bool reserve_off_target_locked() const;
  void worker_loop();
  void wake_worker() noexcept;

  const KVLayout layout_;
  BlockManagerOptions options_;
  std::shared_ptr<PageMapper> mapper_;
  PageOpLog* op_log_;  // mapper_ when it is a PageOpLog, else null
  std::shared_ptr<MemoryBudget> budget_;
  const std::size_t blocks_per_page_;
  const std::size_t page_bytes_;  // physical bytes of one page id

  std::mutex grow_mutex_;
  mutable std::mutex mutex_;
  std::vector<PageState> state_;
  std::vector<std::uint32_t> free_count_;              // per page, when mapped
  std::vector<std::vector<std::uint32_t>> free_slots_; // per page: LIFO of free slots
  std::vector<std::uint8_t> block_used_;
  std::vector<std::uint32_t> bucket_head_, next_, prev_;
  std::vector<std::uint64_t> nonempty_bits_;
  std::set<std::int64_t> unmapped_;                    // lowest id first
  std::size_t mapped_pages_ = 0, spare_pages_ = 0, pending_pages_ = 0;
  std::size_t used_blocks_ = 0, free_mapped_blocks_ = 0;
  std::size_t free_pages_ = 0;  // mapped pages with every block free (bucket blocks_per_page)
  std::size_t slow_allocs_ = 0;
  // Bumped by every alloc and free; the worker sees an idle pool when it stops moving.
  std::uint64_t activity_ = 0;
  std::uint64_t activity_seen_ = 0;
  int idle_rounds_ = 0;
  std::size_t cached_device_free_pages_;
  bool closed_ = false;

  std::thread worker_;
  std::condition_variable worker_cv_;
  std::mutex worker_mutex_;
  bool worker_stop_ = false, worker_kick_ = false;
};

}  // namespace kvcached
