// open_or_create_segment: build under a private name and link into place; open without following links.
#include "registry_open.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <random>

#include "kvcached/registry/registry_errors.hpp"
#include "registry_inspect.hpp"
#include "registry_lock.hpp"
#include "registry_os.hpp"

namespace kvcached::registry_detail {

namespace {

// Tries before giving up: the file may appear, vanish or be replaced meanwhile.
constexpr int kOpenAttempts = 4;
constexpr std::int64_t kDirectoryLockTimeoutNs = 5'000'000'000;
constexpr std::int64_t kDirectoryLockPollNs = 1'000'000;
constexpr const char* kReplaceHint = "kvctl clean removes it; an engine registering on this device replaces it";

struct Opened {
  std::shared_ptr<Segment> segment;  // the registry, or
  bool missing = false;              // no file at the path, or
  std::optional<struct stat> stale;  // a file that may be replaced (why in `why`)
  std::string why;
};

[[noreturn]] void throw_symlink(const std::string& path) {
  char target[4096] = {};
  const ssize_t length = readlink(path.c_str(), target, sizeof target - 1);
  const std::string to = length > 0 ? std::string(target, static_cast<std::size_t>(length)) : "?";
  struct stat info{};
  const bool dangling = stat(path.c_str(), &info) != 0;
  throw RegistryUnusable("registry path " + path + " is a symbolic link (to " + to +
                         (dangling ? ", which does not exist" : "") +
                         "); kvcached never follows links there, so that no link can redirect "
                         "engines to another file. Remove the link");
}

// What the table lies about, seen under its lock; nullopt when nothing. Other damage throws.
std::optional<std::string> lie_under_lock(Segment& segment) {
  try {
    RegistryLock lock(segment);
    lock.confirm();
  } catch (const RegistryUnusable&) {
    if (auto lie = segment.lie()) return lie;
    throw;
  }
  return std::nullopt;
}

Layout* map_layout(int fd, const std::string& path) {
  void* address = mmap(nullptr, kLayoutBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) throw_os_error("mmap(" + path + ")", errno);
  return static_cast<Layout*>(address);
}

Opened open_existing(const std::string& path, const std::string& device, const AccessPolicy& policy) {
  // O_NONBLOCK: a FIFO planted at the path must not block the open.
  const int fd = open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) return Opened{nullptr, true, std::nullopt, ""};
    if (error == ELOOP) throw_symlink(path);
    if (error == EACCES || error == EPERM) throw_open_denied(path, policy);
    if (error == EISDIR || error == ENXIO || error == ENODEV) {
      throw RegistryUnusable("registry path " + path + " is not a regular file; remove it");
    }
    throw_os_error("open(" + path + ")", error);
  }
  struct stat info{};
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    throw_os_error("fstat(" + path + ")", error);
  }
  try {
    if (!S_ISREG(info.st_mode)) check_file(info, path, policy);  // says "not a regular file"
    const FileVerdict verdict = inspect_registry_file(fd, info);
    // Old-style files predate the access policy (often mode 0644): they are
    // judged by their owner alone, and replaced only when they are ours.
    const bool ours = info.st_uid == geteuid();
    switch (verdict.kind) {
      case FileVerdict::current:
        check_file(info, path, policy);
        break;
      case FileVerdict::damaged:
        if (!ours) check_file(info, path, policy);
        close(fd);
        return Opened{nullptr, false, info, verdict.why};
      case FileVerdict::old_style:
        if (!verdict.table_readable || !verdict.live_pids.empty() || !ours) {
          const std::string users = !verdict.table_readable ? "has a table this kvcached cannot read"
                                    : !verdict.live_pids.empty()
                                        ? "is still used by " + describe_pids(verdict.live_pids)
                                        : "belongs to " + describe_user(info.st_uid);
          throw RegistryUnusable("registry " + path + " " + verdict.why + " and " + users +
                                 "; this kvcached cannot share a budget with it. Stop those engines (or run one "
                                 "kvcached version on this machine) and retry: an old-style file of yours that no "
                                 "live process uses is replaced automatically (or by kvctl clean)");
        }
        close(fd);
        return Opened{nullptr, false, info, verdict.why + " and no live process uses it"};
      case FileVerdict::foreign:
      case FileVerdict::other_version:
        throw RegistryUnusable("registry " + path + " " + verdict.why +
                               "; kvcached does not touch it. Remove it (once no engine uses it) "
                               "or point KVCACHED_REGISTRY_DIR elsewhere");
    }
    if (verdict.device != device) {
      throw RegistryUnusable("registry " + path + " belongs to device '" + verdict.device + "', not '" + device +
                             "'; remove it once no engine uses it");
    }
  } catch (...) {
    close(fd);
    throw;
  }
  Layout* layout = nullptr;
  try {
    layout = map_layout(fd, path);
  } catch (...) {
    close(fd);
    throw;
  }
  // From here the Segment owns the descriptor and the mapping (its constructor
  // releases both if it fails).
  auto segment = std::make_shared<Segment>(path, device, fd, layout);
  segment->check_intact(/*check_path=*/true);
  // Values that contradict each other are certain only under the lock: such a file is
  // damaged like one whose copy lied (replaced when creating, reported otherwise).
  if (auto lie = lie_under_lock(*segment))
    return Opened{nullptr, false, info, "holds a value that cannot be true (" + *lie + ")"};
  return Opened{std::move(segment), false, std::nullopt, ""};
}

// Builds a complete registry under a private name, then link()s it into place:
// link fails with EEXIST if someone else won the race, so exactly one file is
// ever published and it is never seen half-initialised. Null when lost.
std::shared_ptr<Segment> create_segment(const std::string& path, const std::string& device, std::size_t budget_bytes,
                                        const AccessPolicy& policy) {
  std::random_device entropy;
  const std::string temp_path = path + ".init." + std::to_string(getpid()) + "." + std::to_string(entropy());
  const int fd = open(temp_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, policy.file_mode());
  if (fd < 0) throw_os_error("open(" + temp_path + ")", errno);
  Layout* layout = nullptr;
  try {
    apply_policy(fd, temp_path, policy);
    if (ftruncate(fd, static_cast<off_t>(kLayoutBytes)) != 0) {
      throw_os_error("ftruncate(" + temp_path + ")", errno);
    }
    layout = map_layout(fd, temp_path);
    init_layout(layout, device, budget_bytes);
  } catch (...) {
    if (layout) munmap(layout, kLayoutBytes);
    close(fd);
    unlink(temp_path.c_str());
    throw;
  }
  const int link_rc = link(temp_path.c_str(), path.c_str());
  const int link_errno = errno;
  unlink(temp_path.c_str());
  if (link_rc != 0) {
    munmap(layout, kLayoutBytes);
    close(fd);
    if (link_errno == EEXIST) return nullptr;  // lost the race: open the winner's
    throw_os_error("link(" + path + ")", link_errno);
  }
  return std::make_shared<Segment>(path, device, fd, layout);
}

}  // namespace

std::optional<std::string> damage_seen_under_lock(const std::string& path, const std::string& device) {
  const Opened opened = open_existing(path, device, AccessPolicy::configured());
  if (!opened.segment && opened.stale) return opened.why;
  return std::nullopt;
}

std::string registry_path(const std::string& device) { return registry_directory() + "/" + kSegmentPrefix + device; }

std::shared_ptr<Segment> open_or_create_segment(const std::string& device, std::optional<std::size_t> budget_bytes) {
  const AccessPolicy policy = AccessPolicy::configured();
  const std::string directory = registry_directory();
  const std::string path = directory + "/" + kSegmentPrefix + device;
  prepare_directory(directory, policy, budget_bytes.has_value());
  for (int attempt = 0; attempt < kOpenAttempts; ++attempt) {
    Opened opened = open_existing(path, device, policy);
    if (opened.segment) return opened.segment;
    if (opened.stale) {
      if (!budget_bytes) {
        throw RegistryUnusable("registry " + path + " " + opened.why + "; " + kReplaceHint);
      }
      remove_if_unchanged(directory, path, *opened.stale);
      continue;
    }
    if (!budget_bytes) {
      throw RegistryNotFound("no kvcached registry for device '" + device + "' at " + path +
                             " (no engine has registered on it yet)");
    }
    if (auto segment = create_segment(path, device, *budget_bytes, policy)) return segment;
  }
  throw RegistryUnusable("registry " + path + " kept appearing, vanishing or changing while opening it; retry");
}

DirectoryLock::DirectoryLock(const std::string& directory)
    : fd_(open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
  if (fd_ < 0) throw_os_error("open(" + directory + ")", errno);
  const std::int64_t deadline_ns = monotonic_now_ns() + kDirectoryLockTimeoutNs;
  while (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error != EWOULDBLOCK && error != EINTR) {
      close(fd_);
      throw_os_error("flock(" + directory + ")", error);
    }
    if (monotonic_now_ns() >= deadline_ns) {
      close(fd_);
      throw RegistryError("registry directory " + directory + " stayed locked for over " +
                          std::to_string(kDirectoryLockTimeoutNs / 1'000'000'000) +
                          " s (flock by another process); retry");
    }
    const timespec pause{0, kDirectoryLockPollNs};
    nanosleep(&pause, nullptr);
  }
}

DirectoryLock::~DirectoryLock() { close(fd_); }  // closing releases the flock

bool remove_if_unchanged(const std::string& directory, const std::string& path, const struct stat& seen) {
  DirectoryLock lock(directory);
  struct stat now{};
  if (lstat(path.c_str(), &now) != 0) return false;
  if (now.st_dev != seen.st_dev || now.st_ino != seen.st_ino) return false;
  if (unlink(path.c_str()) != 0) throw_os_error("unlink(" + path + ")", errno);
  return true;
}

}  // namespace kvcached::registry_detail
