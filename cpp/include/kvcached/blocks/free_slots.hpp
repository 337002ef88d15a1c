// FreeSlots: the free block slots of one mapped page, handed out lowest first.
//
// Lowest first, not last freed first: however frees came back, an alloc gets
// its slots in ascending, mostly contiguous runs, as from SGLang's sorted free
// list. Engines gather a request's tokens (SGLang) or blocks by id, so scattered
// ids cost reads: on a CPU, SGLang with page size 1 ran about 4 % slower with
// the slots a previous pass's frees had scrambled. A bitmap of one bit per slot.
// A block manager also keeps its unmapped page ids in one (lowest id first, one
// bit per page id instead of a tree node's 48 bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcached/error.hpp"

namespace kvcached {

class KVCACHED_EXPORT FreeSlots {
 public:
  // Every slot of a page of `capacity` free (a page just mapped).
  void fill(std::size_t capacity);
  // No slot (the page leaves the allocatable set); gives the bitmap's memory back.
  void clear() noexcept;

  std::size_t size() const noexcept { return free_; }
  std::size_t capacity() const noexcept { return capacity_; }
  bool contains(std::uint32_t slot) const noexcept {
    return slot < capacity_ && (words_[slot / 64] >> (slot % 64) & 1u) != 0;
  }

  // Takes the `n` lowest free slots (n <= size()), appending base + slot to `out` in ascending order.
  void take(std::size_t n, std::int64_t base, std::vector<std::int64_t>& out);
  // Appends base + slot for the (up to) `n` lowest free slots, taking none.
  void lowest(std::size_t n, std::int64_t base, std::vector<std::int64_t>& out) const;
  // Frees a taken slot; InvalidArgument if it is free already or beyond the page.
  void give(std::uint32_t slot);
  // Takes one given slot; InvalidArgument if it is not free.
  void remove(std::uint32_t slot);

 private:
  std::vector<std::uint64_t> words_;
  std::size_t capacity_ = 0, free_ = 0;
  std::size_t first_word_ = 0;  // no free slot lies in a word below this one
};

}  // namespace kvcached
