// The value of a kvcached.config option, for bindings that hand settings to the core: the
// core reads no environment variable, so each setting has one source (kvcached.config.OPTIONS).
#pragma once

#include <nanobind/nanobind.h>

namespace kvcached::bindings {

// kvcached.config.get(name): the variable's value or the option's default. A value the option
// refuses raises its ConfigurationError (naming the variable), which propagates to Python.
// Call with the GIL held and no kvcached lock taken.
inline nanobind::object configured_option(const char* name) {
  return nanobind::module_::import_("kvcached.config").attr("get")(name);
}

}  // namespace kvcached::bindings
