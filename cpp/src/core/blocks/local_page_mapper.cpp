// LocalPageMapper: a block manager's decisions applied to a KVSpace in this process.
#include "local_page_mapper.hpp"

namespace kvcached {

LocalPageMapper::LocalPageMapper(std::shared_ptr<KVSpace> space) : space_(std::move(space)) {
  if (!space_) throw InvalidArgument("LocalPageMapper needs a KV space");
}

UnmapOutcome LocalPageMapper::unmap_pages(const std::vector<std::int64_t>& pages) {
  space_->unmap_pages(pages);  // all of them, or an exception with none
  UnmapOutcome outcome;
  outcome.unmapped = pages;
  return outcome;
}

}  // namespace kvcached
