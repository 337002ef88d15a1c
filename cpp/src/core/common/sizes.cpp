// parse_size_bytes: exact integer arithmetic over the grammar in kvcached/sizes.hpp.
#include "kvcached/sizes.hpp"

#include <cctype>
#include <utility>

namespace kvcached {

namespace {

using Wide = unsigned __int128;

struct Unit {
  const char* spelling;  // lower case
  std::uint64_t factor;
};

constexpr std::uint64_t kKiB = std::uint64_t{1} << 10;
constexpr std::uint64_t kKB = 1000;

// Every spelling a unit may take; compared without regard to case.
constexpr Unit kUnits[] = {
    {"", 1},
    {"b", 1},
    {"k", kKiB},
    {"ki", kKiB},
    {"kib", kKiB},
    {"kb", kKB},
    {"m", kKiB << 10},
    {"mi", kKiB << 10},
    {"mib", kKiB << 10},
    {"mb", kKB * kKB},
    {"g", kKiB << 20},
    {"gi", kKiB << 20},
    {"gib", kKiB << 20},
    {"gb", kKB * kKB * kKB},
    {"t", kKiB << 30},
    {"ti", kKiB << 30},
    {"tib", kKiB << 30},
    {"tb", kKB * kKB * kKB * kKB},
    {"p", kKiB << 40},
    {"pi", kKiB << 40},
    {"pib", kKiB << 40},
    {"pb", kKB * kKB * kKB * kKB * kKB},
};

// Bounds that keep every intermediate below 2^128: the numerator stays under
// 10^30 and the denominator under 10^19, so (2^63 - 1) * denominator fits too.
constexpr std::size_t kMaxDigits = 30;
constexpr std::size_t kMaxFractionDigits = 18;

bool is_space(char c) { return c == ' ' || c == '\t'; }

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

}  // namespace

std::uint64_t parse_size_bytes(const std::string& text, const std::string& what) {
  const auto refuse = [&](const std::string& why) -> std::uint64_t {
    const std::string quoted = "'" + text + "'";
    throw InvalidArgument((what.empty() ? quoted : what + "=" + quoted) + " is not a size: " + why);
  };
  const std::string examples = "write e.g. 4096, 512MiB, 8G or 2GB";
  std::size_t at = 0;
  while (at < text.size() && is_space(text[at])) ++at;
  if (at == text.size()) return refuse("it is empty (" + examples + ")");
  if (text[at] == '-') return refuse("sizes cannot be negative");
  if (!std::isdigit(static_cast<unsigned char>(text[at]))) {
    return refuse("it does not start with a number (" + examples + ")");
  }
  Wide numerator = 0;    // all digits, the decimal point removed
  Wide denominator = 1;  // 10^(digits after the point)
  std::size_t digits = 0;
  std::size_t fraction_digits = 0;
  bool seen_point = false;
  for (; at < text.size(); ++at) {
    const char c = text[at];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      if (++digits > kMaxDigits) return refuse("it is too large (at most 2^63 - 1 bytes)");
      numerator = numerator * 10 + static_cast<unsigned>(c - '0');
      if (seen_point) {
        if (++fraction_digits > kMaxFractionDigits) {
          return refuse("more than " + std::to_string(kMaxFractionDigits) + " digits after the point");
        }
        denominator *= 10;
      }
    } else if (c == '.' && !seen_point) {
      seen_point = true;
      const bool digit_follows = at + 1 < text.size() && std::isdigit(static_cast<unsigned char>(text[at + 1]));
      if (!digit_follows) return refuse("a decimal point must be followed by digits");
    } else {
      break;
    }
  }
  const bool exponent =
      at + 1 < text.size() && (text[at] == 'e' || text[at] == 'E') &&
      (std::isdigit(static_cast<unsigned char>(text[at + 1])) || text[at + 1] == '+' || text[at + 1] == '-');
  if (exponent) return refuse("exponents are not accepted (" + examples + ")");
  while (at < text.size() && is_space(text[at])) ++at;
  std::size_t unit_end = at;
  while (unit_end < text.size() && std::isalpha(static_cast<unsigned char>(text[unit_end]))) {
    ++unit_end;
  }
  const std::string unit_text = text.substr(at, unit_end - at);
  at = unit_end;
  while (at < text.size() && is_space(text[at])) ++at;
  if (at != text.size()) {
    return refuse("unexpected '" + text.substr(at) + "' (" + examples + "; no signs, exponents or separators)");
  }
  const std::string unit = lower(unit_text);
  const Unit* found = nullptr;
  for (const Unit& candidate : kUnits) {
    if (unit == candidate.spelling) found = &candidate;
  }
  if (found == nullptr) {
    return refuse("unknown unit '" + unit_text +
                  "' (K, M, G, T, P or KiB ... PiB: powers of 1024; KB, MB, GB, TB, PB: "
                  "powers of 1000; B: bytes)");
  }
  // Compare before multiplying: value = numerator * factor / denominator.
  const Wide limit = static_cast<Wide>(kMaxSizeBytes) * denominator;
  if (numerator > limit / found->factor) return refuse("it is too large (at most 2^63 - 1 bytes)");
  const Wide product = numerator * found->factor;
  if (product % denominator != 0) return refuse("it is not a whole number of bytes");
  return static_cast<std::uint64_t>(product / denominator);
}

}  // namespace kvcached
