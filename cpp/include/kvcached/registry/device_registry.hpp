// DeviceRegistry: the per-device table in shared memory through which separate
// engine processes share one device's memory budget.
//
// Rationale. Several engines (separate processes, possibly separate users of one
// GPU) each grow their KV cache when busy and give it back when idle. None may
// push the others into out-of-memory, so every page any of them maps is taken
// from one device-wide budget, atomically across processes, and returned only
// once really unmapped.
//
// Approach. One file per physical device, `<dir>/kvcached-<device>` (dir: env
// KVCACHED_REGISTRY_DIR, default /dev/shm; device: a canonical name such as
// "cpu" or "cuda-GPU-<uuid>", registry_names.hpp), mapped MAP_SHARED by every
// user. It holds a versioned header, a process-shared robust mutex, the device
// budget and a fixed table of instance entries (name, pid, process start time,
// uid, the device as its process sees it, limit, mapped / used / reserved
// bytes, worker errors); registry_format.hpp has the layout. The first user
// builds the file under a temporary name and links it into place, so nobody
// ever sees it half-made. Writers hold the mutex (so "check the budget, then
// take" is one step); readers on the hot path (available bytes, limits) read
// lock-free atomics. The file is private to its creator or shared with one
// named group (registry_access.hpp, docs/security.md), opened without following
// symbolic links, and checked on every locked operation: a file that shrank,
// was removed, moved or replaced, or holds values no kvcached writes (a pid
// outside pid_t, more bytes than any device has) detaches the registry with a
// clear error instead of crashing (SIGBUS, fault_guard.hpp), trusting a lie or
// silently splitting the budget in two.
//
// Limitations. Liveness is judged from /proc/<pid>/stat, so all users must
// share one PID namespace (containers sharing a GPU must also share PIDs). The
// layout depends on the C library's pthread_mutex_t; a layout or version
// mismatch is refused with a message, never guessed at. An engine whose
// registry was truncated, removed or replaced cannot take more memory until it
// is restarted (it keeps what it has mapped).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kvcached/blocks/memory_budget.hpp"
#include "kvcached/registry/registry_errors.hpp"
#include "kvcached/registry/registry_names.hpp"
#include "kvcached/weights/weights_budget.hpp"

namespace kvcached {

namespace registry_detail {
class Segment;
struct EntryRecord;
struct Layout;
}  // namespace registry_detail

// One instance as seen in a snapshot of the table.
struct RegistryEntryInfo {
  std::size_t slot = 0;
  std::uint64_t instance_id = 0;  // unique for the life of the file; slots are reused
  std::string name;
  std::int64_t pid = 0;
  std::uint64_t start_time_ticks = 0;  // /proc/<pid>/stat field 22
  std::uint64_t uid = 0;               // effective uid of the registering process
  std::string local_device;            // the device as that process sees it ("cuda:1"), or ""
  bool alive = false;
  std::optional<std::size_t> limit_bytes;
  std::size_t mapped_bytes = 0;     // taken from the budget (every mapped page)
  std::size_t used_bytes = 0;       // pages holding blocks in use, as the pool reports
  std::size_t reserved_bytes = 0;   // mapped but free (background reserve), as reported
  std::size_t wanted_bytes = 0;     // last refused request, while recent (see pressure)
  std::uint64_t worker_errors = 0;  // background worker failures, as the pool reports
  // Memory policy (docs/memory-policy.md); limit_bytes above is its max.
  std::size_t min_bytes = 0;                        // guaranteed: others leave room for it
  std::int64_t priority = 0;                        // higher wins when memory is short
  std::optional<std::size_t> reclaim_target_bytes;  // asked of it by a higher priority, in force now
  // Model weights charged on this entry (weights/weight_space.hpp), beside mapped_bytes.
  std::size_t weights_bytes = 0;  // device memory they hold now
  bool sleeping = false;          // they sleep (their memory is given back until they wake)
};

// A change of one instance's memory policy (kvctl set-policy); fields left empty stay.
struct PolicyChange {
  std::optional<std::size_t> min_bytes;
  bool set_max = false;                  // max_bytes below applies (nullopt: no max)
  std::optional<std::size_t> max_bytes;  // the instance's limit
  std::optional<std::int64_t> priority;
};

// A new instance's memory policy: guaranteed min, max (its limit; none by default), priority.
// Python passes it whole as kvcached.registry.MemoryPolicy (a binding of this value).
struct InstancePolicy {
  std::size_t min_bytes = 0;
  std::optional<std::size_t> max_bytes;
  std::int64_t priority = 0;
};

// InvalidArgument unless an instance could be registered with `policy`: a min no device
// exceeds, a max below "no limit", a priority the entry holds (32 bits), a min not above its
// max. register_instance makes the same checks, naming the instance.
KVCACHED_EXPORT void check_instance_policy(const InstancePolicy& policy);

class RegistryBudget;

class KVCACHED_EXPORT DeviceRegistry {
 public:
  // Opens the registry of canonical `device` ("cpu", "cuda-GPU-<uuid>", ...),
  // creating it with `budget_bytes` if it does not exist yet (the first user
  // decides; later users keep the existing budget). Without a budget a missing
  // registry is RegistryNotFound. `local_device` ("cuda:1") is what
  // register_instance records by default as the device its process sees.
  static std::shared_ptr<DeviceRegistry> open(const std::string& device, std::optional<std::size_t> budget_bytes,
                                              const std::string& local_device = "");
  // Where the registry of `device` lives (honours KVCACHED_REGISTRY_DIR).
  static std::string segment_path(const std::string& device);

  const std::string& device() const noexcept { return device_; }
  const std::string& local_device() const noexcept { return local_device_; }
  const std::string& path() const noexcept;

  // These throw RegistryUnusable once the file is no longer this registry.
  std::size_t budget_bytes() const;
  // Takes effect at once: a lower budget refuses new pages until enough are
  // unmapped, and instances are told to shrink (external_limit_bytes).
  // InvalidArgument (nothing changed) below the sum of the instances' mins.
  void set_budget_bytes(std::size_t budget_bytes);
  // Sum of every entry's mapped bytes at one instant (read under the lock),
  // dead ones included until reclaimed.
  std::size_t mapped_bytes() const;
  // Sum of every entry's weights bytes (model weights awake), read under the lock.
  std::size_t weights_bytes() const;
  // The budget less every entry's mapped and weights bytes.
  std::size_t available_bytes() const;

  std::vector<RegistryEntryInfo> entries() const;
  // Sets (or, with nullopt, clears) the limit (max) of the instances with this
  // pid, or with this name; returns how many entries changed (0: none matched).
  // InvalidArgument (nothing changed) for a limit below an instance's min.
  std::size_t set_limit(const std::variant<std::int64_t, std::string>& name_or_pid,
                        std::optional<std::size_t> limit_bytes);
  // Changes the memory policy of the instances with this pid, or with this name;
  // returns how many entries changed (0: none matched). All or nothing:
  // InvalidArgument (nothing changed) when a min would exceed that instance's max,
  // or the mins of all instances would sum above the budget.
  std::size_t set_policy(const std::variant<std::int64_t, std::string>& name_or_pid, const PolicyChange& change);
  // Frees the entries of dead processes; their mapped bytes return to the
  // budget. Returns how many were freed.
  std::size_t clean_stale();
  // Adds an entry for `pid` (default: this process) with its memory policy (min,
  // max = its limit, priority) and the device as that process sees it (default:
  // the one given to open). Stale entries are reclaimed first, so a restarted
  // engine finds its predecessor's memory free. InvalidArgument when its min is
  // above its max or the mins would sum above the budget. A GPU instance is
  // refused while a registry keyed another way has live instances
  // (registry_directory.hpp).
  // With `join`, a live entry of the same name, pid and local device is joined instead: another
  // handle on it (an engine's weights and its KV cache registering one rank apart),
  // its policy replaced by `policy`; the last handle unregistered frees it.
  std::shared_ptr<RegistryBudget> register_instance(const std::string& name,
                                                    std::optional<std::int64_t> pid = std::nullopt,
                                                    const InstancePolicy& policy = {},
                                                    std::optional<std::string> local_device = std::nullopt,
                                                    bool join = false);

  // Test hook: takes the registry lock and returns without releasing it, so a
  // test can kill the process while it holds the lock. Never use otherwise.
  void hold_lock_for_test();

 private:
  DeviceRegistry(std::string device, std::string local_device, std::shared_ptr<registry_detail::Segment> segment);
  std::shared_ptr<RegistryBudget> join_locked(registry_detail::Layout& layout, const std::string& name,
                                              std::int64_t pid, std::uint64_t start_ticks,
                                              const std::string& local_device, const InstancePolicy& policy);
  std::string device_;
  std::string local_device_;
  std::shared_ptr<registry_detail::Segment> segment_;
};

// One registered instance's view of the device budget. Implements MemoryBudget
// so a pool takes its pages from the shared budget; unregisters on destruction.
class KVCACHED_EXPORT RegistryBudget : public MemoryBudget, public std::enable_shared_from_this<RegistryBudget> {
 public:
  RegistryBudget(std::shared_ptr<registry_detail::Segment> segment, std::size_t slot, std::uint64_t instance_id,
                 std::string name);
  ~RegistryBudget() override;
  RegistryBudget(const RegistryBudget&) = delete;
  RegistryBudget& operator=(const RegistryBudget&) = delete;

  // Takes `bytes` if this instance's limit allows and the device budget has
  // room once what other instances may still claim under their min, and what
  // higher-priority instances were just refused, is set aside. When refused,
  // dead processes' entries are reclaimed (at most every kStaleScanInterval)
  // and the request is retried once; still refused, the refusal is recorded
  // (pressure) and lower-priority instances are asked to shrink, as are the
  // others for what this instance's min is still owed (reclaim targets,
  // docs/memory-policy.md); unless the request is beyond reachable_bytes(),
  // which nobody giving back could meet: then nothing is recorded. Throws
  // BackendUnavailable once the entry is gone and RegistryUnusable once the
  // file is no longer this registry.
  bool try_acquire(std::size_t bytes) override;
  // The same, for what the pool keeps ready on its own account: a refusal is not
  // recorded (no pressure, no reclaim target), since nobody waits for it.
  bool try_acquire_for_reserve(std::size_t bytes) override;
  void release(std::size_t bytes) noexcept override;
  std::size_t available_bytes() const override;
  // Its max, or the budget less the other instances' mins, less what it holds: a request
  // beyond it is refused without recording anything (no pressure, no reclaim target).
  std::optional<std::size_t> reachable_bytes() const override;
  // Throws RegistryUnusable once the file is no longer this registry (checked
  // now: fstat and the header, no lock) and BackendUnavailable once the entry
  // is gone, as try_acquire would.
  void check_usable() const override;
  // This instance's limit (kvctl), lowered to a reclaim target a refused
  // higher-priority instance set (never below this instance's min); while the
  // device is over budget (kvctl lowered it) also the share of the budget that
  // others leave, so every instance shrinks lazily until the device fits again.
  std::optional<std::size_t> external_limit_bytes() const override;
  void report_usage(std::size_t used_bytes, std::size_t mapped_bytes) noexcept override;
  // Publishes the pool's count of background worker failures (kvctl, kvtop).
  void report_worker_errors(std::uint64_t worker_errors) noexcept override;

  // Bytes other instances were recently refused: a hint for this pool's
  // background worker to give its free reserve back.
  std::size_t pressure_bytes() const noexcept override;
  // Says this instance wants `bytes` more and did not ask for them because
  // the device has no room (an engine that checks free memory before it
  // allocates never reaches try_acquire): recorded as a refusal would be, so
  // others see the pressure. A recent larger figure stays (less what was
  // granted since): this says the wait goes on, and the instances asked to
  // shrink are asked for all that is still missing. Only the part of `bytes`
  // this instance could ever hold counts (its own limit, or the budget less the
  // others' mins, bounds it); nothing is recorded when the device has room for
  // that part, or when it is nothing. Takes the registry lock.
  void want(std::size_t bytes) noexcept;
  std::optional<std::size_t> limit_bytes() const noexcept;
  std::size_t min_bytes() const noexcept;
  std::int64_t priority() const noexcept;
  // The shrink a higher-priority instance asks of this one now (docs/memory-policy.md).
  std::optional<std::size_t> reclaim_target_bytes() const noexcept;
  std::size_t mapped_bytes() const noexcept;
  // Model weights on this entry: a WeightsBudget that charges them beside the KV
  // cache (weights_bytes) and shows whether they sleep (registry_weights.cpp).
  std::shared_ptr<WeightsBudget> weights_budget();
  std::size_t weights_bytes() const noexcept;
  bool sleeping() const noexcept;
  std::size_t slot() const noexcept { return slot_; }
  std::uint64_t instance_id() const noexcept { return instance_id_; }
  const std::string& name() const noexcept { return name_; }
  bool registered() const noexcept;
  // Removes the entry now (idempotent). Bytes still counted as mapped return
  // to the budget, so call it only once nothing of this instance is mapped.
  void unregister() noexcept;

 private:
  // The entry while it still belongs to this handle and the registry is
  // usable; null once unregistered, reclaimed, or the file detached.
  registry_detail::EntryRecord* owned_entry() const noexcept;
  bool take(std::size_t bytes, bool record_refusal);
  friend class RegistryWeights;
  // After a device-wide refusal of `bytes` (lock held): records the pressure and
  // asks lower-priority instances to shrink.
  void record_refusal_locked(registry_detail::EntryRecord& entry, std::size_t bytes, bool keep_larger) noexcept;

  std::shared_ptr<registry_detail::Segment> segment_;
  std::size_t slot_;
  std::uint64_t instance_id_;
  std::string name_;
  // A forked child inherits this object but not the registration: only the
  // creating process may remove the entry (else a child's exit would).
  std::int64_t creator_pid_;
  std::atomic<bool> unregistered_{false};  // read by pool threads without the lock
};

}  // namespace kvcached
