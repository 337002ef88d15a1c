"""The per-device registry: how several engine processes share one device's memory.

Every kvcached pool registers itself in a small table in shared memory, one per
*physical* device (``/dev/shm/kvcached-<device>``; the directory can be changed
with ``KVCACHED_REGISTRY_DIR``). The table holds a device-wide *budget* that all
instances respect together: each mapped page is taken from it atomically across
processes and returned only once really unmapped, so no engine can push another
into out-of-memory. Each instance may also have its own *max* (its limit), a
guaranteed *min* and a *priority*: one :class:`MemoryPolicy` value
(``docs/memory-policy.md``). All can be
changed while engines run (``kvctl``) and take effect at once; ``kvtop`` shows
the table live. Entries of processes that died are recognised (pid and process
start time) and their memory returns to the budget.

Device names. A registry is keyed by what identifies the physical device, so
processes that see one GPU under different indices (``CUDA_VISIBLE_DEVICES``)
share one budget: ``cpu``, ``cuda-GPU-<uuid>``, ``hip-GPU-<id>`` or
``hip-pci-<bus id>`` (``kvcached/registry/registry_names.hpp`` has the grammar).
Functions here also accept a device as this process sees it (``"cuda:0"``,
``"hip:1"``) and resolve it through the opened device's ``canonical_name``; a
backend that cannot report one gets ``cuda-index-N`` / ``hip-index-N`` (keyed by
index, with a warning). Each entry also records the device as its own process sees it.

Access. A registry is private to the user who created it unless
``KVCACHED_REGISTRY_GROUP`` names a group to share it with (``docs/security.md``).

Default budget, decided by the first process that creates the registry:

* GPU devices: total device memory × ``KVCACHED_GPU_UTILIZATION`` (default
  0.9), leaving room for the framework's own allocations (weights,
  activations, workspace).
* ``cpu``: the host backend's capacity, whole (it is already a chosen cap).

Typical use by a pool::

    budget = registry_for("cuda:0").register("llama-8b", policy=MemoryPolicy(max_bytes=8 << 30))
    if budget.try_acquire(page_bytes): ...map the page...
    ...unmap the page...; budget.release(page_bytes)
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, TypedDict, Union

from kvcached import _core, config, configured
from kvcached._core import (
    REGISTRY_CAPACITY,
    MemoryPolicy,
    RegistryBudget,
    registry_device_kind,
)
from kvcached.errors import (
    InvalidArgumentError,
    RegistryAccessError,
    RegistryError,
    RegistryNotFoundError,
    RegistryUnusableError,
)
from kvcached.sizes import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

REGISTRY_DIR_ENV = "KVCACHED_REGISTRY_DIR"
REGISTRY_GROUP_ENV = "KVCACHED_REGISTRY_GROUP"
GPU_UTILIZATION_ENV = "KVCACHED_GPU_UTILIZATION"
# Share of a GPU's memory kvcached may map in all; the rest is left to the
# framework (weights, activations, CUDA graphs), like vLLM's gpu_memory_utilization.
DEFAULT_GPU_UTILIZATION = float(config.OPTIONS["gpu_utilization"].default)
HOST_DEVICE = "cpu"
_HOST_SPELLINGS = ("cpu", "host")


class RegistryEntry(TypedDict):
    """One registered instance, as returned by :meth:`DeviceRegistry.entries`."""

    slot: int
    instance_id: int
    name: str  # bytes that are not UTF-8 appear escaped (\\xff)
    pid: int
    start_time_ticks: int
    uid: int  # effective uid of the registering process
    local_device: str  # the device as that process sees it ("cuda:1"), or ""
    alive: bool
    max_bytes: Optional[int]  # its max (MemoryPolicy.max_bytes), None: only the device budget caps it
    limit_bytes: Optional[int]  # the same, under its older name (kvctl --json readers)
    mapped_bytes: int  # taken from the device budget: every mapped page
    used_bytes: int  # pages holding blocks in use (reported by the pool)
    free_mapped_bytes: int  # mapped pages holding no block in use (reported)
    wanted_bytes: int  # a request refused in the last second (memory pressure)
    worker_errors: int  # background worker failures (reported by the pool)
    min_bytes: int  # guaranteed to it (docs/memory-policy.md)
    priority: int  # higher wins; lower gives memory back first
    reclaim_target_bytes: Optional[int]  # a shrink a higher priority asks of it now, or None
    weights_bytes: int  # model weights charged on it and awake now (kvcached.ModelWeights)
    sleeping: bool  # its weights sleep: their memory is given back until they wake


@dataclasses.dataclass(frozen=True)
class DeviceName:
    """A device's registry name and the name this process knows it by."""

    registry: str  # canonical: "cpu", "cuda-GPU-<uuid>", "cuda-index-0", ...
    local: str  # "cpu", "cuda:0", "hip:1"; "" when this process was given only the registry name


def _configure() -> None:
    """Hands the core the registry options as they are now (the variables a process was started
    with, or set since): before every call that opens or lists registries. ConfigurationError,
    naming the variable, for a bad one."""
    group = config.get("registry_group")
    _core.configure_registry(config.get("registry_dir"), group or "")


class DeviceRegistry(_core.DeviceRegistry):
    """The shared-memory registry of one device (``kvcached._core.DeviceRegistry``), opened where
    ``KVCACHED_REGISTRY_DIR`` and ``KVCACHED_REGISTRY_GROUP`` say now.

    ``DeviceRegistry(device, budget_bytes=None, local_device="")`` opens the registry of
    canonical ``device``, creating it with ``budget_bytes`` if it does not exist;
    :func:`registry_for` resolves names such as ``"cuda:0"`` first.
    """

    def __new__(cls, device: str, budget_bytes: Optional[int] = None, local_device: str = "") -> DeviceRegistry:
        _configure()
        return super().__new__(cls, device, budget_bytes, local_device)

    @staticmethod
    def segment_path(device: str) -> str:
        """Where the registry file of ``device`` lives."""
        _configure()
        return _core.DeviceRegistry.segment_path(device)


def registry_dir() -> Path:
    """The directory holding the registry files (``KVCACHED_REGISTRY_DIR``, :data:`kvcached.config.OPTIONS`)."""
    _configure()
    return Path(_core.registry_directory())


def gpu_utilization() -> float:
    """The share of GPU memory kvcached may use, from ``KVCACHED_GPU_UTILIZATION``."""
    return float(config.get("gpu_utilization"))


_warned_index_keyed: set[str] = set()


def _identity_of(device: Any, local: str) -> str:
    """The registry name of an opened GPU: its physical identity (``Device.canonical_name``),
    else its index (with a warning once) for a backend that cannot report one."""
    identity = getattr(device, "canonical_name", None)
    if identity:
        if registry_device_kind(identity) != "gpu_identity":
            raise InvalidArgumentError(f"{local}: the backend reported {identity!r}, which is not a device identity")
        return str(identity)
    backend, _, ordinal = local.partition(":")
    fallback = f"{backend}-index-{ordinal}"
    if local not in _warned_index_keyed:
        _warned_index_keyed.add(local)
        logger.warning(
            "%s: the %s backend reports no device identity, so its registry is keyed by index (%s); "
            "processes that see this GPU under another index get another budget",
            local,
            backend,
            fallback,
        )
    return fallback


def resolve_device(device: Union[str, Any]) -> DeviceName:
    """The registry name of ``device``: a name this process sees ("cpu", "cuda:0", "hip:1",
    "rocm:1"), a registry name ("cuda-GPU-<uuid>") or an opened device.

    Resolving a GPU this process sees opens it (once per process). ValueError for
    a name that is neither; BackendUnavailableError for a GPU that is not here.
    """
    from kvcached.devices import open_device, parse_device

    if not isinstance(device, str):
        local = str(device.name)
        return (
            DeviceName(HOST_DEVICE, HOST_DEVICE)
            if local == HOST_DEVICE
            else DeviceName(_identity_of(device, local), local)
        )
    text = device.strip()
    if not text.isascii():
        shown = text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        raise InvalidArgumentError(f"unknown device {shown!r}: device names are ASCII")
    if text.lower() in _HOST_SPELLINGS:
        return DeviceName(HOST_DEVICE, HOST_DEVICE)
    try:
        registry_device_kind(text)
        return DeviceName(text, "")
    except ValueError:
        pass
    try:
        backend, ordinal = parse_device(text)
    except ValueError:
        raise InvalidArgumentError(
            f"unknown device {text!r}: expected 'cpu', a GPU as this process sees it ('cuda:0', 'hip:1') "
            "or a registry device name ('cuda-GPU-<uuid>', 'hip-pci-<bus id>', ...)"
        ) from None
    local = f"{backend}:{ordinal}"
    return DeviceName(_identity_of(open_device(local), local), local)


def _gpu_total_bytes(device: str) -> int:
    """Total memory of a GPU this process sees, through kvcached's own backend (opens the device)."""
    from kvcached.devices import open_device

    name = resolve_device(device)
    if not name.local:
        raise InvalidArgumentError(
            f"cannot size a budget for {device!r}: name the device as this process sees it "
            "('cuda:0') or give its total memory"
        )
    _free_bytes, total_bytes = open_device(name.local).memory_info()
    return int(total_bytes)


def default_budget_bytes(device: str, total_bytes: Optional[int] = None) -> int:
    """The budget a new registry of ``device`` gets (see the module docstring).

    ``total_bytes`` is the device's total memory (GPU) or the host backend's
    capacity (``cpu``); when omitted it is queried. An invalid
    ``KVCACHED_GPU_UTILIZATION`` raises whatever the device.
    """
    utilization = gpu_utilization()
    if device.strip().lower() in _HOST_SPELLINGS:
        return int(total_bytes) if total_bytes is not None else configured.host_capacity_bytes()
    total = int(total_bytes) if total_bytes is not None else _gpu_total_bytes(device)
    return int(total * utilization)


def registry_for(
    device: Union[str, Any] = HOST_DEVICE,
    total_bytes: Optional[int] = None,
    budget_bytes: Optional[int] = None,
) -> DeviceRegistry:
    """Opens the registry of ``device`` (see :func:`resolve_device`), creating it if needed.

    A new registry gets ``budget_bytes``, else the default budget (computed from
    ``total_bytes`` when given). An existing registry keeps its budget (the
    first user decides; ``kvctl set-budget`` changes it).
    """
    gpu_utilization()  # an invalid value raises on every device, as documented
    name = resolve_device(device)
    try:
        return DeviceRegistry(name.registry, None, name.local)
    except (RegistryNotFoundError, RegistryUnusableError):
        pass  # opening with a budget creates it, or replaces a damaged or unused old-style file
    if budget_bytes is None:
        budget_bytes = default_budget_bytes(name.local or name.registry, total_bytes)
    registry = DeviceRegistry(name.registry, budget_bytes, name.local)
    logger.debug("registry of %s at %s, budget %d bytes", name.registry, registry.path, registry.budget_bytes)
    return registry


def register_pool(device: Union[str, Any], name: str) -> RegistryBudget:
    """Registers pool ``name`` in the registry of ``device`` (created if needed): the budget a
    pool given none takes (what ``import kvcached`` installs, :mod:`kvcached.defaults`)."""
    return registry_for(device).register(name)


def open_existing(device: Union[str, Any]) -> Optional[DeviceRegistry]:
    """The registry of ``device`` if some engine has created it, else None (creates nothing)."""
    name = resolve_device(device)
    try:
        return DeviceRegistry(name.registry, None, name.local)
    except RegistryNotFoundError:
        return None


def registry_files() -> list[dict[str, Any]]:
    """Every ``kvcached-*`` file of :func:`registry_dir` with its status ("current",
    "old_style", "damaged", "foreign", "other_version", "denied", "link", "unfinished")
    and what to do about it; changes nothing."""
    _configure()
    return list(_core.scan_registry_directory())


def clean_directory() -> list[dict[str, Any]]:
    """Removes what no process can use (old-style files without live instances, damaged
    files, unfinished creations, the caller's symbolic links); returns what it removed."""
    _configure()
    return list(_core.clean_registry_directory())


def known_devices() -> list[str]:
    """Devices that have a usable registry in :func:`registry_dir`, sorted."""
    return [file["device"] for file in registry_files() if file["status"] == "current"]


def printable(text: str) -> str:
    """``text`` safe for a terminal: control and other non-printable characters escaped."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


__all__ = [
    "REGISTRY_CAPACITY",
    "DEFAULT_GPU_UTILIZATION",
    "DeviceName",
    "DeviceRegistry",
    "MemoryPolicy",
    "RegistryAccessError",
    "RegistryBudget",
    "RegistryEntry",
    "RegistryError",
    "RegistryNotFoundError",
    "RegistryUnusableError",
    "clean_directory",
    "default_budget_bytes",
    "format_bytes",
    "gpu_utilization",
    "known_devices",
    "open_existing",
    "parse_bytes",
    "printable",
    "registry_dir",
    "registry_files",
    "registry_for",
    "register_pool",
    "resolve_device",
]
