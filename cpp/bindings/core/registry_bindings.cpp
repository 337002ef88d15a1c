// Python bindings of the shared per-device registry: DeviceRegistry and RegistryBudget.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/bindings.hpp"
#include "error_translation.hpp"
#include "kvcached/registry/device_registry.hpp"
#include "kvcached/registry/registry_directory.hpp"
#include "kvcached/registry/registry_names.hpp"
#include "kvcached/registry/registry_settings.hpp"

namespace kvcached::bindings {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Byte counts come from Python as signed ints so a negative one is a clear
// ValueError instead of an overflow or a TypeError about unsigned conversion.
std::size_t checked_bytes(const char* what, std::int64_t bytes) {
  if (bytes < 0) throw InvalidArgument(std::string(what) + " must be >= 0, got " + std::to_string(bytes));
  return static_cast<std::size_t>(bytes);
}

std::optional<std::size_t> checked_optional_bytes(const char* what, std::optional<std::int64_t> bytes) {
  if (!bytes) return std::nullopt;
  return checked_bytes(what, *bytes);
}

// Names come from a file other processes write: bytes that are not UTF-8 are
// shown escaped (\\xff) instead of failing the whole listing.
nb::object text_of(const std::string& bytes) {
  return nb::steal(PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "backslashreplace"));
}

nb::dict entry_to_dict(const RegistryEntryInfo& info) {
  nb::dict entry;
  entry["slot"] = info.slot;
  entry["instance_id"] = info.instance_id;
  entry["name"] = text_of(info.name);
  entry["pid"] = info.pid;
  entry["start_time_ticks"] = info.start_time_ticks;
  entry["uid"] = info.uid;
  entry["local_device"] = text_of(info.local_device);
  entry["alive"] = info.alive;
  // The cap is max_bytes, as in MemoryPolicy; limit_bytes is its older name, kept for kvctl --json readers.
  entry["max_bytes"] = info.limit_bytes ? nb::object(nb::int_(*info.limit_bytes)) : nb::none();
  entry["limit_bytes"] = entry["max_bytes"];
  entry["mapped_bytes"] = info.mapped_bytes;
  entry["used_bytes"] = info.used_bytes;
  // Mapped but free: "reserved" is kept for virtual reservations (pool stats, device counters).
  entry["free_mapped_bytes"] = info.reserved_bytes;
  entry["wanted_bytes"] = info.wanted_bytes;
  entry["worker_errors"] = info.worker_errors;
  entry["min_bytes"] = info.min_bytes;
  entry["priority"] = info.priority;
  entry["reclaim_target_bytes"] =
      info.reclaim_target_bytes ? nb::object(nb::int_(*info.reclaim_target_bytes)) : nb::none();
  entry["weights_bytes"] = info.weights_bytes;
  entry["sleeping"] = info.sleeping;
  return entry;
}

nb::dict file_to_dict(const RegistryFileInfo& info) {
  nb::dict file;
  file["file_name"] = text_of(info.file_name);
  file["path"] = text_of(info.path);
  file["device"] = text_of(info.device);
  file["status"] = status_name(info.status);
  file["live_pids"] = info.live_pids;
  file["removable"] = info.removable;
  file["detail"] = text_of(info.detail);
  return file;
}

// A pid (int), or a name (str, or bytes for names that are not UTF-8).
std::variant<std::int64_t, std::string> name_or_pid_of(nb::handle target) {
  if (nb::isinstance<nb::bool_>(target)) throw InvalidArgument("name_or_pid must be an int pid or a name");
  if (nb::isinstance<nb::int_>(target)) {
    std::int64_t pid = 0;
    if (!nb::try_cast(target, pid) || pid <= 0) {
      throw InvalidArgument("pid must be a positive process id, got " + nb::cast<std::string>(nb::str(target)));
    }
    return pid;
  }
  if (nb::isinstance<nb::str>(target)) return nb::cast<std::string>(target);
  if (nb::isinstance<nb::bytes>(target)) {
    const nb::bytes raw = nb::borrow<nb::bytes>(target);
    return std::string(raw.c_str(), raw.size());
  }
  throw InvalidArgument("name_or_pid must be an int pid or a name (str or bytes)");
}

const char* kind_name(RegistryDeviceKind kind) {
  switch (kind) {
    case RegistryDeviceKind::host:
      return "host";
    case RegistryDeviceKind::gpu_identity:
      return "gpu_identity";
    case RegistryDeviceKind::gpu_index:
      return "gpu_index";
  }
  return "unknown";
}

void install_registry_error_translator() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const RegistryNotFound& e) {
      raise_python_error("RegistryNotFoundError", e.what());
    } catch (const RegistryAccessDenied& e) {
      raise_python_error("RegistryAccessError", e.what());
    } catch (const RegistryUnusable& e) {
      raise_python_error("RegistryUnusableError", e.what());
    } catch (const RegistryError& e) {
      raise_python_error("RegistryError", e.what());
    }
  });
}

// Binds a bare MemoryBudget only when nobody has, so RegistryBudget can name it
// as its base (a pool taking a MemoryBudget then accepts a RegistryBudget).
void ensure_memory_budget_bound(nb::module_& m) {
  if (nb::type<MemoryBudget>().is_valid()) return;
  nb::class_<MemoryBudget>(m, "MemoryBudget", "Where a pool's allowance of physical memory comes from.")
      .def(
          "try_acquire",
          [](MemoryBudget& self, std::int64_t bytes) {
            const std::size_t checked = checked_bytes("bytes", bytes);
            nb::gil_scoped_release unlocked;
            return self.try_acquire(checked);
          },
          "bytes"_a, "Takes `bytes` if the budget allows; False (nothing taken) otherwise.")
      .def(
          "release", [](MemoryBudget& self, std::int64_t bytes) { self.release(checked_bytes("bytes", bytes)); },
          "bytes"_a, "Returns bytes taken earlier, once they are no longer mapped.")
      .def_prop_ro("available_bytes", &MemoryBudget::available_bytes, "What try_acquire could grant now (a hint).")
      .def_prop_ro("external_limit_bytes", &MemoryBudget::external_limit_bytes,
                   "A limit set from outside the pool, or None.")
      .def(
          "report_usage",
          [](MemoryBudget& self, std::int64_t used_bytes, std::int64_t mapped_bytes) {
            self.report_usage(checked_bytes("used_bytes", used_bytes), checked_bytes("mapped_bytes", mapped_bytes));
          },
          "used_bytes"_a, "mapped_bytes"_a, "Publishes the pool's usage.");
}

// Runs a directory walk (scan or clean) with the GIL released and returns its files as dicts.
nb::list registry_files_as_dicts(std::vector<RegistryFileInfo> (*walk)()) {
  std::vector<RegistryFileInfo> files;
  {
    nb::gil_scoped_release unlocked;
    files = walk();
  }
  nb::list result;
  for (const RegistryFileInfo& info : files) result.append(file_to_dict(info));
  return result;
}

}  // namespace

void bind_registry(nb::module_& m) {
  install_registry_error_translator();
  bind_memory_policy(m);
  m.attr("REGISTRY_CAPACITY") = kRegistryCapacity;
  m.attr("REGISTRY_NAME_MAX_BYTES") = kRegistryNameMaxBytes;
  m.attr("REGISTRY_DEVICE_MAX_BYTES") = kRegistryDeviceMaxBytes;
  m.attr("REGISTRY_LOCAL_DEVICE_MAX_BYTES") = kRegistryLocalDeviceMaxBytes;
  ensure_memory_budget_bound(m);

  m.def(
      "registry_device_kind", [](const std::string& device) { return kind_name(registry_device_kind(device)); },
      "device"_a,
      "'host', 'gpu_identity' or 'gpu_index' for a canonical registry device name; "
      "ValueError stating the grammar otherwise.");
  nb::dict layout;
  for (const auto& [field, offset] : registry_layout_offsets()) layout[field.c_str()] = offset;
  m.attr("_REGISTRY_LAYOUT") = layout;
  m.def("validate_instance_name", &validate_instance_name, "name"_a,
        "ValueError unless `name` is a valid instance name (1-63 bytes of UTF-8, no control characters).");
  m.def(
      "configure_registry",
      [](const std::string& directory, const std::string& group) { configure_registry({directory, group}); },
      "directory"_a, "group"_a = "",
      "Makes `directory` (absolute) and `group` (a group name or gid; '': private registries) the "
      "settings of every later registry call of this process. kvcached.registry passes "
      "KVCACHED_REGISTRY_DIR and KVCACHED_REGISTRY_GROUP before each call that opens or lists "
      "registries; ValueError (nothing changed) for a relative directory or an unknown group.");
  m.def("registry_directory", &registry_directory_path,
        "The registry directory configure_registry() was last given; ValueError if it never was.");
  m.def("resolve_registry_group", &resolve_registry_group, "text"_a,
        "The gid a KVCACHED_REGISTRY_GROUP value names (a group name, or a gid from 0 to "
        "2**32 - 2); ValueError naming the variable otherwise.");
  m.def("is_legacy_device_name", &is_legacy_device_name, "device"_a,
        "True for index names older kvcached versions used ('cuda:0', 'rocm:1').");
  m.def(
      "scan_registry_directory", [] { return registry_files_as_dicts(scan_registry_directory); },
      nb::sig("def scan_registry_directory() -> list[dict[str, typing.Any]]"),
      "Every kvcached-* file of the registry directory, with its status; changes nothing.");
  m.def(
      "clean_registry_directory", [] { return registry_files_as_dicts(clean_registry_directory); },
      nb::sig("def clean_registry_directory() -> list[dict[str, typing.Any]]"),
      "Removes old-style files without live instances, damaged files, unfinished creations "
      "and the caller's symbolic links; returns what was removed.");

  nb::class_<RegistryBudget, MemoryBudget>(m, "RegistryBudget",
                                           "One registered instance's share of a device's budget (a MemoryBudget).\n\n"
                                           "Unregisters when dropped or on unregister(); usable as a context manager.")
      .def_prop_ro("name", [](const RegistryBudget& self) { return text_of(self.name()); })
      .def_prop_ro("slot", &RegistryBudget::slot)
      .def_prop_ro("instance_id", &RegistryBudget::instance_id)
      .def_prop_ro("registered", &RegistryBudget::registered,
                   "False once unregistered, reclaimed as stale, or the registry file is gone.")
      .def_prop_ro("max_bytes", &RegistryBudget::limit_bytes,
                   "This instance's max (its limit; kvctl changes it), or None.")
      .def_prop_ro("mapped_bytes", &RegistryBudget::mapped_bytes,
                   "Bytes of KV cache this instance holds against the device budget.")
      .def_prop_ro("weights_bytes", &RegistryBudget::weights_bytes,
                   "Bytes of model weights charged on this entry and awake now.")
      .def_prop_ro("sleeping", &RegistryBudget::sleeping, "Whether the weights on this entry sleep.")
      .def("weights_budget", &RegistryBudget::weights_budget,
           "A WeightsBudget charging model weights on this entry, beside its KV cache "
           "(kvcached.ModelWeights(module, budget=this) does it).")
      .def_prop_ro("min_bytes", &RegistryBudget::min_bytes,
                   "Bytes guaranteed to this instance: others leave room for it to get back to them.")
      .def_prop_ro("priority", &RegistryBudget::priority, "Who gives memory back first: the lower priority.")
      .def_prop_ro("reclaim_target_bytes", &RegistryBudget::reclaim_target_bytes,
                   "What a refused higher-priority instance asks this one to shrink to now (never below "
                   "its min), or None; included in external_limit_bytes.")
      .def_prop_ro("pressure_bytes", &RegistryBudget::pressure_bytes,
                   "Bytes other instances were refused in the last second: give reserve back.")
      .def(
          "want",
          [](RegistryBudget& self, std::int64_t bytes) {
            const std::size_t checked = checked_bytes("bytes", bytes);
            nb::gil_scoped_release unlocked;  // takes the registry's cross-process lock
            self.want(checked);
          },
          "bytes"_a,
          "Records that this instance wants `bytes` more and did not ask because the device "
          "has no room (others then see pressure_bytes), counting only what it could ever hold "
          "(its own limit, or the others' mins, bounds it); nothing when the device has room for "
          "that. Like a refusal, it asks lower priorities to shrink.")
      .def(
          "report_worker_errors",
          [](RegistryBudget& self, std::int64_t worker_errors) {
            self.report_worker_errors(checked_bytes("worker_errors", worker_errors));
          },
          "worker_errors"_a, "Publishes how many times the pool's background worker has failed (kvctl, kvtop).")
      .def("unregister", &RegistryBudget::unregister, nb::call_guard<nb::gil_scoped_release>(),
           "Removes the entry now; bytes still counted return to the budget.")
      .def("__enter__", [](std::shared_ptr<RegistryBudget> self) { return self; })
      .def(
          "__exit__",
          [](RegistryBudget& self, nb::handle, nb::handle, nb::handle) {
            nb::gil_scoped_release unlocked;
            self.unregister();
          },
          "exc_type"_a.none(), "exc_value"_a.none(), "traceback"_a.none());

  nb::class_<DeviceRegistry>(m, "DeviceRegistry",
                             "The shared-memory registry of one device: its budget and its instances.")
      .def(nb::new_([](const std::string& device, std::optional<std::int64_t> budget_bytes,
                       const std::string& local_device) {
             const auto budget = checked_optional_bytes("budget_bytes", budget_bytes);
             nb::gil_scoped_release unlocked;
             return DeviceRegistry::open(device, budget, local_device);
           }),
           "device"_a, "budget_bytes"_a = nb::none(), "local_device"_a = "",
           "Opens the registry of canonical `device` ('cpu', 'cuda-GPU-<uuid>', ...), creating "
           "it with `budget_bytes` if it does not exist (an existing registry keeps its budget). "
           "Without a budget a missing registry raises RegistryNotFoundError. `local_device` "
           "('cuda:1') is recorded by register() as the device this process sees. "
           "kvcached.registry.registry_for resolves names such as 'cuda:0' first.")
      .def_static("segment_path", &DeviceRegistry::segment_path, "device"_a,
                  "Where the registry file of `device` lives (in the configured registry directory).")
      .def_prop_ro("device", &DeviceRegistry::device)
      .def_prop_ro("local_device", &DeviceRegistry::local_device)
      .def_prop_ro("path", &DeviceRegistry::path)
      .def_prop_rw(
          "budget_bytes", &DeviceRegistry::budget_bytes,
          [](DeviceRegistry& self, std::int64_t budget_bytes) {
            const std::size_t budget = checked_bytes("budget_bytes", budget_bytes);
            nb::gil_scoped_release unlocked;
            self.set_budget_bytes(budget);
          },
          "Device-wide budget shared by all instances; setting it takes effect at once.")
      .def_prop_ro("mapped_bytes", &DeviceRegistry::mapped_bytes,
                   "Bytes of KV cache mapped by all instances (dead ones too, until reclaimed).")
      .def_prop_ro("weights_bytes", &DeviceRegistry::weights_bytes,
                   "Bytes of model weights awake on the device, over all instances.")
      .def_prop_ro("available_bytes", &DeviceRegistry::available_bytes)
      .def(
          "entries",
          [](const DeviceRegistry& self) {
            std::vector<RegistryEntryInfo> snapshot;
            {
              nb::gil_scoped_release unlocked;
              snapshot = self.entries();
            }
            nb::list entries;
            for (const RegistryEntryInfo& info : snapshot) entries.append(entry_to_dict(info));
            return entries;
          },
          nb::sig("def entries(self) -> list[dict[str, typing.Any]]"),
          "Snapshot of the live table: one dict per registered instance.")
      .def(
          "set_policy",
          [](DeviceRegistry& self, nb::handle name_or_pid, std::optional<std::int64_t> min_bytes,
             std::optional<std::int64_t> max_bytes, std::optional<std::int64_t> priority, bool clear_max) {
            const auto target = name_or_pid_of(name_or_pid);
            if (clear_max && max_bytes) throw InvalidArgument("give max_bytes or clear_max, not both");
            PolicyChange change;
            change.min_bytes = checked_optional_bytes("min_bytes", min_bytes);
            change.set_max = clear_max || max_bytes.has_value();
            change.max_bytes = checked_optional_bytes("max_bytes", max_bytes);
            change.priority = priority;
            nb::gil_scoped_release unlocked;
            return self.set_policy(target, change);
          },
          "name_or_pid"_a, "min_bytes"_a = nb::none(), "max_bytes"_a = nb::none(), "priority"_a = nb::none(),
          "clear_max"_a = false,
          nb::sig("def set_policy(self, name_or_pid: int | str | bytes, min_bytes: int | None = None, "
                  "max_bytes: int | None = None, priority: int | None = None, clear_max: bool = False) -> int"),
          "Changes the memory policy (min, max = the limit, priority) of instances matching a pid "
          "or name; what is None stays. All or nothing: ValueError (nothing changed) when a min "
          "would exceed its max or the mins would sum above the budget. Returns how many matched.")
      .def("clean_stale", &DeviceRegistry::clean_stale, nb::call_guard<nb::gil_scoped_release>(),
           "Frees entries of dead processes (their memory returns to the budget); returns how many.")
      .def(
          "register",
          [](DeviceRegistry& self, const std::string& name, std::optional<std::int64_t> pid,
             const InstancePolicy& policy, std::optional<std::string> local_device, bool join) {
            nb::gil_scoped_release unlocked;
            return self.register_instance(name, pid, policy, local_device, join);
          },
          "name"_a, "pid"_a = nb::none(), "policy"_a = InstancePolicy{}, "local_device"_a = nb::none(),
          "join"_a = false,
          nb::sig("def register(self, name: str, pid: int | None = None, policy: MemoryPolicy = MemoryPolicy(), "
                  "local_device: str | None = None, join: bool = False) -> RegistryBudget"),
          "Registers an instance (default pid: this process; default local_device: the one "
          "given when opening) with its MemoryPolicy and returns its RegistryBudget. ValueError "
          "when the mins of the device's instances would sum above its budget. With join=True a live "
          "entry of the same name, pid and local device is joined (another handle on it, its policy "
          "replaced by this one's; the last handle unregistered frees it): an engine's weights and KV "
          "cache on one rank.")
      .def("_hold_lock_for_test", &DeviceRegistry::hold_lock_for_test, nb::call_guard<nb::gil_scoped_release>(),
           "Test hook: takes the registry lock and never releases it.");
}

}  // namespace kvcached::bindings
