// Python binding of InstancePolicy as kvcached.registry.MemoryPolicy: an instance's min, max
// and priority as one value, checked once, immutable, comparable and picklable, so serve, the
// engine settings and registration pass it whole.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "core/bindings.hpp"
#include "core/kv_values.hpp"
#include "error_translation.hpp"
#include "kvcached/registry/device_registry.hpp"

namespace kvcached::bindings {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using PolicyState = std::tuple<std::size_t, std::optional<std::size_t>, std::int64_t>;

PolicyState policy_state(const InstancePolicy& policy) { return {policy.min_bytes, policy.max_bytes, policy.priority}; }

InstancePolicy checked_policy(std::size_t min_bytes, std::optional<std::size_t> max_bytes, std::int64_t priority) {
  InstancePolicy policy;
  policy.min_bytes = min_bytes;
  policy.max_bytes = max_bytes;
  policy.priority = priority;
  check_instance_policy(policy);
  return policy;
}

// A whole number, not a bool: the priority's type error names it instead of nanobind's overload list.
std::int64_t priority_arg(nb::handle value) {
  std::int64_t priority = 0;
  if (PyBool_Check(value.ptr()) || !PyLong_Check(value.ptr())) {
    throw_invalid_type("priority must be an integer, got " + text_of(value.type().attr("__name__")));
  }
  if (!nb::try_cast(value, priority)) throw InvalidArgument("priority " + text_of(value) + " is out of range");
  return priority;
}

std::string describe(const InstancePolicy& policy) {
  return "MemoryPolicy(min_bytes=" + std::to_string(policy.min_bytes) +
         ", max_bytes=" + (policy.max_bytes ? std::to_string(*policy.max_bytes) : "None") +
         ", priority=" + std::to_string(policy.priority) + ")";
}

}  // namespace

void bind_memory_policy(nb::module_& m) {
  nb::class_<InstancePolicy>(m, "MemoryPolicy",
                             "An instance's memory policy (docs/memory-policy.md): min_bytes guaranteed to it, "
                             "max_bytes at most (its limit; None: only the device budget caps it), and "
                             "priority (higher keeps its memory longer when another instance is refused).\n\n"
                             "Checked once: ValueError for a min above the max, a negative size or a priority "
                             "outside a 32-bit integer. Immutable, comparable, picklable.")
      .def(
          "__init__",
          [](InstancePolicy* self, nb::handle min_bytes, nb::handle max_bytes, nb::handle priority) {
            new (self)
                InstancePolicy(checked_policy(size_arg("min_bytes", min_bytes, true),
                                              optional_size_arg("max_bytes", max_bytes), priority_arg(priority)));
          },
          "min_bytes"_a = 0, "max_bytes"_a.none() = nb::none(), "priority"_a = 0,
          nb::sig("def __init__(self, min_bytes: int = 0, max_bytes: int | None = None, priority: int = 0) -> None"))
      .def_prop_ro(
          "min_bytes", [](const InstancePolicy& p) { return p.min_bytes; }, "Bytes guaranteed.")
      .def_prop_ro(
          "max_bytes", [](const InstancePolicy& p) { return p.max_bytes; }, "The limit, or None.")
      .def_prop_ro(
          "priority", [](const InstancePolicy& p) { return p.priority; }, "Higher wins; lower gives back first.")
      .def("__eq__",
           [](const InstancePolicy& a, nb::handle b) {
             return nb::isinstance<InstancePolicy>(b) &&
                    policy_state(a) == policy_state(nb::cast<const InstancePolicy&>(b));
           })
      .def("__hash__", [](const InstancePolicy& p) { return nb::hash(nb::cast(policy_state(p))); })
      .def("__repr__", &describe)
      .def("__getstate__", &policy_state)
      .def("__setstate__", [](InstancePolicy& self, const PolicyState& state) {
        new (&self) InstancePolicy(checked_policy(std::get<0>(state), std::get<1>(state), std::get<2>(state)));
      });
}

}  // namespace kvcached::bindings
