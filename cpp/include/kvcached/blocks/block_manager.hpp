// BlockManager: the deciding side of a KV cache. Hands out block ids, decides
// which page ids must be mapped, enforces the pool's limit and its mirrors'
// memory budgets, and keeps a reserve of mapped free pages with a background
// worker. It never touches a device itself: a PageMapper applies its
// decisions (a local KVSpace at once, or PageOps batches for mirrors).
//
// Memory truth: every page id is in exactly one state (unmapped, being
// mapped, mapped with blocks in use, mapped and entirely free, being unmapped,
// awaiting the mirrors' acknowledgement), and stats() reports each. Memory in
// transit is never reported missing: available() counts pages being unmapped
// (alloc waits for that unmap to finish) and budget held for unmaps the
// mirrors have not acknowledged yet (a new page can use it at once: every
// mirror applies the unmap before the map).
//
// Locks (see cpp/src/core/LOCK_ORDER.md): close_mutex_ -> map_mutex_ ->
// mutex_ -> {PageOpLog's mutex, worker_mutex_}. map_mutex_ serialises every
// mapper call and every budget call that may block; mutex_ guards the block
// tables and counts and is never held across a driver call or a call that can
// wait on another process. The fast path (alloc from mapped pages, free)
// takes mutex_ only.
//
// One class over several files in cpp/src/core/blocks/, one concern each:
//   block_manager.cpp             construction; blocks: the fast alloc path, free, reserve, clear
//   block_manager_slow_path.cpp   allocs that must map pages (waiting for budget), alloc_ids
//   block_manager_pages.cpp       mapping and unmapping pages (rollback), spares, page ops, acks
//   block_manager_accounting.cpp  available(), stats(), the limit in force, budget charges
//   block_manager_upkeep.cpp      the reserve: maintain, trim, resize, set_reserve; close
//   block_manager_worker.cpp      the background worker's loop and look-ahead
//   block_manager_options.cpp     BlockManagerOptions (its own value, block_manager_options.hpp)
// What stands alone is its own object already: FreeSlots, BestFitIndex, MirrorBudgets,
// ReservePolicy, PageOpLog (each with its header here) and LocalPageMapper (cpp/src).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvcached/blocks/best_fit_index.hpp"
#include "kvcached/blocks/block_manager_options.hpp"
#include "kvcached/blocks/free_slots.hpp"
#include "kvcached/blocks/memory_budget.hpp"
#include "kvcached/blocks/mirror_budgets.hpp"
#include "kvcached/blocks/page_mapper.hpp"
#include "kvcached/blocks/page_op_log.hpp"
#include "kvcached/blocks/reserve_policy.hpp"
#include "kvcached/space/kv_layout.hpp"
#include "kvcached/space/kv_space.hpp"
#include "kvcached/space/page_metadata.hpp"

namespace kvcached {

struct MirrorStats {
  MirrorProgress progress;        // acknowledgements (device-less managers; defaults locally)
  std::size_t page_bytes = 0;     // what one page id costs on this mirror
  std::size_t charged_pages = 0;  // pages held on its budget
};

struct BlockManagerStats {
  std::size_t num_blocks, num_pages, blocks_per_page, page_id_bytes, block_id_bytes;
  std::size_t used_blocks;         // handed out, reserved or the null block
  std::size_t reserved_blocks;     // held by try_reserve for the next alloc
  std::size_t free_mapped_blocks;  // free blocks on mapped pages
  // Where every page id is (they add up to num_pages):
  std::size_t used_pages;       // mapped, some block in use
  std::size_t free_pages;       // mapped, every block free (the reserve)
  std::size_t mapping_pages;    // being mapped
  std::size_t unmapping_pages;  // being unmapped here (allocatable: alloc waits for it)
  std::size_t pending_pages;    // unmapped, awaiting the mirrors' acknowledgement
  std::size_t unmapped_pages;
  std::size_t mapped_pages;  // used_pages + free_pages
  std::size_t spare_pages;   // pre-created allocations (the KV space's count)
  std::size_t held_pages;    // pages charged to the budget (the most of any mirror)
  std::size_t limit_pages;
  std::optional<std::size_t> limit_bytes;  // the limit in force (the pool's own or set from outside)
  bool asleep;                             // between sleep() and wake_up(): nothing mapped, nothing handed out
  std::size_t slow_allocs;                 // allocs that had to map pages themselves (reserve missed)
  std::size_t worker_errors;               // maintenance rounds of the worker that failed
  std::string last_worker_error;
  std::uint64_t last_seq;  // last PageOps batch handed out (device-less managers)
  std::vector<MirrorStats> mirrors;
};

class KVCACHED_EXPORT BlockManager {
 public:
  // In one process: decisions applied to `space` at once, `budget` (may be
  // null) charged the layout's page_id_bytes per page.
  BlockManager(const KVLayout& layout, const BlockManagerOptions& options, std::shared_ptr<KVSpace> space,
               std::shared_ptr<MemoryBudget> budget);
  // Device-less: decisions recorded as PageOps for one mirror KV space per
  // entry of `mirrors`, each charged on its own budget.
  BlockManager(const KVLayout& layout, const BlockManagerOptions& options, std::vector<MirrorSpec> mirrors);
  // Both refuse (InvalidArgument, before sizing anything) a layout whose
  // bookkeeping, with a local space's, would pass the cap of page_metadata.hpp.
  ~BlockManager();
  // What a block manager keeps per page id and per block id of `layout`.
  static PageMetadataCost page_metadata_cost(const KVLayout& layout) noexcept;
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;

  // `n` block ids: reserved blocks (try_reserve) first, then by the placement
  // policy, mapping pages when needed (waiting for unmaps in flight). Throws
  // BudgetExhausted / DeviceOutOfMemory and rolls back what it mapped.
  std::vector<std::int64_t> alloc(std::size_t n);
  // The same, but when only a memory budget (other pools' use) stands in the
  // way, waits up to `wait` for them to give memory back: it polls the budget
  // (no sleep of a fixed retry period) and maps pages as memory returns, so
  // its maps overlap their unmaps. All or nothing: at the deadline what it
  // mapped is rolled back and BudgetExhausted raised. A limit or the page ids
  // standing in the way raise at once.
  std::vector<std::int64_t> alloc(std::size_t n, std::chrono::nanoseconds wait);
  // The fast path alone: succeeds only if `n` blocks can be taken without
  // mapping and the lock is free right now; never blocks (callers holding the
  // GIL use it first and fall back to alloc() with the GIL released).
  bool try_alloc_mapped(std::size_t n, std::vector<std::int64_t>& out);
  // Take exactly these free block ids (all or nothing).
  void alloc_ids(const std::vector<std::int64_t>& ids);
  // All ids must be handed out and distinct; otherwise nothing is freed.
  void free(const std::vector<std::int64_t>& ids) { free(ids.data(), ids.size()); }
  void free(const std::int64_t* ids, std::size_t count);
  // Set `n` more blocks aside for the next allocs (false, nothing taken, when
  // they cannot be had now). They count as available and alloc hands them out first.
  bool try_reserve(std::size_t n);
  // Free the reserved blocks; returns how many.
  std::size_t release_reserved();
  // Free every block handed out or reserved (not the null block); returns how many.
  std::size_t clear();
  // Blocks alloc could return right now.
  std::size_t available() const;
  std::size_t free_mapped_blocks() const;
  // New limit in bytes (nullopt: none). Returns true when the pool is within
  // it once what is free is given back, false when the shrink is deferred
  // until blocks in use are freed (reserved blocks are released first).
  bool resize(std::optional<std::size_t> limit_bytes);
  // Unmap every free page and release every spare now; the worker keeps them
  // so until the next alloc. Returns pages unmapped.
  std::size_t trim();
  // The engine released its KV cache (SGLang's release_memory_occupation):
  // unmap every page, the null block's too, and map nothing until wake_up()
  // (allocs and reserves are refused as by a limit of 0, the reserve is not
  // refilled). Every block must be free (clear() first): InvalidArgument
  // otherwise, nothing changed. Returns pages unmapped; 0 when asleep already.
  std::size_t sleep();
  // Allow allocs again and map the null block's page back (its contents are not
  // kept). BudgetExhausted / DeviceOutOfMemory, still asleep, when that page
  // cannot be had; InvalidArgument while its unmap awaits the mirrors'
  // acknowledgement. A no-op when awake.
  void wake_up();
  bool asleep() const;
  // One round of reserve keeping (what the worker does); also usable by hand.
  // Allocations it unmaps stay as spares until the next round unless others
  // wait for memory (ReserveGoal::release_now); spares beyond the reserve
  // kept by earlier rounds are released first.
  void maintain();
  // The worker's other job each round: get the next lookahead_pages()
  // unmapped page ids ready (zero chunks split), holding no lock of the
  // manager's, so grows meanwhile wait for one short split at most.
  void prepare_ahead();
  void set_reserve(const ReserveTargets& targets);
  // Unmap everything, release the budgets, stop the worker. Idempotent and
  // safe to call from several threads at once.
  void close();
  bool closed() const;

  // Device-less managers: the next batch for the mirrors, their acknowledgements.
  PageOps take_page_ops();
  void acknowledge(std::size_t mirror, std::uint64_t seq);
  // Mirror `mirror` is gone (its process died): give back what it holds on its
  // budget and stop waiting for its acknowledgements.
  void mirror_lost(std::size_t mirror);
  std::size_t num_mirrors() const noexcept { return budgets_.size(); }

  BlockManagerStats stats() const;
  const KVLayout& layout() const noexcept { return layout_; }
  const BlockManagerOptions& options() const noexcept { return options_; }
  std::size_t page_of(std::int64_t block) const;
  // Unmapped page ids the worker keeps ready ahead of use (zero chunks split):
  // at least the space's look-ahead, and twice the largest of the recent grows.
  std::size_t lookahead_pages() const;

 private:
  using Clock = std::chrono::steady_clock;
  BlockManager(const KVLayout& layout, const BlockManagerOptions& options, std::shared_ptr<PageMapper> mapper,
               std::vector<MirrorSpec> mirrors);
  enum class PageState : std::uint8_t { kUnmapped, kMapping, kMapped, kUnmapping, kAwaitingAck };
  enum BlockState : std::uint8_t { kFree = 0, kUsed = 1, kReserved = 2, kFreeing = 3 };
  using Lock = std::unique_lock<std::mutex>;

  // ---- blocks (mutex_ held) ----
  std::size_t used_pages_locked() const noexcept { return index_.pages() - index_.empty_pages(); }
  // Entirely free mapped pages that may become used under the limit.
  std::size_t new_page_quota_locked() const noexcept;
  // Blocks takeable from mapped pages without mapping, within the limit.
  std::size_t takeable_locked() const noexcept;
  // Take `n` blocks (the caller checked takeable_locked() >= n).
  void take_blocks_locked(std::size_t n, std::vector<std::int64_t>& out);
  // Maps the null block's page (when unmapped) and hands block 0 out for good.
  void take_null_block_locked(Lock& lock);
  void give_blocks_locked(const std::int64_t* ids, std::size_t count);
  // What an alloc of `n` blocks does now: take them, map `pages` first, or refuse.
  struct AllocPlan {
    enum Action { kTake, kGrow, kRefuse } action;
    std::size_t pages;
  };
  AllocPlan plan_alloc_locked(std::size_t n, bool into_reserve) const;
  // Reserved blocks first (unless taking into the reserve), then by placement.
  void take_locked(std::size_t n, bool into_reserve, std::vector<std::int64_t>& out);
  std::vector<std::int64_t> alloc_slow(std::size_t n, bool into_reserve, Clock::time_point deadline);
  // Waits (mutex_ released, map_mutex_ held) until some budget has more room
  // than `room_before` pages, or the deadline; polls tightly, never sleeps a period.
  void wait_for_budget_locked(Lock& lock, std::size_t room_before, Clock::time_point deadline);
  // Pages the budgets would grant now, summed over live mirrors (a change detector).
  std::size_t budget_room_pages_locked() const;
  static std::size_t budget_room_pages_unlocked_poll(const std::vector<std::pair<MemoryBudget*, std::size_t>>& budgets);
  void check_ids_in_range(const std::int64_t* ids, std::size_t count) const;
  std::size_t available_locked() const;
  // Blocks on the next `pages` page ids to be grown (a partial last page has fewer).
  std::size_t growth_blocks_locked(std::size_t pages) const noexcept;
  // Pages obtainable beyond the empty ones: ids, limit, budgets, device;
  // `bound_by` (optional) names the one that binds, for messages.
  std::size_t growth_room_locked(std::string* bound_by = nullptr) const;
  // The same with only the page ids and the limit: what waiting cannot change.
  std::size_t fixed_room_locked() const;
  // Pages the budgets could ever still grant, were everyone else to give back all they
  // may (MemoryBudget::reachable_bytes); `words` (optional) says what bounds it.
  std::size_t reachable_budget_pages_locked(std::string* words = nullptr) const;

  // ---- pages (map_mutex_ held; mutex_ held on entry and exit, released inside) ----
  // `for_reserve`: pages the worker keeps ready, charged without signalling demand.
  std::vector<std::int64_t> grow_locked(Lock& lock, std::size_t count, const std::vector<std::int64_t>* wanted,
                                        bool for_reserve = false);
  // Unmaps in slices of a few allocations; after each slice the budgets are
  // settled, so others can use the memory while the rest is unmapped. With
  // `release_beyond`, spares beyond that many are released after each slice
  // (memory back to the device at once); without, the space keeps them.
  std::size_t shrink_locked(Lock& lock, const std::vector<std::uint32_t>& pages,
                            std::optional<std::size_t> release_beyond = std::nullopt);
  std::size_t shrink_slice_pages() const noexcept;
  void undo_grow_locked(const std::vector<std::int64_t>& pages);
  // Pages whose unmap every live mirror has acknowledged: their ids are reusable.
  void make_reusable_locked(const std::vector<std::int64_t>& pages);
  // Runs a mapper call: a local space's (driver calls) with mutex_ released,
  // the op log's (a leaf lock that never waits) under it. mutex_ is held again
  // on return, also when the call throws.
  void with_mapper(Lock& lock, const std::function<void()>& call);
  // Pages mirror i must hold once the operation in progress is done: `maps`
  // pages of mapping_pages_ are being mapped, `new_spares` spares being made.
  std::size_t required_pages_locked(std::size_t i, std::size_t maps, std::size_t new_spares) const;
  // Charge every mirror what it needs for that (all or nothing; BudgetExhausted).
  void charge_locked(Lock& lock, std::size_t maps, std::size_t new_spares, bool for_reserve = false);
  // Give back what the mirrors hold beyond what they need now.
  void settle_locked(Lock& lock);
  void give_back_locked(Lock& lock, std::vector<std::pair<std::size_t, std::size_t>> releases);
  void refresh_limit_locked() const;
  // The device's free memory in pages (nullopt: no device): the device's own
  // estimate, an atomic read kept by every create and release, so nothing here
  // caches it; `query` asks the driver (no mutex_ held) and resets the estimate.
  std::optional<std::size_t> device_free_pages(bool query = false) const;
  // Pages the device could still back: its free memory, the spares and the
  // pages being unmapped (alloc waits for those); nullopt without a device.
  std::optional<std::size_t> device_room_locked() const;
  // The device bound refused a grow: learn what is really free, then re-plan.
  bool requery_device_locked(Lock& lock);
  void report_usage_locked() const noexcept;
  void trim_spares_locked(Lock& lock, std::size_t keep);
  // maintain()'s steps: spares beyond `keep` released a slice at a time (each
  // under the map lock), the limit, then the goal's free pages and spares.
  void release_spares_beyond(std::size_t keep);
  void keep_within_limit_locked(Lock& lock);
  void keep_reserve_locked(Lock& lock, const ReserveGoal& goal);
  void add_spares_locked(Lock& lock, std::size_t count);
  void probe_budget_for_pressure(Lock& lock, std::size_t pages);
  void note_grow_locked(std::size_t pages);

  // ---- worker ----
  void worker_loop();
  void wake_worker() noexcept;
  void record_worker_error(const char* what) noexcept;

  const KVLayout layout_;
  BlockManagerOptions options_;
  std::shared_ptr<PageMapper> mapper_;
  PageOpLog* op_log_;  // mapper_ when the manager is device-less, else null
  const std::size_t blocks_per_page_;

  std::mutex close_mutex_;
  std::mutex map_mutex_;
  mutable std::mutex mutex_;
  std::vector<PageState> state_;
  std::vector<FreeSlots> free_slots_;  // per mapped page, lowest first
  std::vector<std::uint8_t> block_state_;
  BestFitIndex index_;                  // mapped pages by free blocks
  FreeSlots unmapped_;                  // unmapped page ids, lowest first (a bitmap)
  std::vector<std::int64_t> reserved_;  // try_reserve, handed out first
  std::size_t used_blocks_ = 0;
  std::size_t mapping_pages_ = 0, mapping_blocks_ = 0, unmapping_pages_ = 0, awaiting_ack_pages_ = 0;
  // The limit in force, the tighter of the options' limit and the budgets'
  // external limits (kvctl): in pages, and in bytes as it was set (nullopt:
  // none); refreshed together by every call that decides on it or reports it.
  mutable std::size_t limit_pages_;
  mutable std::optional<std::size_t> limit_bytes_;
  // While a local mapper call runs (mutex_ released): the device room once it
  // is done, which bounds the room read meanwhile (see with_mapper).
  std::optional<std::size_t> device_room_in_flight_;
  MirrorBudgets budgets_;
  ReservePolicy reserve_;
  std::uint64_t allocs_ = 0, frees_ = 0;
  std::deque<std::size_t> recent_grows_;  // pages of the last grows (look-ahead)
  std::size_t slow_allocs_ = 0, worker_errors_ = 0;
  std::string last_worker_error_;
  bool closed_ = false;
  bool asleep_ = false;  // sleep() .. wake_up(): the limit in force is 0

  std::thread worker_;
  std::condition_variable worker_cv_;
  std::mutex worker_mutex_;
  bool worker_stop_ = false, worker_kick_ = false;
};

}  // namespace kvcached
