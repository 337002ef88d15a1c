// Bindings of the KV layer: KVSpace (mapping side), BlockManager (deciding
// side) and PageOps (what travels between them across processes).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "bindings.hpp"
#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/blocks/fixed_budget.hpp"
#include "kvcached/space/kv_space.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvcached::bindings {

namespace {

using Released = nb::call_guard<nb::gil_scoped_release>;
using IdArray = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::device::cpu>;
using IdArrayOut = nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>;

std::vector<std::int64_t> ids_from_array(const IdArray& ids) {
  std::vector<std::int64_t> out(ids.shape(0));
  auto view = ids.view();
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = view(i);
  return out;
}

IdArrayOut ids_to_array(std::vector<std::int64_t>&& ids) {
  auto* heap = new std::vector<std::int64_t>(std::move(ids));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<std::int64_t>*>(p); });
  const std::size_t shape[1] = {heap->size()};
  return IdArrayOut(heap->data(), 1, shape, owner);
}

KVLayout make_layout(std::size_t num_layers, std::size_t num_buffers, std::size_t block_bytes,
                     std::size_t page_bytes, std::size_t num_pages, const std::string& layout) {
  KVLayoutConfig config;
  config.num_layers = num_layers;
  config.num_buffers = num_buffers;
  config.block_bytes = block_bytes;
  config.page_bytes = page_bytes;
  config.num_pages = num_pages;
  config.kind = parse_layout(layout);
  return KVLayout(config);
}

// Keeps a KV reservation alive for as long as an exported tensor lives.
struct MemoryOwner {
  std::shared_ptr<KVMemory> memory;
};

nb::dict stats_dict(const BlockManagerStats& s) {
  nb::dict d;
  d["num_blocks"] = s.num_blocks;
  d["blocks_per_page"] = s.blocks_per_page;
  d["page_id_bytes"] = s.page_bytes;
  d["block_id_bytes"] = s.block_bytes;
  d["used_blocks"] = s.used_blocks;
  d["free_mapped_blocks"] = s.free_mapped_blocks;
  d["mapped_pages"] = s.mapped_pages;
  d["used_pages"] = s.used_pages;
  d["free_pages"] = s.free_pages;
  d["spare_pages"] = s.spare_pages;
  d["pending_pages"] = s.pending_pages;
  d["limit_pages"] = s.limit_pages;
  d["limit_bytes"] = s.limit_bytes ? nb::cast(*s.limit_bytes) : nb::none();
  d["slow_allocs"] = s.slow_allocs;
  d["used_bytes"] = s.used_blocks * s.block_bytes;
  d["mapped_bytes"] = s.mapped_pages * s.page_bytes;
  d["held_bytes"] = (s.mapped_pages + s.spare_pages + s.pending_pages) * s.page_bytes;
  return d;
}

}  // namespace

void bind_kv(nb::module_& m) {
  m.def("pages_for_blocks", &KVLayout::pages_for_blocks, "num_blocks"_a, "block_bytes"_a, "page_bytes"_a,
        "Page ids needed to hold `num_blocks` blocks.");

  nb::class_<FixedBudget, MemoryBudget>(m, "FixedBudget",
                                        "A fixed number of bytes shared by the pools of this process.")
      .def(nb::init<std::size_t>(), "total_bytes"_a)
      .def_prop_ro("total_bytes", &FixedBudget::total_bytes)
      .def_prop_ro("used_bytes", &FixedBudget::used_bytes);

  nb::class_<MemoryOwner>(m, "KVMemoryOwner", "Keeps a KV reservation alive while tensors point into it.");

  nb::class_<PageOps>(m, "PageOps", "One ordered batch of page operations for mirrors: unmaps first, then maps.")
      .def(nb::init<>())
      .def_rw("seq", &PageOps::seq)
      .def_rw("map_pages", &PageOps::map_pages)
      .def_rw("unmap_pages", &PageOps::unmap_pages)
      .def("__bool__", [](const PageOps& ops) { return !ops.map_pages.empty() || !ops.unmap_pages.empty(); })
      .def("__getstate__", [](const PageOps& ops) { return nb::make_tuple(ops.seq, ops.map_pages, ops.unmap_pages); })
      .def("__setstate__",
           [](PageOps& ops, const std::tuple<std::uint64_t, std::vector<std::int64_t>, std::vector<std::int64_t>>& t) {
             new (&ops) PageOps{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
           })
      .def("__repr__", [](const PageOps& ops) {
        return "PageOps(seq=" + std::to_string(ops.seq) + ", map=" + std::to_string(ops.map_pages.size()) +
               " pages, unmap=" + std::to_string(ops.unmap_pages.size()) + " pages)";
      });

  nb::class_<KVSpace>(m, "KVSpace", "The mapping side of a KV cache: a reservation and its mapped page ids.")
      .def("__init__",
           [](KVSpace* self, std::shared_ptr<Device> device, std::size_t num_layers, std::size_t num_buffers,
              std::size_t block_bytes, std::size_t page_bytes, std::size_t num_pages, const std::string& layout,
              bool zero_backing, std::size_t zero_chunk_bytes, std::size_t max_spare_pages) {
             KVSpaceOptions options;
             options.zero_backing = zero_backing;
             options.zero_chunk_bytes = zero_chunk_bytes;
             options.max_spare_pages = max_spare_pages;
             nb::gil_scoped_release release;
             new (self) KVSpace(std::move(device),
                                make_layout(num_layers, num_buffers, block_bytes, page_bytes, num_pages, layout),
                                options);
           },
           "device"_a, "num_layers"_a, "num_buffers"_a, "block_bytes"_a, "page_bytes"_a, "num_pages"_a,
           "layout"_a, "zero_backing"_a = true, "zero_chunk_bytes"_a = 256u << 20, "max_spare_pages"_a = 0)
      .def_prop_ro("base_address", &KVSpace::base)
      .def_prop_ro("size_bytes", &KVSpace::size_bytes)
      .def_prop_ro("num_pages", [](const KVSpace& s) { return s.layout().num_pages(); })
      .def_prop_ro("num_blocks", [](const KVSpace& s) { return s.layout().num_blocks(); })
      .def_prop_ro("blocks_per_page", [](const KVSpace& s) { return s.layout().blocks_per_page(); })
      .def_prop_ro("block_stride_bytes", [](const KVSpace& s) { return s.layout().block_stride_bytes(); })
      .def_prop_ro("layer_stride_bytes", [](const KVSpace& s) { return s.layout().layer_stride_bytes(); })
      .def_prop_ro("buffer_stride_bytes", [](const KVSpace& s) { return s.layout().buffer_stride_bytes(); })
      .def_prop_ro("page_id_bytes", [](const KVSpace& s) { return s.layout().page_id_bytes(); })
      .def_prop_ro("device", &KVSpace::device)
      .def("offset_of", [](const KVSpace& s, std::size_t l, std::size_t b, std::size_t k) { return s.layout().offset_of(l, b, k); },
           "layer"_a, "buffer"_a, "block"_a, "Byte offset of (layer, buffer, block) from the base.")
      .def("map_pages", &KVSpace::map_pages, "pages"_a, Released(), "Map page ids (all or nothing).")
      .def("unmap_pages", &KVSpace::unmap_pages, "pages"_a, Released(),
           "Synchronise the device, then unmap page ids.")
      .def("is_mapped", &KVSpace::is_mapped, "page"_a)
      .def("prepare_pages", &KVSpace::prepare_pages, "pages"_a, Released(),
           "Split zero chunks around these unmapped pages ahead of use (GPU; no-op on host).")
      .def_prop_ro("mapped_pages", &KVSpace::mapped_pages)
      .def_prop_ro("spare_pages", &KVSpace::spare_pages)
      .def("add_spares", &KVSpace::add_spares, "count"_a, Released(),
           "Pre-create allocations for `count` page ids (best effort); returns how many were made.")
      .def("trim_spares", &KVSpace::trim_spares, "keep"_a, Released(), "Release spares beyond `keep`.")
      .def("set_max_spare_pages", &KVSpace::set_max_spare_pages, "count"_a,
           "Unmapped allocations kept for reuse instead of released.")
      .def("apply",
           [](KVSpace& s, const PageOps& ops) {
             nb::gil_scoped_release release;
             if (!ops.unmap_pages.empty()) s.unmap_pages(ops.unmap_pages);
             if (!ops.map_pages.empty()) s.map_pages(ops.map_pages);
             return ops.seq;
           },
           "ops"_a, "Apply a batch from a BlockManager (unmaps, then maps); returns its seq to acknowledge.")
      .def("memory_owner", [](const KVSpace& s) { return MemoryOwner{s.memory()}; },
           "An object that keeps the reservation alive (for exported tensors).")
      .def("close", &KVSpace::close, Released(),
           "Unmap everything; tensors still alive then read zeros. Idempotent.")
      .def_prop_ro("closed", &KVSpace::closed);

  nb::class_<BlockManager>(m, "BlockManager", "The deciding side of a KV cache: block ids, limits, reserve.")
      .def("__init__",
           [](BlockManager* self, std::size_t num_layers, std::size_t num_buffers, std::size_t block_bytes,
              std::size_t page_bytes, std::size_t num_pages, const std::string& layout,
              std::shared_ptr<KVSpace> space, std::size_t num_mirrors, bool null_block,
              std::optional<std::size_t> limit_bytes, std::size_t min_free_pages, std::size_t max_free_pages,
              std::size_t min_spare_pages, std::size_t max_spare_pages, bool background_worker,
              std::shared_ptr<MemoryBudget> budget) {
             BlockManagerOptions options;
             options.null_block = null_block;
             options.limit_bytes = limit_bytes;
             options.reserve = {min_free_pages, max_free_pages, min_spare_pages, max_spare_pages};
             options.background_worker = background_worker;
             std::shared_ptr<PageMapper> mapper;
             if (space) {
               mapper = std::make_shared<LocalPageMapper>(space);
             } else {
               mapper = std::make_shared<PageOpLog>(num_mirrors);
             }
             const KVLayout kv_layout =
                 space ? space->layout()
                       : make_layout(num_layers, num_buffers, block_bytes, page_bytes, num_pages, layout);
             nb::gil_scoped_release release;
             new (self) BlockManager(kv_layout, options, std::move(mapper), std::move(budget));
           },
           "num_layers"_a, "num_buffers"_a, "block_bytes"_a, "page_bytes"_a, "num_pages"_a, "layout"_a,
           "space"_a.none() = nb::none(), "num_mirrors"_a = 1, "null_block"_a = false,
           "limit_bytes"_a.none() = nb::none(), "min_free_pages"_a = 0, "max_free_pages"_a = 0,
           "min_spare_pages"_a = 0, "max_spare_pages"_a = 0, "background_worker"_a = true,
           "budget"_a.none() = nb::none())
      .def("alloc", [](BlockManager& b, std::size_t n) {
             std::vector<std::int64_t> ids;
             if (!b.try_alloc_mapped(n, ids)) {  // may have to wait: let other threads run
               nb::gil_scoped_release release;
               ids = b.alloc(n);
             }
             return ids_to_array(std::move(ids));
           },
           "n"_a, "Allocate n block ids (numpy int64). Raises OutOfMemoryError, rolling back.")
      .def("alloc_ids", [](BlockManager& b, const IdArray& ids) {
             auto v = ids_from_array(ids);
             nb::gil_scoped_release release;
             b.alloc_ids(v);
           }, "ids"_a)
      .def("alloc_ids", [](BlockManager& b, const std::vector<std::int64_t>& ids) {
             nb::gil_scoped_release release;
             b.alloc_ids(ids);
           }, "ids"_a, "Take exactly these free block ids (all or nothing).")
      .def("free", [](BlockManager& b, const IdArray& ids) {
             if (ids.stride(0) == 1) {
               b.free(ids.data(), ids.shape(0));  // no copy for the common contiguous case
             } else {
               b.free(ids_from_array(ids));
             }
           }, "ids"_a)
      .def("free", [](BlockManager& b, const std::vector<std::int64_t>& ids) { b.free(ids); }, "ids"_a,
           "Free block ids (all distinct and in use, or nothing is freed).")
      .def("available", &BlockManager::available, "Blocks that alloc could return right now.")
      .def("free_mapped_blocks", &BlockManager::free_mapped_blocks, "Free blocks on already-mapped pages.")
      .def("resize", &BlockManager::resize, "limit_bytes"_a.none(), Released(),
           "Set the limit in bytes (None: no limit). Below current use, memory returns as blocks are freed.")
      .def("trim", &BlockManager::trim, Released(), "Unmap every free page and release spares now.")
      .def("maintain", &BlockManager::maintain, Released(), "One round of reserve keeping.")
      .def("set_reserve",
           [](BlockManager& b, std::size_t min_free, std::size_t max_free, std::size_t min_spare, std::size_t max_spare) {
             b.set_reserve({min_free, max_free, min_spare, max_spare});
           },
           "min_free_pages"_a, "max_free_pages"_a, "min_spare_pages"_a, "max_spare_pages"_a)
      .def("take_page_ops", &BlockManager::take_page_ops, "Page operations for mirrors since the last call.")
      .def("acknowledge", &BlockManager::acknowledge, "mirror"_a, "seq"_a,
           "Mirror `mirror` applied every batch up to `seq`.")
      .def("stats", [](const BlockManager& b) { return stats_dict(b.stats()); })
      .def("page_of", &BlockManager::page_of, "block"_a)
      .def_prop_ro("blocks_per_page", [](const BlockManager& b) { return b.layout().blocks_per_page(); })
      .def_prop_ro("num_blocks", [](const BlockManager& b) { return b.layout().num_blocks(); })
      .def_prop_ro("page_id_bytes", [](const BlockManager& b) { return b.layout().page_id_bytes(); },
                   "Physical bytes behind one page id (all layers and buffers).")
      .def_prop_ro("block_id_bytes", [](const BlockManager& b) { return b.layout().block_id_bytes(); },
                   "Physical bytes behind one block id (all layers and buffers).")
      .def("close", &BlockManager::close, Released(), "Unmap everything and stop the worker. Idempotent.");
}

}  // namespace kvcached::bindings
