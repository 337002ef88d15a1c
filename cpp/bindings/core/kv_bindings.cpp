// Bindings of the KV layer's objects: KVSpace (mapping side) and BlockManager
// (deciding side). Both take the values of kv_value_bindings.cpp whole.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>

#include "bindings.hpp"
#include "error_translation.hpp"
#include "kv_values.hpp"
#include "kvcached/blocks/block_manager.hpp"
#include "kvcached/blocks/fixed_budget.hpp"
#include "kvcached/space/kv_space.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvcached::bindings {

namespace {

using Released = nb::call_guard<nb::gil_scoped_release>;
using Int64Ids = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::device::cpu>;
using AnyArray = nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu>;
using IdArrayOut = nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>;

[[noreturn]] void not_integer_ids(const std::string& what) {
  throw_invalid_type("ids must be integer block ids, got " + what);
}

template <typename T>
void append_ids(const AnyArray& array, std::vector<std::int64_t>& out) {
  const auto* data = static_cast<const T*>(array.data());
  for (std::size_t i = 0; i < array.shape(0); ++i) {
    const T value = data[static_cast<std::ptrdiff_t>(i) * array.stride(0)];
    if constexpr (std::is_unsigned_v<T>) {
      if (value > static_cast<T>(std::numeric_limits<std::int64_t>::max())) {
        throw InvalidArgument("block id " + std::to_string(value) + " is out of range");
      }
    }
    out.push_back(static_cast<std::int64_t>(value));
  }
}

// Block ids from anything but an int64 array: an array of another integer
// dtype, or a sequence of Python / numpy integers. Floats and bools are a
// TypeError (2.9 must not quietly free block 2, True block 1).
std::int64_t id_from(nb::handle item) {
  if (PyLong_CheckExact(item.ptr())) {  // the common case, without a temporary
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
    if (overflow != 0) throw InvalidArgument("block id " + text_of(item) + " is out of range");
    return value;
  }
  if (PyBool_Check(item.ptr()) || !PyIndex_Check(item.ptr())) {
    not_integer_ids(text_of(nb::repr(item)) + " (" + text_of(item.type().attr("__name__")) + ")");
  }
  nb::object index = nb::steal(PyNumber_Index(item.ptr()));
  if (!index.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) throw InvalidArgument("block id " + text_of(item) + " is out of range");
  return value;
}

std::vector<std::int64_t> ids_from_list(nb::handle list) {
  const Py_ssize_t size = PyList_GET_SIZE(list.ptr());
  std::vector<std::int64_t> out(static_cast<std::size_t>(size));
  for (Py_ssize_t i = 0; i < size; ++i) out[static_cast<std::size_t>(i)] = id_from(PyList_GET_ITEM(list.ptr(), i));
  return out;
}

std::vector<std::int64_t> ids_from(nb::handle ids) {
  if (PyList_CheckExact(ids.ptr())) return ids_from_list(ids);
  std::vector<std::int64_t> out;
  AnyArray array;
  if (nb::try_cast(ids, array, false)) {
    const nb::dlpack::dtype dtype = array.dtype();
    const bool is_int = dtype.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int);
    const bool is_uint = dtype.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt);
    if (!is_int && !is_uint) not_integer_ids("an array of " + text_of(ids.attr("dtype")));
    out.reserve(array.shape(0));
    switch (dtype.bits * (is_int ? 1 : -1)) {
      case 8:
        append_ids<std::int8_t>(array, out);
        break;
      case 16:
        append_ids<std::int16_t>(array, out);
        break;
      case 32:
        append_ids<std::int32_t>(array, out);
        break;
      case 64:
        append_ids<std::int64_t>(array, out);
        break;
      case -8:
        append_ids<std::uint8_t>(array, out);
        break;
      case -16:
        append_ids<std::uint16_t>(array, out);
        break;
      case -32:
        append_ids<std::uint32_t>(array, out);
        break;
      case -64:
        append_ids<std::uint64_t>(array, out);
        break;
      default:
        not_integer_ids("an array of " + std::to_string(dtype.bits) + "-bit integers");
    }
    return out;
  }
  if (PyIndex_Check(ids.ptr()) && !PyBool_Check(ids.ptr())) {  // one id (an int, a numpy integer)
    throw_invalid_type("ids must be a sequence or 1-D array of block ids, got the single id " + text_of(ids) + " (" +
                       text_of(ids.type().attr("__name__")) + "): pass [" + text_of(ids) + "]");
  }
  if (!PySequence_Check(ids.ptr()) || PyUnicode_Check(ids.ptr()) || PyBytes_Check(ids.ptr())) {
    not_integer_ids("an object of type " + text_of(ids.type().attr("__name__")));
  }
  nb::sequence seq = nb::borrow<nb::sequence>(ids);
  for (nb::handle item : seq) out.push_back(id_from(item));
  return out;
}

IdArrayOut ids_to_array(std::vector<std::int64_t>&& ids) {
  auto* heap = new std::vector<std::int64_t>(std::move(ids));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<std::int64_t>*>(p); });
  const std::size_t shape[1] = {heap->size()};
  return IdArrayOut(heap->data(), 1, shape, owner);
}

// Keeps a KV reservation alive for as long as an exported tensor lives.
struct MemoryOwner {
  std::shared_ptr<KVMemory> memory;
};

nb::dict stats_dict(const BlockManagerStats& s) {
  nb::dict d;
  d["num_blocks"] = s.num_blocks;
  d["num_pages"] = s.num_pages;
  d["blocks_per_page"] = s.blocks_per_page;
  d["page_id_bytes"] = s.page_id_bytes;
  d["block_id_bytes"] = s.block_id_bytes;
  d["used_blocks"] = s.used_blocks;
  d["reserved_blocks"] = s.reserved_blocks;
  d["free_mapped_blocks"] = s.free_mapped_blocks;
  d["used_pages"] = s.used_pages;
  d["free_pages"] = s.free_pages;
  d["mapping_pages"] = s.mapping_pages;
  d["unmapping_pages"] = s.unmapping_pages;
  d["pending_pages"] = s.pending_pages;
  d["unmapped_pages"] = s.unmapped_pages;
  d["mapped_pages"] = s.mapped_pages;
  d["spare_pages"] = s.spare_pages;
  d["held_pages"] = s.held_pages;
  d["limit_pages"] = s.limit_pages;
  d["limit_bytes"] = s.limit_bytes ? nb::cast(*s.limit_bytes) : nb::none();
  d["asleep"] = s.asleep;
  d["slow_allocs"] = s.slow_allocs;
  d["worker_errors"] = s.worker_errors;
  d["last_worker_error"] = s.last_worker_error;
  d["last_seq"] = s.last_seq;
  d["used_bytes"] = s.used_blocks * s.block_id_bytes;
  d["mapped_bytes"] = s.mapped_pages * s.page_id_bytes;
  d["held_bytes"] = s.held_pages * s.page_id_bytes;
  nb::list mirrors;
  for (const MirrorStats& m : s.mirrors) {
    nb::dict mirror;
    mirror["alive"] = m.progress.alive;
    mirror["acked_seq"] = m.progress.acked_seq;
    mirror["unacked_batches"] = m.progress.unacked_batches;
    mirror["oldest_unacked_age_s"] = m.progress.oldest_unacked_age_s;
    mirror["page_id_bytes"] = m.page_bytes;
    mirror["held_bytes"] = m.charged_pages * m.page_bytes;
    mirrors.append(mirror);
  }
  d["mirrors"] = mirrors;
  return d;
}

void bind_space(nb::module_& m) {
  nb::class_<MemoryOwner>(m, "KVMemoryOwner", "Keeps a KV reservation alive while tensors point into it.");

  nb::class_<UnmapResult>(m, "UnmapResult", "What an unmap did.")
      .def_ro("unmapped_pages", &UnmapResult::unmapped_pages)
      .def_ro("kept_spare_pages", &UnmapResult::kept_spare_pages, "allocations kept for reuse")
      .def_prop_ro("released_pages", &UnmapResult::released_pages, "allocations given back to the device")
      .def("__repr__", [](const UnmapResult& r) {
        return "UnmapResult(unmapped_pages=" + std::to_string(r.unmapped_pages) +
               ", kept_spare_pages=" + std::to_string(r.kept_spare_pages) + ")";
      });

  nb::class_<KVSpace>(m, "KVSpace", "The mapping side of a KV cache: a reservation and its mapped page ids.")
      .def(
          "__init__",
          [](KVSpace* self, const KVLayout& layout, std::shared_ptr<Device> device, const KVSpaceOptions& options) {
            nb::gil_scoped_release release;
            new (self) KVSpace(std::move(device), layout, options);
          },
          "layout"_a, "device"_a, "options"_a)
      .def_prop_ro("kv_layout", &KVSpace::layout, "The KVLayout this space was built for.")
      .def_prop_ro("base_address", &KVSpace::base)
      .def_prop_ro("size_bytes", &KVSpace::size_bytes)
      .def_prop_ro("device", &KVSpace::device)
      .def("map_pages", &KVSpace::map_pages, "pages"_a, Released(), "Map page ids (all or nothing).")
      .def("unmap_pages", &KVSpace::unmap_pages, "pages"_a, Released(),
           "Synchronise the device, then unmap page ids; returns what it did.")
      .def("apply", &KVSpace::apply, "ops"_a, Released(),
           "Apply a PageOps batch (in seq order: unmaps, then maps); returns the seq to acknowledge.")
      .def_prop_ro("applied_seq", &KVSpace::applied_seq, "The seq of the last batch applied (0: none).")
      .def("is_mapped", &KVSpace::is_mapped, "page"_a)
      .def("prepare_pages", &KVSpace::prepare_pages, "pages"_a, Released(),
           "Split zero chunks around these unmapped pages ahead of use (GPU; no-op on host).")
      .def_prop_ro("zero_frontier_pages", &KVSpace::zero_frontier_pages,
                   "Page ids a pool keeps split ahead of use, at least (0 where nothing is split: host, no zeros).")
      .def_prop_ro("zero_splits_on_map", &KVSpace::zero_splits_on_map,
                   "Zero chunks split while mapping (the grow path); 0 when the look-ahead kept up.")
      .def_prop_ro("mapped_pages", &KVSpace::mapped_pages)
      .def_prop_ro("spare_pages", &KVSpace::spare_pages)
      .def("add_spares", &KVSpace::add_spares, "count"_a, Released(),
           "Pre-create allocations for `count` page ids (best effort); returns how many were made.")
      .def("trim_spares", &KVSpace::trim_spares, "keep"_a, Released(),
           "Release spares beyond `keep`; returns how many were released.")
      .def("set_max_spare_pages", &KVSpace::set_max_spare_pages, "count"_a,
           "Unmapped allocations kept for reuse instead of released.")
      .def(
          "memory_owner", [](const KVSpace& s) { return MemoryOwner{s.memory()}; },
          "An object that keeps the reservation alive (for exported tensors).")
      .def("close", &KVSpace::close, Released(), "Unmap everything; tensors still alive then read zeros. Idempotent.")
      .def_prop_ro("closed", &KVSpace::closed);
}

void bind_block_manager(nb::module_& m) {
  nb::class_<BlockManager>(m, "BlockManager", "The deciding side of a KV cache: block ids, limits, reserve.")
      .def(
          "__init__",
          [](BlockManager* self, const KVLayout& layout, const BlockManagerOptions& options,
             std::shared_ptr<KVSpace> space, std::optional<std::vector<MirrorSpec>> mirrors,
             std::shared_ptr<MemoryBudget> budget) {
            if (space && mirrors) throw InvalidArgument("give a KV space (in-process) or mirrors, not both");
            nb::gil_scoped_release release;
            if (space) {
              new (self) BlockManager(layout, options, std::move(space), std::move(budget));
            } else {
              if (budget) throw InvalidArgument("a device-less manager takes its budgets from its mirrors");
              new (self) BlockManager(layout, options, mirrors ? std::move(*mirrors) : std::vector<MirrorSpec>{{}});
            }
          },
          "layout"_a, "options"_a, "space"_a.none() = nb::none(), "mirrors"_a.none() = nb::none(),
          "budget"_a.none() = nb::none())
      .def(
          "alloc",
          [](BlockManager& b, nb::handle count, double timeout_s) {
            const std::size_t n = count_arg("n", count);
            if (!(timeout_s >= 0.0)) throw InvalidArgument("timeout_s must be a number of seconds >= 0");
            std::vector<std::int64_t> ids;
            if (!b.try_alloc_mapped(n, ids)) {  // may have to wait: let other threads run
              const auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::chrono::duration<double>(std::min(timeout_s, 1e9)));
              nb::gil_scoped_release release;
              ids = b.alloc(n, wait);
            }
            return ids_to_array(std::move(ids));
          },
          "n"_a.none(), "timeout_s"_a = 0.0,
          nb::sig("def alloc(self, n: int, timeout_s: float = 0.0) -> numpy.typing.NDArray[numpy.int64]"),
          "Allocate n block ids (numpy int64). Raises OutOfMemoryError, rolling back. With timeout_s, waits "
          "up to that long for memory other pools give back (only when a budget stands in the way).")
      .def(
          "alloc_list",
          [](BlockManager& b, nb::handle count) {
            const std::size_t n = count_arg("n", count);
            std::vector<std::int64_t> ids;
            if (!b.try_alloc_mapped(n, ids)) {
              nb::gil_scoped_release release;
              ids = b.alloc(n);
            }
            return ids;
          },
          "n"_a.none(), nb::sig("def alloc_list(self, n: int) -> list[int]"), "alloc(n) as a list of ints.")
      .def(
          "alloc_ids",
          [](BlockManager& b, nb::handle ids) {
            std::vector<std::int64_t> v = ids_from(ids);
            nb::gil_scoped_release release;
            b.alloc_ids(v);
          },
          "ids"_a.none(), nb::sig("def alloc_ids(self, ids: Sequence[int] | numpy.ndarray) -> None"),
          "Take exactly these free block ids (all or nothing).")
      .def(
          "free", [](BlockManager& b, const nb::list& ids) { b.free(ids_from_list(ids)); }, "ids"_a)
      .def(
          "free",
          [](BlockManager& b, const Int64Ids& ids) {
            if (ids.stride(0) == 1) {
              b.free(ids.data(), ids.shape(0));  // no copy for the common contiguous case
            } else {
              std::vector<std::int64_t> v;
              v.reserve(ids.shape(0));
              auto view = ids.view();
              for (std::size_t i = 0; i < ids.shape(0); ++i) v.push_back(view(i));
              b.free(v);
            }
          },
          "ids"_a.noconvert())
      .def(
          "free", [](BlockManager& b, nb::handle ids) { b.free(ids_from(ids)); }, "ids"_a.none(),
          nb::sig("def free(self, ids: Sequence[int] | numpy.ndarray) -> None"),
          "Free block ids (integers, all distinct and handed out, or nothing is freed).")
      .def(
          "try_reserve",
          [](BlockManager& b, nb::handle count) {
            const std::size_t n = count_arg("n", count);
            nb::gil_scoped_release release;
            return b.try_reserve(n);
          },
          "n"_a.none(), nb::sig("def try_reserve(self, n: int) -> bool"),
          "Set n more blocks aside for the next allocs, which hand them out first; False (nothing taken) "
          "when they cannot be had now.")
      .def("release_reserved", &BlockManager::release_reserved, "Free the reserved blocks; returns how many.")
      .def("clear", &BlockManager::clear, "Free every block handed out or reserved (not the null block).")
      .def("available", &BlockManager::available, "Blocks that alloc could return right now.")
      .def("free_mapped_blocks", &BlockManager::free_mapped_blocks, "Free blocks on already-mapped pages.")
      .def(
          "resize",
          [](BlockManager& b, nb::handle limit_bytes) {
            const auto limit = optional_size_arg("limit_bytes", limit_bytes);
            nb::gil_scoped_release release;
            return b.resize(limit);
          },
          "limit_bytes"_a.none(), nb::sig("def resize(self, limit_bytes: int | None) -> bool"),
          "Set the limit in bytes (None: none). True when the pool is within it now; False when the shrink "
          "is deferred until blocks in use are freed.")
      .def("trim", &BlockManager::trim, Released(),
           "Unmap every free page and release spares now; kept so until the next alloc. Returns pages unmapped.")
      .def("sleep", &BlockManager::sleep, Released(),
           "Unmap every page, the null block's too, and map nothing until wake_up(); every block must be "
           "free (ValueError otherwise, nothing changed). Returns pages unmapped.")
      .def("wake_up", &BlockManager::wake_up, Released(),
           "Allow allocs again and map the null block's page back; OutOfMemoryError (still asleep) when it "
           "cannot be had.")
      .def_prop_ro("asleep", &BlockManager::asleep, "Between sleep() and wake_up().")
      .def("maintain", &BlockManager::maintain, Released(), "One round of reserve keeping.")
      .def("prepare_ahead", &BlockManager::prepare_ahead, Released(),
           "Get the next lookahead_pages unmapped page ids ready (the worker does this after each round).")
      .def(
          "set_reserve",
          [](BlockManager& b, nb::handle min_free, nb::handle max_free, nb::handle min_spare, nb::handle max_spare) {
            b.set_reserve({size_arg("min_free_pages", min_free, true), size_arg("max_free_pages", max_free, true),
                           size_arg("min_spare_pages", min_spare, true), size_arg("max_spare_pages", max_spare, true)});
          },
          "min_free_pages"_a, "max_free_pages"_a, "min_spare_pages"_a, "max_spare_pages"_a,
          nb::sig("def set_reserve(self, min_free_pages: int, max_free_pages: int, min_spare_pages: int, "
                  "max_spare_pages: int) -> None"))
      .def("take_page_ops", &BlockManager::take_page_ops, "Page operations for the mirrors since the last call.")
      .def("acknowledge", &BlockManager::acknowledge, "mirror"_a, "seq"_a, Released(),
           "Mirror `mirror` applied every batch up to `seq`.")
      .def("mirror_lost", &BlockManager::mirror_lost, "mirror"_a, Released(),
           "Mirror `mirror` is gone: give back what it holds on its budget, stop waiting for its acknowledgements.")
      .def_prop_ro("num_mirrors", &BlockManager::num_mirrors)
      .def("stats", [](const BlockManager& b) { return stats_dict(b.stats()); })
      .def("page_of", &BlockManager::page_of, "block"_a)
      .def_prop_ro("lookahead_pages", &BlockManager::lookahead_pages,
                   "Unmapped page ids kept ready ahead of use (zero chunks split): the space's floor, "
                   "or twice the largest recent grow.")
      .def_prop_ro("kv_layout", &BlockManager::layout, "The KVLayout this manager decides for.")
      .def_prop_ro(
          "options", [](const BlockManager& b) { return b.options(); },
          "Its BlockManagerOptions (the limit as last set by resize).")
      .def_prop_ro("blocks_per_page", [](const BlockManager& b) { return b.layout().blocks_per_page(); })
      .def_prop_ro("num_blocks", [](const BlockManager& b) { return b.layout().num_blocks(); })
      .def_prop_ro(
          "page_id_bytes", [](const BlockManager& b) { return b.layout().page_id_bytes(); },
          "Physical bytes behind one page id (all layers and buffers).")
      .def_prop_ro(
          "block_id_bytes", [](const BlockManager& b) { return b.layout().block_id_bytes(); },
          "Physical bytes behind one block id (all layers and buffers).")
      .def("close", &BlockManager::close, Released(),
           "Unmap everything and stop the worker. Idempotent, also from several threads at once.")
      .def_prop_ro("closed", &BlockManager::closed);
}

}  // namespace

void bind_kv(nb::module_& m) {
  nb::class_<FixedBudget, MemoryBudget>(m, "FixedBudget",
                                        "A fixed number of bytes shared by the pools of this process.")
      .def(nb::init<std::size_t>(), "total_bytes"_a)
      .def_prop_ro("total_bytes", &FixedBudget::total_bytes)
      .def_prop_ro("used_bytes", &FixedBudget::used_bytes);
  bind_kv_values(m);
  bind_space(m);
  bind_block_manager(m);
}

}  // namespace kvcached::bindings
