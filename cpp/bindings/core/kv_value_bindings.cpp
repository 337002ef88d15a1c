// Bindings of the KV layer's values: KVLayout, KVSpaceOptions,
// BlockManagerOptions, Mirror and PageOps — each checked once in C++,
// immutable, comparable and picklable, so they are passed whole (also across
// processes) instead of being re-listed as arguments.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <limits>
#include <string>

#include "bindings.hpp"
#include "error_translation.hpp"
#include "kv_values.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvcached::bindings {

std::size_t size_arg(const char* name, nb::handle value, bool allow_zero) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) {
    throw_invalid_type(std::string(name) + " must be an integer, got " + text_of(value.type().attr("__name__")));
  }
  nb::object index = nb::steal(PyNumber_Index(value.ptr()));
  if (!index.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long as_signed = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && as_signed < 0) || (overflow == 0 && as_signed == 0 && !allow_zero)) {
    throw InvalidArgument(std::string(name) + (allow_zero ? " must not be negative" : " must be positive") + ", got " +
                          text_of(value));
  }
  if (overflow > 0) {
    throw InvalidArgument(std::string(name) + "=" + text_of(value) + " is too large");
  }
  return static_cast<std::size_t>(as_signed);
}

std::optional<std::size_t> optional_size_arg(const char* name, nb::handle value) {
  if (value.is_none()) return std::nullopt;
  return size_arg(name, value, true);
}

KVLayoutConfig layout_config(nb::handle num_layers, nb::handle block_bytes, nb::handle num_blocks,
                             nb::handle page_bytes, nb::handle num_buffers, const std::string& kind) {
  KVLayoutConfig config;
  config.num_layers = size_arg("num_layers", num_layers, false);
  config.block_bytes = size_arg("block_bytes", block_bytes, false);
  if (!num_blocks.is_none()) config.num_blocks = size_arg("num_blocks", num_blocks, false);
  config.page_bytes = size_arg("page_bytes", page_bytes, false);
  config.num_buffers = size_arg("num_buffers", num_buffers, false);
  config.kind = parse_layout(kind);
  return config;
}

nb::dict layout_dict(const KVLayout& l) {
  nb::dict d;
  d["num_layers"] = l.num_layers();
  d["num_buffers"] = l.num_buffers();
  d["block_bytes"] = l.block_bytes();
  d["page_bytes"] = l.page_bytes();
  d["num_blocks"] = l.num_blocks();
  d["kind"] = layout_name(l.kind());
  return d;
}

namespace {

nb::tuple layout_state(const KVLayout& l) {
  return nb::make_tuple(l.num_layers(), l.block_bytes(), l.num_blocks(), l.page_bytes(), l.num_buffers(),
                        layout_name(l.kind()));
}

void bind_layout(nb::module_& m) {
  nb::class_<KVLayout>(m, "KVLayout",
                       "A KV cache's geometry: layers x buffers of num_blocks blocks on pages, per_layer or "
                       "contiguous. Checked once (sizes that overflow are refused); passed whole.")
      .def(
          "__init__",
          [](KVLayout* self, nb::handle num_layers, nb::handle block_bytes, nb::handle num_blocks,
             nb::handle page_bytes, nb::handle num_buffers, const std::string& kind) {
            new (self) KVLayout(layout_config(num_layers, block_bytes, num_blocks, page_bytes, num_buffers, kind));
          },
          "num_layers"_a, "block_bytes"_a, "num_blocks"_a, "page_bytes"_a, "num_buffers"_a = 2, "kind"_a = "per_layer",
          nb::sig("def __init__(self, num_layers: int, block_bytes: int, num_blocks: int, page_bytes: int, "
                  "num_buffers: int = 2, kind: str = 'per_layer') -> None"))
      .def_static(
          "for_capacity",
          [](nb::handle num_layers, nb::handle block_bytes, nb::handle capacity_bytes, nb::handle page_bytes,
             nb::handle num_buffers, const std::string& kind) {
            KVLayoutConfig config = layout_config(num_layers, block_bytes, nb::none(), page_bytes, num_buffers, kind);
            return KVLayout::for_capacity(config, size_arg("capacity_bytes", capacity_bytes, false));
          },
          "num_layers"_a, "block_bytes"_a, "capacity_bytes"_a, "page_bytes"_a, "num_buffers"_a = 2,
          "kind"_a = "per_layer",
          nb::sig("def for_capacity(num_layers: int, block_bytes: int, capacity_bytes: int, page_bytes: int, "
                  "num_buffers: int = 2, kind: str = 'per_layer') -> KVLayout"),
          "As many whole pages as fit in capacity_bytes (all layers and buffers).")
      .def_prop_ro("num_layers", &KVLayout::num_layers)
      .def_prop_ro("num_buffers", &KVLayout::num_buffers)
      .def_prop_ro("block_bytes", &KVLayout::block_bytes, "One block of one layer and one buffer.")
      .def_prop_ro("page_bytes", &KVLayout::page_bytes, "One page of one layer and one buffer.")
      .def_prop_ro("num_blocks", &KVLayout::num_blocks)
      .def_prop_ro("kind", [](const KVLayout& l) { return layout_name(l.kind()); })
      .def_prop_ro("num_pages", &KVLayout::num_pages)
      .def_prop_ro("blocks_per_page", &KVLayout::blocks_per_page)
      .def_prop_ro("num_regions", &KVLayout::num_regions)
      .def_prop_ro("page_id_bytes", &KVLayout::page_id_bytes, "Physical bytes behind one page id (all layers).")
      .def_prop_ro("block_id_bytes", &KVLayout::block_id_bytes, "Physical bytes behind one block id (all layers).")
      .def_prop_ro("reservation_bytes", &KVLayout::reservation_bytes)
      .def_prop_ro("block_stride_bytes", &KVLayout::block_stride_bytes)
      .def_prop_ro("layer_stride_bytes", &KVLayout::layer_stride_bytes)
      .def_prop_ro("buffer_stride_bytes", &KVLayout::buffer_stride_bytes)
      .def("blocks_on_page", &KVLayout::blocks_on_page, "page"_a,
           "Blocks on this page: blocks_per_page, fewer on a partial last page.")
      .def("offset_of", &KVLayout::offset_of, "layer"_a, "buffer"_a, "block"_a,
           "Byte offset of (layer, buffer, block) from the reservation's base.")
      .def("as_dict", &layout_dict)
      .def("__eq__", [](const KVLayout& a,
                        nb::handle b) { return nb::isinstance<KVLayout>(b) && a == nb::cast<const KVLayout&>(b); })
      .def("__hash__", [](const KVLayout& l) { return nb::hash(layout_state(l)); })
      .def("__repr__", [](const KVLayout& l) { return "KVLayout(" + l.describe() + ")"; })
      .def("__getstate__", &layout_state)
      .def("__setstate__",
           [](KVLayout& self,
              const std::tuple<std::size_t, std::size_t, std::size_t, std::size_t, std::size_t, std::string>& t) {
             KVLayoutConfig c;
             c.num_layers = std::get<0>(t);
             c.block_bytes = std::get<1>(t);
             c.num_blocks = std::get<2>(t);
             c.page_bytes = std::get<3>(t);
             c.num_buffers = std::get<4>(t);
             c.kind = parse_layout(std::get<5>(t));
             new (&self) KVLayout(c);
           });
}

nb::tuple options_state(const BlockManagerOptions& o) {
  return nb::make_tuple(o.null_block, o.limit_bytes, o.reserve.min_free_pages, o.reserve.max_free_pages,
                        o.reserve.min_spare_pages, o.reserve.max_spare_pages, o.background_worker,
                        placement_name(o.placement));
}

nb::tuple space_options_state(const KVSpaceOptions& o) {
  return nb::make_tuple(o.zero_backing, o.zero_chunk_bytes, o.max_spare_pages, o.zero_frontier_pages);
}

void bind_options(nb::module_& m) {
  nb::class_<KVSpaceOptions>(m, "KVSpaceOptions", "How a KV space maps: zero backing, spare allocations.")
      .def(
          "__init__",
          [](KVSpaceOptions* self, bool zero_backing, nb::handle zero_chunk_bytes, nb::handle max_spare_pages,
             nb::handle zero_frontier_pages) {
            KVSpaceOptions o;
            o.zero_backing = zero_backing;
            o.zero_chunk_bytes = size_arg("zero_chunk_bytes", zero_chunk_bytes, false);
            o.max_spare_pages = size_arg("max_spare_pages", max_spare_pages, true);
            o.zero_frontier_pages = size_arg("zero_frontier_pages", zero_frontier_pages, true);
            new (self) KVSpaceOptions(o);
          },
          "zero_backing"_a = true, "zero_chunk_bytes"_a = KVSpaceOptions{}.zero_chunk_bytes, "max_spare_pages"_a = 0,
          "zero_frontier_pages"_a = KVSpaceOptions{}.zero_frontier_pages,
          nb::sig("def __init__(self, zero_backing: bool = True, zero_chunk_bytes: int = 268435456, "
                  "max_spare_pages: int = 0, zero_frontier_pages: int = 64) -> None"))
      .def_prop_ro("zero_backing", [](const KVSpaceOptions& o) { return o.zero_backing; })
      .def_prop_ro("zero_chunk_bytes", [](const KVSpaceOptions& o) { return o.zero_chunk_bytes; })
      .def_prop_ro("max_spare_pages", [](const KVSpaceOptions& o) { return o.max_spare_pages; })
      .def_prop_ro("zero_frontier_pages", [](const KVSpaceOptions& o) { return o.zero_frontier_pages; })
      .def("__getstate__", &space_options_state)
      .def("__eq__",
           [](const KVSpaceOptions& a, nb::handle b) {
             return nb::isinstance<KVSpaceOptions>(b) &&
                    space_options_state(a).equal(space_options_state(nb::cast<const KVSpaceOptions&>(b)));
           })
      .def("__setstate__",
           [](KVSpaceOptions& self, const std::tuple<bool, std::size_t, std::size_t, std::size_t>& t) {
             KVSpaceOptions o;
             o.zero_backing = std::get<0>(t);
             o.zero_chunk_bytes = std::get<1>(t);
             o.max_spare_pages = std::get<2>(t);
             o.zero_frontier_pages = std::get<3>(t);
             new (&self) KVSpaceOptions(o);
           })
      .def("__repr__", [](const KVSpaceOptions& o) {
        return "KVSpaceOptions(zero_backing=" + std::string(o.zero_backing ? "True" : "False") +
               ", zero_chunk_bytes=" + std::to_string(o.zero_chunk_bytes) +
               ", max_spare_pages=" + std::to_string(o.max_spare_pages) +
               ", zero_frontier_pages=" + std::to_string(o.zero_frontier_pages) + ")";
      });

  nb::class_<BlockManagerOptions>(m, "BlockManagerOptions",
                                  "How a block manager behaves: null block, limit, reserve targets, worker, "
                                  "placement ('fewest_pages' or 'fullest_first').")
      .def(
          "__init__",
          [](BlockManagerOptions* self, bool null_block, nb::handle limit_bytes, nb::handle min_free_pages,
             nb::handle max_free_pages, nb::handle min_spare_pages, nb::handle max_spare_pages, bool background_worker,
             const std::string& placement) {
            BlockManagerOptions o;
            o.null_block = null_block;
            o.limit_bytes = optional_size_arg("limit_bytes", limit_bytes);
            o.reserve.min_free_pages = size_arg("min_free_pages", min_free_pages, true);
            o.reserve.max_free_pages = size_arg("max_free_pages", max_free_pages, true);
            o.reserve.min_spare_pages = size_arg("min_spare_pages", min_spare_pages, true);
            o.reserve.max_spare_pages = size_arg("max_spare_pages", max_spare_pages, true);
            o.background_worker = background_worker;
            o.placement = parse_placement(placement);
            o.validate();
            new (self) BlockManagerOptions(o);
          },
          "null_block"_a = false, "limit_bytes"_a = nb::none(), "min_free_pages"_a = 0, "max_free_pages"_a = 0,
          "min_spare_pages"_a = 0, "max_spare_pages"_a = 0, "background_worker"_a = false,
          "placement"_a = "fewest_pages",
          nb::sig("def __init__(self, null_block: bool = False, limit_bytes: int | None = None, "
                  "min_free_pages: int = 0, max_free_pages: int = 0, min_spare_pages: int = 0, "
                  "max_spare_pages: int = 0, background_worker: bool = False, "
                  "placement: str = 'fewest_pages') -> None"))
      .def_prop_ro("null_block", [](const BlockManagerOptions& o) { return o.null_block; })
      .def_prop_ro("limit_bytes", [](const BlockManagerOptions& o) { return o.limit_bytes; })
      .def_prop_ro("min_free_pages", [](const BlockManagerOptions& o) { return o.reserve.min_free_pages; })
      .def_prop_ro("max_free_pages", [](const BlockManagerOptions& o) { return o.reserve.max_free_pages; })
      .def_prop_ro("min_spare_pages", [](const BlockManagerOptions& o) { return o.reserve.min_spare_pages; })
      .def_prop_ro("max_spare_pages", [](const BlockManagerOptions& o) { return o.reserve.max_spare_pages; })
      .def_prop_ro("background_worker", [](const BlockManagerOptions& o) { return o.background_worker; })
      .def_prop_ro("placement", [](const BlockManagerOptions& o) { return placement_name(o.placement); })
      .def("__getstate__", &options_state)
      .def("__setstate__",
           [](BlockManagerOptions& self, const std::tuple<bool, std::optional<std::size_t>, std::size_t, std::size_t,
                                                          std::size_t, std::size_t, bool, std::string>& t) {
             BlockManagerOptions o;
             o.null_block = std::get<0>(t);
             o.limit_bytes = std::get<1>(t);
             o.reserve = {std::get<2>(t), std::get<3>(t), std::get<4>(t), std::get<5>(t)};
             o.background_worker = std::get<6>(t);
             o.placement = parse_placement(std::get<7>(t));
             new (&self) BlockManagerOptions(o);
           })
      .def("__eq__",
           [](const BlockManagerOptions& a, nb::handle b) {
             return nb::isinstance<BlockManagerOptions>(b) &&
                    options_state(a).equal(options_state(nb::cast<const BlockManagerOptions&>(b)));
           })
      .def("__repr__", [](const BlockManagerOptions& o) {
        return "BlockManagerOptions(null_block=" + std::string(o.null_block ? "True" : "False") +
               ", limit_bytes=" + (o.limit_bytes ? std::to_string(*o.limit_bytes) : "None") + ", reserve free " +
               std::to_string(o.reserve.min_free_pages) + ".." + std::to_string(o.reserve.max_free_pages) + ", spare " +
               std::to_string(o.reserve.min_spare_pages) + ".." + std::to_string(o.reserve.max_spare_pages) +
               ", background_worker=" + (o.background_worker ? "True" : "False") + ", placement='" +
               placement_name(o.placement) + "')";
      });
}

void bind_page_ops(nb::module_& m) {
  nb::class_<PageOps>(m, "PageOps",
                      "One ordered batch of page operations for a mirror KV space: unmaps first, then maps. "
                      "Picklable: it crosses processes as is.")
      .def(
          "__init__",
          [](PageOps* self, std::uint64_t seq, std::vector<std::int64_t> map_pages,
             std::vector<std::int64_t> unmap_pages) {
            new (self) PageOps{seq, std::move(map_pages), std::move(unmap_pages)};
          },
          "seq"_a = 0, "map_pages"_a = std::vector<std::int64_t>{}, "unmap_pages"_a = std::vector<std::int64_t>{})
      .def_ro("seq", &PageOps::seq)
      .def_ro("map_pages", &PageOps::map_pages)
      .def_ro("unmap_pages", &PageOps::unmap_pages)
      .def("__bool__", [](const PageOps& ops) { return !ops.empty(); })
      .def("__eq__",
           [](const PageOps& a, nb::handle b) {
             if (!nb::isinstance<PageOps>(b)) return false;
             const PageOps& o = nb::cast<const PageOps&>(b);
             return a.seq == o.seq && a.map_pages == o.map_pages && a.unmap_pages == o.unmap_pages;
           })
      .def("__getstate__", [](const PageOps& ops) { return nb::make_tuple(ops.seq, ops.map_pages, ops.unmap_pages); })
      .def("__setstate__",
           [](PageOps& ops, const std::tuple<std::uint64_t, std::vector<std::int64_t>, std::vector<std::int64_t>>& t) {
             new (&ops) PageOps{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
           })
      .def("__repr__", [](const PageOps& ops) {
        return "PageOps(seq=" + std::to_string(ops.seq) + ", map=" + std::to_string(ops.map_pages.size()) +
               " pages, unmap=" + std::to_string(ops.unmap_pages.size()) + " pages)";
      });
}

void bind_mirror(nb::module_& m) {
  nb::class_<MirrorSpec>(m, "Mirror",
                         "One KV space a device-less BlockManager drives (a tensor-parallel rank or a pipeline "
                         "stage): the budget its pages are charged to and, for a stage holding other layers, "
                         "its own layout (same blocks per page and block count; its own page cost).")
      .def(
          "__init__",
          [](MirrorSpec* self, std::shared_ptr<MemoryBudget> budget, std::optional<KVLayout> layout) {
            new (self) MirrorSpec{std::move(budget), std::move(layout)};
          },
          "budget"_a.none() = nb::none(), "layout"_a.none() = nb::none())
      .def_ro("budget", &MirrorSpec::budget)
      .def_ro("layout", &MirrorSpec::layout);
}

}  // namespace

void bind_kv_values(nb::module_& m) {
  bind_layout(m);
  bind_options(m);
  bind_page_ops(m);
  bind_mirror(m);
}

}  // namespace kvcached::bindings
