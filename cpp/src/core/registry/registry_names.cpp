// Parsers of canonical device names, instance names and local device names.
#include "kvcached/registry/registry_names.hpp"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>

namespace kvcached {

namespace {

bool lower_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }
bool digit(char c) { return c >= '0' && c <= '9'; }

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

// "8-4-4-4-12" groups of lower-case hex.
bool is_uuid(const std::string& text) {
  static constexpr std::size_t kGroups[] = {8, 4, 4, 4, 12};
  std::size_t at = 0;
  for (std::size_t index = 0; index < 5; ++index) {
    if (index > 0 && (at >= text.size() || text[at++] != '-')) return false;
    for (std::size_t n = 0; n < kGroups[index]; ++n) {
      if (at >= text.size() || !lower_hex(text[at++])) return false;
    }
  }
  return at == text.size();
}

// Lower-case hex and '-', starting with hex, at most 36 characters.
bool is_hex_id(const std::string& text) {
  constexpr std::size_t kMaxIdChars = 36;
  return !text.empty() && text.size() <= kMaxIdChars && lower_hex(text.front()) &&
         std::all_of(text.begin(), text.end(), [](char c) { return lower_hex(c) || c == '-'; });
}

// "dddd:bb:dd.f" (the domain has 4 or 8 hex digits), lower-case.
bool is_pci_bus_id(const std::string& text) {
  const std::size_t domain_digits = text.find(':');
  if (domain_digits != 4 && domain_digits != 8) return false;
  const std::string rest = text.substr(domain_digits);  // ":bb:dd.f"
  return rest.size() == 8 && rest[0] == ':' && rest[3] == ':' && rest[6] == '.' &&
         std::all_of(text.begin(), text.begin() + domain_digits, lower_hex) && lower_hex(rest[1]) &&
         lower_hex(rest[2]) && lower_hex(rest[4]) && lower_hex(rest[5]) && rest[7] >= '0' && rest[7] <= '7';
}

// A decimal index without leading zeros, at most 4 digits.
bool is_index(const std::string& text) {
  constexpr std::size_t kMaxIndexDigits = 4;
  return !text.empty() && text.size() <= kMaxIndexDigits && std::all_of(text.begin(), text.end(), digit) &&
         (text == "0" || text.front() != '0');
}

// Decodes one UTF-8 sequence at `at`; returns its code point and advances, or -1.
std::int32_t next_code_point(const std::string& text, std::size_t& at) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(at);
  std::size_t length = 0;
  std::int32_t code = 0;
  if (lead < 0x80) {
    ++at;
    return lead;
  } else if ((lead & 0xE0) == 0xC0) {
    length = 2, code = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3, code = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4, code = lead & 0x07;
  } else {
    return -1;
  }
  if (at + length > text.size()) return -1;
  for (std::size_t i = 1; i < length; ++i) {
    if ((byte(at + i) & 0xC0) != 0x80) return -1;
    code = (code << 6) | (byte(at + i) & 0x3F);
  }
  static constexpr std::int32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
  const bool surrogate = code >= 0xD800 && code <= 0xDFFF;
  if (code < kMinForLength[length] || code > 0x10FFFF || surrogate) return -1;  // overlong or invalid
  at += length;
  return code;
}

}  // namespace

RegistryDeviceKind registry_device_kind(const std::string& device) {
  if (device == "cpu") return RegistryDeviceKind::host;
  if (device.size() <= kRegistryDeviceMaxBytes) {
    if ((starts_with(device, "cuda-GPU-") || starts_with(device, "cuda-MIG-")) && is_uuid(device.substr(9))) {
      return RegistryDeviceKind::gpu_identity;
    }
    if (starts_with(device, "hip-GPU-") && is_hex_id(device.substr(8))) {
      return RegistryDeviceKind::gpu_identity;
    }
    if (starts_with(device, "hip-pci-") && is_pci_bus_id(device.substr(8))) {
      return RegistryDeviceKind::gpu_identity;
    }
    if ((starts_with(device, "cuda-index-") && is_index(device.substr(11))) ||
        (starts_with(device, "hip-index-") && is_index(device.substr(10)))) {
      return RegistryDeviceKind::gpu_index;
    }
  }
  std::string shown;
  for (const char c : device.substr(0, 80)) {
    shown += std::isprint(static_cast<unsigned char>(c)) ? std::string(1, c) : std::string("?");
  }
  throw InvalidArgument("device name '" + shown +
                        "' is not a registry device name: expected 'cpu', 'cuda-GPU-<uuid>', 'cuda-MIG-<uuid>', "
                        "'hip-GPU-<id>', 'hip-pci-<dddd:bb:dd.f>', 'cuda-index-<N>' or 'hip-index-<N>' (a device as "
                        "a process sees it, such as 'cuda:0', is resolved to one of these by kvcached.registry)");
}

bool is_legacy_device_name(const std::string& device) {
  for (const char* prefix : {"cuda:", "rocm:", "hip:"}) {
    if (starts_with(device, prefix)) {
      const std::string index = device.substr(std::string(prefix).size());
      return !index.empty() && index.size() <= 4 && std::all_of(index.begin(), index.end(), digit);
    }
  }
  return false;
}

void validate_instance_name(const std::string& name) {
  const auto refuse = [&](const std::string& why) {
    throw InvalidArgument("instance name must be 1-" + std::to_string(kRegistryNameMaxBytes) +
                          " bytes of UTF-8 without control characters; " + why);
  };
  if (name.empty() || name.size() > kRegistryNameMaxBytes) {
    refuse("got " + std::to_string(name.size()) + " bytes");
  }
  for (std::size_t at = 0; at < name.size();) {
    const std::int32_t code = next_code_point(name, at);
    if (code < 0) refuse("it is not valid UTF-8");
    const bool control = code < 0x20 || (code >= 0x7F && code <= 0x9F);  // C0, DEL, C1
    if (control) {
      char code_text[8];
      std::snprintf(code_text, sizeof code_text, "%04X", static_cast<unsigned>(code));
      refuse(std::string("it contains control character U+") + code_text);
    }
  }
}

void validate_local_device(const std::string& local_device) {
  const bool ok = local_device.size() <= kRegistryLocalDeviceMaxBytes &&
                  std::all_of(local_device.begin(), local_device.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || digit(c) || c == ':' || c == '.' || c == '_' || c == '-';
                  });
  if (!ok) {
    throw InvalidArgument("local device name must be at most " + std::to_string(kRegistryLocalDeviceMaxBytes) +
                          " characters of [a-z0-9:._-], such as 'cuda:1'");
  }
}

}  // namespace kvcached
