// Error types shared by every backend: driver failures, out-of-memory, misuse.
// Header-only, so backend modules need nothing from the core library to throw them.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

// Exceptions cross shared-object boundaries (GPU backends live in their own
// extension modules), so their type info must be visible everywhere.
#define KVCACHED_EXPORT __attribute__((visibility("default")))

namespace kvcached {

// A driver (or OS) call failed. Carries which backend, which call, the
// driver's numeric code and the driver's own message.
class KVCACHED_EXPORT DriverError : public std::runtime_error {
 public:
  DriverError(std::string backend, std::string call, std::int64_t code, std::string driver_message)
      : std::runtime_error(backend + ": " + call + " failed (code " + std::to_string(code) + "): " + driver_message),
        backend_(std::move(backend)),
        call_(std::move(call)),
        code_(code),
        driver_message_(std::move(driver_message)) {}

  const std::string& backend() const noexcept { return backend_; }
  const std::string& call() const noexcept { return call_; }
  std::int64_t code() const noexcept { return code_; }
  const std::string& driver_message() const noexcept { return driver_message_; }

 private:
  std::string backend_;
  std::string call_;
  std::int64_t code_;
  std::string driver_message_;
};

// The device (or the host backend's capacity) has no memory left.
class KVCACHED_EXPORT DeviceOutOfMemory : public DriverError {
 public:
  using DriverError::DriverError;
};

// A kvcached limit or budget (not the driver) refused memory.
class KVCACHED_EXPORT BudgetExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller broke a rule (bad size, unknown id, state conflict). Nothing was changed.
class KVCACHED_EXPORT InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The requested backend or device cannot be used on this machine.
class KVCACHED_EXPORT BackendUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvcached
