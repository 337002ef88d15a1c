// probe_fresh_mapping: does GPU work see a fresh HIP mapping at once?
//
// On gfx1201 / ROCm 7.2.1, a kernel launched right after hipMemMap +
// hipMemSetAccess read zeros and lost its stores until ~2 ms had passed
// (ROCm/rocm-systems#11693). This probe repeats the reproducer's shape through
// kvcached's HIP backend: each iteration reserves a fresh range, creates and
// maps one page, sets access, then at once fills it with GPU work (hipMemset,
// a blit kernel) and copies it back (hipMemcpy). It counts the pages whose fill
// did not land, first without the backend's fence, then with
// fence_new_mappings() before the fill, with the settle time --settle-us gives
// (kvcached.config's default for KVCACHED_HIP_MAPPING_SETTLE_US, 2000, unless told).
//
//   probe_fresh_mapping [--iters N] [--page-mib M] [--settle-us U]
//
// Exit code 1 if any page is lost *with* the fence (kvcached's path is then
// unsafe on this machine); the count without it is information.
#include <hip/hip_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvcached/backends/hip_backend.hpp"

namespace {

constexpr unsigned char kPattern = 0x5A;
constexpr std::size_t kBytesPerMiB = std::size_t{1} << 20;

bool check(const char* call, hipError_t code) {
  if (code == hipSuccess) return true;
  std::printf("FAILED: %s returned %d (%s)\n", call, static_cast<int>(code), hipGetErrorString(code));
  return false;
}

// One fresh page filled by GPU work right after mapping; true when the fill
// landed everywhere. `fence`: call fence_new_mappings() before the fill.
bool fill_lands(kvcached::VmmBackend& backend, std::size_t page_bytes, bool fence, std::vector<unsigned char>& host,
                bool& ok) {
  const kvcached::VirtualAddress base = backend.reserve(page_bytes, page_bytes);
  const kvcached::PhysicalHandle handle = backend.create(page_bytes);
  backend.map(base, page_bytes, handle);
  backend.set_access(base, page_bytes);
  if (fence) backend.fence_new_mappings();
  void* device = reinterpret_cast<void*>(base);
  ok = check("hipMemset", hipMemset(device, kPattern, page_bytes)) &&
       check("hipMemcpy", hipMemcpy(host.data(), device, page_bytes, hipMemcpyDeviceToHost));
  bool landed = ok;
  for (std::size_t i = 0; landed && i < page_bytes; ++i) landed = host[i] == kPattern;
  backend.synchronize();
  backend.unmap(base, page_bytes);
  backend.release(handle);
  backend.free_range(base, page_bytes);
  return landed;
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 200;
  std::size_t page_mib = 0;  // 0: the recommended granularity
  long settle_us = 2000;     // kvcached.config's default: the C++ core reads no environment
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long value = std::strtol(argv[i + 1], nullptr, 10);
    if (flag == "--iters" && value > 0) {
      iterations = static_cast<int>(value);
    } else if (flag == "--page-mib" && value > 0) {
      page_mib = static_cast<std::size_t>(value);
    } else if (flag == "--settle-us" && value >= 0) {
      settle_us = value;
    } else {
      std::fprintf(stderr, "usage: probe_fresh_mapping [--iters N] [--page-mib M] [--settle-us U]\n");
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "usage: probe_fresh_mapping [--iters N] [--page-mib M] [--settle-us U]\n");
    return 2;
  }
  try {
    std::shared_ptr<kvcached::VmmBackend> backend = kvcached::make_hip_backend(0, std::chrono::microseconds(settle_us));
    const std::size_t page_bytes = page_mib != 0 ? page_mib * kBytesPerMiB : backend->granularity().recommended_bytes;
    std::vector<unsigned char> host(page_bytes);
    std::printf(
        "== hip device 0 (%s): %d fresh page(s) of %.1f MiB each filled by GPU work "
        "(hipMemset) right after map + set_access, then copied back\n",
        backend->physical_device_name().c_str(), iterations, static_cast<double>(page_bytes) / kBytesPerMiB);
    int lost[2] = {0, 0};
    for (int fence = 0; fence < 2; ++fence) {
      for (int i = 0; i < iterations; ++i) {
        bool ok = true;
        if (!fill_lands(*backend, page_bytes, fence == 1, host, ok)) ++lost[fence];
        if (!ok) return 1;
      }
    }
    std::printf("without the fence: %d of %d page(s) lost the fill\n", lost[0], iterations);
    std::printf("with fence_new_mappings (settle %ld us): %d of %d page(s) lost the fill\n", settle_us, lost[1],
                iterations);
    return lost[1] == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
}
