// inspect_registry_file: the current layout read by copy, and layout version 1 described for it.
#include "registry_inspect.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>

#include "registry_format.hpp"
#include "registry_os.hpp"

namespace kvcached::registry_detail {

namespace {

// Layout version 1, as kvcached wrote it before device identities (std::atomic
// fields had the size and alignment of the plain integers used here).
namespace v1 {
constexpr std::size_t kCapacity = 64;
struct alignas(64) Entry {
  std::uint64_t state;
  std::uint64_t instance_id;
  std::int64_t pid;
  std::uint64_t start_time_ticks;
  std::uint64_t limit_bytes, mapped_bytes, used_bytes, reported_mapped_bytes, wanted_bytes;
  std::int64_t wanted_at_ns;
  char name[64];
};
struct Header {
  HeaderPrefix prefix;
  char device[32];
  pthread_mutex_t mutex;
  std::uint64_t budget_bytes, next_instance_id;
  std::int64_t last_stale_scan_ns, lock_owner_pid;
  std::uint64_t lock_recoveries;
};
struct Layout {
  Header header;
  Entry entries[kCapacity];
};
}  // namespace v1

struct AlignedFree {
  void operator()(void* memory) const { ::operator delete(memory, std::align_val_t{64}); }
};

// Reads `bytes` from the start of the file into 64-byte aligned memory, or null on a short read.
std::unique_ptr<void, AlignedFree> read_start(int fd, std::size_t bytes) {
  std::unique_ptr<void, AlignedFree> memory(::operator new(bytes, std::align_val_t{64}));
  std::memset(memory.get(), 0, bytes);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t got = pread(fd, static_cast<char*>(memory.get()) + done, bytes - done, static_cast<off_t>(done));
    if (got <= 0) return nullptr;
    done += static_cast<std::size_t>(got);
  }
  return memory;
}

template <typename EntryT, std::size_t N>
std::vector<std::int64_t> live_pids_of(const EntryT (&entries)[N]) {
  std::vector<std::int64_t> pids;
  for (const EntryT& entry : entries) {
    if (entry.state == kSlotActive && process_alive(entry.pid, entry.start_time_ticks)) {
      pids.push_back(entry.pid);
    }
  }
  return pids;
}

}  // namespace

FileVerdict inspect_registry_file(int fd, const struct stat& info) {
  FileVerdict verdict;
  const auto size = static_cast<std::size_t>(info.st_size);
  HeaderPrefix prefix{};
  const ssize_t got = pread(fd, &prefix, sizeof prefix, 0);
  if (got != static_cast<ssize_t>(sizeof prefix) || prefix.magic != kRegistryMagic) {
    const bool all_zero =
        got >= 0 && std::all_of(reinterpret_cast<const char*>(&prefix), reinterpret_cast<const char*>(&prefix) + got,
                                [](char c) { return c == 0; });
    if (size == 0 || (all_zero && got > 0)) {
      verdict.kind = FileVerdict::damaged;
      verdict.why = size == 0 ? "is empty (truncated)" : "starts with zeros (truncated or wiped)";
    } else {
      verdict.why = "is not a kvcached registry";
    }
    return verdict;
  }
  if (prefix.version == 1) {
    verdict.kind = FileVerdict::old_style;
    verdict.why = "was made by an older kvcached (layout version 1, devices named by index)";
    auto memory = prefix.layout_bytes == sizeof(v1::Layout) && prefix.capacity == v1::kCapacity
                      ? read_start(fd, sizeof(v1::Layout))
                      : nullptr;
    verdict.table_readable = memory != nullptr;
    if (memory) {
      const auto* layout = static_cast<const v1::Layout*>(memory.get());
      verdict.device.assign(layout->header.device, strnlen(layout->header.device, sizeof layout->header.device));
      verdict.live_pids = live_pids_of(layout->entries);
    }
    return verdict;
  }
  if (prefix.version != kRegistryLayoutVersion) {
    verdict.kind = FileVerdict::other_version;
    verdict.why = "has layout version " + std::to_string(prefix.version) + " (this kvcached reads " +
                  std::to_string(kRegistryLayoutVersion) + "): made by another kvcached version";
    return verdict;
  }
  if (size < kLayoutBytes) {
    verdict.kind = FileVerdict::damaged;
    verdict.why = "is truncated (" + std::to_string(size) + " of " + std::to_string(kLayoutBytes) + " bytes)";
    return verdict;
  }
  auto memory = read_start(fd, kLayoutBytes);
  if (!memory) {
    verdict.kind = FileVerdict::damaged;
    verdict.why = "could not be read whole";
    return verdict;
  }
  const auto* layout = static_cast<const Layout*>(memory.get());
  const Header& header = layout->header;
  if (header.prefix.capacity != kRegistryCapacity || header.prefix.layout_bytes != kLayoutBytes) {
    verdict.kind = FileVerdict::other_version;
    verdict.why = "has a different table size (made by another kvcached build)";
    return verdict;
  }
  if (auto lie = table_lie(*layout)) {
    verdict.kind = FileVerdict::damaged;
    verdict.why = "holds a value that cannot be true (" + *lie + ")";
    return verdict;
  }
  verdict.kind = FileVerdict::current;
  verdict.contradiction_seen = table_contradiction(*layout).has_value();
  verdict.device.assign(header.device, strnlen(header.device, sizeof header.device));
  for (const EntryRecord& entry : layout->entries) {
    if (slot_active(entry) && process_alive(entry.pid.load(), entry.start_time_ticks.load())) {
      verdict.live_pids.push_back(entry.pid.load());
    }
  }
  return verdict;
}

std::string describe_pids(const std::vector<std::int64_t>& pids) {
  std::string text = pids.size() == 1 ? "pid " : "pids ";
  for (std::size_t index = 0; index < pids.size(); ++index) {
    text += (index ? ", " : "") + std::to_string(pids[index]);
  }
  return text;
}

}  // namespace kvcached::registry_detail
