// BestFitIndex as a specification: buckets by free blocks, entirely free
// pages (a partial last page included), and both placement policies.
#include <algorithm>
#include <vector>

#include "check.hpp"
#include "kvcached/blocks/best_fit_index.hpp"

namespace {

using kvcached::BestFitIndex;
using kvcached::Placement;
using kvcached_test::throws;
constexpr std::uint32_t kNone = BestFitIndex::kNone;

void test_counts_follow_inserts_and_updates() {
  BestFitIndex index(8, 16, 16);
  index.insert(0, 16);
  index.insert(1, 3);
  index.insert(2, 0);
  CHECK(index.pages() == 3 && index.free_blocks() == 19);
  CHECK(index.empty_pages() == 1 && index.empty_blocks() == 16);
  index.update(0, 10);  // no longer entirely free
  CHECK(index.empty_pages() == 0 && index.free_blocks() == 13);
  index.update(2, 16);
  CHECK(index.empty_pages() == 1 && index.entirely_free(2));
  index.erase(2);
  CHECK(!index.contains(2) && index.pages() == 2 && index.empty_pages() == 0);
  CHECK(throws<kvcached::InvalidArgument>([&] { index.insert(1, 5); }));   // already in
  CHECK(throws<kvcached::InvalidArgument>([&] { index.insert(3, 17); }));  // more than a page
  CHECK(throws<kvcached::InvalidArgument>([] { BestFitIndex(4, 16, 17); }));
}

void test_single_blocks_fill_the_fullest_page() {
  BestFitIndex index(8, 16, 16);
  index.insert(0, 16);
  index.insert(1, 9);
  index.insert(2, 2);
  index.insert(3, 0);  // full: never chosen
  for (Placement p : {Placement::kFewestPages, Placement::kFullestFirst}) {
    CHECK(index.choose(1, p, true) == 2);
  }
}

void test_a_run_goes_to_the_tightest_page_that_holds_it() {
  BestFitIndex index(8, 16, 16);
  index.insert(0, 16);
  index.insert(1, 9);
  index.insert(2, 2);
  CHECK(index.choose(8, Placement::kFewestPages, true) == 1);   // 9 >= 8, tighter than 16
  CHECK(index.choose(10, Placement::kFewestPages, true) == 0);  // only the empty page holds 10
  CHECK(index.choose(40, Placement::kFewestPages, true) == 0);  // longer than a page: the emptiest first
  CHECK(index.choose(8, Placement::kFullestFirst, true) == 2);  // the old policy scatters: fullest first
  CHECK(index.tightest_fit(3, true) == 1 && index.tightest_fit(17, true) == kNone);
}

void test_entirely_free_pages_can_be_ruled_out() {
  BestFitIndex index(8, 16, 16);
  index.insert(0, 16);
  index.insert(1, 4);
  CHECK(index.choose(10, Placement::kFewestPages, false) == 1);  // the empty page is off limits
  CHECK(index.choose(1, Placement::kFullestFirst, false) == 1);
  index.update(1, 0);
  CHECK(index.choose(1, Placement::kFewestPages, false) == kNone);
  CHECK(index.choose(1, Placement::kFewestPages, true) == 0);
}

void test_a_partial_last_page_counts_as_empty_at_its_own_size() {
  BestFitIndex index(4, 16, 6);  // the last page holds 6 blocks
  index.insert(3, 6);
  index.insert(1, 6);  // a full-size page with 6 free blocks left
  CHECK(index.entirely_free(3) && !index.entirely_free(1));
  CHECK(index.empty_pages() == 1 && index.empty_blocks() == 6);
  CHECK(index.choose(5, Placement::kFewestPages, false) == 1);  // same bucket, the empty one skipped
  const std::vector<std::uint32_t> release = index.empty_pages_to_release(4);
  CHECK(release.size() == 1 && release[0] == 3);
}

void test_release_order_and_count() {
  BestFitIndex index(8, 4, 4);
  for (std::uint32_t p : {5u, 1u, 6u, 2u}) index.insert(p, 4);
  index.insert(3, 1);
  std::vector<std::uint32_t> all = index.empty_pages_to_release(10);
  CHECK((all == std::vector<std::uint32_t>{6, 5, 2, 1}));
  CHECK(index.empty_pages_to_release(2).size() == 2);
  CHECK(index.empty_pages_to_release(0).empty());
}

}  // namespace

int main() {
  test_counts_follow_inserts_and_updates();
  test_single_blocks_fill_the_fullest_page();
  test_a_run_goes_to_the_tightest_page_that_holds_it();
  test_entirely_free_pages_can_be_ruled_out();
  test_a_partial_last_page_counts_as_empty_at_its_own_size();
  test_release_order_and_count();
  return kvcached_test::summary();
}
