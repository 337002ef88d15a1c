// The access-control model of registry_access.hpp: group setting, directory and file checks.
#include "registry_access.hpp"

#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvcached/error.hpp"
#include "kvcached/registry/registry_errors.hpp"
#include "kvcached/registry/registry_settings.hpp"
#include "registry_os.hpp"

namespace kvcached::registry_detail {

namespace {

constexpr std::size_t kGroupBufferBytes = 1 << 16;
constexpr const char* kSecurityDoc = " (see docs/security.md)";

std::string group_hint(const AccessPolicy& policy) {
  return policy.group ? std::string(kRegistryGroupEnv) + "=" + policy.group_text
                      : std::string(kRegistryGroupEnv) + " (unset)";
}

std::string describe_file(const struct stat& info) {
  return "owner " + describe_user(info.st_uid) + ", group " + describe_group(info.st_gid) + ", mode " +
         octal_mode(info.st_mode);
}

// Largest gid a setting may name: (gid_t)-1 tells chown() to leave the group alone.
constexpr unsigned long long kMaxGroupId = static_cast<gid_t>(-1) - 1ull;
constexpr std::size_t kMaxGroupIdDigits = 10;  // 4294967294

std::string group_error(const std::string& text, const std::string& why) {
  return std::string(kRegistryGroupEnv) + "='" + text + "' is invalid: " + why +
         "; give a group name or a gid from 0 to " + std::to_string(kMaxGroupId) + kSecurityDoc;
}

std::mutex settings_mutex;
std::optional<RegistrySettings> configured_settings;  // guarded by settings_mutex

bool trusted_owner(uid_t owner) { return owner == geteuid() || owner == 0; }

void check_parent(const std::string& parent, uid_t directory_owner, const AccessPolicy& policy,
                  const std::string& setting) {
  struct stat info{};
  if (lstat(parent.c_str(), &info) != 0) {
    if (errno == ENOENT) return;  // creating the directory says so, naming the missing parent
    throw_os_error("lstat(" + parent + ")", errno);
  }
  // A link is as safe as the directory holding it (checked too) and where it
  // leads (checked along the resolved path).
  if (S_ISLNK(info.st_mode)) return;
  const std::string where = "directory " + parent + " above the registry directory (" + setting + ")";
  const bool sticky = info.st_mode & S_ISVTX;
  if (!trusted_owner(info.st_uid) && info.st_uid != directory_owner) {
    throw RegistryAccessDenied(where + " has " + describe_file(info) +
                               ": its owner could move the registry directory away or replace "
                               "it. Use a registry directory whose parents belong to root or "
                               "to you" +
                               kSecurityDoc);
  }
  if ((info.st_mode & S_IWOTH) && !sticky) {
    throw RegistryAccessDenied(where + " is writable by every user without the sticky bit (mode " +
                               octal_mode(info.st_mode) +
                               "): anyone could rename the registry directory or replace it" + kSecurityDoc);
  }
  const bool group_trusted = policy.group && info.st_gid == *policy.group;
  if ((info.st_mode & S_IWGRP) && !sticky && !group_trusted) {
    throw RegistryAccessDenied(where + " is writable by group " + describe_group(info.st_gid) +
                               " without the sticky bit, and " + group_hint(policy) +
                               " does not name that group: its members could rename the registry "
                               "directory or replace it" +
                               kSecurityDoc);
  }
}

// Whoever may rename an entry of a directory above the registry directory can
// move the registry away from its path (engines already running keep using it,
// new ones and kvctl see another) or put their own directory there. So every
// directory above it must belong to root, the caller or the registry
// directory's owner, and be writable by others only with the sticky bit (like
// /tmp and /dev/shm: then only an entry's owner may rename it), by its group
// only with the sticky bit or when that is the group of the setting. Both the
// path as written and the one its symbolic links lead to are checked.
void check_parents(const std::string& directory, uid_t directory_owner, const AccessPolicy& policy,
                   const std::string& setting) {
  std::vector<std::string> paths = {directory};
  if (char* resolved = realpath(directory.c_str(), nullptr)) {
    if (directory != resolved) paths.emplace_back(resolved);
    std::free(resolved);
  }
  for (const std::string& path : paths) {
    for (std::size_t slash = path.rfind('/'); slash != std::string::npos && slash > 0;
         slash = path.rfind('/', slash - 1)) {
      check_parent(path.substr(0, slash), directory_owner, policy, setting);
    }
    if (path.size() > 1) check_parent("/", directory_owner, policy, setting);
  }
}

}  // namespace

AccessPolicy AccessPolicy::configured() {
  AccessPolicy policy;
  const RegistrySettings settings = registry_settings();
  if (settings.group.empty()) return policy;
  policy.group_text = settings.group;
  policy.group = resolve_registry_group(settings.group);
  return policy;
}

std::string registry_directory() {
  std::string directory = registry_settings().directory;
  while (directory.size() > 1 && directory.back() == '/') directory.pop_back();
  return directory;
}

void prepare_directory(const std::string& directory, const AccessPolicy& policy, bool create) {
  const std::string setting = std::string(kRegistryDirEnv) + "=" + directory;
  struct stat info{};
  const bool exists = stat(directory.c_str(), &info) == 0;
  if (!exists && errno != ENOENT) throw_os_error("stat(" + directory + ")", errno);
  // Before anything is created in them; a directory about to be made is the caller's.
  check_parents(directory, exists ? info.st_uid : geteuid(), policy, setting);
  if (!exists) {
    const std::size_t slash = directory.rfind('/');
    const std::string parent = slash == 0 ? "/" : directory.substr(0, slash);
    if (!create) {
      throw RegistryNotFound("no kvcached registry in " + directory + ": the directory does not exist (" + setting +
                             "; it is created when the first engine registers)");
    }
    if (mkdir(directory.c_str(), policy.directory_mode()) != 0 && errno != EEXIST) {
      const int mkdir_error = errno;
      if (mkdir_error == ENOENT) {
        throw RegistryNotFound("cannot create the registry directory " + directory + " (" + setting + "): its parent " +
                               parent + " does not exist; create it or choose another directory");
      }
      throw_os_error("mkdir(" + directory + ") for " + setting, mkdir_error);
    }
    // The umask may have narrowed the mode; the group must be the policy's.
    if (policy.group && chown(directory.c_str(), static_cast<uid_t>(-1), *policy.group) != 0) {
      throw RegistryAccessDenied("cannot give the registry directory " + directory + " to group " +
                                 describe_group(*policy.group) + " (" + group_hint(policy) +
                                 "): you are not a member of it" + kSecurityDoc);
    }
    if (chmod(directory.c_str(), policy.directory_mode()) != 0) {
      throw_os_error("chmod(" + directory + ")", errno);
    }
    if (stat(directory.c_str(), &info) != 0) throw_os_error("stat(" + directory + ")", errno);
  }
  if (!S_ISDIR(info.st_mode)) {
    throw RegistryUnusable(setting + " is not a directory");
  }
  const bool group_trusted = policy.group && info.st_gid == *policy.group;
  if (!trusted_owner(info.st_uid) && !group_trusted) {
    throw RegistryAccessDenied("registry directory " + directory + " (" + setting + ") has " + describe_file(info) +
                               ": its owner could replace the registries in it. Use a directory "
                               "of your own, root's, or one of the group in " +
                               group_hint(policy) + kSecurityDoc);
  }
  const bool sticky = info.st_mode & S_ISVTX;
  if ((info.st_mode & S_IWOTH) && !sticky) {
    throw RegistryAccessDenied("registry directory " + directory + " (" + setting +
                               ") is writable by every user without the sticky bit (mode " + octal_mode(info.st_mode) +
                               "): anyone could replace the registries in it" + kSecurityDoc);
  }
  if ((info.st_mode & S_IWGRP) && !sticky && !group_trusted) {
    throw RegistryAccessDenied("registry directory " + directory + " (" + setting + ") is writable by group " +
                               describe_group(info.st_gid) + " without the sticky bit, and " + group_hint(policy) +
                               " does not name that group: its members could replace the "
                               "registries in it" +
                               kSecurityDoc);
  }
}

void check_file(const struct stat& info, const std::string& path, const AccessPolicy& policy) {
  if (!S_ISREG(info.st_mode)) {
    throw RegistryUnusable("registry path " + path + " is not a regular file; remove it");
  }
  const mode_t mode = info.st_mode & 0777;
  if (mode & 0007) {
    throw RegistryAccessDenied(
        "registry " + path + " is open to every user (" + describe_file(info) +
        "): anyone could change its budgets or damage it, so kvcached does not use it. Remove it "
        "once no engine uses it; kvcached then creates it private to its user (mode 0600), or "
        "shared with the group in " +
        std::string(kRegistryGroupEnv) + " (mode 0660)" + kSecurityDoc);
  }
  if (!policy.group) {
    if (mode & 0070) {
      throw RegistryAccessDenied("registry " + path + " is shared with group " + describe_group(info.st_gid) + " (" +
                                 describe_file(info) + ") but " + kRegistryGroupEnv + " is not set here: set " +
                                 kRegistryGroupEnv + "=" + group_name(info.st_gid) + " to use it" + kSecurityDoc);
    }
    if (info.st_uid != geteuid()) {
      throw RegistryAccessDenied(
          "registry " + path + " is private to " + describe_user(info.st_uid) + " (" + describe_file(info) +
          "); only its owner may use it. To share a device between users, "
          "set " +
          kRegistryGroupEnv + " to a group all of them belong to, for every engine and tool" + kSecurityDoc);
    }
    return;
  }
  if (info.st_gid != *policy.group || (mode & 0060) != 0060) {
    throw RegistryAccessDenied(
        "registry " + path + " (" + describe_file(info) + ") is not shared with the group in " + group_hint(policy) +
        " (expected that group and mode 0660). It was created with another "
        "setting: use the same " +
        kRegistryGroupEnv + " everywhere, or remove the file once no engine uses it" + kSecurityDoc);
  }
}

void throw_open_denied(const std::string& path, const AccessPolicy& policy) {
  struct stat info{};
  if (lstat(path.c_str(), &info) != 0) {
    throw RegistryAccessDenied("registry " + path + " cannot be opened: permission denied (" + group_hint(policy) +
                               ")" + kSecurityDoc);
  }
  std::string why;
  if (info.st_mode & 0070) {
    why = "it is shared with group " + describe_group(info.st_gid) + " and you are not a member of it";
  } else {
    why = "it is private to " + describe_user(info.st_uid) + "; to share a device between users, set " +
          std::string(kRegistryGroupEnv) + " to a group all of them belong to, for every engine and tool";
  }
  throw RegistryAccessDenied("registry " + path + " (" + describe_file(info) + ") cannot be opened by " +
                             describe_user(geteuid()) + ": " + why + " (here " + group_hint(policy) + ")" +
                             kSecurityDoc);
}

void apply_policy(int fd, const std::string& path, const AccessPolicy& policy) {
  if (policy.group && fchown(fd, static_cast<uid_t>(-1), *policy.group) != 0) {
    throw RegistryAccessDenied("cannot give registry " + path + " to group " + describe_group(*policy.group) + " (" +
                               group_hint(policy) + "): you are not a member of it" + kSecurityDoc);
  }
  if (fchmod(fd, policy.file_mode()) != 0) throw_os_error("fchmod(" + path + ")", errno);
}

}  // namespace kvcached::registry_detail

namespace kvcached {

using namespace registry_detail;

gid_t resolve_registry_group(const std::string& text) {
  const bool numeric = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  if (numeric) {
    // Range-checked before the cast: a wider value would wrap to another group.
    const std::size_t first_digit = text.find_first_not_of('0');
    const std::size_t digits = first_digit == std::string::npos ? 1 : text.size() - first_digit;
    if (digits > kMaxGroupIdDigits || std::stoull(text) > kMaxGroupId) {
      throw InvalidArgument(group_error(text, "the gid is out of range"));
    }
    // A gid without a name is still a group the kernel knows.
    return static_cast<gid_t>(std::stoull(text));
  }
  std::vector<char> buffer(kGroupBufferBytes);
  group entry{};
  group* found = nullptr;
  if (getgrnam_r(text.c_str(), &entry, buffer.data(), buffer.size(), &found) != 0 || found == nullptr) {
    throw InvalidArgument(group_error(text, "it names no group on this machine"));
  }
  return found->gr_gid;
}

void configure_registry(const RegistrySettings& settings) {
  if (settings.directory.empty() || settings.directory.front() != '/') {
    // Processes started from different working directories would disagree.
    throw InvalidArgument(std::string(kRegistryDirEnv) + "='" + settings.directory + "' must be an absolute path");
  }
  if (!settings.group.empty()) resolve_registry_group(settings.group);
  std::lock_guard<std::mutex> lock(settings_mutex);
  configured_settings = settings;
}

RegistrySettings registry_settings() {
  std::lock_guard<std::mutex> lock(settings_mutex);
  if (!configured_settings) {
    throw InvalidArgument(
        "the registry's directory and group are not configured: call "
        "configure_registry() first (Python does so from kvcached.config)");
  }
  return *configured_settings;
}

}  // namespace kvcached
