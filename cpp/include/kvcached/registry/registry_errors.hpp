// Errors of the device registry; Python sees them as kvcached.errors.Registry*Error.
#pragma once

#include <stdexcept>

#include "kvcached/error.hpp"

namespace kvcached {

// Base of every registry failure other than bad arguments (InvalidArgument).
class KVCACHED_EXPORT RegistryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The registry file for a device does not exist and no budget was given to create it.
class KVCACHED_EXPORT RegistryNotFound : public RegistryError {
 public:
  using RegistryError::RegistryError;
};

// The access-control model refuses the file or its directory for this user
// (see docs/security.md); the message names the file and KVCACHED_REGISTRY_GROUP.
class KVCACHED_EXPORT RegistryAccessDenied : public RegistryError {
 public:
  using RegistryError::RegistryError;
};

// The file cannot serve as this device's registry: not a registry, an older
// layout still in use, damaged, a symbolic link, or truncated, removed or
// replaced while this process was using it. The message says what to do.
class KVCACHED_EXPORT RegistryUnusable : public RegistryError {
 public:
  using RegistryError::RegistryError;
};

}  // namespace kvcached
