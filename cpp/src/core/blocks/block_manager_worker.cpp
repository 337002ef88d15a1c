// BlockManager, background worker: its loop, its errors, and the look-ahead it keeps ready.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "kvcached/blocks/block_manager.hpp"

namespace kvcached {

namespace {

// How often the worker re-checks the reserve when nobody wakes it.
constexpr auto kWorkerPeriod = std::chrono::milliseconds(50);
// How often the worker asks the driver how much device memory is free (the
// pools' own creates and releases keep the estimate exact in between; other
// users of the device show up here, or when a create runs out of memory).
constexpr auto kDeviceQueryPeriod = std::chrono::seconds(1);

}  // namespace

// ---- look-ahead -----------------------------------------------------------------------

std::size_t BlockManager::lookahead_pages() const {
  const std::size_t floor = mapper_->lookahead_pages();
  if (floor == 0) return 0;  // nothing to get ready (host, mirrors, no zero backing)
  Lock lock(mutex_);
  std::size_t largest = 0;
  for (std::size_t pages : recent_grows_) largest = std::max(largest, pages);
  return std::max(floor, 2 * largest);  // the next burst as large as the last ones finds its ids ready
}

void BlockManager::prepare_ahead() {
  const std::size_t want = lookahead_pages();
  if (want == 0) return;
  std::vector<std::int64_t> frontier;
  {
    Lock lock(mutex_);
    if (closed_) return;
    unmapped_.lowest(want, 0, frontier);
  }
  // No lock of ours is held: the space takes its own one run at a time, so a
  // grow meanwhile waits for one split at most, never for the whole frontier.
  // Handed over a few runs at a time: when a free or an alloc wakes the worker
  // meanwhile (memory to give back, a reserve to refill), the rest waits for
  // the next round.
  constexpr std::size_t kPagesBetweenLooks = 32;
  for (std::size_t first = 0; first < frontier.size(); first += kPagesBetweenLooks) {
    const std::size_t end = std::min(frontier.size(), first + kPagesBetweenLooks);
    mapper_->prepare_pages(std::vector<std::int64_t>(frontier.begin() + static_cast<std::ptrdiff_t>(first),
                                                     frontier.begin() + static_cast<std::ptrdiff_t>(end)));
    std::lock_guard<std::mutex> lock(worker_mutex_);
    if (worker_kick_ || worker_stop_) return;
  }
}

// ---- background worker ----------------------------------------------------------------

void BlockManager::wake_worker() noexcept {
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    worker_kick_ = true;
  }
  worker_cv_.notify_one();
}

void BlockManager::record_worker_error(const char* what) noexcept {
  bool first = false;
  std::size_t count = 0;
  try {
    Lock lock(mutex_);
    first = worker_errors_ == 0;
    count = ++worker_errors_;
    last_worker_error_ = what;
  } catch (...) {
  }
  if (count > 0) budgets_.report_worker_errors(count);  // kvctl / kvtop show it
  // Logged once (C++ cannot reach Python's logging from this thread); every
  // failure is counted in stats() and the last one's text kept there.
  if (first) {
    std::fprintf(stderr,
                 "kvcached: the block manager's background worker failed: %s "
                 "(further failures are counted in stats()['worker_errors'])\n",
                 what);
  }
}

void BlockManager::worker_loop() {
  try {
    mapper_->bind_calling_thread();  // once: its driver calls then need no context switch
  } catch (const std::exception& e) {
    record_worker_error(e.what());  // each call binds for itself then
  }
  auto last_query = Clock::now();
  bool first_round = true;  // right after set-up: the reserve and the look-ahead at once
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(worker_mutex_);
      if (!first_round) worker_cv_.wait_for(lock, kWorkerPeriod, [this] { return worker_stop_ || worker_kick_; });
      if (worker_stop_) return;
      worker_kick_ = false;
    }
    first_round = false;
    try {
      if (Clock::now() - last_query >= kDeviceQueryPeriod) {
        last_query = Clock::now();
        device_free_pages(/*query=*/true);  // no lock of ours held: a driver call that resets the estimate
      }
      maintain();
      prepare_ahead();
    } catch (const std::exception& e) {
      record_worker_error(e.what());  // the round is retried next period
    } catch (...) {
      record_worker_error("unknown error");
    }
  }
}

}  // namespace kvcached
