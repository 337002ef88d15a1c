"""The device's registry as ``kvcached serve`` sees it: set up before the engines start, read per model.

Serve owns the device budget when the config gives one, for as long as it runs: the registry outlives
serve (other engines, kvctl and kvtop use it), so on a clean stop serve puts back the budget it found
(or, where it created the registry, the budget a new one gets), unless someone changed the budget
meanwhile (``kvctl set-budget``), which then stays. It refuses to start models whose names are
already registered by live processes (their memory would be counted as the model's), and reads
each model's memory as the sum of its engine's entries (vLLM registers one per rank).

The registry file can disappear under a running serve (removed by hand, or moved): every read then
fails with RegistryUnusableError. Serve opens the registry again at its path (a fresh one, with
the config's budget, which engines restarted from then on join), counts the error (``errors``,
shown in ``/metrics``) and goes on; a read that still fails raises, and its caller reports what
it can. Reclaiming a dead engine's memory never raises: the restart of that engine must not
depend on the registry.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Optional, TypeVar

from kvcached.errors import KvcachedError, RegistryUnusableError, ServeConfigError
from kvcached.registry import DeviceRegistry, default_budget_bytes, open_existing, registry_for
from kvcached.serve.fit import check_fit
from kvcached.serve.spec import ServeConfig
from kvcached.sizes import format_bytes

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ModelMemory:
    """One model's memory in the registry, summed over its engine's live entries."""

    mapped_bytes: int = 0  # KV cache
    used_bytes: int = 0
    weights_bytes: int = 0  # model weights awake on the device (their engine's sleep mode)
    sleeping: bool = False  # the engine's weights sleep (every rank's)
    wanted_bytes: int = 0  # refused in the last second: the engine waits for memory
    min_bytes: Optional[int] = None  # as the registry holds it, where it holds one
    max_bytes: Optional[int] = None
    entries: int = 0

    @property
    def held_bytes(self) -> int:
        """What the model holds of the device budget now: its weights and its KV cache."""
        return self.mapped_bytes + self.weights_bytes


class DeviceMemory:
    """The registry of the served device (``config.device``), shared by serve's threads."""

    def __init__(self, config: ServeConfig) -> None:
        self._config = config
        self._lock = threading.RLock()
        self.errors = 0  # registry reads that failed (the file removed or moved under serve, ...)
        found = self._budget_found()
        self.registry: DeviceRegistry = self._open()
        # The budget to put back on stop: only where serve changed it.
        self._budget_to_restore = found if config.budget_bytes is not None and found != config.budget_bytes else None
        if self._budget_to_restore is not None:
            logger.info(
                "device %s: budget %s while serve runs (was %s; put back when serve stops)",
                self.registry.device,
                format_bytes(config.budget_bytes),
                format_bytes(found),
            )
        try:
            self._check_device()
        except BaseException:
            self.restore_budget()  # a refused start leaves the budget as it found it
            raise

    def _check_device(self) -> None:
        self.registry.clean_stale()  # entries of engines that died before, named like ours
        config = self._config
        check_fit(config.models, self.registry.budget_bytes, "budget" if config.budget_bytes else "device")
        names = {spec.name for spec in config.models}
        for entry in self.registry.entries():
            if entry["alive"] and entry["name"] in names:
                raise ServeConfigError(
                    f"models: {entry['name']!r} is already registered on {self.registry.device} by process "
                    f"{entry['pid']}; stop that engine or give the model another name"
                )

    def _budget_found(self) -> int:
        """The device's budget before serve: its registry's, else the one a new registry gets."""
        try:
            existing = open_existing(self._config.device)
        except KvcachedError:
            existing = None  # a damaged file: registry_for replaces it
        return int(existing.budget_bytes) if existing is not None else default_budget_bytes(self._config.device)

    def _open(self) -> DeviceRegistry:
        registry = registry_for(self._config.device, budget_bytes=self._config.budget_bytes)
        if self._config.budget_bytes is not None and registry.budget_bytes != self._config.budget_bytes:
            registry.budget_bytes = self._config.budget_bytes
        return registry

    def restore_budget(self) -> None:
        """Puts back the budget serve found (see the module docstring); logs what it did. Never raises."""
        wanted, ours = self._budget_to_restore, self._config.budget_bytes
        if wanted is None or ours is None:
            return
        try:
            with self._lock:
                now = int(self.registry.budget_bytes)
                if now != ours:
                    logger.info(
                        "device %s: budget left at %s (changed while serve ran)", self._config.device, format_bytes(now)
                    )
                    return
                self.registry.budget_bytes = wanted
        except (KvcachedError, ValueError) as exc:
            logger.warning(
                "device %s: could not put the budget back to %s: %s", self._config.device, format_bytes(wanted), exc
            )
            return
        logger.info("device %s: budget put back to %s", self._config.device, format_bytes(wanted))
        self._budget_to_restore = None

    def _read(self, read: Callable[[DeviceRegistry], _T]) -> _T:
        """``read(registry)``; once more on a registry opened again if the file went away."""
        with self._lock:
            try:
                return read(self.registry)
            except RegistryUnusableError as exc:
                self.errors += 1
                logger.warning("%s; opening the registry again", exc)
                self.registry = self._open()
                return read(self.registry)
            except KvcachedError:
                self.errors += 1
                raise

    @property
    def budget_bytes(self) -> int:
        return int(self._read(lambda registry: registry.budget_bytes))

    def entries(self) -> list[dict[str, Any]]:
        return self._read(lambda registry: list(registry.entries()))

    def usage(self) -> dict[str, ModelMemory]:
        """Every configured model's memory now (zeros for a model with no live entry)."""
        totals: dict[str, dict[str, Any]] = {spec.name: {} for spec in self._config.models}
        for entry in self.entries():
            model = totals.get(entry["name"])
            if model is None or not entry["alive"]:
                continue
            model["mapped_bytes"] = model.get("mapped_bytes", 0) + entry["mapped_bytes"]
            model["used_bytes"] = model.get("used_bytes", 0) + entry["used_bytes"]
            model["weights_bytes"] = model.get("weights_bytes", 0) + entry["weights_bytes"]
            model["sleeping"] = model.get("sleeping", True) and entry["sleeping"]
            model["wanted_bytes"] = max(model.get("wanted_bytes", 0), entry["wanted_bytes"])
            model["entries"] = model.get("entries", 0) + 1
            if entry.get("min_bytes") is not None:
                model["min_bytes"] = entry["min_bytes"]
            model["max_bytes"] = entry["max_bytes"]
        return {name: ModelMemory(**fields) for name, fields in totals.items()}

    def reclaim(self, name: str) -> int:
        """Returns the memory of ``name``'s dead entries to the budget; the bytes they held (0, logged,
        when the registry cannot be used: the caller goes on, a restart with it)."""

        def clean(registry: DeviceRegistry) -> int:
            held = sum(e["mapped_bytes"] for e in registry.entries() if e["name"] == name and not e["alive"])
            registry.clean_stale()
            return held

        try:
            return self._read(clean)
        except KvcachedError as exc:
            logger.error("%s: its registry entries could not be reclaimed: %s", name, exc)
            return 0

    def live_entries(self, name: str) -> int:
        """How many live entries carry ``name``."""
        return sum(1 for e in self.entries() if e["name"] == name and e["alive"])


__all__ = ["DeviceMemory", "ModelMemory"]
