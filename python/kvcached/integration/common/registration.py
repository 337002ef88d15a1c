"""How an engine integration enters kvcached's per-device registry (kvctl, kvtop).

An engine registers once, before it creates the block manager that decides its
blocks: the returned budget is the device-wide one that all engines on the
device share, so the engine shows up in ``kvctl list`` and can be steered with
``kvctl set-limit``. This module is the one place that adapts the engine
integrations to the registry.
"""

from __future__ import annotations

import logging
from typing import Any

_logger = logging.getLogger(__name__)


def ensure_registry(device: str, total_bytes: int | None = None) -> None:
    """Creates the device's registry if no engine has yet.

    Called where the device is open (a worker, a scheduler holding the KV
    tensors): a process that only decides blocks must not open the device.
    """
    from kvcached.registry import registry_for

    registry_for(device, total_bytes)


def register_engine(
    name: str, *, device: str, limit_bytes: int | None, logger: logging.Logger | None = None
) -> Any:
    """Registers an engine in ``device``'s registry and returns its shared budget.

    ``device`` is a registry device name ("cpu", "cuda:N", "rocm:N"). The
    registry normally exists already (see :func:`ensure_registry`); if not, only
    ``cpu`` can be created here without opening a device. The engine's own
    limit lives in the registry, so ``kvctl set-limit`` can change it later.
    """
    from kvcached import registry

    existing = registry.open_existing(device)
    if existing is None:
        if device != registry.HOST_DEVICE:
            raise RuntimeError(f"kvcached: no registry for {device}; the process holding the device should have created it")
        existing = registry.registry_for(device)
    budget = existing.register(name, limit_bytes=limit_bytes)
    (logger or _logger).info(
        "kvcached: registered %r on %s (device budget %d B, limit %s)",
        name,
        device,
        existing.budget_bytes,
        "none" if limit_bytes is None else f"{limit_bytes} B",
    )
    return budget
