// The reserve kept off the alloc path, as a specification: what a shrink
// unmaps stays as spares until the next round (no release on the path),
// memory goes back at once when others wait, in slices that settle the budget
// as they go, a waiting alloc takes memory as it comes back, and the device's
// free memory is known without asking the driver on every grow.
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "check.hpp"
#include "kvcached/backends/host_backend.hpp"
#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/blocks/fixed_budget.hpp"
#include "kvcached/space/kv_space.hpp"

namespace {

using namespace kvcached;
using kvcached_test::throws;

constexpr std::size_t kKiB = 1024;

KVLayout small_layout(std::size_t num_pages) {
  KVLayoutConfig config;
  config.num_layers = 2;
  config.num_buffers = 2;
  config.block_bytes = 4 * kKiB;
  config.page_bytes = 16 * kKiB;  // 4 blocks per page; 4 allocations per page id per-layer
  config.num_blocks = 4 * num_pages;
  return KVLayout(config);
}

// A FixedBudget whose "others are waiting" signal the test sets, and which
// records the largest single release (slices) and every release.
class WatchedBudget final : public MemoryBudget {
 public:
  explicit WatchedBudget(std::size_t total) : inner_(total) {}
  bool try_acquire(std::size_t bytes) override { return inner_.try_acquire(bytes); }
  void release(std::size_t bytes) noexcept override {
    inner_.release(bytes);
    releases_.fetch_add(1);
    std::size_t largest = largest_release_.load();
    while (bytes > largest && !largest_release_.compare_exchange_weak(largest, bytes)) {
    }
  }
  std::size_t available_bytes() const override { return inner_.available_bytes(); }
  bool may_block() const noexcept override { return false; }
  std::size_t pressure_bytes() const noexcept override { return pressure_.load(); }
  void set_pressure(std::size_t bytes) { pressure_ = bytes; }
  std::size_t used_bytes() const { return inner_.used_bytes(); }
  std::size_t largest_release() const { return largest_release_.load(); }
  std::size_t releases() const { return releases_.load(); }

 private:
  FixedBudget inner_;
  std::atomic<std::size_t> pressure_{0}, largest_release_{0}, releases_{0};
};

BlockManagerOptions reserve_of(std::size_t min_spare, std::size_t max_spare) {
  BlockManagerOptions options;
  options.reserve = {0, 0, min_spare, max_spare};
  return options;
}

void test_a_shrink_keeps_what_it_unmaps_until_the_next_round() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const KVLayout layout = small_layout(16);
  auto space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  auto budget = std::make_shared<WatchedBudget>(16 * layout.page_id_bytes());
  BlockManager m(layout, reserve_of(0, 1), space, budget);
  std::vector<std::int64_t> blocks = m.alloc(4 * layout.blocks_per_page());
  const std::size_t created = device->counters().created_bytes;
  m.free(blocks);
  m.maintain();  // unmaps the 4 free pages: no release on this path
  CHECK(m.stats().mapped_pages == 0 && m.stats().spare_pages == 4);
  CHECK(device->counters().created_bytes == created);
  CHECK(budget->used_bytes() == 4 * layout.page_id_bytes());  // spares stay charged: budget truth
  CHECK(m.available() == 16 * layout.blocks_per_page());      // and their charge is reusable at once
  m.maintain();                                               // the next round releases what is beyond the maximum
  CHECK(m.stats().spare_pages == 1 && budget->used_bytes() == layout.page_id_bytes());
  blocks = m.alloc(layout.blocks_per_page());
  CHECK(device->counters().created_bytes == layout.page_id_bytes());  // the grow took the spare: no create
  m.free(blocks);
  m.close();
  CHECK(budget->used_bytes() == 0 && device->counters().created_bytes == 0);
}

void test_others_waiting_get_the_memory_in_the_same_round_in_slices() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const KVLayout layout = small_layout(32);
  auto space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  auto budget = std::make_shared<WatchedBudget>(32 * layout.page_id_bytes());
  BlockManager m(layout, reserve_of(1, 2), space, budget);
  std::vector<std::int64_t> blocks = m.alloc(16 * layout.blocks_per_page());
  m.free(blocks);
  budget->set_pressure(layout.page_id_bytes());
  const std::size_t releases_before = budget->releases();
  m.maintain();
  BlockManagerStats s = m.stats();
  CHECK(s.mapped_pages == 0 && s.spare_pages == 0 && budget->used_bytes() == 0);
  // Given back slice by slice, not as one release after the whole batch.
  CHECK(budget->releases() - releases_before >= 2);
  CHECK(budget->largest_release() < 16 * layout.page_id_bytes());
  budget->set_pressure(0);
  m.maintain();
  CHECK(m.stats().spare_pages == 1);  // no pressure: the minimum spare is made again
}

void test_trim_and_a_limit_release_at_once() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const KVLayout layout = small_layout(16);
  auto space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  BlockManager m(layout, reserve_of(0, 8), space, nullptr);
  std::vector<std::int64_t> blocks = m.alloc(6 * layout.blocks_per_page());
  m.free(blocks);
  m.maintain();
  CHECK(m.stats().spare_pages == 6);
  m.trim();
  CHECK(m.stats().spare_pages == 0 && device->counters().created_bytes == 0);
  blocks = m.alloc(6 * layout.blocks_per_page());
  m.free(blocks);
  m.maintain();
  CHECK(m.stats().spare_pages == 6);
  CHECK(m.resize(2 * layout.page_id_bytes()));
  CHECK(m.stats().spare_pages <= 2 && device->counters().created_bytes <= 2 * layout.page_id_bytes());
}

void test_a_waiting_alloc_takes_memory_as_it_comes_back() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const KVLayout layout = small_layout(16);
  auto budget = std::make_shared<FixedBudget>(8 * layout.page_id_bytes());
  auto holder_space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  auto waiter_space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  BlockManager holder(layout, reserve_of(0, 0), holder_space, budget);
  BlockManager waiter(layout, reserve_of(0, 0), waiter_space, budget);
  std::vector<std::int64_t> held = holder.alloc(6 * layout.blocks_per_page());
  const std::size_t want = 6 * layout.blocks_per_page();
  CHECK(throws<BudgetExhausted>([&] { waiter.alloc(want); }));  // no wait: refused at once
  CHECK(waiter.stats().mapped_pages == 0);
  std::thread giver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    holder.free(held);
    holder.maintain();  // unmaps; a FixedBudget reports no waiter, so the spares stay a round
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    holder.maintain();  // the next round gives them back
  });
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::int64_t> got = waiter.alloc(want, std::chrono::seconds(5));
  const auto waited = std::chrono::steady_clock::now() - start;
  giver.join();
  CHECK(got.size() == want && waiter.stats().mapped_pages == 6);
  CHECK(waited >= std::chrono::milliseconds(15) && waited < std::chrono::seconds(4));
  // A deadline that passes rolls everything back.
  CHECK(throws<BudgetExhausted>([&] { holder.alloc(6 * layout.blocks_per_page(), std::chrono::milliseconds(30)); }));
  CHECK(holder.stats().mapped_pages == 0 && holder.stats().spare_pages == 0);
  // A limit is not something waiting can change: refused at once.
  holder.resize(layout.page_id_bytes());
  const auto limited = std::chrono::steady_clock::now();
  CHECK(throws<BudgetExhausted>([&] { holder.alloc(2 * layout.blocks_per_page(), std::chrono::seconds(5)); }));
  CHECK(std::chrono::steady_clock::now() - limited < std::chrono::seconds(1));
  waiter.free(got);
}

void test_the_device_estimate_follows_creates_without_a_query() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  CHECK(device->estimated_free_bytes() == 64 << 20);
  {
    PhysicalAllocation a = device->create(2 << 20);
    CHECK(device->estimated_free_bytes() == (62 << 20));
    CHECK(device->memory_info().free_bytes == device->estimated_free_bytes());
  }
  CHECK(device->estimated_free_bytes() == 64 << 20);
  CHECK(throws<DeviceOutOfMemory>([&] { device->create(128 << 20); }));
  CHECK(device->estimated_free_bytes() == 64 << 20);  // an out-of-memory create asked the driver again
}

}  // namespace

int main() {
  test_a_shrink_keeps_what_it_unmaps_until_the_next_round();
  test_others_waiting_get_the_memory_in_the_same_round_in_slices();
  test_trim_and_a_limit_release_at_once();
  test_a_waiting_alloc_takes_memory_as_it_comes_back();
  test_the_device_estimate_follows_creates_without_a_query();
  return kvcached_test::summary();
}
