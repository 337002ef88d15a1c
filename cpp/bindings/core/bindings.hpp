// Entry points of the kvcached._core module's parts, one per concern.
#pragma once

#include <nanobind/nanobind.h>

namespace kvcached::bindings {

void bind_device(nanobind::module_& m);
void bind_kv(nanobind::module_& m);

}  // namespace kvcached::bindings
