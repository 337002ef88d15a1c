// Scanning and cleaning the registry directory; refusing GPU registries keyed two ways.
#include "kvcached/registry/registry_directory.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "kvcached/registry/registry_errors.hpp"
#include "kvcached/registry/registry_names.hpp"
#include "registry_access.hpp"
#include "registry_inspect.hpp"
#include "registry_open.hpp"
#include "registry_os.hpp"

namespace kvcached {

using namespace registry_detail;
using Status = RegistryFileInfo::Status;

namespace {

constexpr const char* kUnfinishedMarker = ".init.";

// "kvcached-cpu.init.<pid>.<n>": the creator's pid, or 0.
std::int64_t creator_pid(const std::string& file_name) {
  const std::size_t at = file_name.find(kUnfinishedMarker);
  if (at == std::string::npos) return 0;
  return std::strtoll(file_name.c_str() + at + std::string(kUnfinishedMarker).size(), nullptr, 10);
}

bool creator_alive(std::int64_t pid) { return pid > 0 && live_process_start_ticks(pid).has_value(); }

RegistryFileInfo inspect(const std::string& directory, const std::string& file_name, const AccessPolicy& policy,
                         struct stat& seen) {
  RegistryFileInfo info;
  info.file_name = file_name;
  info.path = directory + "/" + file_name;
  info.device = file_name.substr(std::string(kSegmentPrefix).size());
  if (lstat(info.path.c_str(), &seen) != 0) {
    info.detail = "vanished while scanning";
    return info;
  }
  if (file_name.find(kUnfinishedMarker) != std::string::npos) {
    info.status = Status::unfinished;
    const std::int64_t pid = creator_pid(file_name);
    info.removable = !creator_alive(pid) && seen.st_uid == geteuid();
    info.detail =
        info.removable ? "left by a creation that did not finish (its process is gone)" : "a registry being created";
    return info;
  }
  if (S_ISLNK(seen.st_mode)) {
    info.status = Status::link;
    info.removable = seen.st_uid == geteuid();
    info.detail = "a symbolic link: kvcached never follows it; remove it";
    return info;
  }
  const int fd = open(info.path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    info.status = Status::denied;
    info.detail = "cannot be opened by this user (" + describe_user(geteuid()) + ")";
    return info;
  }
  struct stat opened{};
  const bool same_file = fstat(fd, &opened) == 0 && opened.st_ino == seen.st_ino;
  const FileVerdict verdict = same_file ? inspect_registry_file(fd, opened) : FileVerdict{};
  close(fd);
  if (!same_file) {
    info.detail = "changed while scanning";
    return info;
  }
  // Old-style and damaged files predate or escaped the access policy: judged
  // by their owner alone (registry_open.cpp does the same).
  const bool ours = opened.st_uid == geteuid();
  info.live_pids = verdict.live_pids;
  switch (verdict.kind) {
    case FileVerdict::current:
      try {
        check_file(opened, info.path, policy);
      } catch (const RegistryError& error) {
        info.status = Status::denied;
        info.detail = error.what();
        return info;
      }
      info.status = verdict.device == info.device ? Status::current : Status::foreign;
      if (info.status == Status::current && verdict.contradiction_seen) {
        try {
          if (auto damage = damage_seen_under_lock(info.path, info.device)) {
            info.status = Status::damaged;
            info.removable = ours;
            info.detail = *damage;
            return info;
          }
        } catch (const std::exception&) {
          // Changed meanwhile, or its lock is held too long: reported as the copy showed it.
        }
      }
      info.detail = info.status == Status::current
                        ? "used by " + std::to_string(info.live_pids.size()) + " live instance(s)"
                        : "its header names device '" + verdict.device + "'";
      break;
    case FileVerdict::old_style:
      info.status = ours ? Status::old_style : Status::denied;
      info.removable = ours && verdict.table_readable && verdict.live_pids.empty();
      info.detail = verdict.why;
      if (!ours) {
        info.detail += "; it belongs to " + describe_user(opened.st_uid);
      } else if (info.removable) {
        info.detail += "; no live process uses it";
      } else if (verdict.table_readable) {
        info.detail +=
            "; still used by " + describe_pids(verdict.live_pids) + ": stop those engines, then kvctl clean removes it";
      } else {
        info.detail += "; its table cannot be read: remove it once no engine uses it";
      }
      break;
    case FileVerdict::damaged:
      info.status = Status::damaged;
      info.removable = ours;
      info.detail = verdict.why;
      break;
    case FileVerdict::foreign:
    case FileVerdict::other_version:
      info.status = verdict.kind == FileVerdict::foreign ? Status::foreign : Status::other_version;
      info.detail = verdict.why + "; kvcached leaves it alone";
      break;
  }
  return info;
}

// Calls `visit(info, stat)` for each "kvcached-*" entry of the registry directory, sorted.
template <typename Visit>
void for_each_registry_file(Visit visit) {
  const AccessPolicy policy = AccessPolicy::configured();
  const std::string directory = registry_directory();
  DIR* listing = opendir(directory.c_str());
  if (listing == nullptr) {
    if (errno == ENOENT) return;
    throw_os_error("opendir(" + directory + ")", errno);
  }
  std::vector<std::string> names;
  while (const dirent* item = readdir(listing)) {
    const std::string name = item->d_name;
    if (name.rfind(kSegmentPrefix, 0) == 0 && name.size() > std::string(kSegmentPrefix).size()) {
      names.push_back(name);
    }
  }
  closedir(listing);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    struct stat seen{};
    const RegistryFileInfo info = inspect(directory, name, policy, seen);
    visit(info, seen, directory);
  }
}

// A GPU registry's keying: identity, index (current files), or old-style.
enum class Keying { none, identity, index, old_style };

Keying keying_of(const RegistryFileInfo& info) {
  if (info.status == Status::old_style) {
    // Version-1 files were named "cpu" or by GPU index ("cuda:0", "rocm:1").
    return is_legacy_device_name(info.device) ? Keying::old_style : Keying::none;
  }
  if (info.status != Status::current) return Keying::none;
  try {
    switch (registry_device_kind(info.device)) {
      case RegistryDeviceKind::gpu_identity:
        return Keying::identity;
      case RegistryDeviceKind::gpu_index:
        return Keying::index;
      case RegistryDeviceKind::host:
        return Keying::none;
    }
  } catch (const InvalidArgument&) {
  }
  return Keying::none;
}

const char* describe_keying(Keying keying) {
  switch (keying) {
    case Keying::identity:
      return "by physical identity";
    case Keying::index:
      return "by the index a process sees (its backend reports no identity)";
    case Keying::old_style:
      return "by index, as older kvcached versions did";
    case Keying::none:
      break;
  }
  return "";
}

}  // namespace

std::string registry_directory_path() { return registry_directory(); }

const char* status_name(Status status) noexcept {
  switch (status) {
    case Status::current:
      return "current";
    case Status::old_style:
      return "old_style";
    case Status::damaged:
      return "damaged";
    case Status::foreign:
      return "foreign";
    case Status::other_version:
      return "other_version";
    case Status::denied:
      return "denied";
    case Status::link:
      return "link";
    case Status::unfinished:
      return "unfinished";
  }
  return "unknown";
}

std::vector<RegistryFileInfo> scan_registry_directory() {
  std::vector<RegistryFileInfo> files;
  for_each_registry_file(
      [&](const RegistryFileInfo& info, const struct stat&, const std::string&) { files.push_back(info); });
  return files;
}

std::vector<RegistryFileInfo> clean_registry_directory() {
  std::vector<RegistryFileInfo> removed;
  for_each_registry_file([&](const RegistryFileInfo& info, const struct stat& seen, const std::string& directory) {
    if (info.removable && remove_if_unchanged(directory, info.path, seen)) removed.push_back(info);
  });
  return removed;
}

void check_registry_keying(const std::string& device) {
  const RegistryDeviceKind kind = registry_device_kind(device);
  if (kind == RegistryDeviceKind::host) return;
  const Keying mine = kind == RegistryDeviceKind::gpu_identity ? Keying::identity : Keying::index;
  for_each_registry_file([&](const RegistryFileInfo& info, const struct stat& seen, const std::string& directory) {
    const Keying theirs = keying_of(info);
    if (theirs == Keying::none || theirs == mine) return;
    if (info.live_pids.empty()) {
      if (info.removable) remove_if_unchanged(directory, info.path, seen);
      return;
    }
    throw RegistryUnusable("registry " + info.path + " keys a GPU " + describe_keying(theirs) + " and is used by " +
                           describe_pids(info.live_pids) + ", while this process keys its GPU " +
                           describe_keying(mine) + " (" + device +
                           "): the two could be one GPU with two independent budgets. Run one kvcached version "
                           "with the same GPU backend for every engine on this machine; once those processes are "
                           "gone, kvctl clean (or the next registration) removes an old-style file");
  });
}

}  // namespace kvcached
