"""The device's registry as ``kvcached serve`` sees it: set up before the engines start, read per model.

Serve owns the device budget when the config gives one, refuses to start models whose names are
already registered by live processes (their memory would be counted as the model's), and reads
each model's memory as the sum of its engine's entries (vLLM registers one per rank).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Optional

from kvcached.errors import ServeConfigError
from kvcached.registry import DeviceRegistry, registry_for
from kvcached.serve.config import ServeConfig, check_min_sum
from kvcached.sizes import format_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelMemory:
    """One model's memory in the registry, summed over its engine's live entries."""

    mapped_bytes: int = 0
    used_bytes: int = 0
    wanted_bytes: int = 0  # refused in the last second: the engine waits for memory
    min_bytes: Optional[int] = None  # as the registry holds it, where it holds one
    max_bytes: Optional[int] = None
    entries: int = 0


class DeviceMemory:
    """The registry of the served device (``config.device``), shared by serve's threads."""

    def __init__(self, config: ServeConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self.registry: DeviceRegistry = registry_for(config.device, budget_bytes=config.budget_bytes)
        self.registry.clean_stale()  # entries of engines that died before, named like ours
        if config.budget_bytes is not None and self.registry.budget_bytes != config.budget_bytes:
            logger.info(
                "device %s: budget set to %s (was %s)",
                self.registry.device,
                format_bytes(config.budget_bytes),
                format_bytes(self.registry.budget_bytes),
            )
            self.registry.budget_bytes = config.budget_bytes
        check_min_sum(config.models, self.registry.budget_bytes, "budget" if config.budget_bytes else "device")
        names = {spec.name for spec in config.models}
        for entry in self.registry.entries():
            if entry["alive"] and entry["name"] in names:
                raise ServeConfigError(
                    f"models: {entry['name']!r} is already registered on {self.registry.device} by process "
                    f"{entry['pid']}; stop that engine or give the model another name"
                )

    @property
    def budget_bytes(self) -> int:
        return int(self.registry.budget_bytes)

    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.registry.entries())

    def usage(self) -> dict[str, ModelMemory]:
        """Every configured model's memory now (zeros for a model with no live entry)."""
        totals: dict[str, dict[str, Any]] = {spec.name: {} for spec in self._config.models}
        for entry in self.entries():
            model = totals.get(entry["name"])
            if model is None or not entry["alive"]:
                continue
            model["mapped_bytes"] = model.get("mapped_bytes", 0) + entry["mapped_bytes"]
            model["used_bytes"] = model.get("used_bytes", 0) + entry["used_bytes"]
            model["wanted_bytes"] = max(model.get("wanted_bytes", 0), entry["wanted_bytes"])
            model["entries"] = model.get("entries", 0) + 1
            if entry.get("min_bytes") is not None:
                model["min_bytes"] = entry["min_bytes"]
            model["max_bytes"] = entry["max_bytes"]
        return {name: ModelMemory(**fields) for name, fields in totals.items()}

    def reclaim(self, name: str) -> int:
        """Returns the memory of ``name``'s dead entries to the budget; the bytes they held."""
        with self._lock:
            held = sum(e["mapped_bytes"] for e in self.registry.entries() if e["name"] == name and not e["alive"])
            self.registry.clean_stale()
        return held

    def live_entries(self, name: str) -> int:
        """How many live entries carry ``name``."""
        return sum(1 for e in self.entries() if e["name"] == name and e["alive"])


__all__ = ["DeviceMemory", "ModelMemory"]
