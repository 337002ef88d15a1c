// Host memory taken by a pool's per-page-id bookkeeping, and the cap that refuses a geometry
// whose bookkeeping alone would exhaust the host.
//
// A KV space and a block manager keep a few dozen bytes per page id (mapping
// records, page states, free-slot bitmaps, the best-fit index), sized when
// they are made. A geometry of 2^28 page ids of 4 KiB took over 20 GB before
// its first block: such a geometry is refused up front, with its cost, rather
// than left to the OOM killer or std::bad_alloc.
#pragma once

#include <cstddef>
#include <string>

#include "kvcached/space/kv_layout.hpp"

namespace kvcached {

// What one owner of bookkeeping keeps, per page id and per block id.
struct PageMetadataCost {
  std::size_t bytes_per_page_id = 0;
  std::size_t bytes_per_block = 0;

  PageMetadataCost operator+(const PageMetadataCost& other) const noexcept {
    return {bytes_per_page_id + other.bytes_per_page_id, bytes_per_block + other.bytes_per_block};
  }
};

// The bookkeeping `cost` comes to for `layout` (saturating at SIZE_MAX).
KVCACHED_EXPORT std::size_t page_metadata_bytes(const KVLayout& layout, const PageMetadataCost& cost) noexcept;

// The most bookkeeping one pool may keep: 4 GiB, or a quarter of the host's
// physical memory if that is less.
KVCACHED_EXPORT std::size_t page_metadata_cap_bytes() noexcept;

// Throws InvalidArgument, naming the geometry, its page ids, what `owner` ("a
// pool") would keep and the cap, when that is above page_metadata_cap_bytes().
KVCACHED_EXPORT void check_page_metadata(const KVLayout& layout, const PageMetadataCost& cost,
                                         const std::string& owner);

// The error for a std::bad_alloc while `owner` sized its bookkeeping for `layout`.
[[noreturn]] KVCACHED_EXPORT void throw_page_metadata_exhausted(const KVLayout& layout, const PageMetadataCost& cost,
                                                                const std::string& owner);

}  // namespace kvcached
