// KVLayout: the one value describing a KV cache's geometry — where each
// (layer, buffer, block) lives in a reservation and which byte ranges one page
// id covers. Built and checked once; KVSpace, BlockManager and the Python
// layers all take it whole.
//
// Two layouts:
//  * per_layer  — region r = layer * num_buffers + buffer holds that layer's
//    blocks back to back (block stride = block_bytes). A page id is one
//    page_bytes chunk at the same offset of every region: L·B separate
//    physical allocations, because CUDA cannot map one allocation at several
//    offsets of it (cuMemMap refuses a non-zero offset: docs/gpu-backends.md).
//  * contiguous — a block is one run holding every layer and buffer
//    (block stride = L·B·block_bytes). A page id is one *compound page* of
//    L·B·page_bytes: one allocation, so growing is O(1) driver calls.
//
// `num_blocks` need not be a whole number of pages: the last page then holds
// fewer blocks (blocks_on_page), and ids past num_blocks do not exist.
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
  std::size_t num_buffers = 2;  // 2: K and V; 1: MLA or a K||V cell
  std::size_t block_bytes = 0;  // one block of one layer and one buffer
  std::size_t page_bytes = 0;   // per region; multiple of the device granularity
  std::size_t num_blocks = 0;   // block ids the cache addresses: [0, num_blocks)
  KVLayoutKind kind = KVLayoutKind::kPerLayer;
};

struct ByteRange {
  std::size_t offset;  // from the reservation's base
  std::size_t size;
};

class KVCACHED_EXPORT KVLayout {
 public:
  // Largest reservation a layout may describe (2^56 bytes, far above any
  // device's virtual address space), so every product below fits in 64 bits.
  static constexpr std::size_t kMaxReservationBytes = std::size_t{1} << 56;
  // Page ids are 32-bit inside the block manager.
  static constexpr std::size_t kMaxPages = (std::size_t{1} << 32) - 1;

  // Validates the configuration (InvalidArgument naming the field and why).
  explicit KVLayout(const KVLayoutConfig& config);
  // As many whole pages as fit in `capacity_bytes` (all layers and buffers);
  // `config.num_blocks` is ignored and set to pages x blocks per page.
  static KVLayout for_capacity(KVLayoutConfig config, std::size_t capacity_bytes);

  const KVLayoutConfig& config() const noexcept { return config_; }
  std::size_t num_layers() const noexcept { return config_.num_layers; }
  std::size_t num_buffers() const noexcept { return config_.num_buffers; }
  std::size_t block_bytes() const noexcept { return config_.block_bytes; }
  std::size_t page_bytes() const noexcept { return config_.page_bytes; }
  KVLayoutKind kind() const noexcept { return config_.kind; }
  std::size_t num_regions() const noexcept { return config_.num_layers * config_.num_buffers; }
  std::size_t blocks_per_page() const noexcept { return blocks_per_page_; }
  std::size_t num_pages() const noexcept { return num_pages_; }
  std::size_t num_blocks() const noexcept { return config_.num_blocks; }
  // Blocks that exist on `page`: blocks_per_page, fewer on a partial last page.
  std::size_t blocks_on_page(std::size_t page) const noexcept;
  // Physical bytes behind one page id (all layers and buffers).
  std::size_t page_id_bytes() const noexcept { return num_regions() * config_.page_bytes; }
  // Physical bytes behind one block id (all layers and buffers).
  std::size_t block_id_bytes() const noexcept { return num_regions() * config_.block_bytes; }
  std::size_t reservation_bytes() const noexcept { return num_pages_ * page_id_bytes(); }
  // Bytes of one physical allocation backing part of a page id.
  std::size_t allocation_bytes() const noexcept;
  std::size_t allocations_per_page() const noexcept;

  // Strides of the engine-visible geometry, in bytes.
  std::size_t block_stride_bytes() const noexcept;
  std::size_t layer_stride_bytes() const noexcept;
  std::size_t buffer_stride_bytes() const noexcept;
  // Byte offset of (layer, buffer, block); InvalidArgument outside the layout.
  std::size_t offset_of(std::size_t layer, std::size_t buffer, std::size_t block) const;

  // The ranges page `page_id` covers, one per allocation, ascending.
  std::vector<ByteRange> page_ranges(std::size_t page_id) const;
  // Ranges of the reservation that hold blocks (per region for per_layer).
  std::vector<ByteRange> data_regions() const;

  bool operator==(const KVLayout& other) const noexcept;
  bool operator!=(const KVLayout& other) const noexcept { return !(*this == other); }
  std::string describe() const;

 private:
  KVLayoutConfig config_;
  std::size_t blocks_per_page_;
  std::size_t num_pages_;
};

}  // namespace kvcached
