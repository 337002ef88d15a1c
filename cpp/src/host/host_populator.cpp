// The populating thread: one per process, never joined (see host_populator.hpp).
#include "host_populator.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

namespace kvcached {

namespace {

// The online CPUs the calling thread is not bound to: none when it may run
// on all of them (nothing to stay off then). The kernel keeps the thread
// inside its cgroup's CPUs whatever is asked.
cpu_set_t cpus_beside_caller() {
  cpu_set_t caller, others;
  CPU_ZERO(&others);
  if (pthread_getaffinity_np(pthread_self(), sizeof caller, &caller) != 0) return others;
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  for (long cpu = 0; cpu < online && cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &caller)) CPU_SET(cpu, &others);
  }
  return others;
}

class Populator {
 public:
  Populator() : pid_(getpid()) {
    const cpu_set_t cpus = cpus_beside_caller();
    thread_ = std::thread([this, cpus] { run(cpus); });
    thread_.detach();  // lives as long as the process; its state is never freed
  }

  pid_t pid() const { return pid_; }

  void enqueue(VirtualAddress address, std::size_t size_bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back(address, size_bytes);
      ++queued_;
    }
    wake_.notify_one();
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::size_t target = queued_;
    done_.wait(lock, [&] { return finished_ >= target; });
  }

 private:
  void run(cpu_set_t cpus) {
    // Off the mapping thread's CPUs when it is bound to some (a CPU engine's
    // worker); if that leaves none, wherever the scheduler puts it.
    if (CPU_COUNT(&cpus) > 0) pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
    for (;;) {
      std::pair<VirtualAddress, std::size_t> range;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return !queue_.empty(); });
        range = queue_.front();
        queue_.pop_front();
      }
      // Advisory: EFAULT/ENOMEM for a range unmapped meanwhile, EINVAL before Linux 5.14.
      madvise(reinterpret_cast<void*>(range.first), range.second, MADV_POPULATE_WRITE);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++finished_;
      }
      done_.notify_all();
    }
  }

  const pid_t pid_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::deque<std::pair<VirtualAddress, std::size_t>> queue_;
  std::size_t queued_ = 0;
  std::size_t finished_ = 0;
  std::thread thread_;
};

std::mutex populator_mutex;
Populator* populator = nullptr;  // leaked: in use until the process ends

// This process's populator; a forked child starts its own (the parent's
// thread does not exist there, and its lock may have been held at the fork).
Populator* current_populator() {
  std::lock_guard<std::mutex> lock(populator_mutex);
  if (populator == nullptr || populator->pid() != getpid()) populator = new Populator();
  return populator;
}

}  // namespace

void populate_in_background(VirtualAddress address, std::size_t size_bytes) noexcept {
  try {
    current_populator()->enqueue(address, size_bytes);
  } catch (...) {
    // No thread (or no memory for the queue): the pages fault in on first write.
  }
}

void wait_for_population() noexcept {
  try {
    current_populator()->wait();
  } catch (...) {
  }
}

}  // namespace kvcached
