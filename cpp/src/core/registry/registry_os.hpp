// Operating-system helpers of the registry: errors, clocks, process liveness, user names.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace kvcached::registry_detail {

[[noreturn]] void throw_os_error(const std::string& call, int error);

// CLOCK_MONOTONIC in ns: one clock for every process on the host.
std::int64_t monotonic_now_ns() noexcept;

// Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22),
// or nullopt when the process does not exist, has exited (a zombie's memory
// is already freed) or cannot be seen in /proc.
std::optional<std::uint64_t> live_process_start_ticks(std::int64_t pid);

// The process `pid` is alive and is the one that started at `start_ticks`
// (a different start time means the pid was reused by an unrelated process).
// A process that exists but is hidden from this user's /proc (hidepid) counts
// as alive: its entry must not be reclaimed on a guess.
bool process_alive(std::int64_t pid, std::uint64_t start_ticks);

// "alice (uid 1000)" / "uid 1000" when the name is unknown; same for groups.
std::string describe_user(uid_t uid);
std::string describe_group(gid_t gid);
// The group's name, or its number when it has none.
std::string group_name(gid_t gid);
// "0660"
std::string octal_mode(mode_t mode);

}  // namespace kvcached::registry_detail
