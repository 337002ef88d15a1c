// Where the device registries live and which group shares them: given by the caller, never
// read from the environment (Python passes kvcached.config's values before each registry call).
#pragma once

#include <sys/types.h>

#include <string>

#include "kvcached/error.hpp"

namespace kvcached {

struct RegistrySettings {
  std::string directory;  // absolute (KVCACHED_REGISTRY_DIR)
  std::string group;      // a group name or gid (KVCACHED_REGISTRY_GROUP); empty: private registries
};

// Makes `settings` the ones every later registry call of this process uses. InvalidArgument
// (nothing changed) for a relative directory or a group this machine does not know.
KVCACHED_EXPORT void configure_registry(const RegistrySettings& settings);

// The settings configure_registry() was last given; InvalidArgument if it never was.
KVCACHED_EXPORT RegistrySettings registry_settings();

// The gid `text` names: a group name, or a gid in ASCII digits from 0 to 2^32 - 2
// ((gid_t)-1 means "no change" to chown). InvalidArgument naming KVCACHED_REGISTRY_GROUP
// and what to give otherwise.
KVCACHED_EXPORT gid_t resolve_registry_group(const std::string& text);

}  // namespace kvcached
