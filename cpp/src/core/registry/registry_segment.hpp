// Segment: one mapped registry file, and how it notices that the file is no longer its own.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "registry_format.hpp"

namespace kvcached::registry_detail {

// Why a segment stopped being usable; 0 while it is.
// How often the hot paths (try_acquire) also check that the path still names the file.
inline constexpr std::int64_t kPathCheckIntervalNs = 100'000'000;

enum DetachReason : int {
  kAttached = 0,
  kTruncated,    // the file shrank (seen by fstat)
  kFaulted,      // an access raised SIGBUS: the file shrank (seen by the fault guard)
  kRemoved,      // the file was unlinked
  kReplaced,     // the path now names another file
  kOverwritten,  // the header no longer describes this device's registry
  kImpossible,   // the table holds a value that cannot be true (table_lie)
};

// The mapped file. Shared by the DeviceRegistry and every RegistryBudget made
// from it, so the mapping outlives whichever is dropped first. Keeps the file
// descriptor open to check, on every locked operation, that the file is still
// the one the path names and still whole.
class Segment {
 public:
  // Takes ownership of `fd` and of the mapping `layout` (kLayoutBytes) of it.
  Segment(std::string path, std::string device, int fd, Layout* layout);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const std::string& path() const noexcept { return path_; }
  const std::string& device() const noexcept { return device_; }
  Layout& layout() noexcept { return *layout_; }
  const Layout& layout() const noexcept { return *layout_; }
  Header& header() noexcept { return layout_->header; }
  const Header& header() const noexcept { return layout_->header; }
  EntryRecord& entry(std::size_t slot) noexcept { return layout_->entries[slot]; }
  const EntryRecord& entry(std::size_t slot) const noexcept { return layout_->entries[slot]; }

  // One relaxed load: lock-free readers call it before trusting the mapping.
  bool detached() const noexcept { return reason_.load(std::memory_order_relaxed) != kAttached; }
  // Throws RegistryUnusable unless the file is still whole, still linked and
  // its header still this device's; detaches the segment first. With
  // `check_path`, also that the path still names this file (one more syscall);
  // without, that too at most every kPathCheckIntervalNs, so an engine whose
  // file or directory was renamed away stops taking memory from a budget that
  // new engines no longer see.
  void check_intact(bool check_path);
  // Throws RegistryUnusable if detached.
  void check_attached() const;
  // Throws RegistryUnusable (detaching first) if the header no longer
  // describes this device's registry; memory reads only, no system call.
  // Called before every lock: a garbage mutex is never handed to pthreads.
  void check_header();
  // Throws RegistryUnusable (detaching first) if the table holds a value that
  // cannot be true (table_lie). Never a false alarm, with or without the lock.
  void check_table();
  // The same, and values that contradict each other (table_contradiction): call
  // with the lock held, the only place where those are certain.
  void check_table_locked();
  // What the table was found to lie about, once detached for it (kImpossible).
  std::optional<std::string> lie() const;
  [[noreturn]] void throw_unusable() const;
  // Stops using the file (idempotent; the first reason is kept).
  void detach(DetachReason reason) noexcept;

 private:
  [[noreturn]] void detach_for_lie(const std::string& lie);

  std::string path_;
  std::string device_;
  int fd_;
  Layout* layout_;
  dev_t file_device_ = 0;
  ino_t file_inode_ = 0;
  std::atomic<int> reason_{kAttached};
  std::atomic<std::int64_t> path_checked_at_ns_{0};
  int watch_token_ = -1;
  mutable std::mutex lie_mutex_;  // guards lie_ (messages only)
  std::string lie_;               // what table_lie found, for kImpossible
};

}  // namespace kvcached::registry_detail
