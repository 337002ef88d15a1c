// LocalPageMapper: a block manager's decisions applied at once to a KVSpace in
// this process (the block manager's default mapper; see page_mapper.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kvcached/blocks/page_mapper.hpp"
#include "kvcached/space/kv_space.hpp"

namespace kvcached {

class LocalPageMapper final : public PageMapper {
 public:
  explicit LocalPageMapper(std::shared_ptr<KVSpace> space);
  void map_pages(const std::vector<std::int64_t>& pages) override { space_->map_pages(pages); }
  UnmapOutcome unmap_pages(const std::vector<std::int64_t>& pages) override;
  std::size_t spare_pages() const noexcept override { return space_->spare_pages(); }
  std::size_t add_spares(std::size_t count) override { return space_->add_spares(count); }
  std::size_t trim_spares(std::size_t keep) override { return space_->trim_spares(keep); }
  void set_max_spare_pages(std::size_t count) override { space_->set_max_spare_pages(count); }
  void prepare_pages(const std::vector<std::int64_t>& pages) override { space_->prepare_pages(pages); }
  std::size_t lookahead_pages() const noexcept override { return space_->zero_frontier_pages(); }
  std::optional<std::size_t> device_free_bytes(bool query) const override {
    const auto& device = space_->device();
    return query ? device->memory_info().free_bytes : device->estimated_free_bytes();
  }
  void bind_calling_thread() override { space_->device()->bind_calling_thread(); }
  const std::shared_ptr<KVSpace>& space() const noexcept { return space_; }

 private:
  std::shared_ptr<KVSpace> space_;
};

}  // namespace kvcached
