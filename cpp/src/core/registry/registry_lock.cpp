// RegistryLock: polling acquisition of the robust mutex, recovery from dead owners, timeout.
#include "registry_lock.hpp"

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "kvcached/registry/registry_errors.hpp"
#include "registry_os.hpp"

namespace kvcached::registry_detail {

namespace {
constexpr int kYieldingAttempts = 64;
constexpr std::int64_t kFirstSleepNs = 20'000;
constexpr std::int64_t kLongestSleepNs = 1'000'000;
}  // namespace

RegistryLock::RegistryLock(Segment& segment, LockCheck check) : segment_(segment) {
  if (check == LockCheck::attached) {
    segment.check_attached();
    segment.check_header();
  } else {
    segment.check_intact(/*check_path=*/check == LockCheck::file_path);
  }
  Header& header = segment.header();
  const std::int64_t deadline_ns = monotonic_now_ns() + kLockTimeoutNs;
  std::int64_t sleep_ns = kFirstSleepNs;
  for (int attempt = 0;; ++attempt) {
    int rc = pthread_mutex_trylock(&header.mutex);
    if (rc == EOWNERDEAD) {
      header.lock_recoveries.fetch_add(1, std::memory_order_relaxed);
      rc = pthread_mutex_consistent(&header.mutex);
    }
    if (rc == 0) break;
    if (rc == ENOTRECOVERABLE || rc == EINVAL) {
      // Not a lock any more: an owner died and recovery failed, or its bytes were overwritten.
      segment.detach(kOverwritten);
      throw RegistryUnusable("registry lock of " + segment.path() + " is damaged (" + std::strerror(rc) +
                             "); this process takes no more memory through "
                             "it. Remove the file once no engine uses it, then restart the engines");
    }
    if (rc != EBUSY) throw_os_error("pthread_mutex_trylock(" + segment.path() + ")", rc);
    // The file may have shrunk under us: the holder then moved to private pages
    // and will never release the shared mutex. Noticed by fstat while sleeping.
    if (attempt < kYieldingAttempts) {
      segment.check_attached();
    } else {
      segment.check_intact(/*check_path=*/false);
    }
    if (monotonic_now_ns() >= deadline_ns) {
      throw DriverError("registry", "pthread_mutex_trylock", ETIMEDOUT,
                        "registry lock of " + segment.path() + " held for over " +
                            std::to_string(kLockTimeoutNs / 1'000'000'000) + " s by pid " +
                            std::to_string(header.lock_owner_pid.load()) + " (stopped or hung?)");
    }
    if (attempt < kYieldingAttempts) {
      sched_yield();
    } else {
      const timespec pause{0, static_cast<long>(sleep_ns)};
      nanosleep(&pause, nullptr);
      sleep_ns = std::min(sleep_ns * 2, kLongestSleepNs);
    }
  }
  header.lock_owner_pid.store(getpid(), std::memory_order_relaxed);
  if (segment.detached()) {  // a fault while taking it: the lock was private memory
    pthread_mutex_unlock(&header.mutex);
    segment.throw_unusable();
  }
  if (check == LockCheck::attached) return;  // hot paths: see LockCheck
  try {
    segment.check_table_locked();  // a lying entry must not steer this section (sums, liveness)
  } catch (...) {
    header.lock_owner_pid.store(0, std::memory_order_relaxed);
    pthread_mutex_unlock(&header.mutex);
    throw;
  }
}

RegistryLock::~RegistryLock() {
  Header& header = segment_.header();
  header.lock_owner_pid.store(0, std::memory_order_relaxed);
  pthread_mutex_unlock(&header.mutex);
}

}  // namespace kvcached::registry_detail
