// FreeSlots: a bitmap of a page's free slots, lowest first.
#include "kvcached/blocks/free_slots.hpp"

#include <string>

namespace kvcached {

void FreeSlots::fill(std::size_t capacity) {
  capacity_ = capacity;
  free_ = capacity;
  first_word_ = 0;
  words_.assign((capacity + 63) / 64, ~std::uint64_t{0});
  if (capacity % 64 != 0) words_.back() = (std::uint64_t{1} << (capacity % 64)) - 1;
}

void FreeSlots::clear() noexcept {
  std::vector<std::uint64_t>().swap(words_);
  capacity_ = free_ = first_word_ = 0;
}

void FreeSlots::take(std::size_t n, std::int64_t base, std::vector<std::int64_t>& out) {
  if (n > free_) {
    throw InvalidArgument("internal error: " + std::to_string(n) + " slots asked of a page with " +
                          std::to_string(free_) + " free");
  }
  free_ -= n;
  std::size_t w = first_word_;
  for (; n > 0; ++w) {
    std::uint64_t bits = words_[w];
    for (; bits != 0 && n > 0; --n) {
      const int bit = __builtin_ctzll(bits);
      out.push_back(base + static_cast<std::int64_t>(w * 64 + static_cast<std::size_t>(bit)));
      bits &= bits - 1;  // the lowest set bit taken
    }
    words_[w] = bits;
    if (bits != 0) break;  // this word still has free slots: the next take starts here
  }
  first_word_ = w;
}

void FreeSlots::lowest(std::size_t n, std::int64_t base, std::vector<std::int64_t>& out) const {
  for (std::size_t w = first_word_; w < words_.size() && n > 0; ++w) {
    for (std::uint64_t bits = words_[w]; bits != 0 && n > 0; bits &= bits - 1, --n) {
      out.push_back(base + static_cast<std::int64_t>(w * 64 + static_cast<std::size_t>(__builtin_ctzll(bits))));
    }
  }
}

void FreeSlots::give(std::uint32_t slot) {
  if (slot >= capacity_ || contains(slot)) {
    throw InvalidArgument("internal error: slot " + std::to_string(slot) + " given back twice or beyond the page");
  }
  words_[slot / 64] |= std::uint64_t{1} << (slot % 64);
  if (slot / 64 < first_word_) first_word_ = slot / 64;
  ++free_;
}

void FreeSlots::remove(std::uint32_t slot) {
  if (!contains(slot)) throw InvalidArgument("internal error: slot " + std::to_string(slot) + " is not free");
  words_[slot / 64] &= ~(std::uint64_t{1} << (slot % 64));
  --free_;
}

}  // namespace kvcached
