// BlockManager as a specification, without Python: memory truth (every page
// accounted for, budget charges), reservations, limits, trim, sleep, placement, and
// the device-less manager driving mirrors on their own budgets.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "check.hpp"
#include "kvcached/backends/host_backend.hpp"
#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/blocks/fixed_budget.hpp"
#include "kvcached/registry/device_registry.hpp"
#include "kvcached/registry/registry_settings.hpp"
#include "kvcached/space/kv_space.hpp"

namespace {

using namespace kvcached;
using kvcached_test::throws;

constexpr std::size_t kKiB = 1024;

KVLayout layout_of(std::size_t num_blocks, std::size_t num_layers = 2, std::size_t blocks_per_page = 4) {
  KVLayoutConfig config;
  config.num_layers = num_layers;
  config.num_buffers = 2;
  config.block_bytes = 4 * kKiB;
  config.page_bytes = blocks_per_page * 4 * kKiB;
  config.num_blocks = num_blocks;
  return KVLayout(config);
}

std::size_t pages_of(const BlockManager& m, const std::vector<std::int64_t>& blocks) {
  std::set<std::size_t> pages;
  for (std::int64_t b : blocks) pages.insert(m.page_of(b));
  return pages.size();
}

bool pages_add_up(const BlockManagerStats& s) {
  return s.used_pages + s.free_pages + s.mapping_pages + s.unmapping_pages + s.pending_pages + s.unmapped_pages ==
         s.num_pages;
}

void test_the_layout_checks_its_arithmetic() {
  CHECK(throws<InvalidArgument>([] { layout_of(1, std::size_t{1} << 44); }));  // overflowing reservation
  CHECK(throws<InvalidArgument>([] { layout_of(std::size_t{1} << 62); }));     // too many page ids
  CHECK(throws<InvalidArgument>([] { layout_of(0); }));
  const KVLayout layout = layout_of(30);
  CHECK(layout.num_pages() == 8 && layout.blocks_on_page(7) == 2 && layout.blocks_on_page(6) == 4);
  CHECK(throws<InvalidArgument>([&] { layout.offset_of(0, 0, 30); }));
}

void test_a_partial_last_page_is_used_and_given_back() {
  auto budget = std::make_shared<FixedBudget>(std::size_t{1} << 30);
  BlockManager m(layout_of(30), BlockManagerOptions{}, {MirrorSpec{budget, std::nullopt}});
  CHECK(m.available() == 30);
  std::vector<std::int64_t> all = m.alloc(30);
  CHECK(*std::max_element(all.begin(), all.end()) == 29 && m.available() == 0);
  CHECK(throws<BudgetExhausted>([&] { m.alloc(1); }));
  CHECK(throws<InvalidArgument>([&] { m.free({30}); }));  // ids past num_blocks do not exist
  m.free(all);
  CHECK(m.trim() == 8);
  m.acknowledge(0, m.take_page_ops().seq);
  const BlockManagerStats s = m.stats();
  CHECK(s.mapped_pages == 0 && s.pending_pages == 0 && budget->used_bytes() == 0 && pages_add_up(s));
}

void test_reserved_blocks_are_handed_out_first() {
  BlockManager m(layout_of(32), BlockManagerOptions{}, {MirrorSpec{}});
  CHECK(m.try_reserve(12));
  CHECK(m.available() == 32 && m.stats().reserved_blocks == 12);
  CHECK(!m.try_reserve(21) && m.stats().reserved_blocks == 12);  // only 20 more exist
  std::vector<std::int64_t> first = m.alloc(20);
  CHECK(m.stats().reserved_blocks == 0 && m.available() == 12);
  CHECK(m.try_reserve(12));
  CHECK(m.alloc(12).size() == 12 && m.available() == 0);  // the next alloc of that size is guaranteed
  CHECK(m.clear() == 32 && m.available() == 32);
}

void test_free_refuses_reserved_blocks_and_changes_nothing() {
  BlockManager m(layout_of(32), BlockManagerOptions{}, {MirrorSpec{}});
  CHECK(m.try_reserve(4));
  std::vector<std::int64_t> used = m.alloc(8);  // the 4 reserved, then 4 more
  CHECK(m.try_reserve(2));
  const std::size_t before = m.stats().used_blocks;
  BlockManagerStats s = m.stats();
  CHECK(s.reserved_blocks == 2);
  // Find a reserved id: one not in `used` that is in use.
  std::vector<std::int64_t> reserved;
  for (std::int64_t b = 0; b < 32; ++b) {
    if (std::find(used.begin(), used.end(), b) == used.end()) {
      try {
        m.alloc_ids({b});
        m.free({b});
      } catch (const InvalidArgument&) {
        reserved.push_back(b);
      }
    }
  }
  CHECK(reserved.size() == 2);
  CHECK(throws<InvalidArgument>([&] { m.free({used[0], reserved[0]}); }));
  CHECK(m.stats().used_blocks == before);
  CHECK(m.release_reserved() == 2 && m.stats().used_blocks == before - 2);
}

void test_resize_says_whether_the_limit_holds_now() {
  BlockManager m(layout_of(32), BlockManagerOptions{}, {MirrorSpec{}});
  const std::size_t page = m.layout().page_id_bytes();
  CHECK(m.resize(2 * page));
  std::vector<std::int64_t> blocks = m.alloc(8);
  CHECK(!m.resize(page));  // two pages in use: deferred
  CHECK(m.available() == 0);
  m.free(std::vector<std::int64_t>(blocks.begin(), blocks.begin() + 4));
  m.maintain();
  CHECK(m.resize(page));
  CHECK(m.resize(std::nullopt));
}

void test_trim_is_kept_until_the_next_alloc() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const KVLayout layout = layout_of(64);
  auto space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  BlockManagerOptions options;
  options.reserve = {2, 4, 1, 2};
  BlockManager m(layout, options, space, nullptr);
  m.maintain();
  CHECK(m.stats().free_pages == 2 && m.stats().spare_pages == 1);
  m.trim();
  for (int i = 0; i < 10; ++i) m.maintain();
  BlockManagerStats s = m.stats();
  CHECK(s.mapped_pages == 0 && s.spare_pages == 0 && s.held_pages == 0);
  CHECK(device->counters().created_bytes == 0);
  std::vector<std::int64_t> one = m.alloc(1);
  m.maintain();
  CHECK(m.stats().free_pages == 2);  // the reserve refills once allocation resumed
  m.free(one);
  m.close();
  CHECK(device->counters().mapped_bytes == 0 && device->counters().created_bytes == 0);
}

// Six pages with a hole of 7 blocks each, and one entirely free page (the reserve).
std::vector<std::int64_t> leave_holes(BlockManager& m) {
  std::vector<std::int64_t> held = m.alloc(7 * 64);
  std::vector<std::int64_t> freed;
  for (std::size_t p = 0; p < 7; ++p) {
    std::size_t on_page = 0;
    for (std::int64_t b : held) {
      if (m.page_of(b) == p && (p == 6 || on_page++ < 7)) freed.push_back(b);
    }
  }
  m.free(freed);
  return freed;
}

void test_a_run_lands_on_one_page_and_single_blocks_fill_holes() {
  BlockManager m(layout_of(64 * 8, 2, 64), BlockManagerOptions{}, {MirrorSpec{}});
  leave_holes(m);
  std::vector<std::int64_t> run = m.alloc(40);
  CHECK(pages_of(m, run) == 1);
  CHECK(m.page_of(run[0]) == 6);  // the free page, not six holes
  std::vector<std::int64_t> single = m.alloc(1);
  CHECK(m.page_of(single[0]) < 6);

  BlockManagerOptions old;
  old.placement = Placement::kFullestFirst;
  BlockManager scattered(layout_of(64 * 8, 2, 64), old, {MirrorSpec{}});
  leave_holes(scattered);
  CHECK(pages_of(scattered, scattered.alloc(40)) == 6);  // what the fewest-pages policy avoids
}

void test_a_refused_budget_takes_nothing() {
  auto device = Device::open(make_host_backend({64 << 20, HostMemory::kSharedFiles, HostPopulate::kBackground}));
  const KVLayout layout = layout_of(64);
  auto space = std::make_shared<KVSpace>(device, layout, KVSpaceOptions{});
  auto budget = std::make_shared<FixedBudget>(3 * layout.page_id_bytes());
  BlockManager m(layout, BlockManagerOptions{}, space, budget);
  std::vector<std::int64_t> a = m.alloc(5);
  CHECK(m.available() == 7);
  CHECK(throws<BudgetExhausted>([&] { m.alloc(8); }));
  const BlockManagerStats s = m.stats();
  CHECK(s.mapped_pages == 2 && budget->used_bytes() == 2 * layout.page_id_bytes() && pages_add_up(s));
  CHECK(m.alloc(7).size() == 7);
}

void test_close_from_two_threads() {
  for (int round = 0; round < 50; ++round) {
    BlockManagerOptions options;
    options.background_worker = true;
    options.reserve = {1, 2, 0, 0};
    BlockManager m(layout_of(64), options, {MirrorSpec{}});
    m.free(m.alloc(5));
    std::thread a([&] { m.close(); }), b([&] { m.close(); });
    a.join();
    b.join();
    CHECK(m.closed() && m.available() == 0);
    CHECK(throws<InvalidArgument>([&] { m.alloc(1); }));
  }
}

// ---- mirrors: every page charged on every mirror's budget ---------------------------

std::vector<std::shared_ptr<FixedBudget>> fixed_budgets(std::size_t count, std::size_t bytes) {
  std::vector<std::shared_ptr<FixedBudget>> budgets;
  for (std::size_t i = 0; i < count; ++i) budgets.push_back(std::make_shared<FixedBudget>(bytes));
  return budgets;
}

template <typename Budget>
std::vector<MirrorSpec> specs(const std::vector<std::shared_ptr<Budget>>& budgets) {
  std::vector<MirrorSpec> mirrors;
  for (const auto& b : budgets) mirrors.push_back({b, std::nullopt});
  return mirrors;
}

std::vector<std::size_t> used(const std::vector<std::shared_ptr<FixedBudget>>& budgets) {
  std::vector<std::size_t> out;
  for (const auto& b : budgets) out.push_back(b->used_bytes());
  return out;
}

void test_charges_are_taken_on_every_mirror_and_released_per_mirror() {
  const KVLayout layout = layout_of(64);
  const std::size_t page = layout.page_id_bytes();
  auto budgets = fixed_budgets(3, 1 << 30);
  BlockManager m(layout, BlockManagerOptions{}, specs(budgets));
  std::vector<std::int64_t> blocks = m.alloc(8);
  CHECK(used(budgets) == std::vector<std::size_t>(3, 2 * page));
  for (std::size_t i = 0; i < 3; ++i) m.acknowledge(i, m.take_page_ops().seq);
  m.free(blocks);
  m.trim();
  const PageOps unmap = m.take_page_ops();
  CHECK(unmap.unmap_pages.size() == 2);
  m.acknowledge(2, unmap.seq);
  CHECK((used(budgets) == std::vector<std::size_t>{2 * page, 2 * page, 0}));
  CHECK(m.stats().pending_pages == 2);  // reusable only once every mirror has acknowledged
  m.acknowledge(0, unmap.seq);
  m.acknowledge(1, unmap.seq);
  CHECK(used(budgets) == std::vector<std::size_t>(3, 0) && m.stats().pending_pages == 0);
  CHECK(throws<InvalidArgument>([&] { m.acknowledge(3, 1); }));
  CHECK(throws<InvalidArgument>([&] { m.acknowledge(0, unmap.seq + 1); }));
}

void test_a_refusing_mirror_leaves_nothing_taken_elsewhere() {
  const KVLayout layout = layout_of(64);
  const std::size_t page = layout.page_id_bytes();
  std::vector<std::shared_ptr<FixedBudget>> budgets = {std::make_shared<FixedBudget>(8 * page),
                                                       std::make_shared<FixedBudget>(page),
                                                       std::make_shared<FixedBudget>(8 * page)};
  BlockManager m(layout, BlockManagerOptions{}, specs(budgets));
  CHECK(m.available() == 4);
  CHECK(throws<BudgetExhausted>([&] { m.alloc_ids({0, 4}); }));
  CHECK(used(budgets) == std::vector<std::size_t>(3, 0) && m.take_page_ops().empty());
  CHECK(m.alloc(4).size() == 4 && used(budgets) == std::vector<std::size_t>(3, page));
  CHECK(throws<BudgetExhausted>([&] { m.alloc(1); }));
  CHECK(used(budgets) == std::vector<std::size_t>(3, page));
}

void test_pipeline_stages_are_charged_their_own_page_cost() {
  const KVLayout whole = layout_of(64, 4);
  const KVLayout first = layout_of(64, 3), second = layout_of(64, 1);
  auto budgets = fixed_budgets(2, 1 << 30);
  BlockManager m(whole, BlockManagerOptions{}, {{budgets[0], first}, {budgets[1], second}});
  m.alloc(12);
  CHECK((used(budgets) == std::vector<std::size_t>{3 * first.page_id_bytes(), 3 * second.page_id_bytes()}));
  CHECK(throws<InvalidArgument>(
      [&] { BlockManager bad(whole, BlockManagerOptions{}, {{nullptr, layout_of(64, 1, 8)}}); }));
}

void test_charges_awaiting_acknowledgement_are_reused_at_once() {
  const KVLayout layout = layout_of(64);
  const std::size_t page = layout.page_id_bytes();
  auto budgets = fixed_budgets(2, 2 * page);
  BlockManager m(layout, BlockManagerOptions{}, specs(budgets));
  std::vector<std::int64_t> blocks = m.alloc(8);
  const PageOps map = m.take_page_ops();
  m.acknowledge(0, map.seq);
  m.acknowledge(1, map.seq);
  m.free(std::vector<std::int64_t>(blocks.begin(), blocks.begin() + 4));
  m.trim();
  const PageOps unmap = m.take_page_ops();  // handed out, not yet acknowledged
  m.acknowledge(0, unmap.seq);              // mirror 0 has unmapped; mirror 1 has not
  CHECK((used(budgets) == std::vector<std::size_t>{page, 2 * page}));
  CHECK(m.available() == 4);
  std::vector<std::int64_t> again = m.alloc(4);  // mirror 1's pending charge covers its new page
  CHECK((used(budgets) == std::vector<std::size_t>{2 * page, 2 * page}));
  CHECK(std::find(unmap.unmap_pages.begin(), unmap.unmap_pages.end(), static_cast<std::int64_t>(m.page_of(again[0]))) ==
        unmap.unmap_pages.end());
  m.acknowledge(1, unmap.seq);
  CHECK((used(budgets) == std::vector<std::size_t>{2 * page, 2 * page}));  // the charge moved, not released
  const PageOps map_again = m.take_page_ops();
  m.acknowledge(0, map_again.seq);
  m.acknowledge(1, map_again.seq);
  CHECK((used(budgets) == std::vector<std::size_t>{2 * page, 2 * page}) && m.stats().pending_pages == 0);
}

void test_sleep_unmaps_every_page_with_the_null_blocks_and_maps_nothing_until_woken() {
  const KVLayout layout = layout_of(32);
  const std::size_t page = layout.page_id_bytes();
  auto budgets = fixed_budgets(2, 1 << 30);
  BlockManagerOptions options;
  options.null_block = true;
  BlockManager m(layout, options, specs(budgets));
  const auto acknowledge = [&](const PageOps& ops) {
    for (std::size_t i = 0; i < 2; ++i) m.acknowledge(i, ops.seq);
  };
  acknowledge(m.take_page_ops());  // the null block's page
  std::vector<std::int64_t> blocks = m.alloc(10);
  acknowledge(m.take_page_ops());
  CHECK(throws<InvalidArgument>([&] { m.sleep(); }));  // blocks handed out: nothing changes
  CHECK(!m.asleep() && m.stats().mapped_pages == 3 && m.take_page_ops().unmap_pages.empty());
  m.free(blocks);
  CHECK(m.sleep() == 3 && m.asleep() && m.sleep() == 0);
  const PageOps unmap = m.take_page_ops();
  CHECK(unmap.unmap_pages.size() == 3);
  acknowledge(unmap);
  BlockManagerStats s = m.stats();
  CHECK(s.asleep && s.mapped_pages == 0 && s.used_blocks == 0 && s.limit_pages == 0 && pages_add_up(s));
  CHECK(used(budgets) == std::vector<std::size_t>(2, 0));  // every mirror's budget has it all back
  CHECK(m.available() == 0 && !m.try_reserve(1));
  CHECK(throws<BudgetExhausted>([&] { m.alloc(1); }));
  m.maintain();
  CHECK(m.stats().mapped_pages == 0 && used(budgets) == std::vector<std::size_t>(2, 0));
  m.wake_up();
  CHECK(!m.asleep() && m.stats().used_blocks == 1 && m.stats().mapped_pages == 1);  // the null block's page
  CHECK(used(budgets) == std::vector<std::size_t>(2, page));
  blocks = m.alloc(31);  // every block but the null block
  CHECK(std::find(blocks.begin(), blocks.end(), 0) == blocks.end());
  m.wake_up();  // awake: nothing to do
  CHECK(m.stats().used_blocks == 32);
}

void test_a_refused_wake_up_stays_asleep() {
  const KVLayout layout = layout_of(32);
  auto budget = std::make_shared<FixedBudget>(layout.page_id_bytes());
  BlockManagerOptions options;
  options.null_block = true;
  BlockManager m(layout, options, {MirrorSpec{budget, std::nullopt}});
  m.acknowledge(0, m.take_page_ops().seq);
  m.sleep();
  const PageOps unmap = m.take_page_ops();
  CHECK(throws<InvalidArgument>([&] { m.wake_up(); }));  // the unmap is not acknowledged yet
  CHECK(m.asleep());
  m.acknowledge(0, unmap.seq);
  CHECK(budget->try_acquire(layout.page_id_bytes()));  // someone else took the memory meanwhile
  CHECK(throws<BudgetExhausted>([&] { m.wake_up(); }));
  CHECK(m.asleep() && m.stats().used_blocks == 0 && m.available() == 0);
  budget->release(layout.page_id_bytes());
  m.wake_up();
  CHECK(!m.asleep() && m.stats().used_blocks == 1);
}

void test_a_lost_mirror_gives_back_its_budget() {
  const KVLayout layout = layout_of(64);
  const std::size_t page = layout.page_id_bytes();
  auto budgets = fixed_budgets(2, 1 << 30);
  BlockManager m(layout, BlockManagerOptions{}, specs(budgets));
  std::vector<std::int64_t> blocks = m.alloc(12);
  m.acknowledge(0, m.take_page_ops().seq);  // mirror 1 stopped answering
  m.free(std::vector<std::int64_t>(blocks.begin(), blocks.begin() + 4));
  m.trim();
  m.acknowledge(0, m.take_page_ops().seq);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  BlockManagerStats s = m.stats();
  CHECK(s.mirrors[0].progress.unacked_batches == 0 && s.mirrors[0].progress.oldest_unacked_age_s == 0);
  CHECK(s.mirrors[1].progress.unacked_batches == 2 && s.mirrors[1].progress.oldest_unacked_age_s >= 0.02);
  CHECK((used(budgets) == std::vector<std::size_t>{2 * page, 3 * page}) && s.pending_pages == 1);
  m.mirror_lost(1);
  s = m.stats();
  CHECK((used(budgets) == std::vector<std::size_t>{2 * page, 0}) && s.pending_pages == 0 &&
        !s.mirrors[1].progress.alive);
  m.alloc(4);
  CHECK((used(budgets) == std::vector<std::size_t>{3 * page, 0}));
  m.close();
  CHECK(used(budgets) == std::vector<std::size_t>(2, 0));
}

void test_mirrors_on_the_shared_registry_budget() {
  char dir[] = "/tmp/kvcached-test-registry-XXXXXX";
  if (mkdtemp(dir) == nullptr) return;
  configure_registry({dir, ""});
  const KVLayout layout = layout_of(64);
  const std::size_t page = layout.page_id_bytes();
  auto registry = DeviceRegistry::open("cpu", std::size_t{1} << 30);
  std::vector<std::shared_ptr<RegistryBudget>> ranks = {registry->register_instance("rank-0"),
                                                        registry->register_instance("rank-1")};
  const auto mapped = [&] { return std::vector<std::size_t>{ranks[0]->mapped_bytes(), ranks[1]->mapped_bytes()}; };
  {
    BlockManager m(layout, BlockManagerOptions{}, specs(ranks));
    std::vector<std::int64_t> blocks = m.alloc(8);
    CHECK(mapped() == std::vector<std::size_t>(2, 2 * page));
    m.acknowledge(0, m.take_page_ops().seq);
    m.acknowledge(1, 1);
    registry->set_limit(std::string("rank-0"), 2 * page);
    CHECK(throws<BudgetExhausted>([&] { m.alloc(4); }));
    CHECK(mapped() == std::vector<std::size_t>(2, 2 * page));  // nothing stayed taken on rank 1
    m.free(blocks);
    m.trim();
    const PageOps unmap = m.take_page_ops();
    m.acknowledge(0, unmap.seq);
    CHECK((mapped() == std::vector<std::size_t>{0, 2 * page}));
    m.mirror_lost(1);
    CHECK(mapped() == std::vector<std::size_t>(2, 0) && m.stats().pending_pages == 0);
  }
  for (auto& r : ranks) r->unregister();
  unlink(DeviceRegistry::segment_path("cpu").c_str());
  rmdir(dir);
}

}  // namespace

int main() {
  test_the_layout_checks_its_arithmetic();
  test_a_partial_last_page_is_used_and_given_back();
  test_reserved_blocks_are_handed_out_first();
  test_free_refuses_reserved_blocks_and_changes_nothing();
  test_resize_says_whether_the_limit_holds_now();
  test_trim_is_kept_until_the_next_alloc();
  test_a_run_lands_on_one_page_and_single_blocks_fill_holes();
  test_a_refused_budget_takes_nothing();
  test_close_from_two_threads();
  test_charges_are_taken_on_every_mirror_and_released_per_mirror();
  test_a_refusing_mirror_leaves_nothing_taken_elsewhere();
  test_pipeline_stages_are_charged_their_own_page_cost();
  test_charges_awaiting_acknowledgement_are_reused_at_once();
  test_a_lost_mirror_gives_back_its_budget();
  test_sleep_unmaps_every_page_with_the_null_blocks_and_maps_nothing_until_woken();
  test_a_refused_wake_up_stays_asleep();
  test_mirrors_on_the_shared_registry_budget();
  return kvcached_test::summary();
}
