// C++ side of the contract and allocator tests, on the host backend: the same
// rules the Python suite checks, without Python in the way. Prints
// "N passed, M failed" and exits non-zero on any failure (run by CTest).
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "kvcached/backends/host_backend.hpp"
#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/blocks/fixed_budget.hpp"
#include "kvcached/device/device.hpp"
#include "kvcached/space/kv_space.hpp"

namespace {

using namespace kvcached;
using kvcached_test::throws;

constexpr std::size_t kMiB = std::size_t{1} << 20;

void test_device_rules() {
  auto device = Device::open(make_host_backend({64 * kMiB, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const std::size_t page = device->granularity().recommended_bytes;
  {
    Reservation range = device->reserve(4 * page);
    PhysicalAllocation memory = device->create(page);
    CHECK(throws<InvalidArgument>([&] { device->reserve(page + 1); }));
    CHECK(throws<InvalidArgument>([&] { device->map(range.base() + 4 * page, memory); }));
    device->map_accessible(range.base(), memory);
    std::memset(reinterpret_cast<void*>(range.base()), 7, page);
    CHECK(throws<InvalidArgument>([&] { device->map(range.base(), memory); }));         // over a mapping
    CHECK(throws<InvalidArgument>([&] { memory.release(); }));                          // still mapped
    CHECK(throws<InvalidArgument>([&] { device->unmap(range.base() + page, page); }));  // not mapped
    device->map_accessible(range.base() + 2 * page, memory);  // a second mapping shares the bytes
    CHECK(reinterpret_cast<unsigned char*>(range.base() + 2 * page)[5] == 7);
    device->unmap(range.base(), page);
    device->unmap(range.base() + 2 * page, page);
    memory.release();
    CHECK(throws<DeviceOutOfMemory>([&] { device->create(128 * kMiB); }));
  }
  const DeviceCounters counters = device->counters();
  CHECK(counters.reserved_bytes == 0 && counters.created_bytes == 0 && counters.mapped_bytes == 0);
}

void test_block_manager_over_a_kv_space() {
  auto device = Device::open(make_host_backend({256 * kMiB, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  KVLayoutConfig config;
  config.num_layers = 2;
  config.num_buffers = 2;
  config.block_bytes = 64 * 1024;
  config.page_bytes = 2 * kMiB;
  config.num_blocks = 64 * 32;
  const KVLayout layout(config);
  auto space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  auto budget = std::make_shared<FixedBudget>(8 * layout.page_id_bytes());
  {
    BlockManager manager(layout, BlockManagerOptions{}, space, budget);
    std::vector<std::int64_t> blocks = manager.alloc(layout.blocks_per_page() + 1);
    CHECK(manager.stats().mapped_pages == 2 && budget->used_bytes() == 2 * layout.page_id_bytes());
    const std::vector<std::int64_t> twice = {blocks[0], blocks[0]};
    CHECK(throws<InvalidArgument>([&] { manager.free(twice); }));
    CHECK(manager.stats().used_blocks == blocks.size());  // nothing freed by the bad call
    CHECK(throws<BudgetExhausted>([&] { manager.alloc(7 * layout.blocks_per_page()); }));
    CHECK(manager.stats().mapped_pages == 2);  // rolled back
    manager.free(blocks);
    manager.trim();
    CHECK(manager.stats().mapped_pages == 0 && budget->used_bytes() == 0);
    manager.resize(layout.page_id_bytes());
    CHECK(manager.available() == layout.blocks_per_page());
  }
  space->close();
  CHECK(device->counters().mapped_bytes == 0);
}

void test_unmapped_regions_read_zero() {
  auto device = Device::open(make_host_backend({64 * kMiB, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  KVLayoutConfig config;
  config.num_layers = 1;
  config.num_buffers = 1;
  config.block_bytes = 2 * kMiB;
  config.page_bytes = 2 * kMiB;
  config.num_blocks = 4;
  KVSpace space(device, KVLayout(config), KVSpaceOptions{});
  const auto* bytes = reinterpret_cast<const unsigned char*>(space.base());
  CHECK(bytes[3 * 2 * kMiB + 11] == 0);
  space.map_pages({3});
  reinterpret_cast<unsigned char*>(space.base())[3 * 2 * kMiB + 11] = 9;
  space.unmap_pages({3});
  CHECK(bytes[3 * 2 * kMiB + 11] == 0);
}

void test_a_space_applies_page_ops_in_order() {
  auto device = Device::open(make_host_backend({64 * kMiB, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  KVLayoutConfig config;
  config.num_layers = 2;
  config.num_buffers = 2;
  config.block_bytes = 64 * 1024;
  config.page_bytes = 2 * kMiB;
  config.num_blocks = 4 * 32;
  KVSpaceOptions options;
  options.max_spare_pages = 1;
  KVSpace space(device, KVLayout(config), options);
  CHECK(space.apply(PageOps{1, {0, 1}, {}}) == 1 && space.mapped_pages() == 2);
  CHECK(throws<InvalidArgument>([&] { space.apply(PageOps{1, {2}, {}}); }));  // applied already
  CHECK(throws<InvalidArgument>([&] { space.apply(PageOps{3, {2}, {}}); }));  // batch 2 missing
  CHECK(throws<InvalidArgument>([&] { space.apply(PageOps{2, {1}, {}}); }));  // mapped already
  CHECK(throws<InvalidArgument>([&] { space.apply(PageOps{2, {}, {3}}); }));  // not mapped
  CHECK(space.applied_seq() == 1 && space.mapped_pages() == 2);               // nothing changed
  CHECK(space.apply(PageOps{2, {0}, {0, 1}}) == 2);                           // unmaps first: page 0 comes back fresh
  CHECK(space.mapped_pages() == 1 && space.spare_pages() == 0);               // the kept spare backed page 0 again
  const UnmapResult result = space.unmap_pages({0});
  CHECK(result.unmapped_pages == 1 && result.kept_spare_pages == 1 && result.released_pages() == 0);
  CHECK(space.trim_spares(0) == 1 && space.spare_pages() == 0);
  CHECK(space.apply(PageOps{}) == 0);
  space.close();
  CHECK(device->counters().mapped_bytes == 0 && device->counters().created_bytes == 0);
}

}  // namespace

int main() {
  test_device_rules();
  test_block_manager_over_a_kv_space();
  test_unmapped_regions_read_zero();
  test_a_space_applies_page_ops_in_order();
  return kvcached_test::summary();
}
