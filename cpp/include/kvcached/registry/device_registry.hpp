// DeviceRegistry: the per-device table in shared memory through which separate
// engine processes share one device's memory budget.
//
// Rationale. Several engines (separate processes, possibly separate users of one
// GPU) each grow their KV cache when busy and give it back when idle. None may
// push the others into out-of-memory, so every page any of them maps is taken
// from one device-wide budget, atomically across processes, and returned only
// once really unmapped.
//
// Approach. One file per device, `<dir>/kvcached-<device>` (dir: env
// KVCACHED_REGISTRY_DIR, default /dev/shm), mapped MAP_SHARED by every user. It
// holds a versioned header, a process-shared robust mutex, the device budget and
// a fixed table of instance entries (name, pid, process start time, limit,
// mapped / used / reserved bytes). The first user builds the file under a
// temporary name and links it into place, so nobody ever sees it half-made.
// Every field is a lock-free 64-bit atomic: writers hold the mutex (so "check
// the budget, then take" is one step), readers on the hot path (available
// bytes, limits) read without it.
//
// Limitations. Liveness is judged from /proc/<pid>/stat, so all users must
// share one PID namespace (containers sharing a GPU must also share PIDs). The
// layout depends on the C library's pthread_mutex_t; a layout or version
// mismatch is refused with a message, never guessed at.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "kvcached/blocks/memory_budget.hpp"

namespace kvcached {

namespace registry_detail {
struct Segment;
}

// How many instances one device's registry can hold at once.
inline constexpr std::size_t kRegistryCapacity = 64;
// Longest instance name, in bytes (the table stores names inline).
inline constexpr std::size_t kRegistryNameMaxBytes = 63;
// Longest device name ("cpu", "cuda:0", "rocm:7"), in bytes.
inline constexpr std::size_t kRegistryDeviceMaxBytes = 31;

// The registry file for `device` does not exist and no budget was given to create it.
class KVCACHED_EXPORT RegistryNotFound : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One instance as seen in a snapshot of the table.
struct RegistryEntryInfo {
  std::size_t slot = 0;
  std::uint64_t instance_id = 0;  // unique for the life of the file; slots are reused
  std::string name;
  std::int64_t pid = 0;
  std::uint64_t start_time_ticks = 0;  // /proc/<pid>/stat field 22
  bool alive = false;
  std::optional<std::size_t> limit_bytes;
  std::size_t mapped_bytes = 0;    // taken from the budget (every mapped page)
  std::size_t used_bytes = 0;      // pages holding blocks in use, as the pool reports
  std::size_t reserved_bytes = 0;  // mapped but free (background reserve), as reported
  std::size_t wanted_bytes = 0;    // last refused request, while recent (see pressure)
};

class RegistryBudget;

class KVCACHED_EXPORT DeviceRegistry {
 public:
  // Opens the registry of `device` ("cpu", "cuda:0", ...), creating it with
  // `budget_bytes` if it does not exist yet (the first user decides; later
  // users keep the existing budget). Without a budget a missing registry is
  // RegistryNotFound.
  static std::shared_ptr<DeviceRegistry> open(const std::string& device,
                                              std::optional<std::size_t> budget_bytes);
  // Where the registry of `device` lives (honours KVCACHED_REGISTRY_DIR).
  static std::string segment_path(const std::string& device);

  const std::string& device() const noexcept { return device_; }
  const std::string& path() const noexcept;

  std::size_t budget_bytes() const noexcept;
  // Takes effect at once: a lower budget refuses new pages until enough are
  // unmapped, and instances are told to shrink (external_limit_bytes).
  void set_budget_bytes(std::size_t budget_bytes);
  // Sum of every entry's mapped bytes, dead ones included until reclaimed.
  std::size_t mapped_bytes() const noexcept;
  std::size_t available_bytes() const noexcept;

  std::vector<RegistryEntryInfo> entries() const;
  // Sets (or, with nullopt, clears) the limit of the instances with this pid,
  // or with this name; returns how many entries changed (0: none matched).
  std::size_t set_limit(const std::variant<std::int64_t, std::string>& name_or_pid,
                        std::optional<std::size_t> limit_bytes);
  // Frees the entries of dead processes; their mapped bytes return to the
  // budget. Returns how many were freed.
  std::size_t clean_stale();
  // Adds an entry for `pid` (default: this process) with an optional initial
  // limit. Stale entries are reclaimed first, so a restarted engine finds its
  // predecessor's memory free.
  std::shared_ptr<RegistryBudget> register_instance(
      const std::string& name, std::optional<std::int64_t> pid = std::nullopt,
      std::optional<std::size_t> limit_bytes = std::nullopt);

  // Test hook: takes the registry lock and returns without releasing it, so a
  // test can kill the process while it holds the lock. Never use otherwise.
  void hold_lock_for_test();

 private:
  DeviceRegistry(std::string device, std::shared_ptr<registry_detail::Segment> segment);
  std::string device_;
  std::shared_ptr<registry_detail::Segment> segment_;
};

// One registered instance's view of the device budget. Implements MemoryBudget
// so a pool takes its pages from the shared budget; unregisters on destruction.
class KVCACHED_EXPORT RegistryBudget : public MemoryBudget {
 public:
  RegistryBudget(std::shared_ptr<registry_detail::Segment> segment, std::size_t slot,
                 std::uint64_t instance_id, std::string name);
  ~RegistryBudget() override;
  RegistryBudget(const RegistryBudget&) = delete;
  RegistryBudget& operator=(const RegistryBudget&) = delete;

  // Takes `bytes` if both the device budget and this instance's limit allow.
  // When refused, dead processes' entries are reclaimed (at most every
  // kStaleScanInterval) and the request is retried once.
  bool try_acquire(std::size_t bytes) override;
  void release(std::size_t bytes) noexcept override;
  std::size_t available_bytes() const override;
  // This instance's limit (kvctl); while the device is over budget (kvctl
  // lowered it) also the share of the budget that others leave, so every
  // instance shrinks lazily until the device fits again.
  std::optional<std::size_t> external_limit_bytes() const override;
  void report_usage(std::size_t used_bytes, std::size_t mapped_bytes) noexcept override;

  // Bytes other instances were recently refused: a hint for this pool's
  // background worker to give its free reserve back.
  std::size_t pressure_bytes() const noexcept override;
  std::optional<std::size_t> limit_bytes() const noexcept;
  std::size_t mapped_bytes() const noexcept;
  std::size_t slot() const noexcept { return slot_; }
  std::uint64_t instance_id() const noexcept { return instance_id_; }
  const std::string& name() const noexcept { return name_; }
  bool registered() const noexcept;
  // Removes the entry now (idempotent). Bytes still counted as mapped return
  // to the budget, so call it only once nothing of this instance is mapped.
  void unregister() noexcept;

 private:
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
