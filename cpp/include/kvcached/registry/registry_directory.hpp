// The registry directory as a whole: what files it holds, cleaning it, old-style registries.
//
// Old-style registries (layout version 1, GPUs named by index such as
// "kvcached-cuda:0") cannot share a budget with current ones. A GPU instance
// is therefore refused while a GPU registry keyed another way (old-style, or by
// index rather than identity, or the reverse) has live instances in the same
// directory: the two could be one GPU with two independent budgets. Old-style
// files no live process uses are removed on the way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvcached/error.hpp"

namespace kvcached {

struct RegistryFileInfo {
  enum class Status {
    current,        // a registry of this kvcached
    old_style,      // layout version 1
    damaged,        // truncated or wiped
    foreign,        // not a kvcached registry
    other_version,  // made by another kvcached version
    denied,         // the access policy refuses it for this user
    link,           // a symbolic link (never followed)
    unfinished,     // a creation under a temporary name
  };
  std::string file_name;  // "kvcached-cpu"
  std::string path;
  std::string device;  // the name after "kvcached-"
  Status status = Status::foreign;
  std::vector<std::int64_t> live_pids;  // processes with live entries (current, old-style)
  bool removable = false;               // what clean_registry_directory would remove
  std::string detail;                   // plain words: what it is and what to do
};

// Where fields sit in the current file layout, by name ("entries", "entry_bytes",
// "entry.pid", "entry.name", "header.version", ...): for tests that damage a
// file on purpose and for tools that read one. Not an interface to write through.
KVCACHED_EXPORT std::vector<std::pair<std::string, std::size_t>> registry_layout_offsets();

// The configured registry directory (registry_settings.hpp).
KVCACHED_EXPORT std::string registry_directory_path();

KVCACHED_EXPORT const char* status_name(RegistryFileInfo::Status status) noexcept;

// Every "kvcached-*" file of the registry directory, sorted by name; nothing is changed.
KVCACHED_EXPORT std::vector<RegistryFileInfo> scan_registry_directory();

// Removes what no process can use any more: old-style files without live
// instances, damaged files, unfinished creations of dead processes and the
// caller's own symbolic links. Returns what was removed.
KVCACHED_EXPORT std::vector<RegistryFileInfo> clean_registry_directory();

// Throws RegistryUnusable if registering on GPU `device` could create a second
// budget for one GPU (see above); removes old-style files no live process uses.
KVCACHED_EXPORT void check_registry_keying(const std::string& device);

}  // namespace kvcached
