// bench_vmm: how long each driver VMM call takes, per backend, from N threads.
//
// Each thread, each iteration: reserve a range of --pages pages, create that
// many physical pages, map + set_access each, then unmap and release each and
// free the range. Every call is timed; the table gives count, mean and
// percentiles in microseconds per operation, and the map+set_access rate over
// all threads (phases start together, so the rate is total pairs / wall time).
//
//   bench_vmm [--backend host|cuda|hip] [--threads N] [--pages N] [--page-mib M] [--iters K]
//
// Without --backend every backend compiled in is run and one that cannot open
// a device is reported and skipped; a backend named with --backend must open.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvcached/device/backend.hpp"

#include "kvcached/backends/host_backend.hpp"
#ifdef KVCACHED_BENCH_CUDA
#include "kvcached/backends/cuda_backend.hpp"
#endif
#ifdef KVCACHED_BENCH_HIP
#include "kvcached/backends/hip_backend.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kBytesPerMiB = std::size_t{1} << 20;
constexpr double kMicrosecondsPerSecond = 1e6;

struct Options {
  std::string backend;  // empty: every backend compiled in
  int threads = 1;
  std::size_t pages_per_thread = 64;
  std::size_t page_mib = 0;  // 0: the backend's recommended granularity
  int iterations = 5;
};

enum Operation { kReserve, kCreate, kMap, kSetAccess, kUnmap, kRelease, kOperationCount };
const char* const kOperationNames[kOperationCount] = {"reserve", "create", "map", "set_access", "unmap", "release"};

using Samples = std::vector<double>;  // microseconds

struct ThreadSamples {
  Samples by_operation[kOperationCount];
};

double elapsed_us(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// Every thread waits here until all have arrived; the last one to arrive runs
// `on_release` (used to stamp phase times) before letting the others go.
class Barrier {
 public:
  explicit Barrier(int parties) : parties_(parties) {}
  void arrive_and_wait(const std::function<void()>& on_release = {}) {
    std::unique_lock<std::mutex> lock(mutex_);
    const long generation = generation_;
    if (++arrived_ == parties_) {
      if (on_release) on_release();
      arrived_ = 0;
      ++generation_;
      released_.notify_all();
      return;
    }
    released_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  const int parties_;
  int arrived_ = 0;
  long generation_ = 0;
};

std::shared_ptr<kvcached::VmmBackend> open_backend(const std::string& name) {
  using namespace kvcached;
  // kvcached.config's defaults, passed explicitly: the C++ core reads no environment.
  if (name == "host") return make_host_backend({0, HostMemory::kSharedFiles, HostPopulate::kBackground});
#ifdef KVCACHED_BENCH_CUDA
  if (name == "cuda") return make_cuda_backend(0);
#endif
#ifdef KVCACHED_BENCH_HIP
  if (name == "hip") return make_hip_backend(0, std::chrono::microseconds(2000));
#endif
  throw kvcached::BackendUnavailable("backend '" + name + "' is not compiled into bench_vmm");
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names{"host"};
#ifdef KVCACHED_BENCH_CUDA
  names.push_back("cuda");
#endif
#ifdef KVCACHED_BENCH_HIP
  names.push_back("hip");
#endif
  return names;
}

double percentile(const Samples& sorted, double fraction) {
  if (sorted.empty()) return 0.0;
  const auto index = static_cast<std::size_t>(fraction * static_cast<double>(sorted.size() - 1));
  return sorted[index];
}

void print_table(const std::vector<ThreadSamples>& per_thread) {
  std::printf("%-12s %8s %10s %10s %10s %10s %10s\n", "operation", "count", "avg_us", "p50_us", "p90_us", "p99_us",
              "max_us");
  for (int op = 0; op < kOperationCount; ++op) {
    Samples all;
    for (const auto& thread : per_thread) {
      all.insert(all.end(), thread.by_operation[op].begin(), thread.by_operation[op].end());
    }
    std::sort(all.begin(), all.end());
    double sum = 0.0;
    for (double sample : all) sum += sample;
    const double average = all.empty() ? 0.0 : sum / static_cast<double>(all.size());
    std::printf("%-12s %8zu %10.2f %10.2f %10.2f %10.2f %10.2f\n", kOperationNames[op], all.size(), average,
                percentile(all, 0.50), percentile(all, 0.90), percentile(all, 0.99), all.empty() ? 0.0 : all.back());
  }
}

// Runs the benchmark on one backend; returns false when it failed.
bool run_backend(const std::string& name, const Options& options) {
  std::shared_ptr<kvcached::VmmBackend> backend;
  try {
    backend = open_backend(name);
  } catch (const std::exception& e) {
    // Skipping is fine when running everything; a backend asked for by name must run.
    std::printf("== %s: skipped (%s)\n\n", name.c_str(), e.what());
    return options.backend.empty();
  }
  const kvcached::Granularity granularity = backend->granularity();
  const std::size_t page_bytes =
      options.page_mib != 0 ? options.page_mib * kBytesPerMiB : granularity.recommended_bytes;
  if (page_bytes % granularity.minimum_bytes != 0) {
    std::printf("== %s: --page-mib %zu is not a multiple of the minimum granularity (%zu bytes)\n", name.c_str(),
                options.page_mib, granularity.minimum_bytes);
    return false;
  }
  const std::size_t range_bytes = page_bytes * options.pages_per_thread;
  std::printf(
      "== %s device %d: %d thread(s) x %zu page(s) of %.1f MiB, %d iteration(s); "
      "granularity minimum %zu, recommended %zu bytes\n",
      name.c_str(), backend->device_ordinal(), options.threads, options.pages_per_thread,
      static_cast<double>(page_bytes) / kBytesPerMiB, options.iterations, granularity.minimum_bytes,
      granularity.recommended_bytes);

  std::vector<ThreadSamples> samples(options.threads);
  Barrier barrier(options.threads);
  Clock::time_point map_phase_start;
  double map_phase_wall_us = 0.0;
  std::mutex error_mutex;
  std::string first_error;

  auto worker = [&](int thread_index) {
    ThreadSamples& mine = samples[thread_index];
    bool failed = false;
    for (int iteration = 0; iteration < options.iterations; ++iteration) {
      kvcached::VirtualAddress base = 0;
      std::vector<kvcached::PhysicalHandle> handles;
      std::size_t mapped = 0;
      try {
        if (!failed) {
          auto start = Clock::now();
          base = backend->reserve(range_bytes, page_bytes);
          mine.by_operation[kReserve].push_back(elapsed_us(start));
          for (std::size_t page = 0; page < options.pages_per_thread; ++page) {
            start = Clock::now();
            handles.push_back(backend->create(page_bytes));
            mine.by_operation[kCreate].push_back(elapsed_us(start));
          }
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (first_error.empty()) first_error = e.what();
        failed = true;
      }
      // Everyone starts mapping at once, so the phase's wall time gives the rate.
      barrier.arrive_and_wait([&] { map_phase_start = Clock::now(); });
      try {
        for (std::size_t page = 0; !failed && page < handles.size(); ++page) {
          const kvcached::VirtualAddress address = base + page * page_bytes;
          auto start = Clock::now();
          backend->map(address, page_bytes, handles[page]);
          mine.by_operation[kMap].push_back(elapsed_us(start));
          ++mapped;
          start = Clock::now();
          backend->set_access(address, page_bytes);
          mine.by_operation[kSetAccess].push_back(elapsed_us(start));
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (first_error.empty()) first_error = e.what();
        failed = true;
      }
      barrier.arrive_and_wait([&] { map_phase_wall_us += elapsed_us(map_phase_start); });
      // Tear down whatever was set up, even after a failure.
      try {
        for (std::size_t page = 0; page < mapped; ++page) {
          const auto start = Clock::now();
          backend->unmap(base + page * page_bytes, page_bytes);
          mine.by_operation[kUnmap].push_back(elapsed_us(start));
        }
        for (auto handle : handles) {
          const auto start = Clock::now();
          backend->release(handle);
          mine.by_operation[kRelease].push_back(elapsed_us(start));
        }
        if (base != 0) backend->free_range(base, range_bytes);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (first_error.empty()) first_error = e.what();
        failed = true;
      }
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < options.threads; ++t) threads.emplace_back(worker, t);
  for (auto& thread : threads) thread.join();

  print_table(samples);
  std::size_t pairs = 0;
  for (const auto& thread : samples) pairs += thread.by_operation[kSetAccess].size();
  const double pairs_per_second =
      map_phase_wall_us > 0.0 ? static_cast<double>(pairs) * kMicrosecondsPerSecond / map_phase_wall_us : 0.0;
  std::printf("map+set_access: %.0f per second in total over %d thread(s)\n", pairs_per_second, options.threads);
  if (!first_error.empty()) {
    std::printf("FAILED: %s\n\n", first_error.c_str());
    return false;
  }
  std::printf("\n");
  return true;
}

void print_usage() {
  std::printf(
      "usage: bench_vmm [--backend host|cuda|hip] [--threads N] [--pages N] [--page-mib M] "
      "[--iters K]\n"
      "  --backend   one backend (default: every backend compiled in)\n"
      "  --threads   threads, each with its own range and pages (default 1)\n"
      "  --pages     pages per thread per iteration (default 64)\n"
      "  --page-mib  page size in MiB (default: the backend's recommended granularity)\n"
      "  --iters     iterations (default 5)\n");
}

bool parse_options(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") return false;
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_vmm: %s needs a value\n", flag.c_str());
      return false;
    }
    const char* value = argv[++i];
    const long number = std::strtol(value, nullptr, 10);
    if (flag == "--backend") {
      options.backend = value;
    } else if (flag == "--threads" && number > 0) {
      options.threads = static_cast<int>(number);
    } else if (flag == "--pages" && number > 0) {
      options.pages_per_thread = static_cast<std::size_t>(number);
    } else if (flag == "--page-mib" && number > 0) {
      options.page_mib = static_cast<std::size_t>(number);
    } else if (flag == "--iters" && number > 0) {
      options.iterations = static_cast<int>(number);
    } else {
      std::fprintf(stderr, "bench_vmm: bad option %s %s\n", flag.c_str(), value);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) {
    print_usage();
    return 2;
  }
  const std::vector<std::string> backends =
      options.backend.empty() ? compiled_backends() : std::vector<std::string>{options.backend};
  if (backends.empty()) {
    std::printf("bench_vmm: no backend compiled in\n");
    return 2;
  }
  bool all_ok = true;
  for (const auto& name : backends) all_ok = run_backend(name, options) && all_ok;
  return all_ok ? 0 : 1;
}
