// Sizes written by people ("512MiB", "8G", "2GB"): the one grammar kvcached reads them with.
//
// A size is a whole number of bytes: digits, optionally a decimal point and more
// digits, then optionally a unit, with spaces allowed around the unit. Units
// ignore case and there are no bit units:
//   (none), B                        bytes
//   K, M, G, T, P  and  KiB ... PiB  powers of 1024 (Ki, Mi, ... too)
//   KB, MB, GB, TB, PB               powers of 1000
// A fraction is accepted only when the result is a whole number of bytes
// ("1.5G" yes, "0.5" no). Signs, exponents, inf, nan and values of 2^63 bytes or
// more are refused. Python reads sizes through the same function
// (kvcached.sizes.parse_bytes), so every option and tool agrees.
#pragma once

#include <cstdint>
#include <string>

#include "kvcached/error.hpp"

namespace kvcached {

// Largest size accepted: 2^63 - 1 bytes (sizes travel as signed 64-bit integers).
inline constexpr std::uint64_t kMaxSizeBytes = (std::uint64_t{1} << 63) - 1;

// Parses `text` by the grammar above. On failure throws InvalidArgument whose
// message names `what` (an option or variable, e.g. "KVCACHED_PAGE_BYTES") when
// given, quotes the text and says why.
KVCACHED_EXPORT std::uint64_t parse_size_bytes(const std::string& text, const std::string& what = "");

}  // namespace kvcached
