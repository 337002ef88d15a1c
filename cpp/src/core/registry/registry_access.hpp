// The registry's access-control model: who may open a registry file and its directory.
//
// A registry is private to the user who created it (file mode 0600), unless
// KVCACHED_REGISTRY_GROUP names a group (by name or gid): then it is created
// mode 0660 and owned by that group, and every member who sets the same value
// may use it. Nobody else can open it, so nobody else can change a budget or a
// limit, truncate it or corrupt it. A file is used only if it matches the
// setting exactly: regular, no access for others, private and owned by the
// caller (no group set) or shared with exactly the named group. The directory
// (KVCACHED_REGISTRY_DIR; created 0700 / 0770 when missing)
// must belong to the caller, root or that group, and must not let others
// replace files in it (writable by others only with the sticky bit); the
// directories above it must not let others rename it (belong to root, the
// caller or its owner; writable by others only with the sticky bit). Every
// refusal names the file and the setting. docs/security.md is the user's view.
// Both settings come from configure_registry() (registry_settings.hpp), not the environment.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <optional>
#include <string>

namespace kvcached::registry_detail {

inline constexpr const char* kRegistryDirEnv = "KVCACHED_REGISTRY_DIR";
inline constexpr const char* kRegistryGroupEnv = "KVCACHED_REGISTRY_GROUP";
inline constexpr const char* kSegmentPrefix = "kvcached-";

struct AccessPolicy {
  std::optional<gid_t> group;  // KVCACHED_REGISTRY_GROUP, resolved
  std::string group_text;      // as the user wrote it

  // The group of the configured settings (registry_settings.hpp), resolved;
  // InvalidArgument if it names no group.
  static AccessPolicy configured();
  mode_t file_mode() const noexcept { return group ? 0660 : 0600; }
  mode_t directory_mode() const noexcept { return group ? 0770 : 0700; }
};

// The configured directory (registry_settings.hpp), without trailing '/'.
std::string registry_directory();

// Checks the directory against the policy. A missing directory is created with
// the policy's mode when `create`, else RegistryNotFound names it.
void prepare_directory(const std::string& directory, const AccessPolicy& policy, bool create);

// Checks an opened registry file (fstat of the descriptor); RegistryAccessDenied
// or RegistryUnusable name the file, what is wrong and the setting to use.
void check_file(const struct stat& info, const std::string& path, const AccessPolicy& policy);

// Explains why open(path) failed with EACCES / EPERM; always throws RegistryAccessDenied.
[[noreturn]] void throw_open_denied(const std::string& path, const AccessPolicy& policy);

// Gives a file being created the policy's exact mode and group (umask aside).
void apply_policy(int fd, const std::string& path, const AccessPolicy& policy);

}  // namespace kvcached::registry_detail
