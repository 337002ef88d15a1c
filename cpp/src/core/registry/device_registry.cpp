// DeviceRegistry and RegistryBudget: the shared-memory table, its lock, and
// the budget arithmetic that keeps all engines on one device within budget.
#include "kvcached/registry/device_registry.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <cstdio>
#include <limits>
#include <new>
#include <random>

namespace kvcached {

namespace {

// "KVCREGST" read as a little-endian integer; says the file is ours.
constexpr std::uint64_t kRegistryMagic = 0x545347455243564bULL;
// Bump whenever the layout below changes; old files are refused, not misread.
constexpr std::uint32_t kRegistryLayoutVersion = 1;
constexpr const char* kDefaultRegistryDir = "/dev/shm";
constexpr const char* kRegistryDirEnv = "KVCACHED_REGISTRY_DIR";
constexpr const char* kSegmentPrefix = "kvcached-";
// Users of one GPU may be different accounts; the umask still decides.
constexpr mode_t kSegmentMode = 0666;
// Stored in place of a limit when an instance has none.
constexpr std::uint64_t kNoLimit = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kSlotFree = 0;
constexpr std::uint64_t kSlotActive = 1;
// Critical sections last microseconds; a lock held this long means its owner
// is stopped (SIGSTOP, debugger), which a robust mutex cannot detect.
constexpr std::int64_t kLockTimeoutNs = 5'000'000'000;
// A refused try_acquire rescans /proc for dead owners at most this often, so
// a pool hammering a full budget does not read 64 files per page.
constexpr std::int64_t kStaleScanIntervalNs = 100'000'000;
// How long a refused request counts as pressure on the other instances.
constexpr std::int64_t kPressureWindowNs = 1'000'000'000;
// /proc/<pid>/stat: fields after the command name start at field 3 (state);
// field 22 is the start time in clock ticks since boot.
constexpr std::size_t kStatStateField = 3;
constexpr std::size_t kStatStartTimeField = 22;

using Counter = std::atomic<std::uint64_t>;
static_assert(Counter::is_always_lock_free, "registry counters must be lock-free in shared memory");
static_assert(std::atomic<std::int64_t>::is_always_lock_free);

std::int64_t monotonic_now_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // one clock for every process on the host
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string errno_text(int error) { return std::string(std::strerror(error)); }

[[noreturn]] void throw_os_error(const std::string& call, int error) {
  throw DriverError("registry", call, error, errno_text(error));
}

}  // namespace

namespace registry_detail {

// One instance's row. Every field is an atomic so hot-path readers need no
// lock; writers hold the registry lock. `name` is written before `state`
// turns active (release) and never while active.
struct alignas(64) EntryRecord {
  Counter state;
  Counter instance_id;
  std::atomic<std::int64_t> pid;
  Counter start_time_ticks;
  Counter limit_bytes;
  Counter mapped_bytes;
  Counter used_bytes;
  Counter reported_mapped_bytes;
  Counter wanted_bytes;
  std::atomic<std::int64_t> wanted_at_ns;
  char name[kRegistryNameMaxBytes + 1];
};

struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t capacity;
  std::uint64_t layout_bytes;  // guards against a different pthread ABI or build
  char device[kRegistryDeviceMaxBytes + 1];
  pthread_mutex_t mutex;
  Counter budget_bytes;
  Counter next_instance_id;
  std::atomic<std::int64_t> last_stale_scan_ns;
  std::atomic<std::int64_t> lock_owner_pid;  // for the timeout message only
  Counter lock_recoveries;                  // times a dead owner's lock was taken over
};

struct Layout {
  Header header;
  EntryRecord entries[kRegistryCapacity];
};

// The mapped file. Shared by the DeviceRegistry and every RegistryBudget made
// from it, so the mapping outlives whichever is dropped first.
struct Segment {
  std::string path;
  Layout* layout = nullptr;

  Segment(std::string p, Layout* l) : path(std::move(p)), layout(l) {}
  ~Segment() { munmap(layout, sizeof(Layout)); }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header& header() noexcept { return layout->header; }
  EntryRecord& entry(std::size_t slot) noexcept { return layout->entries[slot]; }
};

// Why a robust process-shared pthread mutex and not flock/fcntl: (1) a killed
// owner is handled by the kernel (robust futex list): the next locker gets
// EOWNERDEAD instead of waiting forever; (2) uncontended it is a userspace
// atomic, no system call, which matters because try_acquire runs once per
// mapped page; (3) it excludes threads of one process too, whereas fcntl locks
// are per process and flock per open file description, so those would need a
// second in-process lock. Recovery is safe because no critical section leaves
// the table inconsistent midway: each one ends in single atomic stores (an
// entry turns active only after it is filled), so a dead owner's half-done
// step is either invisible or complete.
class RegistryLock {
 public:
  explicit RegistryLock(Segment& segment) : header_(segment.header()) {
    timespec deadline{};
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    const std::int64_t deadline_ns =
        static_cast<std::int64_t>(deadline.tv_sec) * 1'000'000'000 + deadline.tv_nsec +
        kLockTimeoutNs;
    deadline.tv_sec = deadline_ns / 1'000'000'000;
    deadline.tv_nsec = deadline_ns % 1'000'000'000;
    int rc = pthread_mutex_clocklock(&header_.mutex, CLOCK_MONOTONIC, &deadline);
    if (rc == EOWNERDEAD) {
      header_.lock_recoveries.fetch_add(1, std::memory_order_relaxed);
      rc = pthread_mutex_consistent(&header_.mutex);
    }
    if (rc == ETIMEDOUT) {
      throw DriverError("registry", "pthread_mutex_clocklock", rc,
                        "registry lock of " + segment.path + " held for over " +
                            std::to_string(kLockTimeoutNs / 1'000'000'000) + " s by pid " +
                            std::to_string(header_.lock_owner_pid.load()) +
                            " (stopped or hung?)");
    }
    if (rc != 0) throw_os_error("pthread_mutex_clocklock", rc);
    header_.lock_owner_pid.store(getpid(), std::memory_order_relaxed);
  }
  ~RegistryLock() {
    header_.lock_owner_pid.store(0, std::memory_order_relaxed);
    pthread_mutex_unlock(&header_.mutex);
  }
  RegistryLock(const RegistryLock&) = delete;
  RegistryLock& operator=(const RegistryLock&) = delete;

 private:
  Header& header_;
};

namespace {

bool slot_active(const EntryRecord& entry) noexcept {
  return entry.state.load(std::memory_order_acquire) == kSlotActive;
}

std::optional<std::size_t> limit_of(const EntryRecord& entry) noexcept {
  const std::uint64_t limit = entry.limit_bytes.load(std::memory_order_relaxed);
  if (limit == kNoLimit) return std::nullopt;
  return static_cast<std::size_t>(limit);
}

std::size_t total_mapped_bytes(Segment& segment) noexcept {
  std::size_t total = 0;
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    const EntryRecord& entry = segment.entry(slot);
    if (slot_active(entry)) total += entry.mapped_bytes.load(std::memory_order_relaxed);
  }
  return total;
}

std::size_t saturating_sub(std::size_t a, std::size_t b) noexcept { return a > b ? a - b : 0; }

// Start time of `pid` in clock ticks since boot, or nullopt when the process
// does not exist or has already exited (zombie: its memory is already freed).
std::optional<std::uint64_t> live_process_start_ticks(std::int64_t pid) {
  // stdio rather than iostreams: see device.cpp on libstdc++ locale state.
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return std::nullopt;
  char buffer[1024] = {};
  const std::size_t length = std::fread(buffer, 1, sizeof buffer - 1, file);
  std::fclose(file);
  const std::string line(buffer, length);
  // The command name (field 2) may contain spaces and parentheses; it ends at the last ')'.
  const std::size_t name_end = line.rfind(')');
  if (name_end == std::string::npos) return std::nullopt;
  std::optional<std::uint64_t> start_ticks;
  std::size_t cursor = name_end + 1;
  for (std::size_t index = kStatStateField;; ++index) {
    const std::size_t begin = line.find_first_not_of(" \n", cursor);
    if (begin == std::string::npos) break;
    const std::size_t end = std::min(line.find_first_of(" \n", begin), line.size());
    const std::string field = line.substr(begin, end - begin);
    cursor = end;
    if (index == kStatStateField && (field == "Z" || field == "X")) return std::nullopt;
    if (index == kStatStartTimeField) {
      start_ticks = std::strtoull(field.c_str(), nullptr, 10);
      break;
    }
  }
  return start_ticks;
}

bool entry_owner_alive(const EntryRecord& entry) {
  const auto start = live_process_start_ticks(entry.pid.load(std::memory_order_relaxed));
  // A different start time means the pid was reused by an unrelated process.
  return start && *start == entry.start_time_ticks.load(std::memory_order_relaxed);
}

std::size_t clean_stale_locked(Segment& segment) {
  std::size_t freed = 0;
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    EntryRecord& entry = segment.entry(slot);
    if (!slot_active(entry) || entry_owner_alive(entry)) continue;
    // The owner is gone, so are its mappings: its bytes go back to the budget.
    entry.state.store(kSlotFree, std::memory_order_release);
    entry.mapped_bytes.store(0, std::memory_order_relaxed);
    ++freed;
  }
  segment.header().last_stale_scan_ns.store(monotonic_now_ns(), std::memory_order_relaxed);
  return freed;
}

void validate_device_name(const std::string& device) {
  const bool well_formed =
      !device.empty() && device.size() <= kRegistryDeviceMaxBytes &&
      std::all_of(device.begin(), device.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == ':' || c == '_' ||
               c == '-' || c == '.';
      });
  if (!well_formed) {
    throw InvalidArgument("device name '" + device + "' must be 1-" +
                          std::to_string(kRegistryDeviceMaxBytes) +
                          " characters of [A-Za-z0-9:_.-], e.g. 'cpu' or 'cuda:0'");
  }
}

void init_layout(Layout* layout, const std::string& device, std::size_t budget_bytes) {
  new (layout) Layout();
  Header& header = layout->header;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  // Relocking from the owning thread is an error (EDEADLK), not a silent hang.
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
  const int rc = pthread_mutex_init(&header.mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) throw_os_error("pthread_mutex_init", rc);
  header.version = kRegistryLayoutVersion;
  header.capacity = kRegistryCapacity;
  header.layout_bytes = sizeof(Layout);
  std::strncpy(header.device, device.c_str(), kRegistryDeviceMaxBytes);
  header.budget_bytes.store(budget_bytes);
  std::atomic_thread_fence(std::memory_order_release);
  header.magic = kRegistryMagic;
}

void validate_layout(const Layout* layout, const std::string& path, const std::string& device) {
  const Header& header = layout->header;
  const auto refuse = [&](const std::string& why) {
    throw BackendUnavailable("registry " + path + " " + why +
                             "; it was made by another kvcached build. Remove it once no "
                             "engine uses this device.");
  };
  if (header.magic != kRegistryMagic) refuse("is not a kvcached registry");
  if (header.version != kRegistryLayoutVersion) {
    refuse("has layout version " + std::to_string(header.version) + ", expected " +
           std::to_string(kRegistryLayoutVersion));
  }
  if (header.capacity != kRegistryCapacity || header.layout_bytes != sizeof(Layout)) {
    refuse("has a different table size");
  }
  if (device != header.device) refuse(std::string("belongs to device '") + header.device + "'");
}

Layout* map_layout(int fd, const std::string& path) {
  void* addr = mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) throw_os_error("mmap(" + path + ")", errno);
  return static_cast<Layout*>(addr);
}

// Builds a complete registry under a private name, then link()s it into place:
// link fails with EEXIST if someone else won the race, so exactly one file is
// ever published and it is never seen half-initialised.
std::shared_ptr<Segment> create_segment(const std::string& path, const std::string& device,
                                        std::size_t budget_bytes) {
  std::random_device entropy;
  const std::string temp_path =
      path + ".init." + std::to_string(getpid()) + "." + std::to_string(entropy());
  const int fd = open(temp_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, kSegmentMode);
  if (fd < 0) throw_os_error("open(" + temp_path + ")", errno);
  Layout* layout = nullptr;
  try {
    if (ftruncate(fd, sizeof(Layout)) != 0) throw_os_error("ftruncate(" + temp_path + ")", errno);
    layout = map_layout(fd, temp_path);
    init_layout(layout, device, budget_bytes);
  } catch (...) {
    if (layout) munmap(layout, sizeof(Layout));
    close(fd);
    unlink(temp_path.c_str());
    throw;
  }
  close(fd);  // the mapping keeps the file alive
  const int link_rc = link(temp_path.c_str(), path.c_str());
  const int link_errno = errno;
  unlink(temp_path.c_str());
  if (link_rc != 0) {
    munmap(layout, sizeof(Layout));
    if (link_errno == EEXIST) return nullptr;  // lost the race: open the winner's
    throw_os_error("link(" + path + ")", link_errno);
  }
  return std::make_shared<Segment>(path, layout);
}

std::shared_ptr<Segment> open_existing_segment(const std::string& path, const std::string& device) {
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return nullptr;
    throw_os_error("open(" + path + ")", errno);
  }
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    throw_os_error("fstat(" + path + ")", error);
  }
  if (static_cast<std::size_t>(info.st_size) < sizeof(Layout)) {
    close(fd);
    throw BackendUnavailable("registry " + path + " is too small (" +
                             std::to_string(info.st_size) + " bytes, expected " +
                             std::to_string(sizeof(Layout)) +
                             "); it was made by another kvcached build. Remove it once no "
                             "engine uses this device.");
  }
  Layout* layout = nullptr;
  try {
    layout = map_layout(fd, path);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  auto segment = std::make_shared<Segment>(path, layout);
  validate_layout(layout, path, device);
  return segment;
}

}  // namespace
}  // namespace registry_detail

using registry_detail::EntryRecord;
using registry_detail::RegistryLock;
using registry_detail::Segment;

// ---- DeviceRegistry --------------------------------------------------------

std::string DeviceRegistry::segment_path(const std::string& device) {
  registry_detail::validate_device_name(device);
  const char* dir = std::getenv(kRegistryDirEnv);
  const std::string directory = (dir && *dir) ? dir : kDefaultRegistryDir;
  return directory + "/" + kSegmentPrefix + device;
}

std::shared_ptr<DeviceRegistry> DeviceRegistry::open(const std::string& device,
                                                     std::optional<std::size_t> budget_bytes) {
  const std::string path = segment_path(device);
  // Two rounds suffice: either the file exists, or we create it, or someone
  // else created it between our open and our link.
  constexpr int kOpenAttempts = 2;
  for (int attempt = 0; attempt < kOpenAttempts; ++attempt) {
    if (auto segment = registry_detail::open_existing_segment(path, device)) {
      return std::shared_ptr<DeviceRegistry>(new DeviceRegistry(device, std::move(segment)));
    }
    if (!budget_bytes) {
      throw RegistryNotFound("no kvcached registry for device '" + device + "' at " + path +
                             " (no engine has registered on it yet)");
    }
    if (auto segment = registry_detail::create_segment(path, device, *budget_bytes)) {
      return std::shared_ptr<DeviceRegistry>(new DeviceRegistry(device, std::move(segment)));
    }
  }
  throw DriverError("registry", "open(" + path + ")", EEXIST,
                    "registry file appeared and vanished while opening it");
}

DeviceRegistry::DeviceRegistry(std::string device, std::shared_ptr<Segment> segment)
    : device_(std::move(device)), segment_(std::move(segment)) {}

const std::string& DeviceRegistry::path() const noexcept { return segment_->path; }

std::size_t DeviceRegistry::budget_bytes() const noexcept {
  return segment_->header().budget_bytes.load(std::memory_order_relaxed);
}

void DeviceRegistry::set_budget_bytes(std::size_t budget_bytes) {
  RegistryLock lock(*segment_);
  segment_->header().budget_bytes.store(budget_bytes, std::memory_order_relaxed);
}

std::size_t DeviceRegistry::mapped_bytes() const noexcept {
  return registry_detail::total_mapped_bytes(*segment_);
}

std::size_t DeviceRegistry::available_bytes() const noexcept {
  return registry_detail::saturating_sub(budget_bytes(), mapped_bytes());
}

std::vector<RegistryEntryInfo> DeviceRegistry::entries() const {
  std::vector<RegistryEntryInfo> snapshot;
  {
    RegistryLock lock(*segment_);
    for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
      const EntryRecord& entry = segment_->entry(slot);
      if (!registry_detail::slot_active(entry)) continue;
      RegistryEntryInfo info;
      info.slot = slot;
      info.instance_id = entry.instance_id.load();
      info.name = entry.name;
      info.pid = entry.pid.load();
      info.start_time_ticks = entry.start_time_ticks.load();
      info.limit_bytes = registry_detail::limit_of(entry);
      info.mapped_bytes = entry.mapped_bytes.load();
      info.used_bytes = entry.used_bytes.load();
      info.reserved_bytes = registry_detail::saturating_sub(entry.reported_mapped_bytes.load(),
                                                            info.used_bytes);
      const bool wanted_recently =
          monotonic_now_ns() - entry.wanted_at_ns.load() < kPressureWindowNs;
      info.wanted_bytes = wanted_recently ? entry.wanted_bytes.load() : 0;
      snapshot.push_back(std::move(info));
    }
  }
  // /proc is read outside the lock: liveness is a report here, not a decision.
  for (RegistryEntryInfo& info : snapshot) {
    const auto start = registry_detail::live_process_start_ticks(info.pid);
    info.alive = start && *start == info.start_time_ticks;
  }
  return snapshot;
}

std::size_t DeviceRegistry::set_limit(const std::variant<std::int64_t, std::string>& name_or_pid,
                                      std::optional<std::size_t> limit_bytes) {
  if (limit_bytes && *limit_bytes >= kNoLimit) throw InvalidArgument("limit is too large");
  RegistryLock lock(*segment_);
  std::size_t changed = 0;
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    EntryRecord& entry = segment_->entry(slot);
    if (!registry_detail::slot_active(entry)) continue;
    const bool matches = std::holds_alternative<std::int64_t>(name_or_pid)
                             ? entry.pid.load() == std::get<std::int64_t>(name_or_pid)
                             : std::get<std::string>(name_or_pid) == entry.name;
    if (!matches) continue;
    entry.limit_bytes.store(limit_bytes ? *limit_bytes : kNoLimit, std::memory_order_relaxed);
    ++changed;
  }
  return changed;
}

std::size_t DeviceRegistry::clean_stale() {
  RegistryLock lock(*segment_);
  return registry_detail::clean_stale_locked(*segment_);
}

std::shared_ptr<RegistryBudget> DeviceRegistry::register_instance(
    const std::string& name, std::optional<std::int64_t> pid,
    std::optional<std::size_t> limit_bytes) {
  if (limit_bytes && *limit_bytes >= kNoLimit) throw InvalidArgument("limit is too large");
  if (name.empty() || name.size() > kRegistryNameMaxBytes ||
      name.find('\0') != std::string::npos) {
    throw InvalidArgument("instance name must be 1-" + std::to_string(kRegistryNameMaxBytes) +
                          " bytes without NUL, got " + std::to_string(name.size()) + " bytes");
  }
  const std::int64_t owner_pid = pid ? *pid : static_cast<std::int64_t>(getpid());
  const auto start_ticks = registry_detail::live_process_start_ticks(owner_pid);
  if (!start_ticks) {
    throw InvalidArgument("pid " + std::to_string(owner_pid) + " is not a running process");
  }
  RegistryLock lock(*segment_);
  registry_detail::clean_stale_locked(*segment_);
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    EntryRecord& entry = segment_->entry(slot);
    if (registry_detail::slot_active(entry)) continue;
    const std::uint64_t instance_id = segment_->header().next_instance_id.fetch_add(1) + 1;
    entry.instance_id.store(instance_id);
    entry.pid.store(owner_pid);
    entry.start_time_ticks.store(*start_ticks);
    entry.limit_bytes.store(limit_bytes ? *limit_bytes : kNoLimit);
    entry.mapped_bytes.store(0);
    entry.used_bytes.store(0);
    entry.reported_mapped_bytes.store(0);
    entry.wanted_bytes.store(0);
    entry.wanted_at_ns.store(0);
    std::memset(entry.name, 0, sizeof(entry.name));
    std::memcpy(entry.name, name.data(), name.size());
    entry.state.store(kSlotActive, std::memory_order_release);  // publish last
    return std::make_shared<RegistryBudget>(segment_, slot, instance_id, name);
  }
  throw BackendUnavailable("registry " + segment_->path + " is full (" +
                           std::to_string(kRegistryCapacity) + " live instances)");
}

void DeviceRegistry::hold_lock_for_test() {
  auto* lock = new RegistryLock(*segment_);  // leaked on purpose: never unlocked
  (void)lock;
}

// ---- RegistryBudget --------------------------------------------------------

RegistryBudget::RegistryBudget(std::shared_ptr<Segment> segment, std::size_t slot,
                               std::uint64_t instance_id, std::string name)
    : segment_(std::move(segment)),
      slot_(slot),
      instance_id_(instance_id),
      name_(std::move(name)),
      creator_pid_(getpid()) {}

RegistryBudget::~RegistryBudget() { unregister(); }

namespace {
// The entry still belongs to this handle (not reclaimed and reused).
bool owns_entry(const EntryRecord& entry, std::uint64_t instance_id) noexcept {
  return registry_detail::slot_active(entry) && entry.instance_id.load() == instance_id;
}
}  // namespace

bool RegistryBudget::registered() const noexcept {
  return !unregistered_ && owns_entry(segment_->entry(slot_), instance_id_);
}

bool RegistryBudget::try_acquire(std::size_t bytes) {
  if (bytes == 0) return true;
  RegistryLock lock(*segment_);
  EntryRecord& entry = segment_->entry(slot_);
  if (unregistered_.load() || !owns_entry(entry, instance_id_)) {
    throw BackendUnavailable("registry entry '" + name_ + "' in " + segment_->path +
                             " is gone (unregistered, or reclaimed because its pid was "
                             "judged dead); register again");
  }
  const std::size_t own_mapped = entry.mapped_bytes.load(std::memory_order_relaxed);
  const auto limit = registry_detail::limit_of(entry);
  if (limit && bytes > registry_detail::saturating_sub(*limit, own_mapped)) return false;

  const auto device_has_room = [&] {
    const std::size_t budget = segment_->header().budget_bytes.load(std::memory_order_relaxed);
    return bytes <= registry_detail::saturating_sub(budget,
                                                    registry_detail::total_mapped_bytes(*segment_));
  };
  bool granted = device_has_room();
  if (!granted) {
    const std::int64_t now = monotonic_now_ns();
    const std::int64_t last_scan = segment_->header().last_stale_scan_ns.load();
    if (now - last_scan >= kStaleScanIntervalNs && registry_detail::clean_stale_locked(*segment_) > 0) {
      granted = device_has_room();
    }
  }
  if (!granted) {
    // Only a device-wide refusal is pressure on others; one's own limit is not.
    entry.wanted_bytes.store(bytes, std::memory_order_relaxed);
    entry.wanted_at_ns.store(monotonic_now_ns(), std::memory_order_relaxed);
    return false;
  }
  entry.mapped_bytes.store(own_mapped + bytes, std::memory_order_relaxed);
  entry.wanted_bytes.store(0, std::memory_order_relaxed);
  return true;
}

void RegistryBudget::release(std::size_t bytes) noexcept {
  if (bytes == 0) return;
  try {
    RegistryLock lock(*segment_);
    EntryRecord& entry = segment_->entry(slot_);
    if (unregistered_.load() || !owns_entry(entry, instance_id_)) return;
    const std::size_t own_mapped = entry.mapped_bytes.load(std::memory_order_relaxed);
    entry.mapped_bytes.store(registry_detail::saturating_sub(own_mapped, bytes),
                             std::memory_order_relaxed);
  } catch (...) {
    // The lock timed out: the bytes stay counted, which errs on the safe side
    // (the budget looks fuller than it is) until this process exits.
  }
}

std::size_t RegistryBudget::available_bytes() const {
  const EntryRecord& entry = segment_->entry(slot_);
  if (unregistered_.load() || !owns_entry(entry, instance_id_)) return 0;
  const std::size_t budget = segment_->header().budget_bytes.load(std::memory_order_relaxed);
  std::size_t available = registry_detail::saturating_sub(
      budget, registry_detail::total_mapped_bytes(*segment_));
  if (const auto limit = registry_detail::limit_of(entry)) {
    available = std::min(available, registry_detail::saturating_sub(
                                        *limit, entry.mapped_bytes.load(std::memory_order_relaxed)));
  }
  return available;
}

std::optional<std::size_t> RegistryBudget::external_limit_bytes() const {
  const EntryRecord& entry = segment_->entry(slot_);
  if (unregistered_.load() || !owns_entry(entry, instance_id_)) return std::nullopt;
  std::optional<std::size_t> limit = registry_detail::limit_of(entry);
  const std::size_t budget = segment_->header().budget_bytes.load(std::memory_order_relaxed);
  const std::size_t total = registry_detail::total_mapped_bytes(*segment_);
  if (total > budget) {
    const std::size_t others = total - entry.mapped_bytes.load(std::memory_order_relaxed);
    const std::size_t share = registry_detail::saturating_sub(budget, others);
    limit = limit ? std::min(*limit, share) : share;
  }
  return limit;
}

void RegistryBudget::report_usage(std::size_t used_bytes, std::size_t mapped_bytes) noexcept {
  EntryRecord& entry = segment_->entry(slot_);
  if (unregistered_.load() || !owns_entry(entry, instance_id_)) return;
  // Display-only fields, each written by its owner alone: no lock needed.
  entry.used_bytes.store(used_bytes, std::memory_order_relaxed);
  entry.reported_mapped_bytes.store(mapped_bytes, std::memory_order_relaxed);
}

std::size_t RegistryBudget::pressure_bytes() const noexcept {
  const std::int64_t now = monotonic_now_ns();
  std::size_t wanted = 0;
  for (std::size_t slot = 0; slot < kRegistryCapacity; ++slot) {
    if (slot == slot_) continue;
    const EntryRecord& entry = segment_->entry(slot);
    if (!registry_detail::slot_active(entry)) continue;
    if (now - entry.wanted_at_ns.load(std::memory_order_relaxed) < kPressureWindowNs) {
      wanted += entry.wanted_bytes.load(std::memory_order_relaxed);
    }
  }
  return wanted;
}

std::optional<std::size_t> RegistryBudget::limit_bytes() const noexcept {
  const EntryRecord& entry = segment_->entry(slot_);
  if (unregistered_.load() || !owns_entry(entry, instance_id_)) return std::nullopt;
  return registry_detail::limit_of(entry);
}

std::size_t RegistryBudget::mapped_bytes() const noexcept {
  const EntryRecord& entry = segment_->entry(slot_);
  if (unregistered_.load() || !owns_entry(entry, instance_id_)) return 0;
  return entry.mapped_bytes.load(std::memory_order_relaxed);
}

void RegistryBudget::unregister() noexcept {
  if (unregistered_ || getpid() != creator_pid_) return;
  try {
    RegistryLock lock(*segment_);
    EntryRecord& entry = segment_->entry(slot_);
    if (owns_entry(entry, instance_id_)) {
      entry.state.store(kSlotFree, std::memory_order_release);
      entry.mapped_bytes.store(0, std::memory_order_relaxed);
    }
    unregistered_ = true;
  } catch (...) {
    // Lock timed out: the entry stays and is reclaimed as stale once this
    // process exits.
  }
}

}  // namespace kvcached
