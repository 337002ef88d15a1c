"""kvcached's sleep-mode backend for vLLM 0.32 (``sleep_mode_backend="kvcached"``, the default under kvcached).

Loaded lazily by vLLM's ``SleepModeBackendFactory`` in each worker. The worker's
weights (:func:`.sleep.current_weights`) sleep and wake in place; the KV cache
was given back by the EngineCore before the worker was asked (:mod:`.sleep`), so
``kv_cache`` needs nothing here: it grows again as the scheduler allocates.
"""

from __future__ import annotations

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from .plan import settings
from .sleep import current_weights

_LEVEL_DISCARD = 2


class KvcachedSleepBackend(SleepModeBackend):
    """Weights to host memory (level 1) or discarded (level 2), woken at the same addresses."""

    def suspend(self, level: int = 1) -> None:
        weights = current_weights()
        if weights is not None:
            weights.sleep(level)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        weights = current_weights()
        if weights is not None and (tags is None or "weights" in tags):
            weights.wake_up(timeout_s=settings().wake_timeout_s)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        weights = current_weights()
        if weights is not None and "weights" in tags:
            weights.sleep(_LEVEL_DISCARD)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # only the weights' memory comes and goes

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True  # the weights come back at the same addresses

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        return True


__all__ = ["KvcachedSleepBackend"]
