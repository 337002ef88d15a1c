// The per-page-id bookkeeping cap (page_metadata.hpp): its arithmetic and its messages.
#include "kvcached/space/page_metadata.hpp"

#include <unistd.h>

#include <algorithm>
#include <limits>

#include "kvcached/error.hpp"

namespace kvcached {

namespace {

constexpr std::size_t kMaxPageMetadataBytes = std::size_t{4} << 30;
constexpr std::size_t kPhysicalMemoryShare = 4;  // at most a quarter of the host's memory

std::string describe_cost(const KVLayout& layout, const PageMetadataCost& cost, const std::string& owner) {
  return owner + " over " + std::to_string(layout.num_pages()) + " page ids (" + layout.describe() + ") keeps " +
         std::to_string(cost.bytes_per_page_id) + " bytes of bookkeeping per page id and " +
         std::to_string(cost.bytes_per_block) + " per block, " + std::to_string(page_metadata_bytes(layout, cost)) +
         " bytes in all";
}

}  // namespace

std::size_t page_metadata_bytes(const KVLayout& layout, const PageMetadataCost& cost) noexcept {
  std::size_t pages = 0, blocks = 0, total = 0;
  if (__builtin_mul_overflow(layout.num_pages(), cost.bytes_per_page_id, &pages) ||
      __builtin_mul_overflow(layout.num_blocks(), cost.bytes_per_block, &blocks) ||
      __builtin_add_overflow(pages, blocks, &total)) {
    return std::numeric_limits<std::size_t>::max();
  }
  return total;
}

std::size_t page_metadata_cap_bytes() noexcept {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return kMaxPageMetadataBytes;
  const std::size_t physical = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
  return std::min(kMaxPageMetadataBytes, physical / kPhysicalMemoryShare);
}

void check_page_metadata(const KVLayout& layout, const PageMetadataCost& cost, const std::string& owner) {
  const std::size_t cap = page_metadata_cap_bytes();
  if (page_metadata_bytes(layout, cost) <= cap) return;
  throw InvalidArgument(describe_cost(layout, cost, owner) + ", more than the " + std::to_string(cap) +
                        " bytes kvcached allows (4 GiB, or a quarter of this host's memory). Use larger "
                        "pages (page_bytes) or fewer blocks");
}

void throw_page_metadata_exhausted(const KVLayout& layout, const PageMetadataCost& cost, const std::string& owner) {
  throw BudgetExhausted("host memory ran out: " + describe_cost(layout, cost, owner) +
                        ". Free host memory, or use larger pages (page_bytes) or fewer blocks");
}

}  // namespace kvcached
