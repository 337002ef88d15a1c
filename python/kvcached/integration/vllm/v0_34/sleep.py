"""Sleep mode under vLLM 0.34: what changed from 0.32 (``v0_32.sleep`` holds the rest).

0.34's worker no longer saves and restores anything itself around a level-2 sleep:
it passes its backend the storages a weight update will rewrite (``discardable``)
and expects every other byte back after ``resume``. kvcached's backend here keeps
exactly those other storages (buffers, parameters kept by name) through a level-2
sleep of the weights (:meth:`kvcached.ModelWeights.sleep` with ``keep``), and the
CPU worker gets 0.34's GPU-worker sleep.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvcached.weights.placement import module_tensors

from ..v0_32.sleep import current_weights
from ..v0_32.sleep_backend import KvcachedSleepBackend as _Backend032

_LEVEL_KEEP, _LEVEL_DISCARD = 1, 2


class KvcachedSleepBackend(_Backend032):
    """0.32's backend, but for ``suspend``: weights kept in host memory (nothing discardable) or
    discarded but for what must survive."""

    def suspend(self, discardable: Collection[int] = ()) -> None:  # type: ignore[override]
        weights = current_weights()
        if weights is not None:
            if discardable:
                keep = [t for t in module_tensors(weights.module) if t.untyped_storage().data_ptr() not in discardable]
                weights.sleep(_LEVEL_DISCARD, keep=keep)
            else:
                weights.sleep(_LEVEL_KEEP)
        self._state = "SUSPENDED"


def worker_sleep(self: Any, level: int = 1) -> None:
    """The CPU worker's sleep, as 0.34's GPU worker does it (the KV cache went back before)."""
    discardable = self._discardable_parameters(self.model_runner.model) if level == 2 else set()
    self.sleep_mode_backend.suspend(discardable)


def worker_wake_up(self: Any, tags: list[str] | None = None) -> None:
    self.sleep_mode_backend.resume(tags)


def worker_discard(self: Any, tags: tuple[str, ...]) -> None:
    self.sleep_mode_backend.discard(tags)


__all__ = ["KvcachedSleepBackend", "worker_discard", "worker_sleep", "worker_wake_up"]
