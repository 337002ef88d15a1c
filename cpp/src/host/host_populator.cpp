// The populating thread: one per process, never joined (see host_populator.hpp).
#include "host_populator.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

using Clock = std::chrono::steady_clock;

// About 0.1 ms of populating on the development VM (bench/probes/host_page_cost.py).
constexpr std::size_t kPieceBytes = 128u << 10;
// Mapping a page id takes tens of microseconds per page without contention.
constexpr auto kQuietBeforeStart = std::chrono::microseconds(200);

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
  explicit Populator(const cpu_set_t& cpus) : pid_(getpid()) {
    thread_ = std::thread([this, cpus] { run(cpus); });
    thread_.detach();  // lives as long as the process; its state is never freed
  }

  pid_t pid() const { return pid_; }

  void enqueue(VirtualAddress address, std::size_t size_bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back(address, size_bytes);
      ++queued_;
      last_enqueue_ = Clock::now();
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
    // Off the mapping thread's CPUs (a CPU engine's worker is bound to its own),
    // and only when those CPUs have nothing else to run (SCHED_IDLE): any
    // other thread that wakes there (vLLM's EngineCore) takes the CPU at once,
    // where a thread at nice 19 may keep it for the rest of its time slice.
    pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
    sched_param no_priority{};
    if (sched_setscheduler(0, SCHED_IDLE, &no_priority) != 0) {
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);  // the next lowest
    }
    for (;;) {
      std::pair<VirtualAddress, std::size_t> range;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return !queue_.empty(); });
        // Start once the mapping thread has gone quiet (a page op maps its
        // pages one after another): its mmap/mprotect calls need the lock
        // populating holds, and would wait for each piece.
        for (auto quiet = Clock::now() - last_enqueue_; quiet < kQuietBeforeStart;
             quiet = Clock::now() - last_enqueue_) {
          lock.unlock();
          std::this_thread::sleep_for(kQuietBeforeStart - quiet);
          lock.lock();
        }
        range = queue_.front();
        queue_.pop_front();
      }
      // In small pieces: populating holds the process's mmap lock, which the
      // mapping thread's next mmap/mprotect (and the engine's own mmap and
      // munmap) must wait for. Advisory: EFAULT/ENOMEM for a range unmapped
      // meanwhile, EINVAL before Linux 5.14.
      for (std::size_t done = 0; done < range.second; done += kPieceBytes) {
        const std::size_t piece = std::min(kPieceBytes, range.second - done);
        if (madvise(reinterpret_cast<void*>(range.first + done), piece, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) {
          break;
        }
        // A thread that waits by yielding (vLLM's EngineCore polls its queues
        // so) gets the CPU back after each piece instead of after a time slice.
        sched_yield();
      }
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
  Clock::time_point last_enqueue_{};
  std::size_t queued_ = 0;
  std::size_t finished_ = 0;
  std::thread thread_;
};

std::mutex populator_mutex;
Populator* populator = nullptr;  // leaked: in use until the process ends

// This process's populator; a forked child starts its own (the parent's
// thread does not exist there, and its lock may have been held at the fork).
// `cpus`: where a new one runs (the first caller's spare CPUs).
Populator* current_populator(const cpu_set_t& cpus) {
  std::lock_guard<std::mutex> lock(populator_mutex);
  if (populator == nullptr || populator->pid() != getpid()) populator = new Populator(cpus);
  return populator;
}

}  // namespace

void populate_in_background(VirtualAddress address, std::size_t size_bytes) noexcept {
  try {
    // A thread that may run anywhere has no idle CPU to hand the work to: a
    // populating thread would take CPU time from the engine's own compute
    // threads (SGLang's CPU engine leaves its threads unbound). Its pages
    // fault in on first write.
    const cpu_set_t others = cpus_beside_caller();
    if (CPU_COUNT(&others) == 0) return;
    current_populator(others)->enqueue(address, size_bytes);
  } catch (...) {
    // No thread (or no memory for the queue): the pages fault in on first write.
  }
}

void wait_for_population() noexcept {
  Populator* current = nullptr;
  {
    std::lock_guard<std::mutex> lock(populator_mutex);
    if (populator != nullptr && populator->pid() == getpid()) current = populator;
  }
  if (current == nullptr) return;  // nothing was queued in this process
  try {
    current->wait();
  } catch (...) {
  }
}

}  // namespace kvcached
