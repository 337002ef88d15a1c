// BestFitIndex: bucket lists of mapped pages by free block count, and the placement choice.
#include "kvcached/blocks/best_fit_index.hpp"

#include <algorithm>
#include <limits>
#include <string>

namespace kvcached {

namespace {
constexpr std::size_t kNoBucket = std::numeric_limits<std::size_t>::max();
}

BestFitIndex::BestFitIndex(std::size_t num_pages, std::size_t blocks_per_page, std::size_t last_page_blocks)
    : blocks_per_page_(blocks_per_page), last_page_blocks_(last_page_blocks) {
  if (num_pages == 0 || num_pages > kNone || blocks_per_page == 0 || blocks_per_page >= kAbsent ||
      last_page_blocks == 0 || last_page_blocks > blocks_per_page) {
    throw InvalidArgument("BestFitIndex: bad geometry (" + std::to_string(num_pages) + " pages of " +
                          std::to_string(blocks_per_page) + " blocks, last " + std::to_string(last_page_blocks) + ")");
  }
  free_.assign(num_pages, kAbsent);
  next_.assign(num_pages, kNone);
  prev_.assign(num_pages, kNone);
  head_.assign(blocks_per_page + 1, kNone);
  nonempty_bits_.assign((blocks_per_page + 1 + 63) / 64, 0);
}

void BestFitIndex::link(std::uint32_t page, std::size_t bucket) {
  const std::uint32_t head = head_[bucket];
  next_[page] = head;
  prev_[page] = kNone;
  if (head != kNone) prev_[head] = page;
  head_[bucket] = page;
  nonempty_bits_[bucket / 64] |= (1ull << (bucket % 64));
}

void BestFitIndex::unlink(std::uint32_t page, std::size_t bucket) {
  if (prev_[page] != kNone) {
    next_[prev_[page]] = next_[page];
  } else {
    head_[bucket] = next_[page];
  }
  if (next_[page] != kNone) prev_[next_[page]] = prev_[page];
  next_[page] = prev_[page] = kNone;
  if (head_[bucket] == kNone) nonempty_bits_[bucket / 64] &= ~(1ull << (bucket % 64));
}

void BestFitIndex::count(std::uint32_t page, std::size_t free_blocks, int sign) {
  const bool empty = free_blocks == capacity(page);
  if (sign > 0) {
    ++pages_;
    free_total_ += free_blocks;
    if (empty) ++empty_pages_, empty_blocks_ += free_blocks;
  } else {
    --pages_;
    free_total_ -= free_blocks;
    if (empty) --empty_pages_, empty_blocks_ -= free_blocks;
  }
}

void BestFitIndex::insert(std::uint32_t page, std::size_t free_blocks) {
  if (contains(page) || free_blocks > capacity(page)) {
    throw InvalidArgument("BestFitIndex: page " + std::to_string(page) + " cannot be inserted with " +
                          std::to_string(free_blocks) + " free blocks");
  }
  free_[page] = static_cast<std::uint32_t>(free_blocks);
  link(page, free_blocks);
  count(page, free_blocks, +1);
}

void BestFitIndex::update(std::uint32_t page, std::size_t free_blocks) {
  const std::size_t old = free_[page];
  if (old == free_blocks) return;
  count(page, old, -1);
  unlink(page, old);
  free_[page] = static_cast<std::uint32_t>(free_blocks);
  link(page, free_blocks);
  count(page, free_blocks, +1);
}

void BestFitIndex::erase(std::uint32_t page) {
  const std::size_t old = free_[page];
  count(page, old, -1);
  unlink(page, old);
  free_[page] = kAbsent;
}

std::uint32_t BestFitIndex::first_usable(std::size_t bucket, bool allow_empty) const {
  std::uint32_t page = head_[bucket];
  if (allow_empty) return page;
  if (bucket == blocks_per_page_) return kNone;  // only entirely free pages have that many
  // Below a full page's count only a partial last page can be entirely free.
  while (page != kNone && entirely_free(page)) page = next_[page];
  return page;
}

std::size_t BestFitIndex::next_bucket(std::size_t from) const {
  for (std::size_t word = from / 64; word < nonempty_bits_.size(); ++word) {
    std::uint64_t bits = nonempty_bits_[word];
    if (word == from / 64) bits &= ~0ull << (from % 64);
    if (bits != 0) return word * 64 + static_cast<std::size_t>(__builtin_ctzll(bits));
  }
  return kNoBucket;
}

std::size_t BestFitIndex::previous_bucket(std::size_t from) const {
  for (std::size_t word = from / 64 + 1; word-- > 0;) {
    std::uint64_t bits = nonempty_bits_[word];
    if (word == from / 64 && from % 64 != 63) bits &= (1ull << (from % 64 + 1)) - 1;
    if (bits != 0) return word * 64 + 63 - static_cast<std::size_t>(__builtin_clzll(bits));
  }
  return kNoBucket;
}

std::uint32_t BestFitIndex::tightest_fit(std::size_t n, bool allow_empty) const {
  // Smallest bucket >= n holding a usable page (bucket 0: full pages, never chosen).
  for (std::size_t b = next_bucket(std::max<std::size_t>(n, 1)); b != kNoBucket; b = next_bucket(b + 1)) {
    const std::uint32_t page = first_usable(b, allow_empty);
    if (page != kNone) return page;
    if (b == blocks_per_page_) break;
  }
  return kNone;
}

std::uint32_t BestFitIndex::choose(std::size_t remaining, Placement placement, bool allow_empty) const {
  if (remaining == 0) return kNone;
  if (placement == Placement::kFullestFirst) return tightest_fit(1, allow_empty);
  // Fewest pages: the tightest page holding the whole remainder, else the emptiest one.
  if (remaining <= blocks_per_page_) {
    const std::uint32_t fit = tightest_fit(remaining, allow_empty);
    if (fit != kNone) return fit;
  }
  for (std::size_t b = previous_bucket(blocks_per_page_); b != kNoBucket && b > 0; b = previous_bucket(b - 1)) {
    const std::uint32_t page = first_usable(b, allow_empty);
    if (page != kNone) return page;
  }
  return kNone;
}

std::vector<std::uint32_t> BestFitIndex::empty_pages_to_release(std::size_t count) const {
  std::vector<std::uint32_t> pages;
  const std::uint32_t last = static_cast<std::uint32_t>(free_.size() - 1);
  if (count > 0 && last_page_blocks_ < blocks_per_page_ && contains(last) && entirely_free(last)) {
    pages.push_back(last);
  }
  for (std::uint32_t p = head_[blocks_per_page_]; p != kNone && pages.size() < count; p = next_[p]) {
    pages.push_back(p);
  }
  std::sort(pages.begin(), pages.end(), [](std::uint32_t a, std::uint32_t b) { return a > b; });
  if (pages.size() > count) pages.resize(count);
  return pages;
}

}  // namespace kvcached
