// BlockManagerOptions: the one value holding how a block manager behaves
// (null block, limit, reserve targets, worker, placement). Checked once by
// validate(); bound to Python as a value and passed whole.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "kvcached/error.hpp"

namespace kvcached {

// How the blocks of one alloc are placed on mapped pages.
enum class Placement {
  // A run goes to the page with the fewest free blocks that still holds all
  // of it, else takes the emptiest page and repeats, so a request's blocks
  // share as few pages as possible; a single block fills the fullest page.
  kFewestPages,
  // Every block goes to the fullest page first (the earlier policy, kept to
  // measure against: it scatters long runs over small holes).
  kFullestFirst,
};

Placement parse_placement(const std::string& name);
std::string placement_name(Placement placement);

struct ReserveTargets {
  std::size_t min_free_pages = 0;   // mapped pages with no block in use, kept ready
  std::size_t max_free_pages = 0;   // beyond this, free pages are unmapped
  std::size_t min_spare_pages = 0;  // pre-created, unmapped allocations kept ready
  std::size_t max_spare_pages = 0;  // beyond this, spares are released
  void validate() const;
};

struct BlockManagerOptions {
  bool null_block = false;                 // block 0 reserved (engines point padding at it)
  std::optional<std::size_t> limit_bytes;  // physical bytes this pool may hold (nullopt: none)
  ReserveTargets reserve;
  bool background_worker = false;  // keep `reserve` with a thread
  Placement placement = Placement::kFewestPages;
  void validate() const { reserve.validate(); }
};

}  // namespace kvcached
