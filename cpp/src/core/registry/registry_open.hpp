// Finding, creating and replacing registry files: paths, symlinks, races, stale files.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "registry_access.hpp"
#include "registry_segment.hpp"

namespace kvcached::registry_detail {

// Where the registry of canonical `device` lives.
std::string registry_path(const std::string& device);

// Opens the registry of `device`, creating it with `budget_bytes` if missing.
// Without a budget a missing registry is RegistryNotFound. The path is opened
// without following symbolic links; the file and directory must pass the
// access policy. A damaged file, or an old-style one no live process uses, is
// replaced when creating and reported (RegistryUnusable) otherwise.
std::shared_ptr<Segment> open_or_create_segment(const std::string& device, std::optional<std::size_t> budget_bytes);

// Why the current registry file at `path` is damaged, judged with it open and its lock
// held (values that contradict each other are certain only there); nullopt when it is
// sound. Throws what opening it would (another version, access denied, ...).
std::optional<std::string> damage_seen_under_lock(const std::string& path, const std::string& device);

// Exclusive lock on a directory (flock), so that removing a stale file cannot
// race with another remover putting a fresh one in its place.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::string& directory);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_;
};

// Unlinks `path` if it is still the file `seen` (same device and inode); holds
// the directory lock meanwhile. True if removed.
bool remove_if_unchanged(const std::string& directory, const std::string& path, const struct stat& seen);

}  // namespace kvcached::registry_detail
