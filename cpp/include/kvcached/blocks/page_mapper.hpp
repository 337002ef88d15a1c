// PageMapper: how a BlockManager's decisions ("map these page ids", "unmap
// those") reach memory. In one process a LocalPageMapper
// (cpp/src/core/blocks/local_page_mapper.hpp) applies them to a KVSpace at
// once; across processes a PageOpLog (page_op_log.hpp) records them
// as ordered batches that mirror KVSpaces apply and acknowledge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "kvcached/error.hpp"  // KVCACHED_EXPORT

namespace kvcached {

// What became of pages a block manager gave up.
struct UnmapOutcome {
  std::vector<std::int64_t> unmapped;      // unmapped everywhere: the ids are reusable now
  std::vector<std::int64_t> awaiting_ack;  // reusable once every mirror has acknowledged the unmap
};

class KVCACHED_EXPORT PageMapper {
 public:
  virtual ~PageMapper() = default;
  // All or nothing; throws (e.g. DeviceOutOfMemory) with nothing mapped.
  virtual void map_pages(const std::vector<std::int64_t>& pages) = 0;
  virtual UnmapOutcome unmap_pages(const std::vector<std::int64_t>& pages) = 0;
  // Pre-created, unmapped allocations that map_pages uses first (read
  // without waiting: the count is published atomically by the space).
  virtual std::size_t spare_pages() const noexcept { return 0; }
  // Pre-create up to `count` spares; returns how many were made.
  virtual std::size_t add_spares(std::size_t count) {
    (void)count;
    return 0;
  }
  // Release spares beyond `keep`; returns how many were released.
  virtual std::size_t trim_spares(std::size_t keep) {
    (void)keep;
    return 0;
  }
  // How many unmapped allocations an unmap may keep as spares.
  virtual void set_max_spare_pages(std::size_t count) { (void)count; }
  // Get these unmapped pages ready to be mapped quickly (best effort).
  virtual void prepare_pages(const std::vector<std::int64_t>& pages) { (void)pages; }
  // How many unmapped page ids the mapper wants ready ahead of use at least.
  virtual std::size_t lookahead_pages() const noexcept { return 0; }
  // Device memory still free, when the mapper has a device: `query` asks the
  // driver (microseconds), otherwise an estimate with no driver call.
  virtual std::optional<std::size_t> device_free_bytes(bool query) const {
    (void)query;
    return std::nullopt;
  }
  // The calling thread is the block manager's worker: bind the device to it.
  virtual void bind_calling_thread() {}
};

}  // namespace kvcached
