// Python binding of the size grammar (kvcached/sizes.hpp), so Python and C++ share one parser.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "core/bindings.hpp"
#include "kvcached/sizes.hpp"

namespace kvcached::bindings {

namespace nb = nanobind;
using namespace nb::literals;

void bind_sizes(nb::module_& m) {
  m.attr("MAX_SIZE_BYTES") = kMaxSizeBytes;
  m.def("parse_size_bytes", &parse_size_bytes, "text"_a, "what"_a = "",
        "Parses a size ('4096', '512MiB', '8G', '2GB') into bytes; ValueError naming `what` "
        "(an option or variable) when the text is not a valid size. Grammar: kvcached.sizes.");
}

}  // namespace kvcached::bindings
