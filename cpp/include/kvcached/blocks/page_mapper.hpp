// PageMapper: how a BlockManager's decisions ("map these page ids", "unmap
// those") reach memory. In one process a LocalPageMapper applies them to a
// KVSpace at once; across processes a PageOpLog records them as ordered lists
// that mirror KVSpaces apply and acknowledge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "kvcached/space/kv_space.hpp"

namespace kvcached {

struct UnmapOutcome {
  std::size_t released_pages = 0;             // memory given back now
  std::size_t spare_pages = 0;                // kept as pre-created allocations (still held)
  std::vector<std::int64_t> pending_pages;    // given back once every mirror acknowledges
};

class KVCACHED_EXPORT PageMapper {
 public:
  virtual ~PageMapper() = default;
  // All or nothing; throws (e.g. DeviceOutOfMemory) with nothing mapped.
  virtual void map_pages(const std::vector<std::int64_t>& pages) = 0;
  virtual UnmapOutcome unmap_pages(const std::vector<std::int64_t>& pages) = 0;
  // Spare (pre-created, unmapped) page allocations that map_pages uses first.
  virtual std::size_t spare_pages() const { return 0; }
  // Pre-create up to `count` spares; returns how many were made.
  virtual std::size_t add_spares(std::size_t count) { (void)count; return 0; }
  // Release spares beyond `keep`; returns how many were released.
  virtual std::size_t trim_spares(std::size_t keep) { (void)keep; return 0; }
  // Get these unmapped pages ready to be mapped quickly (best effort).
  virtual void prepare_pages(const std::vector<std::int64_t>& pages) { (void)pages; }
  // Device memory still free, when the mapper knows it (cached; may be stale).
  virtual std::optional<std::size_t> device_free_bytes() const { return std::nullopt; }
};

class KVCACHED_EXPORT LocalPageMapper final : public PageMapper {
 public:
  explicit LocalPageMapper(std::shared_ptr<KVSpace> space) : space_(std::move(space)) {}
  void map_pages(const std::vector<std::int64_t>& pages) override { space_->map_pages(pages); }
  UnmapOutcome unmap_pages(const std::vector<std::int64_t>& pages) override;
  std::size_t spare_pages() const override { return space_->spare_pages(); }
  std::size_t add_spares(std::size_t count) override { return space_->add_spares(count); }
  void prepare_pages(const std::vector<std::int64_t>& pages) override { space_->prepare_pages(pages); }
  std::size_t trim_spares(std::size_t keep) override;
  std::optional<std::size_t> device_free_bytes() const override {
    return space_->device()->memory_info().free_bytes;
  }
  const std::shared_ptr<KVSpace>& space() const noexcept { return space_; }

 private:
  std::shared_ptr<KVSpace> space_;
};

// One batch of page operations for mirrors to apply: unmaps first, then maps
// (the two lists never share a page: a page mapped and unmapped before the
// batch was taken is dropped from both, and a page awaiting acknowledgement
// of its unmap is never mapped again).
struct PageOps {
  std::uint64_t seq = 0;
  std::vector<std::int64_t> map_pages;
  std::vector<std::int64_t> unmap_pages;
};

class KVCACHED_EXPORT PageOpLog final : public PageMapper {
 public:
  explicit PageOpLog(std::size_t num_mirrors);
  void map_pages(const std::vector<std::int64_t>& pages) override;
  UnmapOutcome unmap_pages(const std::vector<std::int64_t>& pages) override;

  // Everything recorded since the last call, as one batch (seq increases by
  // one per non-empty batch; an empty batch has seq 0 and needs no ack).
  PageOps take_ops();
  // Mirror `mirror` has applied every batch up to `seq`. Returns the pages
  // whose unmap every mirror has now acknowledged (their memory is free).
  std::vector<std::int64_t> acknowledge(std::size_t mirror, std::uint64_t seq);
  std::size_t num_mirrors() const noexcept { return acked_.size(); }
  std::size_t pending_pages() const;

 private:
  mutable std::mutex mutex_;
  PageOps open_;                                                  // not yet taken
  std::uint64_t next_seq_ = 1;
  std::deque<std::pair<std::uint64_t, std::vector<std::int64_t>>> unacked_;  // (seq, unmapped pages)
  std::vector<std::uint64_t> acked_;                              // per mirror
  std::size_t pending_pages_ = 0;
};

}  // namespace kvcached
