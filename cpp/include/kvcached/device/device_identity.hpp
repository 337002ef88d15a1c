// Physical device identity: one canonical text per physical device, the same in
// every process whatever its visible-devices mask or the ordinal it sees.
//
//   host  "cpu"
//   CUDA  "cuda-GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"   the UUID as nvidia-smi spells it
//   HIP   "hip-GPU-<16 hex digits>"                         the UUID body rocminfo prints after "GPU-"
//         "hip-GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"    a UUID reported as 16 raw bytes
//         "hip-pci-dddd:bb:dd.f"                            a device without a UUID: its PCI address
//
// Lower case throughout. Header-only, so the GPU backend modules use it without
// linking the core library.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

namespace kvcached::identity {

inline constexpr std::size_t kUuidBytes = 16;
inline constexpr const char* kHost = "cpu";

inline std::string lower(std::string text) {
  for (char& c : text) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return text;
}

// 16 raw bytes as 8-4-4-4-12 hex groups.
inline std::string from_uuid_bytes(const std::string& backend, const unsigned char* bytes) {
  std::string text = backend + "-GPU-";
  char hex[3];
  for (std::size_t i = 0; i < kUuidBytes; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned>(bytes[i]));
    text += hex;
  }
  return text;
}

// A UUID the driver reports as text (ROCm: 16 hex characters).
inline std::string from_uuid_text(const std::string& backend, const std::string& text) {
  return backend + "-GPU-" + lower(text);
}

// A PCI address "dddd:bb:dd.f" as the driver reports it.
inline std::string from_pci_bus_id(const std::string& backend, const std::string& bus_id) {
  return backend + "-pci-" + lower(bus_id);
}

}  // namespace kvcached::identity
