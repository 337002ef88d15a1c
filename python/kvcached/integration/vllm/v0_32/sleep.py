"""vLLM 0.32's sleep mode through kvcached: weights sleep in place, the KV cache is given back.

With kvcached active and ``enable_sleep_mode``, vLLM's sleep mode runs on
kvcached's sleep-mode backend (:mod:`.sleep_backend`, registered under the name
``kvcached`` and used in place of ``cumem``), on every device kvcached has,
the CPU build included (where vLLM alone ignores sleep):

* **Worker** (each rank): right after ``load_model`` the model's weights move
  into a :class:`kvcached.ModelWeights`, charged on the rank's registry entry,
  which the EngineCore's KV registration then joins (one row per rank).
  ``sleep(level)`` puts them to sleep (1: contents to host memory, 2:
  discarded), ``wake_up(tags)`` maps them back at the same addresses, so CUDA
  graphs and compiled kernels stay valid. The CPU worker, whose own
  ``sleep`` only warns, gets vLLM's GPU-worker behaviour (level-2 buffers kept).
* **EngineCore**: before the workers sleep (levels 1 and 2) or discard
  ``kv_cache``, the engine's KV memory is given back at once, every rank:
  vLLM has already paused and emptied its prefix cache, so every block is
  free; kvcached evicts, trims its reserve and flushes the unmaps to the ranks.
  The block manager sleeps (nothing mapped, its null block neither) until
  ``wake_up`` wakes ``kv_cache``.
* The engine's registry name is fixed in the EngineCore process before its
  workers start (``KVCACHED_NAME``), so the workers register under it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any

from kvcached.errors import IntegrationError
from kvcached.integration.common.rank_devices import describe_rank
from kvcached.integration.common.registration import register_rank

from .plan import BACKEND_NAME, ENGINE_CORE_ATTR, VLLM_DEFAULT_BACKEND, settings, sleep_mode_wanted, use_settings

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerWeights:
    """A worker's model weights in kvcached and the handle on its rank's registry entry."""

    weights: Any  # kvcached.ModelWeights
    entry: Any  # RegistryBudget, joined by the EngineCore's KV registration

    def close(self) -> None:
        self.weights.close()
        self.entry.unregister()  # the EngineCore's handle keeps the entry while the engine runs


_held: dict[int, WorkerWeights] = {}  # pid -> this worker's (a forked child must not reuse its parent's)


def current_weights() -> Any:
    """This worker process's :class:`kvcached.ModelWeights`, or None (sleep mode off, or not loaded)."""
    held = _held.get(os.getpid())
    return held.weights if held is not None else None


# ---- EngineCore: a name before the workers start; KV memory given back before they sleep --------


def wrap_executor_init(original: Any) -> Any:
    """The EngineCore's executor starts the workers: the engine's name is fixed before it does
    (vLLM loads plugins in EngineCore.__init__, so this is the first point kvcached sees)."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if sleep_mode_wanted(vllm_config) and not settings().name:
            from .scheduler import engine_name

            name = engine_name(vllm_config)
            os.environ["KVCACHED_NAME"] = name  # the workers this executor starts inherit it
            use_settings(dataclasses.replace(settings(), name=name))
        original(self, vllm_config, *args, **kwargs)

    return __init__


def _release_kv(executor: Any, why: str) -> None:
    engine_core = getattr(executor, ENGINE_CORE_ATTR, None)
    if engine_core is not None:
        from .scheduler import release_all_kv

        released = release_all_kv(engine_core)
        if released is not None:
            logger.info("kvcached: %s: the KV cache gave back all of its memory on every rank (%s)", why, released)


def wrap_executor_sleep(original: Any) -> Any:
    def sleep(self: Any, level: int = 1) -> Any:
        if level >= 1 and "weights" not in getattr(self, "sleeping_tags", ()):
            _release_kv(self, f"sleep level {level}")
        return original(self, level)

    return sleep


def wrap_executor_wake_up(original: Any) -> Any:
    def wake_up(self: Any, tags: list[str] | None = None) -> Any:
        waking_kv = "kv_cache" in getattr(self, "sleeping_tags", ()) and (tags is None or "kv_cache" in tags)
        result = original(self, tags)  # the weights first: they take their memory before the KV cache
        engine_core = getattr(self, ENGINE_CORE_ATTR, None)
        if waking_kv and engine_core is not None:
            from .scheduler import resume_kv

            resume_kv(engine_core)
        return result

    return wake_up


def wrap_executor_discard(original: Any) -> Any:
    def discard(self: Any, tags: tuple[str, ...]) -> Any:
        if "kv_cache" in tags and "kv_cache" not in getattr(self, "sleeping_tags", ()):
            _release_kv(self, "kv_cache discarded")
        return original(self, tags)

    return discard


# ---- Worker: the weights move into kvcached once loaded -------------------------------------


def wrap_load_model(original: Any) -> Any:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if sleep_mode_wanted(self.vllm_config):
            adopt_weights(self)
        return result

    return load_model


def adopt_weights(worker: Any) -> Any:
    """Moves the worker's model into kvcached memory, charged on its rank's registry entry."""
    from kvcached.weights import ModelWeights

    previous = _held.pop(os.getpid(), None)
    if previous is not None:  # a second load_model: the old model is gone
        previous.close()
    current = settings()
    if not current.name:
        raise IntegrationError("kvcached: no engine name reached the worker (KVCACHED_NAME); sleep mode needs it")
    rank = describe_rank(worker.device, worker.rank)
    budget = register_rank(current.name, rank, policy=current.policy, logger=logger, join=True)
    try:
        weights = ModelWeights(
            worker.model_runner.get_model(), device=rank.local_device, name=current.name, budget=budget
        )
    except BaseException:
        budget.unregister()
        raise
    _held[os.getpid()] = WorkerWeights(weights, budget)
    logger.info("kvcached: the model's weights can sleep: %s (%s)", weights, rank.label)
    return weights


def wrap_memory_pool_context(original: Any) -> Any:
    """vLLM's sleep mode turns on its cuMem allocator for weights and KV; kvcached owns both."""

    def _maybe_get_memory_pool_context(self: Any, tag: str) -> Any:
        if sleep_mode_wanted(self.vllm_config):
            return contextlib.nullcontext()
        return original(self, tag)

    return _maybe_get_memory_pool_context


def worker_sleep(self: Any, level: int = 1) -> None:
    """Worker.sleep for the CPU worker (vLLM's own only warns): as vLLM's GPU worker does it."""
    if level == 2:
        model = self.model_runner.model
        self._save_sleep_parameters(model)
        self._sleep_saved_buffers = {name: buffer.cpu().clone() for name, buffer in model.named_buffers()}
    self.sleep_mode_backend.suspend(level)


def worker_wake_up(self: Any, tags: list[str] | None = None) -> None:
    self.sleep_mode_backend.resume(tags)
    if tags is None or "weights" in tags:
        model = self.model_runner.model
        if self._sleep_saved_parameters:
            self._restore_sleep_parameters(model)
        if self._sleep_saved_buffers:
            for name, buffer in model.named_buffers():
                if name in self._sleep_saved_buffers:
                    buffer.data.copy_(self._sleep_saved_buffers[name].data)
            self._sleep_saved_buffers = {}


def worker_discard(self: Any, tags: tuple[str, ...]) -> None:
    self.sleep_mode_backend.discard(tags)


def wrap_create_backend(original: Any) -> Any:
    """Under kvcached, vLLM's default sleep-mode backend is kvcached's."""

    def create_backend(cls: Any, model_config: Any) -> Any:
        if getattr(model_config, "sleep_mode_backend", None) == VLLM_DEFAULT_BACKEND:
            logger.info("kvcached: sleep mode runs on kvcached's backend (%r)", BACKEND_NAME)
            return cls.get_backend_class(BACKEND_NAME)()
        return original.__func__(cls, model_config)

    return classmethod(create_backend)


def register_backend(module: str) -> None:
    """Registers kvcached's backend (``module``'s ``KvcachedSleepBackend``) with vLLM's factory, once."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    if BACKEND_NAME not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend(BACKEND_NAME, module, "KvcachedSleepBackend")


def sleep_mode_available(self: Any) -> bool:
    """The CPU platform's answer under kvcached: sleep mode runs there through kvcached."""
    return True


__all__ = [
    "BACKEND_NAME",
    "adopt_weights",
    "current_weights",
    "register_backend",
    "sleep_mode_available",
    "worker_discard",
    "worker_sleep",
    "worker_wake_up",
    "wrap_create_backend",
    "wrap_executor_init",
    "wrap_executor_discard",
    "wrap_executor_sleep",
    "wrap_executor_wake_up",
    "wrap_load_model",
    "wrap_memory_pool_context",
]
