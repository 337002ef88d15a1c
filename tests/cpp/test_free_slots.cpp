// FreeSlots as a specification: lowest free slot first, whatever order the frees came back in.
#include <cstdint>
#include <vector>

#include "check.hpp"
#include "kvcached/blocks/free_slots.hpp"

namespace {

using kvcached::FreeSlots;
using kvcached_test::throws;
using Ids = std::vector<std::int64_t>;

Ids take(FreeSlots& slots, std::size_t n, std::int64_t base = 0) {
  Ids out;
  slots.take(n, base, out);
  return out;
}

void test_a_fresh_page_hands_out_ascending_runs() {
  FreeSlots slots;
  slots.fill(130);  // three words, the last partial
  CHECK(slots.size() == 130 && slots.capacity() == 130);
  CHECK((take(slots, 3, 1000) == Ids{1000, 1001, 1002}));
  const Ids rest = take(slots, 127);
  CHECK(rest.size() == 127 && rest.front() == 3 && rest.back() == 129);
  for (std::size_t i = 1; i < rest.size(); ++i) CHECK(rest[i] == rest[i - 1] + 1);
  CHECK(slots.size() == 0);
  CHECK(throws<kvcached::InvalidArgument>([&] { take(slots, 1); }));
}

void test_frees_in_any_order_come_back_lowest_first() {
  FreeSlots slots;
  slots.fill(256);
  take(slots, 256);
  for (std::uint32_t s : {200u, 7u, 65u, 64u, 130u, 8u}) slots.give(s);  // scrambled, across words
  CHECK(slots.size() == 6);
  CHECK((take(slots, 4) == Ids{7, 8, 64, 65}));
  slots.give(3);
  CHECK((take(slots, 3) == Ids{3, 130, 200}));
}

void test_give_and_remove_refuse_what_does_not_hold() {
  FreeSlots slots;
  slots.fill(64);
  CHECK(throws<kvcached::InvalidArgument>([&] { slots.give(5); }));   // free already
  CHECK(throws<kvcached::InvalidArgument>([&] { slots.give(64); }));  // beyond the page
  slots.remove(5);
  CHECK(!slots.contains(5) && slots.size() == 63);
  CHECK(throws<kvcached::InvalidArgument>([&] { slots.remove(5); }));
  CHECK((take(slots, 6) == Ids{0, 1, 2, 3, 4, 6}));
  slots.give(5);
  CHECK((take(slots, 1) == Ids{5}));
}

void test_clear_empties_and_fill_starts_again() {
  FreeSlots slots;
  slots.fill(10);
  take(slots, 4);
  slots.clear();
  CHECK(slots.size() == 0 && slots.capacity() == 0 && !slots.contains(0));
  slots.fill(10);
  CHECK((take(slots, 2) == Ids{0, 1}));
}

}  // namespace

void test_lowest_looks_without_taking() {
  kvcached::FreeSlots slots;
  slots.fill(200);
  for (std::uint32_t slot : {0u, 1u, 64u, 65u}) slots.remove(slot);
  Ids seen;
  slots.lowest(3, 10, seen);
  CHECK((seen == Ids{12, 13, 14}) && slots.size() == 196);
  seen.clear();
  slots.lowest(1000, 0, seen);  // more than there are: all of them, in order
  CHECK(seen.size() == 196 && seen[61] == 63 && seen[62] == 66 && seen.back() == 199);
}

int main() {
  test_a_fresh_page_hands_out_ascending_runs();
  test_frees_in_any_order_come_back_lowest_first();
  test_give_and_remove_refuse_what_does_not_hold();
  test_clear_empties_and_fill_starts_again();
  test_lowest_looks_without_taking();
  return kvcached_test::summary();
}
