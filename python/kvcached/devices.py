"""Finding backends and opening devices.

The host backend lives in the core module and is always there. Each GPU
backend is a separate extension module linked with its vendor library
(``kvcached._cuda`` with libcuda, ``kvcached._hip`` with libamdhip64), so a
machine without a driver can still ``import kvcached``; asking it for a GPU
then raises :class:`~kvcached.errors.BackendUnavailableError` saying what is
missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from typing import Any, Optional

from kvcached import _core, defaults
from kvcached.errors import BackendUnavailableError, InvalidArgumentError, InvalidTypeError, KvcachedError

logger = logging.getLogger(__name__)

# Backend name -> extension module providing it.
GPU_BACKEND_MODULES = {"cuda": "kvcached._cuda", "hip": "kvcached._hip"}


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can be used in this process, and if not, why."""

    name: str
    available: bool
    device_count: int
    reason: str = ""
    driver_version: Optional[int] = None


def _probe_gpu_backend(name: str) -> BackendStatus:
    module_name = GPU_BACKEND_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if getattr(exc, "name", None) == module_name:
            reason = f"{module_name} was not built (no {name} headers at build time)"
        else:
            reason = f"{module_name} cannot load its driver library: {exc}"
        return BackendStatus(name, False, 0, reason)
    try:
        count = int(module.device_count())
        version = int(module.driver_version())
    except KvcachedError as exc:
        return BackendStatus(name, False, 0, str(exc))
    if count == 0:
        return BackendStatus(name, False, 0, f"no {name} device found", version)
    return BackendStatus(name, True, count, "", version)


_status_cache: dict[str, BackendStatus] = {}
_devices: dict[str, _core.Device] = {}
_lock = threading.Lock()


def backend_status(name: str) -> BackendStatus:
    """Status of one backend ("host", "cuda" or "hip"); probed once per process."""
    if name == "host":
        return BackendStatus("host", True, 1)
    if name not in GPU_BACKEND_MODULES:
        raise InvalidArgumentError(f"unknown backend {name!r}; expected 'host', 'cuda' or 'hip'")
    with _lock:
        if name not in _status_cache:
            _status_cache[name] = _probe_gpu_backend(name)
        return _status_cache[name]


def backends() -> list[BackendStatus]:
    """Status of every backend kvcached knows, host first."""
    return [backend_status(name) for name in ("host", "cuda", "hip")]


def device_name_from_torch(device: Any) -> str:
    """kvcached's device string for a torch device (or anything ``torch.device`` accepts).

    ``"cpu"`` stays ``"cpu"``. PyTorch's ROCm build names AMD GPUs ``cuda:N`` and
    sets ``torch.version.hip``; there ``cuda:N`` becomes ``"hip:N"``, elsewhere it
    stays ``"cuda:N"``. A device without an index is the current one. This is the
    one place a torch device becomes a kvcached device name.
    """
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise InvalidArgumentError(f"kvcached has no backend for torch device type {device.type!r}")
    kind = "hip" if getattr(torch.version, "hip", None) else "cuda"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{kind}:{index}"


def parse_device(spec: Any) -> tuple[str, int]:
    """Split a device into (backend, ordinal).

    ``"cpu"`` is the host backend. ``"cuda:N"`` names the N-th GPU of whichever
    GPU backend is present: like PyTorch's ROCm build, it also names an AMD GPU
    when HIP is the GPU backend here. ``"hip:N"`` and ``"rocm:N"`` ask for HIP
    explicitly. A ``torch.device`` goes through :func:`device_name_from_torch`.
    The ordinal is the one this process sees (after ``CUDA_VISIBLE_DEVICES``,
    ``HIP_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES``); see
    :func:`canonical_device_name` for the physical device.
    """
    if not isinstance(spec, str) and hasattr(spec, "type") and hasattr(spec, "index"):
        spec = device_name_from_torch(spec)
    if not isinstance(spec, str):
        raise InvalidTypeError(f"device must be a string like 'cpu' or 'cuda:0', got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("cpu", "host"):
        return "host", 0
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "hip", "rocm") or (index and not index.isdigit()):
        raise InvalidArgumentError(f"bad device {spec!r}; expected 'cpu', 'cuda[:N]', 'hip[:N]' or 'rocm[:N]'")
    ordinal = int(index) if index else 0
    if kind == "rocm":
        kind = "hip"
    if kind == "cuda" and not backend_status("cuda").available and backend_status("hip").available:
        kind = "hip"
    return kind, ordinal


_canonical_names: dict[tuple[str, int], str] = {}


def canonical_device_name(spec: Any = "cpu") -> str:
    """The physical device behind ``spec``, the same text in every process.

    Processes that see one GPU under different ordinals (``CUDA_VISIBLE_DEVICES=1,0``
    in one, ``=0,1`` in another) get the same name for it: ``"cpu"``,
    ``"cuda-GPU-<uuid>"`` (the UUID as nvidia-smi prints it), ``"hip-GPU-<uuid>"``
    (as rocminfo prints it) or ``"hip-pci-<bus id>"`` for an AMD GPU without a
    UUID. Works for a device without VMM support too. Raises
    :class:`~kvcached.errors.BackendUnavailableError` when there is no such device.
    """
    backend, ordinal = parse_device(spec)
    if backend == "host":
        return "cpu"
    key = (backend, ordinal)
    with _lock:
        name = _canonical_names.get(key)
    if name is None:
        status = backend_status(backend)
        if not status.available:
            raise BackendUnavailableError(f"cannot identify {spec!r}: {status.reason}")
        module = importlib.import_module(GPU_BACKEND_MODULES[backend])
        name = str(module.physical_device_name(ordinal))
        with _lock:
            _canonical_names[key] = name
    return name


def open_device(spec: Any = "cpu") -> _core.Device:
    """Open (once per process) and return the device named by ``spec``.

    Its ``canonical_name`` is :func:`canonical_device_name` of ``spec``.
    """
    backend, ordinal = parse_device(spec)
    key = f"{backend}:{ordinal}"
    with _lock:
        device = _devices.get(key)
    if device is not None:
        return device
    if backend == "host":
        # KVCACHED_HOST_* once kvcached is imported (ConfigurationError naming a bad one).
        host = defaults.current().host_device_settings()
        device = _core.open_host_device(host.capacity_bytes, host.memory, host.populate)
    else:
        status = backend_status(backend)
        if not status.available:
            raise BackendUnavailableError(f"cannot open {spec!r}: {status.reason}")
        if ordinal >= status.device_count:
            raise BackendUnavailableError(
                f"cannot open {spec!r}: only {status.device_count} {backend} device(s) present"
            )
        module = importlib.import_module(GPU_BACKEND_MODULES[backend])
        settings = (defaults.current().hip_mapping_settle_us(),) if backend == "hip" else ()
        device = _core.open_backend_capsule(module.open_backend(ordinal, *settings))
    with _lock:
        device = _devices.setdefault(key, device)
    logger.debug("opened %s (%s backend)", device.name, device.backend)
    return device


def usable_devices() -> list[str]:
    """ "cpu", plus the first device of each GPU backend usable in this process."""
    return ["cpu"] + [f"{s.name}:0" for s in backends() if s.name != "host" and s.available]


def default_device() -> str:
    """The first GPU if one can be opened, else "cpu"."""
    for name in ("cuda", "hip"):
        if backend_status(name).available:
            return f"{name}:0"
    return "cpu"


__all__ = [
    "BackendStatus",
    "backend_status",
    "backends",
    "parse_device",
    "device_name_from_torch",
    "canonical_device_name",
    "open_device",
    "usable_devices",
    "default_device",
]
