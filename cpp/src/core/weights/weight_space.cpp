// WeightSpace (weights/weight_space.hpp): sleep releases a model's weight memory, wake maps it back in place.
#include "kvcached/weights/weight_space.hpp"

#include <string>
#include <utility>

#include "kvcached/error.hpp"

namespace kvcached {
namespace {

std::size_t round_up(std::size_t value, std::size_t unit) { return (value + unit - 1) / unit * unit; }

std::string bytes_text(std::size_t bytes) {
  return std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 20) + " MiB)";
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
  s.host_buffer_bytes = host_buffer_ != nullptr ? size_bytes() : 0;
  s.sleep_level = static_cast<int>(level_);
  s.sleeps = sleeps_;
  s.wakes = wakes_;
  return s;
}

void WeightSpace::sleep(SleepLevel level) {
  if (level != SleepLevel::kKeepContents && level != SleepLevel::kDiscardContents) {
    throw InvalidArgument("sleep level " + std::to_string(static_cast<int>(level)) +
                          " is unknown: expected 1 (keep the contents in host memory) or 2 (discard them)");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("the weights were closed");
  if (level_ != SleepLevel::kAwake) return;
  Device& device = *device_;
  device.synchronize();  // kernels still reading the weights finish before they go
  if (level == SleepLevel::kKeepContents) {
    ensure_host_buffer_locked();
    auto* host = static_cast<char*>(host_buffer_);
    for (const Chunk& chunk : chunks_)
      copies_->copy_to_host(host + chunk.offset, base() + chunk.offset, chunk.size_bytes);
    copies_->wait();
  }
  unmap_all_locked();
  cover_unmapped_locked();
  if (budget_) budget_->credit(size_bytes(), /*sleeping=*/true);
  level_ = level;
  ++sleeps_;
}

bool WeightSpace::try_wake() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw InvalidArgument("the weights were closed");
  if (level_ == SleepLevel::kAwake) return true;
  if (budget_ && !budget_->try_charge(size_bytes())) return false;
  try {
    map_all_locked(level_ == SleepLevel::kKeepContents ? Contents::kRestored : Contents::kZero);
  } catch (...) {
    cover_unmapped_locked();
    if (budget_) budget_->credit(size_bytes(), /*sleeping=*/true);
    throw;
  }
  level_ = SleepLevel::kAwake;
  ++wakes_;
  return true;
}

void WeightSpace::release_host_buffer() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (level_ == SleepLevel::kKeepContents) {
    throw InvalidArgument("the host buffer holds the weights of a model asleep at level 1: wake it first");
  }
  free_host_buffer_locked();
}

const void* WeightSpace::host_contents() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return level_ == SleepLevel::kKeepContents ? host_buffer_ : nullptr;
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
  const auto* host = static_cast<const char*>(host_buffer_);
  try {
    allocations_.reserve(chunks_.size());
    for (const Chunk& chunk : chunks_) {
      PhysicalAllocation allocation = device.create(chunk.size_bytes);
      device.map_accessible(base() + chunk.offset, allocation);
      allocations_.push_back(std::move(allocation));
      if (contents == Contents::kUninitialised) continue;
      device.fence_new_mappings();  // a copy is device work: it must see the fresh mapping (HIP)
      if (contents == Contents::kRestored) {
        copies_->copy_from_host(base() + chunk.offset, host + chunk.offset, chunk.size_bytes);
      } else {
        copies_->fill_zero(base() + chunk.offset, chunk.size_bytes);
      }
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

void WeightSpace::ensure_host_buffer_locked() {
  if (host_buffer_ == nullptr) host_buffer_ = device_->backend().allocate_host_buffer(size_bytes());
}

void WeightSpace::free_host_buffer_locked() noexcept {
  if (host_buffer_ == nullptr) return;
  device_->backend().free_host_buffer(host_buffer_, size_bytes());
  host_buffer_ = nullptr;
}

}  // namespace kvcached
