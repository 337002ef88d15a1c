// ZeroBacking: makes the unmapped parts of a KV reservation read as zeros, so
// a kernel's stray read of an unused block returns zeros instead of faulting.
//
// Host: a private read-only anonymous mapping gives zeros for free, no matter
// how large. GPU: there is no such thing, so shared zero-filled allocations are
// mapped over the holes. One mapping per page (what the reference does) costs
// a driver call per page at set-up; instead the range is covered with coarse,
// power-of-two chunks of up to `max_chunk_bytes` (one shared allocation per
// chunk size), and a chunk is split only when a real page is mapped inside it.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <vector>

#include "kvcached/device/device.hpp"

namespace kvcached {

class KVCACHED_EXPORT ZeroBacking {
 public:
  virtual ~ZeroBacking() = default;
  // Fill [address, address + size) with zeros (it holds no mapping now).
  virtual void cover(VirtualAddress address, std::size_t size_bytes) = 0;
  // The same with unit-sized zero pieces only: the range is then prepared
  // (see prepare) without a split. Used at set-up for the first page ids.
  virtual void cover_prepared(VirtualAddress address, std::size_t size_bytes) = 0;
  // Remove the zero mappings overlapping [address, address + size) so real
  // memory can be mapped there; the rest of any split chunk stays covered.
  virtual void uncover(VirtualAddress address, std::size_t size_bytes) = 0;
  // Split ahead of use: afterwards [address, address + size) is covered by
  // unit-sized zero pieces, so mapping real memory there later replaces one
  // piece instead of splitting a coarse chunk on the grow path. A run of
  // units is split and re-covered together (one set_access for the run).
  virtual void prepare(VirtualAddress address, std::size_t size_bytes) = 0;
  // Number of zero mappings currently in place (0 on host, where it is free).
  virtual std::size_t mapping_count() const = 0;
  // Coarse chunks split so far (by uncover or prepare): each one costs an
  // unmap plus zero pieces mapped and given access around the edge.
  virtual std::size_t splits() const { return 0; }

  // `unit_bytes`: the smallest size ever covered or uncovered (an allocation
  // of the KV layout); `max_chunk_bytes`: largest zero allocation (GPU only).
  static std::unique_ptr<ZeroBacking> create(std::shared_ptr<Device> device, VirtualAddress base,
                                             std::size_t unit_bytes, std::size_t max_chunk_bytes);
};

}  // namespace kvcached
