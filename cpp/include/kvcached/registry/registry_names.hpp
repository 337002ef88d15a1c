// What registries, instances and devices may be called: one parser for each.
//
// A registry is keyed by the *physical* device, so that processes seeing one
// GPU under different indices (CUDA_VISIBLE_DEVICES) share one budget.
// Canonical device names:
//   cpu                                   the host (one registry per machine)
//   cuda-GPU-<uuid>, cuda-MIG-<uuid>      a CUDA device or MIG instance by UUID,
//                                         nvidia-smi style, lower-case hex 8-4-4-4-12
//   hip-GPU-<id>                          an AMD GPU by its unique id (hex and '-')
//   hip-pci-<dddd:bb:dd.f>                an AMD GPU by PCI bus id (lower-case hex)
//   cuda-index-<N>, hip-index-<N>         a GPU whose backend cannot report its
//                                         identity, by the index this process sees
// Older kvcached versions named registries by index ("cuda:0", "rocm:1"); such
// names are refused here and handled as old-style files (registry_directory.hpp).
#pragma once

#include <cstddef>
#include <string>

#include "kvcached/error.hpp"

namespace kvcached {

// How many instances one device's registry can hold at once.
inline constexpr std::size_t kRegistryCapacity = 64;
// Longest instance name, in bytes (the table stores names inline).
inline constexpr std::size_t kRegistryNameMaxBytes = 63;
// Longest canonical device name, in bytes.
inline constexpr std::size_t kRegistryDeviceMaxBytes = 63;
// Longest device name as a process sees it ("cuda:1", "hip:0", "cpu"), in bytes.
inline constexpr std::size_t kRegistryLocalDeviceMaxBytes = 15;

enum class RegistryDeviceKind {
  host,          // "cpu"
  gpu_identity,  // keyed by physical identity
  gpu_index,     // keyed by the index one process sees (no identity available)
};

// The kind of a canonical device name; InvalidArgument stating the grammar otherwise.
KVCACHED_EXPORT RegistryDeviceKind registry_device_kind(const std::string& device);
// True for names older kvcached versions keyed GPU registries by ("cuda:0",
// "rocm:1", "hip:2"); such files are old-style whatever their content.
KVCACHED_EXPORT bool is_legacy_device_name(const std::string& device);
// Instance names: 1-63 bytes of valid UTF-8 without control characters (they
// are printed by kvctl and kvtop). InvalidArgument otherwise.
KVCACHED_EXPORT void validate_instance_name(const std::string& name);
// Local device names: up to 15 bytes of [a-z0-9:._-] (empty: not given).
KVCACHED_EXPORT void validate_local_device(const std::string& local_device);

}  // namespace kvcached
