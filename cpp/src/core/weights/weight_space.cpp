// WeightSpace (weights/weight_space.hpp): sleep releases a model's weight memory, wake maps it back in place.
#include "kvcached/weights/weight_space.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "kvcached/error.hpp"

namespace kvcached {
namespace {

std::size_t round_up(std::size_t value, std::size_t unit) { return (value + unit - 1) / unit * unit; }

std::string bytes_text(std::size_t bytes) {
  return std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 20) + " MiB)";
}

// `ranges` sorted and merged where they touch or overlap; InvalidArgument for one outside [0, size).
std::vector<ByteRange> merged(std::vector<ByteRange> ranges, std::size_t size) {
  for (const ByteRange& r : ranges) {
    if (r.offset > size || r.size > size - r.offset) {
      throw InvalidArgument("kept range [" + std::to_string(r.offset) + ", +" + std::to_string(r.size) +
                            ") is outside the weights' " + std::to_string(size) + " bytes");
    }
  }
  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    if (r.size == 0) continue;
    if (!out.empty() && r.offset <= out.back().offset + out.back().size) {
      out.back().size = std::max(out.back().offset + out.back().size, r.offset + r.size) - out.back().offset;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

std::size_t total_bytes(const std::vector<ByteRange>& ranges) {
  std::size_t total = 0;
  for (const ByteRange& r : ranges) total += r.size;
  return total;
}

}  // namespace

WeightSpace::WeightSpace(std::shared_ptr<Device> device, std::size_t size_bytes, std::shared_ptr<WeightsBudget> budget,
                         const WeightSpaceOptions& options)
    : device_(std::move(device)), budget_(std::move(budget)) {
  if (!device_) throw InvalidArgument("WeightSpace needs a device");
  if (size_bytes == 0) throw InvalidArgument("WeightSpace needs at least one byte of weights");
  const std::size_t granularity = device_->granularity().recommended_bytes;
  const std::size_t requested_chunk = options.chunk_bytes != 0 ? options.chunk_bytes : options.kDefaultChunkBytes;
  chunk_bytes_ = round_up(requested_chunk, granularity);
  const std::size_t total = round_up(size_bytes, granularity);
  for (std::size_t offset = 0; offset < total; offset += chunk_bytes_) {
    chunks_.push_back({offset, std::min(chunk_bytes_, total - offset)});
  }
  memory_ = std::make_shared<WeightMemory>();
  memory_->device = device_;
  memory_->reservation = device_->reserve(total);
  base_ = memory_->reservation.base();
  size_bytes_ = total;
  copies_ = device_->backend().open_copy_queue();
  if (budget_ && !budget_->try_charge(total)) {
    throw BudgetExhausted("weights of " + bytes_text(total) + " do not fit: the device budget refused them");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    map_all_locked(Contents::kUninitialised);
  } catch (...) {
    if (budget_) budget_->credit(total, /*sleeping=*/false);
    throw;
  }
}

WeightSpace::~WeightSpace() {
  try {
    close();
  } catch (...) {
    // A destructor cannot report; close() already gave back what it could.
  }
}

std::shared_ptr<WeightMemory> WeightSpace::memory() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return memory_;
}

SleepLevel WeightSpace::sleep_level() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return level_;
}

WeightSpaceStats WeightSpace::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  WeightSpaceStats s;
  s.size_bytes = size_bytes();
  for (const PhysicalAllocation& allocation : allocations_) s.mapped_bytes += allocation.size_bytes();
  s.chunks = chunks_.size();
  s.chunk_bytes = chunk_bytes_;
  s.host_buffer_bytes = host_buffer_bytes_;
  s.kept_bytes = level_ == SleepLevel::kAwake ? 0 : total_bytes(kept_);
  s.sleep_level = static_cast<int>(level_);
  s.sleeps = sleeps_;
  s.wakes = wakes_;
  return s;
}

void WeightSpace::sleep(SleepLevel level, const std::vector<ByteRange>& keep) {
  if (level != SleepLevel::kKeepContents && level != SleepLevel::kDiscardContents) {
    throw InvalidArgument("sleep level " + std::to_string(static_cast<int>(level)) +
                          " is unknown: expected 1 (keep the contents in host memory) or 2 (discard them)");
  }
  std::vector<ByteRange> kept =
      level == SleepLevel::kKeepContents ? std::vector<ByteRange>{{0, size_bytes_}} : merged(keep, size_bytes_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("the weights were closed");
  if (level_ != SleepLevel::kAwake) return;
  device_->synchronize();  // kernels still reading the weights finish before they go
  const std::size_t kept_total = total_bytes(kept);
  if (kept_total > 0) {
    ensure_host_buffer_locked(kept_total);
    auto* host = static_cast<char*>(host_buffer_);
    for (const ByteRange& range : kept) {
      // Chunk by chunk: a copy never spans two physical allocations (ROCm).
      for (const Chunk& chunk : chunks_) {
        const std::size_t begin = std::max(range.offset, chunk.offset);
        const std::size_t end = std::min(range.offset + range.size, chunk.offset + chunk.size_bytes);
        if (begin < end) copies_->copy_to_host(host + (begin - range.offset), base_ + begin, end - begin);
      }
      host += range.size;
    }
    copies_->wait();
  }
  unmap_all_locked();
  cover_unmapped_locked();
  if (budget_) budget_->credit(size_bytes_, /*sleeping=*/true);
  kept_ = std::move(kept);
  level_ = level;
  ++sleeps_;
}

bool WeightSpace::try_wake() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("the weights were closed");
  if (level_ == SleepLevel::kAwake) return true;
  if (budget_ && !budget_->try_charge(size_bytes())) return false;
  try {
    map_all_locked(level_ == SleepLevel::kKeepContents ? Contents::kRestored : Contents::kZeroThenKept);
  } catch (...) {
    cover_unmapped_locked();
    if (budget_) budget_->credit(size_bytes(), /*sleeping=*/true);
    throw;
  }
  level_ = SleepLevel::kAwake;
  kept_.clear();
  ++wakes_;
  return true;
}

void WeightSpace::release_host_buffer() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (level_ != SleepLevel::kAwake && !kept_.empty()) {
    throw InvalidArgument("the host buffer holds what the sleeping weights keep: wake them first");
  }
  free_host_buffer_locked();
}

void WeightSpace::copy_kept_contents(std::size_t offset, void* destination, std::size_t size) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (level_ == SleepLevel::kAwake || closed_) throw InvalidArgument("the weights are not asleep");
  std::size_t packed = 0;
  for (const ByteRange& range : kept_) {
    if (offset >= range.offset && offset <= range.offset + range.size && size <= range.offset + range.size - offset) {
      std::memcpy(destination, static_cast<const char*>(host_buffer_) + packed + (offset - range.offset), size);
      return;
    }
    packed += range.size;
  }
  throw InvalidArgument("[" + std::to_string(offset) + ", +" + std::to_string(size) +
                        ") of the sleeping weights was not kept");
}

void WeightSpace::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  if (level_ == SleepLevel::kAwake) {
    try {
      device_->synchronize();
    } catch (...) {
      // Unmapping goes ahead: the memory is given back whatever the device says.
    }
    unmap_all_locked();
    cover_unmapped_locked();
  }
  if (budget_) budget_->credit(level_ == SleepLevel::kAwake ? size_bytes() : 0, /*sleeping=*/false);
  free_host_buffer_locked();
  copies_.reset();
  memory_.reset();  // tensors still holding the range keep it reserved (and, on the host, reading zeros)
}

bool WeightSpace::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

// Creates, maps and fences each chunk, then queues what it should hold, so the
// next chunk's driver calls overlap this chunk's copy; waits for all copies.
// On failure everything mapped here is unmapped again.
void WeightSpace::map_all_locked(Contents contents) {
  Device& device = *device_;
  try {
    allocations_.reserve(chunks_.size());
    for (const Chunk& chunk : chunks_) {
      PhysicalAllocation allocation = device.create(chunk.size_bytes);
      device.map_accessible(base_ + chunk.offset, allocation);
      allocations_.push_back(std::move(allocation));
      if (contents == Contents::kUninitialised) continue;
      device.fence_new_mappings();  // a copy is device work: it must see the fresh mapping (HIP)
      if (contents == Contents::kZeroThenKept) copies_->fill_zero(base_ + chunk.offset, chunk.size_bytes);
      queue_kept_into_locked(chunk);
    }
    if (contents == Contents::kUninitialised) {
      device.fence_new_mappings();
    } else {
      copies_->wait();
    }
  } catch (...) {
    try {
      copies_->wait();  // nothing may still be copying into memory about to be unmapped
    } catch (...) {
    }
    unmap_all_locked();
    throw;
  }
}

// Queues the copies of the kept ranges' bytes that fall in `chunk` back from the host buffer.
void WeightSpace::queue_kept_into_locked(const Chunk& chunk) {
  const auto* host = static_cast<const char*>(host_buffer_);
  for (const ByteRange& range : kept_) {
    const std::size_t begin = std::max(range.offset, chunk.offset);
    const std::size_t end = std::min(range.offset + range.size, chunk.offset + chunk.size_bytes);
    if (begin < end) copies_->copy_from_host(base_ + begin, host + (begin - range.offset), end - begin);
    host += range.size;
  }
}

void WeightSpace::unmap_all_locked() noexcept {
  // Each allocation unmaps itself (wherever it is mapped) and is released.
  allocations_.clear();
}

void WeightSpace::cover_unmapped_locked() noexcept {
  try {
    // Host: reads of the unmapped range give zeros instead of a fault. GPUs: no-op.
    device_->map_free_zero_pages(base(), size_bytes());
  } catch (...) {
    // Left PROT_NONE: stray reads fault, as on a GPU.
  }
}

void WeightSpace::ensure_host_buffer_locked(std::size_t bytes) {
  if (host_buffer_ != nullptr && host_buffer_bytes_ >= bytes) return;  // kept from an earlier sleep
  free_host_buffer_locked();
  host_buffer_ = device_->backend().allocate_host_buffer(bytes);
  host_buffer_bytes_ = bytes;
}

void WeightSpace::free_host_buffer_locked() noexcept {
  if (host_buffer_ == nullptr) return;
  device_->backend().free_host_buffer(host_buffer_, host_buffer_bytes_);
  host_buffer_ = nullptr;
  host_buffer_bytes_ = 0;
}

}  // namespace kvcached
