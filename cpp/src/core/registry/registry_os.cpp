// OS helpers of the registry: /proc liveness, clocks, user and group names.
#include "registry_os.hpp"

#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kvcached/error.hpp"

namespace kvcached::registry_detail {

namespace {
// /proc/<pid>/stat: fields after the command name start at field 3 (state);
// field 22 is the start time in clock ticks since boot.
constexpr std::size_t kStatStateField = 3;
constexpr std::size_t kStatStartTimeField = 22;
constexpr std::size_t kNameBufferBytes = 16384;
}  // namespace

void throw_os_error(const std::string& call, int error) {
  throw DriverError("registry", call, error, std::strerror(error));
}

std::int64_t monotonic_now_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

namespace {

enum class ProcState { missing, exited, running };

// What /proc/<pid>/stat says: missing (no such file: no process, or hidden),
// exited (zombie) or running, with its start time.
ProcState read_proc_stat(std::int64_t pid, std::uint64_t& start_ticks) {
  // stdio rather than iostreams: see device.cpp on libstdc++ locale state.
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return ProcState::missing;
  char buffer[1024] = {};
  const std::size_t length = std::fread(buffer, 1, sizeof buffer - 1, file);
  std::fclose(file);
  const std::string line(buffer, length);
  // The command name (field 2) may contain spaces and parentheses; it ends at the last ')'.
  const std::size_t name_end = line.rfind(')');
  if (name_end == std::string::npos) return ProcState::missing;
  std::size_t cursor = name_end + 1;
  for (std::size_t index = kStatStateField;; ++index) {
    const std::size_t begin = line.find_first_not_of(" \n", cursor);
    if (begin == std::string::npos) return ProcState::missing;
    const std::size_t end = std::min(line.find_first_of(" \n", begin), line.size());
    const std::string field = line.substr(begin, end - begin);
    cursor = end;
    if (index == kStatStateField && (field == "Z" || field == "X")) return ProcState::exited;
    if (index == kStatStartTimeField) {
      start_ticks = std::strtoull(field.c_str(), nullptr, 10);
      return ProcState::running;
    }
  }
}

}  // namespace

std::optional<std::uint64_t> live_process_start_ticks(std::int64_t pid) {
  std::uint64_t start_ticks = 0;
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max() || read_proc_stat(pid, start_ticks) != ProcState::running) {
    return std::nullopt;
  }
  return start_ticks;
}

bool process_alive(std::int64_t pid, std::uint64_t start_ticks) {
  // Outside pid_t's positive range no process can have it (and the cast for
  // kill() below would turn it into another pid, 0 being "my process group").
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return false;
  std::uint64_t actual_ticks = 0;
  switch (read_proc_stat(pid, actual_ticks)) {
    case ProcState::running:
      return actual_ticks == start_ticks;
    case ProcState::exited:
      return false;
    case ProcState::missing:
      break;
  }
  // Not in /proc: gone, or hidden from this user (hidepid); kill(0) tells.
  return kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

std::string describe_user(uid_t uid) {
  std::vector<char> buffer(kNameBufferBytes);
  passwd entry{};
  passwd* found = nullptr;
  getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found);
  const std::string id = "uid " + std::to_string(uid);
  return found ? std::string(found->pw_name) + " (" + id + ")" : id;
}

std::string group_name(gid_t gid) {
  std::vector<char> buffer(kNameBufferBytes);
  group entry{};
  group* found = nullptr;
  getgrgid_r(gid, &entry, buffer.data(), buffer.size(), &found);
  return found ? std::string(found->gr_name) : std::to_string(gid);
}

std::string describe_group(gid_t gid) {
  const std::string name = group_name(gid);
  const std::string id = "gid " + std::to_string(gid);
  return name == std::to_string(gid) ? id : name + " (" + id + ")";
}

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

}  // namespace kvcached::registry_detail
