// PageOps: one ordered batch of page-id operations from a deciding side (a
// BlockManager) to a mapping side (a KVSpace, here or in another process).
// Unmaps are applied before maps; the two lists never share a page.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcached {

struct PageOps {
  std::uint64_t seq = 0;  // 1, 2, 3, ... per batch; 0: an empty batch (nothing to apply)
  std::vector<std::int64_t> map_pages;
  std::vector<std::int64_t> unmap_pages;
  bool empty() const noexcept { return map_pages.empty() && unmap_pages.empty(); }
};

}  // namespace kvcached
