// kvcached._core: WeightSpace (model weights that sleep and wake in place) and its budgets.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>

#include "bindings.hpp"
#include "kv_values.hpp"
#include "kvcached/blocks/memory_budget.hpp"
#include "kvcached/weights/weight_space.hpp"

namespace kvcached::bindings {

namespace nb = nanobind;
using namespace nb::literals;
using Released = nb::call_guard<nb::gil_scoped_release>;

namespace {

nb::dict stats_dict(const WeightSpaceStats& s) {
  nb::dict d;
  d["size_bytes"] = s.size_bytes;
  d["mapped_bytes"] = s.mapped_bytes;
  d["chunks"] = s.chunks;
  d["chunk_bytes"] = s.chunk_bytes;
  d["host_buffer_bytes"] = s.host_buffer_bytes;
  d["kept_bytes"] = s.kept_bytes;
  d["sleep_level"] = s.sleep_level;
  d["sleeps"] = s.sleeps;
  d["wakes"] = s.wakes;
  return d;
}

using HostBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

}  // namespace

void bind_weights(nb::module_& m) {
  nb::class_<WeightsBudget>(m, "WeightsBudget", "Where a model's weights are charged while they hold device memory.")
      .def(
          "try_charge",
          [](WeightsBudget& self, nb::handle bytes) {
            const std::size_t checked = size_arg("bytes", bytes, /*allow_zero=*/true);
            nb::gil_scoped_release release;
            return self.try_charge(checked);
          },
          "bytes"_a, "Takes `bytes` for weights being mapped; False (nothing taken) when there is no room.")
      .def(
          "credit",
          [](WeightsBudget& self, nb::handle bytes, bool sleeping) {
            const std::size_t checked = size_arg("bytes", bytes, /*allow_zero=*/true);
            nb::gil_scoped_release release;
            self.credit(checked, sleeping);
          },
          "bytes"_a, "sleeping"_a, "Gives back `bytes` of weights just unmapped; `sleeping`: asleep, not gone.");
  nb::class_<MemoryBudgetWeights, WeightsBudget>(m, "MemoryBudgetWeights",
                                                 "Weights charged on a plain MemoryBudget (e.g. a FixedBudget).")
      .def(nb::init<std::shared_ptr<MemoryBudget>>(), "budget"_a);

  nb::class_<WeightMemory>(m, "WeightMemory", "Keeps a weights reservation alive while tensors point into it.");

  nb::class_<WeightSpace>(m, "WeightSpace",
                          "A model's weights in one reservation: sleep gives the device memory back, wake maps it "
                          "again at the same addresses.")
      .def(
          "__init__",
          [](WeightSpace* self, std::shared_ptr<Device> device, nb::handle size_bytes,
             std::shared_ptr<WeightsBudget> budget, nb::handle chunk_bytes) {
            WeightSpaceOptions options;
            options.chunk_bytes = size_arg("chunk_bytes", chunk_bytes, /*allow_zero=*/true);
            const std::size_t size = size_arg("size_bytes", size_bytes, /*allow_zero=*/false);
            nb::gil_scoped_release release;
            new (self) WeightSpace(std::move(device), size, std::move(budget), options);
          },
          "device"_a, "size_bytes"_a, "budget"_a.none(), "chunk_bytes"_a = 0,
          "Reserves and maps `size_bytes` (rounded up to the granularity), charged on `budget` (None: none).")
      .def_prop_ro("base_address", &WeightSpace::base)
      .def_prop_ro("size_bytes", &WeightSpace::size_bytes)
      .def_prop_ro("device", &WeightSpace::device)
      .def_prop_ro(
          "sleep_level", [](const WeightSpace& s) { return static_cast<int>(s.sleep_level()); },
          "0 while awake, else the level it sleeps at (1: contents in host memory, 2: discarded).")
      .def_prop_ro("closed", &WeightSpace::closed)
      .def(
          "stats", [](const WeightSpace& s) { return stats_dict(s.stats()); }, "Sizes, state and counts.")
      .def(
          "sleep",
          [](WeightSpace& s, int level, const std::vector<std::pair<nb::handle, nb::handle>>& keep) {
            std::vector<ByteRange> ranges;
            for (const auto& [offset, size] : keep) {
              ranges.push_back({size_arg("offset", offset, true), size_arg("size", size, true)});
            }
            nb::gil_scoped_release release;
            s.sleep(static_cast<SleepLevel>(level), ranges);
          },
          "level"_a, "keep"_a = std::vector<std::pair<nb::handle, nb::handle>>{},
          "Release the device memory (1: contents copied to host memory first; 2: discarded but for the "
          "(offset, size) ranges in `keep`, restored on wake).")
      .def("try_wake", &WeightSpace::try_wake, Released(),
           "Map the memory back in place (contents restored, or zero after level 2); False when the budget "
           "refuses (still asleep).")
      .def("release_host_buffer", &WeightSpace::release_host_buffer, Released(),
           "Free the host buffer kept for level-1 contents (not while asleep at level 1).")
      .def(
          "copy_kept_contents",
          [](const WeightSpace& s, nb::handle offset_bytes, HostBytes destination) {
            const std::size_t offset = size_arg("offset_bytes", offset_bytes, /*allow_zero=*/true);
            nb::gil_scoped_release release;
            s.copy_kept_contents(offset, destination.data(), destination.shape(0));
          },
          "offset_bytes"_a, "destination"_a,
          "Copy contents kept while asleep, from `offset_bytes` of the range, into a CPU byte array.")
      .def(
          "memory_owner", [](const WeightSpace& s) { return s.memory(); },
          "An object that keeps the reservation alive (for exported tensors).")
      .def("close", &WeightSpace::close, Released(),
           "Unmap and release everything and credit the budget; the range stays reserved for live tensors. "
           "Idempotent.");
}

}  // namespace kvcached::bindings
