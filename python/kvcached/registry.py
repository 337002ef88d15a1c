"""The per-device registry: how several engine processes share one device's memory.

Every kvcached pool registers itself in a small table in shared memory, one per
device (``/dev/shm/kvcached-<device>``; the directory can be changed with
``KVCACHED_REGISTRY_DIR``). The table holds a device-wide *budget* that all
instances respect together: each mapped page is taken from it atomically across
processes and returned only once really unmapped, so no engine can push another
into out-of-memory. Each instance may also have its own *limit*. Both can be
changed while engines run (``kvctl``) and take effect at once; ``kvtop`` shows
the table live. Entries of processes that died are recognised (pid and process
start time) and their memory returns to the budget.

Default budget, decided by the first process that creates the registry:

* GPU devices (``cuda:N``, ``rocm:N``): total device memory × the utilisation
  ``KVCACHED_GPU_UTILIZATION`` (default 0.9), leaving room for the framework's
  own allocations (weights, activations, workspace).
* ``cpu``: the host backend's capacity, whole (it is already a chosen cap).

Typical use by a pool::

    budget = registry_for("cuda:0").register("llama-8b")
    if budget.try_acquire(page_bytes): ...map the page...
    ...unmap the page...; budget.release(page_bytes)
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional, TypedDict

from kvcached._core import (
    REGISTRY_CAPACITY,
    DeviceRegistry,
    RegistryBudget,
    RegistryNotFoundError,
)

logger = logging.getLogger(__name__)

REGISTRY_DIR_ENV = "KVCACHED_REGISTRY_DIR"
DEFAULT_REGISTRY_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvcached-"
GPU_UTILIZATION_ENV = "KVCACHED_GPU_UTILIZATION"
# Share of a GPU's memory kvcached may map in all; the rest is left to the
# framework (weights, activations, CUDA graphs), like vLLM's gpu_memory_utilization.
DEFAULT_GPU_UTILIZATION = 0.9
HOST_DEVICE = "cpu"


class RegistryEntry(TypedDict):
    """One registered instance, as returned by :meth:`DeviceRegistry.entries`."""

    slot: int
    instance_id: int
    name: str
    pid: int
    start_time_ticks: int
    alive: bool
    limit_bytes: Optional[int]
    mapped_bytes: int  # taken from the device budget: every mapped page
    used_bytes: int  # pages holding blocks in use (reported by the pool)
    reserved_bytes: int  # mapped but free pages kept in reserve (reported)
    wanted_bytes: int  # a request refused in the last second (memory pressure)


def registry_dir() -> Path:
    """The directory holding the registry files (``KVCACHED_REGISTRY_DIR`` or /dev/shm)."""
    return Path(os.environ.get(REGISTRY_DIR_ENV) or DEFAULT_REGISTRY_DIR)


def gpu_utilization() -> float:
    """The share of GPU memory kvcached may use, from ``KVCACHED_GPU_UTILIZATION``."""
    text = os.environ.get(GPU_UTILIZATION_ENV)
    if not text:
        return DEFAULT_GPU_UTILIZATION
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{GPU_UTILIZATION_ENV}={text!r} is not a number; use e.g. 0.9") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{GPU_UTILIZATION_ENV}={text!r} must be in (0, 1]")
    return value


def _host_capacity_bytes() -> int:
    from kvcached import _core

    return int(_core.default_host_capacity_bytes())


def _gpu_total_bytes(device: str) -> int:
    """Total memory of a GPU, through kvcached's own backend (opens the device)."""
    from kvcached.devices import open_device

    match = re.fullmatch(r"(cuda|rocm|hip):(\d+)", device)
    if match is None:
        raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda:N' or 'rocm:N'")
    _free_bytes, total_bytes = open_device(device).memory_info()
    return int(total_bytes)


def default_budget_bytes(device: str, total_bytes: Optional[int] = None) -> int:
    """The budget a new registry of ``device`` gets (see the module docstring).

    ``total_bytes`` is the device's total memory (GPU) or the host backend's
    capacity (``cpu``); when omitted it is queried.
    """
    if device == HOST_DEVICE:
        return int(total_bytes) if total_bytes is not None else _host_capacity_bytes()
    total = int(total_bytes) if total_bytes is not None else _gpu_total_bytes(device)
    return int(total * gpu_utilization())


def registry_for(device: str = HOST_DEVICE, total_bytes: Optional[int] = None) -> DeviceRegistry:
    """Opens the registry of ``device``, creating it with the default budget if needed.

    An existing registry keeps its budget (the first user decides; ``kvctl
    set-budget`` changes it), so ``total_bytes`` only matters for the first one.
    """
    try:
        return DeviceRegistry(device)
    except RegistryNotFoundError:
        pass
    budget_bytes = default_budget_bytes(device, total_bytes)
    registry = DeviceRegistry(device, budget_bytes)
    logger.debug("registry of %s at %s, budget %d bytes", device, registry.path, registry.budget_bytes)
    return registry


def open_existing(device: str) -> Optional[DeviceRegistry]:
    """The registry of ``device`` if some engine has created it, else None (creates nothing)."""
    try:
        return DeviceRegistry(device)
    except RegistryNotFoundError:
        return None


def known_devices() -> list[str]:
    """Devices that have a registry in :func:`registry_dir`, sorted."""
    directory = registry_dir()
    if not directory.is_dir():
        return []
    devices = []
    for path in directory.glob(SEGMENT_PREFIX + "*"):
        device = path.name[len(SEGMENT_PREFIX):]
        # Skip half-made files of a creator that lost the race (".init.<pid>.<n>").
        if ".init." not in device and path.is_file():
            devices.append(device)
    return sorted(devices)


_BINARY_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DECIMAL_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """Parses a size: ``1073741824``, ``512M``, ``1.5GiB``, ``8G`` (binary), ``2GB`` (decimal)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512MiB, 8G, 2GB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    unit = unit[:-2] if unit.endswith("ib") else unit
    if unit.endswith("b") and unit in _DECIMAL_UNITS:
        return int(number * _DECIMAL_UNITS[unit])
    if unit == "b":
        unit = ""
    if unit not in _BINARY_UNITS:
        raise ValueError(f"unknown size unit {match.group(2)!r} in {text!r} (use K, M, G, T, KiB, GB, ...)")
    return int(number * _BINARY_UNITS[unit])


def format_bytes(count: Optional[int]) -> str:
    """A size for people: ``1.5 GiB``; ``-`` for None."""
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


__all__ = [
    "REGISTRY_CAPACITY",
    "DEFAULT_GPU_UTILIZATION",
    "DeviceRegistry",
    "RegistryBudget",
    "RegistryEntry",
    "RegistryNotFoundError",
    "default_budget_bytes",
    "format_bytes",
    "gpu_utilization",
    "known_devices",
    "open_existing",
    "parse_bytes",
    "registry_dir",
    "registry_for",
]
