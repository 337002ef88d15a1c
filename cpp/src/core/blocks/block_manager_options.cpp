// BlockManagerOptions: names of the placement policies, checks of the reserve targets.
#include "kvcached/blocks/block_manager_options.hpp"

namespace kvcached {

Placement parse_placement(const std::string& name) {
  if (name == "fewest_pages") return Placement::kFewestPages;
  if (name == "fullest_first") return Placement::kFullestFirst;
  throw InvalidArgument("placement must be 'fewest_pages' or 'fullest_first', got '" + name + "'");
}

std::string placement_name(Placement placement) {
  return placement == Placement::kFewestPages ? "fewest_pages" : "fullest_first";
}

void ReserveTargets::validate() const {
  if (min_free_pages > max_free_pages || min_spare_pages > max_spare_pages) {
    throw InvalidArgument("reserve minimums must not exceed their maximums (free pages " +
                          std::to_string(min_free_pages) + ".." + std::to_string(max_free_pages) + ", spare pages " +
                          std::to_string(min_spare_pages) + ".." + std::to_string(max_spare_pages) + ")");
  }
}

}  // namespace kvcached
