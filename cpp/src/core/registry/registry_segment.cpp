// Segment: the mapping of one registry file and its integrity checks.
#include "registry_segment.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "fault_guard.hpp"
#include "kvcached/registry/registry_errors.hpp"
#include "registry_os.hpp"

namespace kvcached::registry_detail {

Segment::Segment(std::string path, std::string device, int fd, Layout* layout)
    : path_(std::move(path)), device_(std::move(device)), fd_(fd), layout_(layout) {
  struct stat info{};
  if (fstat(fd_, &info) == 0) {
    file_device_ = info.st_dev;
    file_inode_ = info.st_ino;
  }
  try {
    watch_token_ = watch_mapping(layout_, kLayoutBytes, &reason_, kFaulted);
  } catch (...) {
    munmap(layout_, kLayoutBytes);
    close(fd_);
    throw;
  }
}

Segment::~Segment() {
  unwatch_mapping(watch_token_);
  const int reason = reason_.load();
  // Private pages replaced the mapping: a thread's robust-mutex list may point
  // into them, so they stay (fault_guard.hpp, limitations).
  if (reason != kTruncated && reason != kFaulted) munmap(layout_, kLayoutBytes);
  close(fd_);
}

void Segment::detach(DetachReason reason) noexcept {
  int expected = kAttached;
  reason_.compare_exchange_strong(expected, reason);
}

void Segment::check_attached() const {
  if (detached()) throw_unusable();
}

void Segment::check_intact(bool check_path) {
  check_attached();
  struct stat info{};
  if (fstat(fd_, &info) != 0) throw_os_error("fstat(" + path_ + ")", errno);
  if (static_cast<std::size_t>(info.st_size) < kLayoutBytes) {
    // Accesses would now raise SIGBUS; make them harmless before anyone tries.
    replace_with_private_pages(layout_, kLayoutBytes);
    detach(kTruncated);
    throw_unusable();
  }
  if (info.st_nlink == 0) {
    detach(kRemoved);
    throw_unusable();
  }
  const std::int64_t now = monotonic_now_ns();
  if (!check_path && now - path_checked_at_ns_.load(std::memory_order_relaxed) >= kPathCheckIntervalNs) {
    check_path = true;
  }
  if (check_path) {
    path_checked_at_ns_.store(now, std::memory_order_relaxed);
    struct stat at_path{};
    if (lstat(path_.c_str(), &at_path) != 0) {
      detach(kRemoved);
      throw_unusable();
    }
    if (at_path.st_dev != file_device_ || at_path.st_ino != file_inode_) {
      detach(kReplaced);
      throw_unusable();
    }
  }
  check_header();
}

void Segment::check_header() {
  if (header_mismatch(header(), device_)) {
    detach(kOverwritten);
    throw_unusable();
  }
  check_attached();  // a fault while reading the header
}

void Segment::check_table() {
  if (auto lie = table_lie(*layout_)) detach_for_lie(*lie);
}

void Segment::check_table_locked() {
  check_table();
  if (auto contradiction = table_contradiction(*layout_)) detach_for_lie(*contradiction);
}

void Segment::detach_for_lie(const std::string& lie) {
  {
    std::lock_guard<std::mutex> guard(lie_mutex_);
    if (lie_.empty()) lie_ = lie;
  }
  detach(kImpossible);
  throw_unusable();
}

std::optional<std::string> Segment::lie() const {
  if (reason_.load() != kImpossible) return std::nullopt;
  std::lock_guard<std::mutex> guard(lie_mutex_);
  return lie_;
}

void Segment::throw_unusable() const {
  std::string what;
  switch (reason_.load()) {
    case kImpossible: {
      std::lock_guard<std::mutex> guard(lie_mutex_);
      what = "holds a value that cannot be true (" + lie_ +
             "): it was damaged or written by something other than kvcached";
      break;
    }
    case kTruncated:
    case kFaulted:
      what = "was truncated while this process used it (its shared state is gone)";
      break;
    case kRemoved:
      what =
          "was removed while this process used it (or moved: it, or a directory above it, "
          "was renamed)";
      break;
    case kReplaced:
      what = "was replaced by another file while this process used it";
      break;
    default:
      what =
          "was overwritten while this process used it (its header no longer describes "
          "device '" +
          device_ + "')";
      break;
  }
  throw RegistryUnusable("registry " + path_ + " " + what +
                         "; this process no longer shares the device budget through it and takes no more memory "
                         "from it. Restart the engine: it then joins the registry now at that path (or creates a "
                         "fresh one; `kvctl clean` removes a damaged file).");
}

}  // namespace kvcached::registry_detail
