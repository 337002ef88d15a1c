// RegistryLock: the registry's process-shared robust mutex, taken without ever sleeping in the kernel.
//
// Why a robust process-shared pthread mutex and not flock/fcntl: (1) a killed
// owner is handled by the kernel (robust futex list): the next locker gets
// EOWNERDEAD instead of waiting forever; (2) uncontended it is a user-space
// atomic, no system call, which matters because try_acquire runs once per
// mapped page; (3) it excludes threads of one process too, whereas fcntl locks
// are per process and flock per open file description, so those would need a
// second in-process lock. Recovery is safe because no critical section leaves
// the table inconsistent midway: each one ends in single atomic stores (an
// entry turns active only after it is filled), so a dead owner's half-done
// step is either invisible or complete.
//
// Why trylock with back-off and not a blocking lock: a waiter blocked in the
// futex system call on a page whose file was truncated gets EFAULT, and glibc
// aborts the process on that. Polling keeps every access to the mapping in user
// space, where a truncated file raises SIGBUS, which fault_guard.hpp turns into
// a clear error. Critical sections last microseconds: the poll yields first,
// then sleeps from 20 us up to 1 ms, checking meanwhile that the file is still
// whole (a holder whose file shrank moved to private pages and will never
// release the shared mutex). A lock still held after kLockTimeoutNs
// means its owner is stopped (SIGSTOP, debugger), which a robust mutex cannot
// detect: that is an error naming the owner's pid.
#pragma once

#include <cstdint>

#include "registry_segment.hpp"

namespace kvcached::registry_detail {

inline constexpr std::int64_t kLockTimeoutNs = 5'000'000'000;

// What a RegistryLock checks before taking the lock. Hot paths (a page's
// try_acquire / release) skip the system calls: a shrunk file faults on the
// lock itself (fault_guard.hpp), and confirm() checks the rest afterwards.
// They also skip the scan for impossible values: a lie in an entry can only
// make them refuse (sums saturate, a pid no process has is dead); try_acquire
// scans before it refuses, and when the budget itself is impossible.
enum class LockCheck {
  attached,   // the segment is not detached and its header intact (memory reads)
  file,       // also fstat: whole, still linked, header intact; and the table scan
  file_path,  // also that the path still names this file (slow paths)
};

class RegistryLock {
 public:
  // Checks the segment as asked, then takes the lock, then (unless `attached`)
  // checks that the table holds no impossible value (Segment::check_table_locked). Throws
  // RegistryUnusable, or DriverError when the lock stays held past the timeout.
  explicit RegistryLock(Segment& segment, LockCheck check = LockCheck::file_path);
  ~RegistryLock();
  RegistryLock(const RegistryLock&) = delete;
  RegistryLock& operator=(const RegistryLock&) = delete;

  // Throws RegistryUnusable if the file shrank, was wiped, removed or replaced
  // while the lock was held (the section may then have read zeros, or run on
  // private pages): call before acting on what was read under the lock.
  void confirm() const { segment_.check_intact(/*check_path=*/false); }

 private:
  Segment& segment_;
};

}  // namespace kvcached::registry_detail
