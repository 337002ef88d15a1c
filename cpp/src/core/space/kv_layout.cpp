// KVLayout: validation and address arithmetic of the two KV layouts.
#include "kvcached/space/kv_layout.hpp"

#include <numeric>

namespace kvcached {

KVLayoutKind parse_layout(const std::string& name) {
  if (name == "per_layer") return KVLayoutKind::kPerLayer;
  if (name == "contiguous") return KVLayoutKind::kContiguous;
  throw InvalidArgument("layout must be 'per_layer' or 'contiguous', got '" + name + "'");
}

std::string layout_name(KVLayoutKind kind) {
  return kind == KVLayoutKind::kPerLayer ? "per_layer" : "contiguous";
}

std::size_t KVLayout::pages_for_blocks(std::size_t num_blocks, std::size_t block_bytes,
                                       std::size_t page_bytes) {
  if (block_bytes == 0 || page_bytes < block_bytes) return 0;
  const std::size_t per_page = page_bytes / block_bytes;
  return (num_blocks + per_page - 1) / per_page;
}

KVLayout::KVLayout(const KVLayoutConfig& config) : config_(config), blocks_per_page_(0) {
  if (config.num_layers == 0) throw InvalidArgument("num_layers must be positive");
  if (config.num_buffers == 0) throw InvalidArgument("num_buffers must be positive (2 for K and V, 1 for MLA)");
  if (config.block_bytes == 0) throw InvalidArgument("block_bytes must be positive");
  if (config.page_bytes == 0) throw InvalidArgument("page_bytes must be positive");
  if (config.block_bytes > config.page_bytes || config.page_bytes % config.block_bytes != 0) {
    // Suggest the smallest page that holds whole blocks and keeps the old page's alignment.
    const std::size_t suggestion = std::lcm(config.block_bytes, config.page_bytes);
    throw InvalidArgument("a block of " + std::to_string(config.block_bytes) +
                          " bytes does not divide the page of " + std::to_string(config.page_bytes) +
                          " bytes; a page of " + std::to_string(suggestion) + " bytes would work");
  }
  if (config.num_pages == 0) throw InvalidArgument("the virtual capacity must hold at least one page");
  blocks_per_page_ = config.page_bytes / config.block_bytes;
}

std::size_t KVLayout::allocation_bytes() const noexcept {
  return config_.kind == KVLayoutKind::kPerLayer ? config_.page_bytes : page_id_bytes();
}

std::size_t KVLayout::allocations_per_page() const noexcept {
  return config_.kind == KVLayoutKind::kPerLayer ? num_regions() : 1;
}

std::size_t KVLayout::block_stride_bytes() const noexcept {
  return config_.kind == KVLayoutKind::kPerLayer ? config_.block_bytes : block_id_bytes();
}

std::size_t KVLayout::buffer_stride_bytes() const noexcept {
  return config_.kind == KVLayoutKind::kPerLayer ? config_.num_pages * config_.page_bytes
                                                 : config_.block_bytes;
}

std::size_t KVLayout::layer_stride_bytes() const noexcept {
  return buffer_stride_bytes() * config_.num_buffers;
}

std::size_t KVLayout::offset_of(std::size_t layer, std::size_t buffer, std::size_t block) const noexcept {
  return layer * layer_stride_bytes() + buffer * buffer_stride_bytes() + block * block_stride_bytes();
}

std::vector<ByteRange> KVLayout::page_ranges(std::size_t page_id) const {
  std::vector<ByteRange> ranges;
  if (config_.kind == KVLayoutKind::kContiguous) {
    ranges.push_back({page_id * page_id_bytes(), page_id_bytes()});
    return ranges;
  }
  const std::size_t region_bytes = config_.num_pages * config_.page_bytes;
  ranges.reserve(num_regions());
  for (std::size_t r = 0; r < num_regions(); ++r) {
    ranges.push_back({r * region_bytes + page_id * config_.page_bytes, config_.page_bytes});
  }
  return ranges;
}

std::vector<ByteRange> KVLayout::data_regions() const {
  if (config_.kind == KVLayoutKind::kContiguous) return {{0, reservation_bytes()}};
  const std::size_t region_bytes = config_.num_pages * config_.page_bytes;
  std::vector<ByteRange> regions;
  for (std::size_t r = 0; r < num_regions(); ++r) regions.push_back({r * region_bytes, region_bytes});
  return regions;
}

}  // namespace kvcached
