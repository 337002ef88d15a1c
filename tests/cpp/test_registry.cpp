// C++ side of the registry and size tests: the grammar, device names, and a
// registry that survives its file being truncated, removed or symlinked, with
// no Python in the way. Prints "N passed, M failed"; non-zero exit on failure.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

#include "kvcached/registry/device_registry.hpp"
#include "kvcached/registry/registry_directory.hpp"
#include "kvcached/registry/registry_names.hpp"
#include "kvcached/registry/registry_settings.hpp"
#include "kvcached/sizes.hpp"

namespace {

using namespace kvcached;

int passed = 0, failed = 0;

void check(bool condition, const char* what, int line) {
  if (condition) {
    ++passed;
  } else {
    ++failed;
    std::fprintf(stderr, "FAILED line %d: %s\n", line, what);
  }
}
#define CHECK(condition) check((condition), #condition, __LINE__)

template <typename Exception>
bool throws(const std::function<void()>& body, const std::string& words = "") {
  try {
    body();
  } catch (const Exception& error) {
    return std::string(error.what()).find(words) != std::string::npos;
  } catch (...) {
    return false;
  }
  return false;
}

constexpr std::size_t kPage = std::size_t{2} << 20;
const std::string kGpu = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000a";

void test_size_grammar() {
  CHECK(parse_size_bytes("4096") == 4096);
  CHECK(parse_size_bytes("8G") == (std::uint64_t{8} << 30));
  CHECK(parse_size_bytes("2GB") == 2'000'000'000);
  CHECK(parse_size_bytes("1.5 GiB") == (std::uint64_t{3} << 29));
  CHECK(parse_size_bytes("9223372036854775807") == kMaxSizeBytes);
  CHECK(throws<InvalidArgument>([] { parse_size_bytes("9223372036854775808"); }, "too large"));
  CHECK(throws<InvalidArgument>([] { parse_size_bytes("0.5"); }, "whole number of bytes"));
  CHECK(throws<InvalidArgument>([] { parse_size_bytes("1e99", "X"); }, "X='1e99' is not a size"));
  CHECK(throws<InvalidArgument>([] { parse_size_bytes("-1"); }, "negative"));
  CHECK(throws<InvalidArgument>([] { parse_size_bytes("nan"); }));
}

void test_device_names() {
  CHECK(registry_device_kind("cpu") == RegistryDeviceKind::host);
  CHECK(registry_device_kind(kGpu) == RegistryDeviceKind::gpu_identity);
  CHECK(registry_device_kind("hip-pci-0000:c1:00.0") == RegistryDeviceKind::gpu_identity);
  CHECK(registry_device_kind("hip-index-3") == RegistryDeviceKind::gpu_index);
  for (const char* bad : {"cuda:0", "../x", "", "cuda-GPU-0A1B2C3D-0000-4000-8000-00000000000A", "hip-index-01"}) {
    CHECK(throws<InvalidArgument>([&] { registry_device_kind(bad); }, "not a registry device name"));
  }
  CHECK(is_legacy_device_name("rocm:1") && !is_legacy_device_name("cpu"));
  CHECK(throws<InvalidArgument>([] { validate_instance_name("bad\x1b[2J"); }, "control character"));
  CHECK(throws<InvalidArgument>([] { validate_instance_name("bad\xff"); }, "not valid UTF-8"));
}

void test_registry_survives_a_truncated_file() {
  auto registry = DeviceRegistry::open("cpu", 8 * kPage, "cpu");
  auto budget = registry->register_instance("engine");
  CHECK(budget->try_acquire(2 * kPage));
  CHECK(truncate(registry->path().c_str(), 0) == 0);
  CHECK(budget->available_bytes() == 0 && !budget->registered());  // no SIGBUS
  CHECK(throws<RegistryUnusable>([&] { budget->try_acquire(kPage); }, "was truncated"));
  budget->release(2 * kPage);
  auto fresh = DeviceRegistry::open("cpu", 4 * kPage);  // replaces the damaged file
  CHECK(fresh->budget_bytes() == 4 * kPage && fresh->entries().empty());
}

void test_registry_refuses_links_and_removed_files(const std::string& directory) {
  auto target = DeviceRegistry::open(kGpu, 8 * kPage);
  const std::string link = directory + "/kvcached-cuda-index-0";
  CHECK(symlink(target->path().c_str(), link.c_str()) == 0);
  CHECK(throws<RegistryUnusable>([] { DeviceRegistry::open("cuda-index-0", kPage); }, "symbolic link"));
  auto budget = target->register_instance("engine");
  CHECK(unlink(target->path().c_str()) == 0);
  CHECK(throws<RegistryUnusable>([&] { budget->try_acquire(kPage); }, "was removed"));
  struct stat info{};
  CHECK(stat(DeviceRegistry::open("cpu", kPage)->path().c_str(), &info) == 0 && (info.st_mode & 0777) == 0600);
}

// Settings come from the caller; a gid wider than gid_t is refused, never wrapped.
void test_registry_settings_are_checked_when_given(const std::string& directory) {
  CHECK(resolve_registry_group("0") == 0);
  CHECK(resolve_registry_group("4294967294") == static_cast<gid_t>(4294967294u));
  CHECK(throws<InvalidArgument>([] { resolve_registry_group("4294967295"); }, "out of range"));
  CHECK(throws<InvalidArgument>([] { resolve_registry_group("4294968298"); }, "KVCACHED_REGISTRY_GROUP='4294968298'"));
  CHECK(throws<InvalidArgument>([] { resolve_registry_group("nosuch-kvcached-group"); },
                                "names no group on this machine"));
  CHECK(throws<InvalidArgument>([] { configure_registry({"relative/dir", ""}); }, "absolute path"));
  CHECK(throws<InvalidArgument>([&] { configure_registry({directory, "4294968298"}); }, "out of range"));
  CHECK(registry_settings().directory == directory && registry_settings().group.empty());  // unchanged
}

std::size_t layout_offset(const std::string& field) {
  for (const auto& [name, offset] : registry_layout_offsets()) {
    if (name == field) return offset;
  }
  return 0;
}

// Writes `value` over field `field` of table slot `slot`, as a hostile writer could.
bool poke_entry(const std::string& path, std::size_t slot, const std::string& field, std::int64_t value) {
  const std::size_t offset =
      layout_offset("entries") + slot * layout_offset("entry_bytes") + layout_offset("entry." + field);
  const int fd = open(path.c_str(), O_WRONLY);
  const bool written = fd >= 0 && pwrite(fd, &value, sizeof value, static_cast<off_t>(offset)) == sizeof value;
  if (fd >= 0) close(fd);
  return written;
}

void test_registry_refuses_a_table_that_lies() {
  auto registry = DeviceRegistry::open("cpu", 8 * kPage);
  auto first = registry->register_instance("first");
  auto second = registry->register_instance("second");
  // Two entries of 2^63 bytes each would sum to 0: a full device read as empty.
  CHECK(poke_entry(registry->path(), first->slot(), "mapped_bytes", INT64_MIN));
  CHECK(poke_entry(registry->path(), second->slot(), "mapped_bytes", INT64_MIN));
  CHECK(first->available_bytes() == 0);  // read without the lock: the sum saturates
  CHECK(throws<RegistryUnusable>([&] { registry->mapped_bytes(); }, "cannot be true"));
  CHECK(throws<RegistryUnusable>([&] { second->try_acquire(kPage); }, "mapped_bytes 9223372036854775808"));
  // A pid of 2^62 is 0 as a pid_t: kill(0, 0) would call it alive forever.
  auto fresh = DeviceRegistry::open("cpu", 8 * kPage);  // replaces the damaged file
  auto liar = fresh->register_instance("liar");
  CHECK(poke_entry(fresh->path(), liar->slot(), "pid", std::int64_t{1} << 62));
  CHECK(throws<RegistryUnusable>([&] { fresh->clean_stale(); }, "pid 4611686018427387904"));
  CHECK(throws<InvalidArgument>([&] { DeviceRegistry::open("cpu", 8 * kPage)->set_budget_bytes(std::size_t{1} << 60); },
                                "larger than any device"));
}

}  // namespace

int main() {
  char directory[] = "/tmp/kvcached-registry-test-XXXXXX";
  if (mkdtemp(directory) == nullptr) return 2;
  configure_registry({directory, ""});
  test_registry_settings_are_checked_when_given(directory);
  test_size_grammar();
  test_device_names();
  test_registry_survives_a_truncated_file();
  test_registry_refuses_links_and_removed_files(directory);
  test_registry_refuses_a_table_that_lies();
  std::printf("%d passed, %d failed\n", passed, failed);
  const std::string cleanup = std::string("rm -rf ") + directory;
  if (std::system(cleanup.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", directory);
  return failed == 0 ? 0 : 1;
}
