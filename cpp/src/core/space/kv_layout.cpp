// KVLayout: validation (with checked size arithmetic) and address arithmetic of the two KV layouts.
#include "kvcached/space/kv_layout.hpp"

#include <numeric>

namespace kvcached {

namespace {

// a * b, or InvalidArgument saying what overflowed.
std::size_t checked_product(std::size_t a, std::size_t b, const std::string& what) {
  std::size_t product = 0;
  if (__builtin_mul_overflow(a, b, &product) || product > KVLayout::kMaxReservationBytes) {
    throw InvalidArgument(what + " is too large (" + std::to_string(a) + " x " + std::to_string(b) +
                          " exceeds 2^56 bytes)");
  }
  return product;
}

}  // namespace

KVLayoutKind parse_layout(const std::string& name) {
  if (name == "per_layer") return KVLayoutKind::kPerLayer;
  if (name == "contiguous") return KVLayoutKind::kContiguous;
  throw InvalidArgument("layout must be 'per_layer' or 'contiguous', got '" + name + "'");
}

std::string layout_name(KVLayoutKind kind) { return kind == KVLayoutKind::kPerLayer ? "per_layer" : "contiguous"; }

KVLayout::KVLayout(const KVLayoutConfig& config) : config_(config), blocks_per_page_(0), num_pages_(0) {
  if (config.num_layers == 0) throw InvalidArgument("num_layers must be positive");
  if (config.num_buffers != 1 && config.num_buffers != 2) {
    throw InvalidArgument("num_buffers must be 1 (MLA, K||V cells) or 2 (K and V), got " +
                          std::to_string(config.num_buffers));
  }
  if (config.block_bytes == 0) throw InvalidArgument("block_bytes must be positive");
  if (config.page_bytes == 0) throw InvalidArgument("page_bytes must be positive");
  if (config.block_bytes > config.page_bytes || config.page_bytes % config.block_bytes != 0) {
    // Suggest the smallest page that holds whole blocks and keeps the old page's alignment.
    std::string suggestion = "lcm";
    if (config.block_bytes <= kMaxReservationBytes && config.page_bytes <= kMaxReservationBytes) {
      suggestion = std::to_string(std::lcm(config.block_bytes, config.page_bytes));
    }
    throw InvalidArgument("a block of " + std::to_string(config.block_bytes) + " bytes does not divide the page of " +
                          std::to_string(config.page_bytes) + " bytes; a page of " + suggestion + " bytes would work");
  }
  if (config.num_blocks == 0) throw InvalidArgument("num_blocks must be positive");
  blocks_per_page_ = config.page_bytes / config.block_bytes;
  num_pages_ = config.num_blocks / blocks_per_page_ + (config.num_blocks % blocks_per_page_ != 0 ? 1 : 0);
  if (num_pages_ > kMaxPages) {
    throw InvalidArgument("num_blocks=" + std::to_string(config.num_blocks) + " needs " + std::to_string(num_pages_) +
                          " page ids, too large (at most 2^32 - 1)");
  }
  const std::size_t regions = checked_product(config.num_layers, config.num_buffers, "num_layers x num_buffers");
  const std::size_t page_id = checked_product(regions, config.page_bytes, "a page id (layers x buffers x page_bytes)");
  checked_product(num_pages_, page_id, "the reservation (pages x page id bytes)");
}

KVLayout KVLayout::for_capacity(KVLayoutConfig config, std::size_t capacity_bytes) {
  config.num_blocks = 1;  // validate everything else first
  const KVLayout one(config);
  const std::size_t pages = capacity_bytes / one.page_id_bytes();
  if (pages == 0) {
    throw InvalidArgument("capacity_bytes=" + std::to_string(capacity_bytes) + " is smaller than one page id (" +
                          std::to_string(config.page_bytes) + " bytes x " + std::to_string(one.num_regions()) +
                          " layer buffers)");
  }
  if (pages > kMaxPages) throw InvalidArgument("capacity_bytes=" + std::to_string(capacity_bytes) + " is too large");
  config.num_blocks = pages * one.blocks_per_page();
  return KVLayout(config);
}

std::size_t KVLayout::blocks_on_page(std::size_t page) const noexcept {
  if (page + 1 < num_pages_) return blocks_per_page_;
  if (page + 1 == num_pages_) return config_.num_blocks - page * blocks_per_page_;
  return 0;
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
  return config_.kind == KVLayoutKind::kPerLayer ? num_pages_ * config_.page_bytes : config_.block_bytes;
}

std::size_t KVLayout::layer_stride_bytes() const noexcept { return buffer_stride_bytes() * config_.num_buffers; }

std::size_t KVLayout::offset_of(std::size_t layer, std::size_t buffer, std::size_t block) const {
  if (layer >= config_.num_layers || buffer >= config_.num_buffers || block >= config_.num_blocks) {
    throw InvalidArgument("(layer " + std::to_string(layer) + ", buffer " + std::to_string(buffer) + ", block " +
                          std::to_string(block) + ") is outside the layout (" + describe() + ")");
  }
  return layer * layer_stride_bytes() + buffer * buffer_stride_bytes() + block * block_stride_bytes();
}

std::vector<ByteRange> KVLayout::page_ranges(std::size_t page_id) const {
  std::vector<ByteRange> ranges;
  if (config_.kind == KVLayoutKind::kContiguous) {
    ranges.push_back({page_id * page_id_bytes(), page_id_bytes()});
    return ranges;
  }
  const std::size_t region_bytes = num_pages_ * config_.page_bytes;
  ranges.reserve(num_regions());
  for (std::size_t r = 0; r < num_regions(); ++r) {
    ranges.push_back({r * region_bytes + page_id * config_.page_bytes, config_.page_bytes});
  }
  return ranges;
}

std::vector<ByteRange> KVLayout::data_regions() const {
  if (config_.kind == KVLayoutKind::kContiguous) return {{0, reservation_bytes()}};
  const std::size_t region_bytes = num_pages_ * config_.page_bytes;
  std::vector<ByteRange> regions;
  for (std::size_t r = 0; r < num_regions(); ++r) regions.push_back({r * region_bytes, region_bytes});
  return regions;
}

bool KVLayout::operator==(const KVLayout& other) const noexcept {
  const KVLayoutConfig& a = config_;
  const KVLayoutConfig& b = other.config_;
  return a.num_layers == b.num_layers && a.num_buffers == b.num_buffers && a.block_bytes == b.block_bytes &&
         a.page_bytes == b.page_bytes && a.num_blocks == b.num_blocks && a.kind == b.kind;
}

std::string KVLayout::describe() const {
  return std::to_string(config_.num_layers) + " layers x " + std::to_string(config_.num_buffers) + " buffers, " +
         std::to_string(config_.num_blocks) + " blocks of " + std::to_string(config_.block_bytes) + " bytes, " +
         std::to_string(config_.page_bytes) + "-byte pages, " + layout_name(config_.kind);
}

}  // namespace kvcached
