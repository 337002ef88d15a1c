// PageOpLog: a device-less block manager's decisions as ordered PageOps
// batches for mirror KV spaces (in other processes, possibly on other
// devices), and what each mirror has acknowledged.
//
// Every mirror applies every batch in seq order and acknowledges it itself.
// A page id unmapped in batch s becomes reusable (mappable again) only once
// every live mirror has acknowledged s. A mirror that is gone is declared lost
// (mirror_lost): the log stops waiting for it.
//
// For the budget of each mirror the log answers peak_pages(): the most pages
// a mirror can hold at any point between the batch it has acknowledged and
// the open batch — the memory its budget must cover. Within a batch unmaps
// come first, so a page unmapped in an earlier batch already covers a page
// mapped in a later one on that mirror.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "kvcached/blocks/page_mapper.hpp"
#include "kvcached/space/page_ops.hpp"

namespace kvcached {

struct MirrorProgress {
  bool alive = true;
  std::uint64_t acked_seq = 0;
  std::size_t unacked_batches = 0;  // handed out, not yet acknowledged by this mirror
  double oldest_unacked_age_s = 0;  // since the oldest of those was handed out (0: none)
};

class KVCACHED_EXPORT PageOpLog final : public PageMapper {
 public:
  explicit PageOpLog(std::size_t num_mirrors);
  // Recorded in the open batch. A page unmapped in the open batch that was
  // mapped in it too never reaches a mirror: it is dropped from both lists.
  void map_pages(const std::vector<std::int64_t>& pages) override;
  UnmapOutcome unmap_pages(const std::vector<std::int64_t>& pages) override;

  // Everything recorded since the last call, as one batch (seq increases by
  // one per non-empty batch; an empty batch has seq 0 and needs no ack).
  PageOps take_ops();
  // Mirror `mirror` has applied every batch up to `seq` (an older seq is a
  // no-op; one never handed out is InvalidArgument). Returns the page ids
  // whose unmap every live mirror has now acknowledged. A lost mirror's
  // acknowledgements are ignored.
  std::vector<std::int64_t> acknowledge(std::size_t mirror, std::uint64_t seq);
  // Stop waiting for `mirror`; returns the page ids that thereby became reusable.
  std::vector<std::int64_t> mirror_lost(std::size_t mirror);

  // Most pages `mirror` can hold from its acknowledged batch to the end of the
  // open batch, given that the open batch leaves `pages_after_open` mapped and
  // `extra_maps` more maps are about to be recorded in it.
  std::size_t peak_pages(std::size_t mirror, std::size_t pages_after_open, std::size_t extra_maps) const;

  std::size_t num_mirrors() const noexcept { return acked_.size(); }
  bool alive(std::size_t mirror) const;
  MirrorProgress progress(std::size_t mirror) const;
  std::uint64_t last_seq() const;          // the last batch handed out (0: none)
  std::size_t pages_awaiting_ack() const;  // unmapped, not yet reusable

 private:
  using Clock = std::chrono::steady_clock;
  struct Batch {
    std::uint64_t seq;
    std::size_t maps;
    std::vector<std::int64_t> unmaps;
    Clock::time_point taken_at;
  };
  void check_mirror(std::size_t mirror) const;
  // Drops batches every live mirror has acknowledged; returns their unmapped pages.
  std::vector<std::int64_t> release_acknowledged_locked();

  mutable std::mutex mutex_;  // a leaf: nothing is called while it is held
  PageOps open_;              // not yet taken
  std::uint64_t next_seq_ = 1;
  std::deque<Batch> batches_;  // handed out, not acknowledged by every live mirror
  std::vector<std::uint64_t> acked_;
  std::vector<std::uint8_t> alive_;
  std::size_t awaiting_ack_ = 0;
};

}  // namespace kvcached
