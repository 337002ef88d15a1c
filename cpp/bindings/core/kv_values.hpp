// Shared by the KV bindings: checked conversion of Python integers.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/space/kv_layout.hpp"
#include "kvcached/space/kv_space.hpp"

namespace kvcached::bindings {

// A Python int (or anything with __index__, not bool) as a size: TypeError for
// other types, ValueError (InvalidArgument) when negative, zero (unless
// allowed) or beyond 64 bits — the real reason, never a wrapped-around value.
// str(value), for messages.
inline std::string text_of(nanobind::handle value) {
  return nanobind::steal<nanobind::str>(PyObject_Str(value.ptr())).c_str();
}
std::size_t size_arg(const char* name, nanobind::handle value, bool allow_zero);
// A count of blocks (0 allowed), checked as size_arg does; a plain
// non-negative int, the common case, costs one conversion and no temporary.
inline std::size_t count_arg(const char* name, nanobind::handle value) {
  if (PyLong_CheckExact(value.ptr())) {
    int overflow = 0;
    const long long count = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow == 0 && count >= 0) return static_cast<std::size_t>(count);
  }
  return size_arg(name, value, true);  // bools, numpy integers, and every refusal's message
}
std::optional<std::size_t> optional_size_arg(const char* name, nanobind::handle value);
nanobind::dict layout_dict(const KVLayout& layout);

void bind_kv_values(nanobind::module_& m);

}  // namespace kvcached::bindings
