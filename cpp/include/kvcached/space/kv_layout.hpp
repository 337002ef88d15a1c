// KVLayout: where each (layer, buffer, block) lives in a KV reservation, and
// which byte ranges one page id covers.
//
// Two layouts:
//  * per_layer  — region r = layer * num_buffers + buffer holds that layer's
//    blocks back to back (block stride = block_bytes). A page id is one
//    page_bytes chunk at the same offset of every region: L·B separate
//    physical allocations, because CUDA cannot map one allocation at several
//    offsets of it (DESIGN.md, measured facts).
//  * contiguous — a block is one run holding every layer and buffer
//    (block stride = L·B·block_bytes). A page id is one *compound page* of
//    L·B·page_bytes: one allocation, so growing is O(1) driver calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvcached/error.hpp"

namespace kvcached {

enum class KVLayoutKind { kPerLayer, kContiguous };

KVLayoutKind parse_layout(const std::string& name);
std::string layout_name(KVLayoutKind kind);

struct KVLayoutConfig {
  std::size_t num_layers = 0;
  std::size_t num_buffers = 2;   // 2: K and V; 1: MLA or a K||V cell
  std::size_t block_bytes = 0;   // one block of one layer and one buffer
  std::size_t page_bytes = 0;    // per region; multiple of the device granularity
  std::size_t num_pages = 0;     // virtual capacity in page ids
  KVLayoutKind kind = KVLayoutKind::kPerLayer;
};

struct ByteRange {
  std::size_t offset;  // from the reservation's base
  std::size_t size;
};

class KVCACHED_EXPORT KVLayout {
 public:
  // Validates the configuration (clear InvalidArgument messages).
  explicit KVLayout(const KVLayoutConfig& config);
  // Page count needed for `num_blocks` blocks (rounded up to whole pages).
  static std::size_t pages_for_blocks(std::size_t num_blocks, std::size_t block_bytes,
                                      std::size_t page_bytes);

  const KVLayoutConfig& config() const noexcept { return config_; }
  std::size_t num_regions() const noexcept { return config_.num_layers * config_.num_buffers; }
  std::size_t blocks_per_page() const noexcept { return blocks_per_page_; }
  std::size_t num_pages() const noexcept { return config_.num_pages; }
  std::size_t num_blocks() const noexcept { return config_.num_pages * blocks_per_page_; }
  // Physical bytes behind one page id (all layers and buffers).
  std::size_t page_id_bytes() const noexcept { return num_regions() * config_.page_bytes; }
  // Physical bytes behind one block id (all layers and buffers).
  std::size_t block_id_bytes() const noexcept { return num_regions() * config_.block_bytes; }
  std::size_t reservation_bytes() const noexcept { return config_.num_pages * page_id_bytes(); }
  // Bytes of one physical allocation backing part of a page id.
  std::size_t allocation_bytes() const noexcept;
  std::size_t allocations_per_page() const noexcept;

  // Strides of the engine-visible geometry, in bytes.
  std::size_t block_stride_bytes() const noexcept;
  std::size_t layer_stride_bytes() const noexcept;
  std::size_t buffer_stride_bytes() const noexcept;
  std::size_t offset_of(std::size_t layer, std::size_t buffer, std::size_t block) const noexcept;

  // The ranges page `page_id` covers, one per allocation, ascending.
  std::vector<ByteRange> page_ranges(std::size_t page_id) const;
  // Ranges of the reservation that hold blocks (per region for per_layer).
  std::vector<ByteRange> data_regions() const;

 private:
  KVLayoutConfig config_;
  std::size_t blocks_per_page_;
};

}  // namespace kvcached
