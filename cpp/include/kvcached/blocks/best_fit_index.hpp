// BestFitIndex: a pool's mapped pages bucketed by how many free blocks each
// has, so the page the next blocks of an alloc should go to is found in
// O(blocks_per_page / 64), whatever the pool's size. It also knows which pages
// are entirely free (those can be given back) and the placement policy.
//
// A page's capacity is blocks_per_page, except a partial last page (when the
// pool's block count is not a whole number of pages): it is "entirely free"
// at its own capacity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcached/blocks/block_manager_options.hpp"
#include "kvcached/error.hpp"

namespace kvcached {

class KVCACHED_EXPORT BestFitIndex {
 public:
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;

  BestFitIndex(std::size_t num_pages, std::size_t blocks_per_page, std::size_t last_page_blocks);

  // Page membership (a page is in the index while it is mapped).
  void insert(std::uint32_t page, std::size_t free_blocks);
  void update(std::uint32_t page, std::size_t free_blocks);
  void erase(std::uint32_t page);
  bool contains(std::uint32_t page) const noexcept { return free_[page] != kAbsent; }
  std::size_t free_blocks(std::uint32_t page) const noexcept { return free_[page]; }
  std::size_t capacity(std::uint32_t page) const noexcept {
    return page + 1 == free_.size() ? last_page_blocks_ : blocks_per_page_;
  }
  bool entirely_free(std::uint32_t page) const noexcept { return free_[page] == capacity(page); }

  // Totals over the pages in the index.
  std::size_t pages() const noexcept { return pages_; }
  std::size_t free_blocks() const noexcept { return free_total_; }
  std::size_t empty_pages() const noexcept { return empty_pages_; }    // entirely free
  std::size_t empty_blocks() const noexcept { return empty_blocks_; }  // their blocks

  // The page the next blocks of an alloc come from, with `remaining` blocks
  // still to place (see Placement). `allow_empty`: whether an entirely free
  // page may be used (a limit can forbid new pages). kNone when no page fits.
  std::uint32_t choose(std::size_t remaining, Placement placement, bool allow_empty) const;
  // The page with the fewest free blocks that still has at least `n` (n >= 1),
  // or kNone. `allow_empty` as in choose().
  std::uint32_t tightest_fit(std::size_t n, bool allow_empty) const;
  // Up to `count` entirely free pages, in descending id order (a partial last
  // page first: it holds the fewest blocks).
  std::vector<std::uint32_t> empty_pages_to_release(std::size_t count) const;

 private:
  static constexpr std::uint32_t kAbsent = 0xFFFFFFFFu;
  void link(std::uint32_t page, std::size_t bucket);
  void unlink(std::uint32_t page, std::size_t bucket);
  void count(std::uint32_t page, std::size_t free_blocks, int sign);
  // First page of `bucket` that may be used, or kNone.
  std::uint32_t first_usable(std::size_t bucket, bool allow_empty) const;
  // Lowest non-empty bucket >= from (<= blocks_per_page), or SIZE_MAX.
  std::size_t next_bucket(std::size_t from) const;
  // Highest non-empty bucket <= from, or SIZE_MAX.
  std::size_t previous_bucket(std::size_t from) const;

  std::size_t blocks_per_page_, last_page_blocks_;
  std::vector<std::uint32_t> free_;           // per page; kAbsent when not in the index
  std::vector<std::uint32_t> head_;           // per bucket (free block count)
  std::vector<std::uint32_t> next_, prev_;    // per page, within its bucket
  std::vector<std::uint64_t> nonempty_bits_;  // per bucket
  std::size_t pages_ = 0, free_total_ = 0, empty_pages_ = 0, empty_blocks_ = 0;
};

}  // namespace kvcached
