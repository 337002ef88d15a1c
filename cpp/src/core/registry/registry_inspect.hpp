// Inspecting a file that may be a registry without mapping it: current, old-style, damaged or foreign.
//
// Layout version 1 (kvcached before device identities) is described here field
// by field, only to tell whether any live process still uses such a file: a
// version-1 file nobody uses may be replaced, one in use must be refused.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvcached::registry_detail {

struct FileVerdict {
  enum Kind {
    current,        // this layout version, whole
    old_style,      // layout version 1
    damaged,        // ours but truncated, empty, or holding impossible values
    foreign,        // not a kvcached registry
    other_version,  // a version this build does not know (maybe newer): never removed
  };
  Kind kind = foreign;
  std::string why;     // "was made by an older kvcached (layout version 1)", ...
  std::string device;  // from the header, when it has one
  // Pids of active entries whose processes are alive (current and readable old-style files).
  std::vector<std::int64_t> live_pids;
  // Old-style: whether its table could be read (else nobody can tell who uses it).
  bool table_readable = true;
  // Current: its copy holds values that contradict each other, which only a look under
  // the lock can confirm (the copy may have caught a change half-way).
  bool contradiction_seen = false;
};

// Reads the file behind `fd` (fstat'ed as `info`) with pread.
FileVerdict inspect_registry_file(int fd, const struct stat& info);

// "pids 12, 34" for messages.
std::string describe_pids(const std::vector<std::int64_t>& pids);

}  // namespace kvcached::registry_detail
