// Bindings of the backend contract: Device, Reservation, PhysicalAllocation.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <optional>
#include <string>

#include "bindings.hpp"
#include "kvcached/backends/host_backend.hpp"
#include "kvcached/device/device.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvcached::bindings {

namespace {

using Released = nb::call_guard<nb::gil_scoped_release>;

// The host backend with the settings its caller gives (kvcached.devices passes kvcached.config's):
// `capacity_bytes` None is half of the machine's memory limit.
std::shared_ptr<Device> open_host_device(std::optional<std::size_t> capacity_bytes, const std::string& memory,
                                         const std::string& populate) {
  const HostBackendOptions options{capacity_bytes ? *capacity_bytes : machine_host_capacity_bytes(),
                                   parse_host_memory(memory), parse_host_populate(populate)};
  nb::gil_scoped_release unlocked;
  return Device::open(make_host_backend(options));
}

std::shared_ptr<Device> open_backend_capsule(nb::handle capsule) {
  auto* holder = static_cast<std::shared_ptr<VmmBackend>*>(PyCapsule_GetPointer(capsule.ptr(), kBackendCapsuleName));
  if (holder == nullptr) {
    PyErr_Clear();
    throw InvalidArgument(std::string("expected a capsule named ") + kBackendCapsuleName);
  }
  return Device::open(*holder);
}

nb::dict counters_dict(const DeviceCounters& c) {
  nb::dict d;
  d["reserved_bytes"] = c.reserved_bytes;
  d["created_bytes"] = c.created_bytes;
  d["mapped_bytes"] = c.mapped_bytes;
  d["reservations"] = c.reservations;
  d["allocations"] = c.allocations;
  d["mappings"] = c.mappings;
  return d;
}

}  // namespace

void bind_device(nb::module_& m) {
  nb::class_<Reservation>(m, "Reservation", "A reserved virtual address range (move-only).")
      .def_prop_ro("address", &Reservation::base, "First address of the range.")
      .def_prop_ro("size", &Reservation::size_bytes, "Size in bytes.")
      .def_prop_ro("valid", &Reservation::valid, "False once freed.")
      .def("free", &Reservation::free, Released(),
           "Unmap whatever is still mapped inside, then free the range. Idempotent.");

  nb::class_<PhysicalAllocation>(m, "PhysicalAllocation", "A physical memory allocation (move-only).")
      .def_prop_ro("handle", &PhysicalAllocation::handle, "The driver's handle.")
      .def_prop_ro("size", &PhysicalAllocation::size_bytes, "Size in bytes.")
      .def_prop_ro("valid", &PhysicalAllocation::valid, "False once released.")
      .def("release", &PhysicalAllocation::release, Released(),
           "Give the memory back. Raises ValueError while the allocation is mapped.");

  nb::class_<Device>(m, "Device", "One device behind the VMM contract, with kvcached's rule checks.")
      .def_prop_ro("name", &Device::name, "Device string with the ordinal this process sees, e.g. 'cpu' or 'cuda:0'.")
      .def_prop_ro("canonical_name", &Device::canonical_name,
                   "The physical device, the same in every process whatever its visible-devices "
                   "mask: 'cpu', 'cuda-GPU-<uuid>', 'hip-GPU-<uuid>' or 'hip-pci-<bus id>'.")
      .def_prop_ro("backend", &Device::backend_name, "'host', 'cuda' or 'hip'.")
      .def_prop_ro("ordinal", &Device::ordinal)
      .def_prop_ro(
          "dlpack_device_type", [](const Device& d) { return static_cast<int>(d.dlpack_device_type()); },
          "DLPack device type: 1 cpu, 2 cuda, 10 rocm.")
      .def_prop_ro(
          "granularity",
          [](const Device& d) {
            const Granularity g = d.granularity();
            return std::make_pair(g.minimum_bytes, g.recommended_bytes);
          },
          "(minimum_bytes, recommended_bytes).")
      .def(
          "memory_info",
          [](const Device& d) {
            const MemoryInfo info = d.memory_info();
            return std::make_pair(info.free_bytes, info.total_bytes);
          },
          Released(), "(free_bytes, total_bytes) of the device, asked of the driver.")
      .def_prop_ro("estimated_free_bytes", &Device::estimated_free_bytes,
                   "Free bytes without a driver call: the last memory_info(), less what was created "
                   "through this Device since, plus what was released.")
      .def(
          "counters", [](const Device& d) { return counters_dict(d.counters()); },
          "Reserved / created / mapped bytes and object counts held through this Device.")
      .def("reserve", &Device::reserve, "size"_a, "alignment"_a = 0, Released(),
           "Reserve a virtual address range (size a multiple of the minimum granularity).")
      .def("create", &Device::create, "size"_a, Released(), "Create a physical allocation of `size` bytes.")
      .def("map", &Device::map, "address"_a, "allocation"_a, Released(),
           "Map the whole allocation at `address`; not accessible until set_access.")
      .def("unmap", &Device::unmap, "address"_a, "size"_a, Released(),
           "Unmap whole mappings exactly covering [address, address + size).")
      .def("map_accessible", &Device::map_accessible, "address"_a, "allocation"_a, Released(),
           "map + set_access in one call; the mapping is undone if set_access fails.")
      .def("set_access", &Device::set_access, "address"_a, "size"_a, Released(),
           "Make mapped memory readable and writable by the device.")
      .def("synchronize", &Device::synchronize, Released(), "Wait for work queued on the device.")
      .def("fence_new_mappings", &Device::fence_new_mappings, Released(),
           "Make mappings made so far visible to device work submitted from now on (may wait; "
           "HIP: KVCACHED_HIP_MAPPING_SETTLE_US). Call before handing fresh memory to kernels.")
      .def(
          "view",
          [](Device& d, std::uintptr_t address, std::size_t size, nb::handle owner) {
            // ROCm fails a copy spanning two separately reserved ranges, even
            // adjacent ones, so no exported array ever spans two.
            if (!d.inside_one_reservation(address, size)) {
              throw InvalidArgument("view: [" + std::to_string(address) + ", +" + std::to_string(size) +
                                    ") is not inside one reserved range");
            }
            const std::size_t shape[1] = {size};
            return nb::ndarray<nb::array_api, uint8_t, nb::ndim<1>>(
                reinterpret_cast<void*>(address), 1, shape, owner, nullptr, nb::dtype<uint8_t>(),
                static_cast<int>(d.dlpack_device_type()), d.ordinal());
          },
          "address"_a, "size"_a, "owner"_a.none(),
          "A DLPack byte array over [address, address + size) that keeps `owner` alive. "
          "The range must lie inside one reservation (ValueError otherwise). Low-level: the "
          "caller guarantees the memory is mapped and accessible.");

  m.def("open_host_device", &open_host_device, "capacity_bytes"_a.none() = nb::none(), "memory"_a = "shared_files",
        "populate"_a = "background",
        "Open a host backend device of `capacity_bytes` (None: half of the machine's or cgroup's memory "
        "limit) whose allocations are `memory` ('shared_files', 'anonymous', 'huge_pages'), populated "
        "`populate` ('background', 'on_touch'). kvcached.open_device('cpu') passes the KVCACHED_HOST_* "
        "options; this low-level call takes only what it is given.");
  m.def("open_backend_capsule", &open_backend_capsule, "capsule"_a,
        "Wrap a backend handed over by a GPU backend module (kvcached._cuda / kvcached._hip).");
  m.def("machine_host_capacity_bytes", &machine_host_capacity_bytes,
        "Half of the machine's (or cgroup's) memory limit: the host backend's capacity when none is given.");
  m.def(
      "wait_for_host_population",
      [] {
        nb::gil_scoped_release release;
        wait_for_population();
      },
      "Block until the host pages mapped so far are populated (KVCACHED_HOST_POPULATE=background).");
}

}  // namespace kvcached::bindings
