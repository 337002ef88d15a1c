"""SGLang 0.5.23's memory saver through kvcached: an engine's weights and KV cache released and resumed in place.

Rationale
---------
RL post-training frameworks (verl, slime, OpenRLHF) call SGLang's
``release_memory_occupation(tags)`` and ``resume_memory_occupation(tags)``
around every training step, to lend the device to training and take it back.
SGLang builds them on its memory saver adapter (``TorchMemorySaverAdapter``):
the model is loaded and the KV pools are built inside ``region(tag)``, and
``pause(tag)`` / ``resume(tag)`` release and restore what was allocated there
(``torch_memory_saver``: CUDA only). Under kvcached the KV cache is kvcached's
already and the weights can be (:class:`kvcached.ModelWeights`), so kvcached
provides the adapter, on every device it runs on (SGLang's CPU engine too).

Approach
--------
* ``TorchMemorySaverAdapter.create(enable=True)`` returns
  :class:`KvcachedMemorySaverAdapter` in an engine kvcached runs (its server
  arguments checked here; a refusal found later, when the KV cache is planned,
  stops the engine: it could not keep the adapter's promises). Every adapter of
  a process acts on the process's one :data:`SAVER`, as SGLang's adapters act
  on torch_memory_saver's one singleton.
* Weights: ``region("weights", enable_cpu_backup)`` records SGLang's choice
  (``--enable-weights-cpu-backup``); once ``load_model_with_memory_saver``
  returns, a :class:`~kvcached.ModelWeights` adopts the model on the rank's
  device, on the rank's registry entry (its KV cache joins that entry later:
  one row per rank, ``weights_bytes`` beside ``mapped_bytes``). ``pause``
  sleeps at level 1 with the CPU backup (contents kept in host memory) and at
  level 2 without it (discarded, as torch_memory_saver discards them: the
  caller loads weights again, ``update_weights_from_disk`` / ``_tensor`` /
  ``_distributed``). ``resume`` wakes them at the same addresses; when the
  device budget has no room in time, :class:`~kvcached.errors.OutOfMemoryError`
  is raised in the scheduler, as any failure of ``resume_memory_occupation`` is.
* KV cache: ``pause("kv_cache")`` marks the engine's allocator released;
  SGLang then flushes its cache, and once the allocator holds no block its
  blocks sleep (``EngineBlocks.sleep``): every page is unmapped, the padding
  page too, on every rank, and nothing is mapped (no reserve, no idle refill)
  until ``resume("kv_cache")`` maps the padding page again and lets the cache
  grow on demand. Requests that come meanwhile wait; the engine asks nobody
  for memory while released.
* ``cuda_graph``: graphs are captured with torch's own graph context; their
  memory is not given back (``pause("cuda_graph")`` says so once).

Limitations
-----------
CUDA-graph memory, and tensors SGLang allocates outside the model and the KV
pools (the request-to-token table, sampling buffers), stay allocated. Draft
models are not adopted (kvcached refuses speculative decoding).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS
from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

from kvcached.errors import IntegrationError, InvalidArgumentError
from kvcached.integration.common.registration import register_rank

from . import plan as _plan

logger = logging.getLogger(__name__)

#: Weights sleep levels: with SGLang's CPU backup the contents are kept, without it they are discarded.
LEVEL_KEEP, LEVEL_DISCARD = 1, 2


class MemorySaver:
    """What one scheduler process can release: its model's weights and its KV cache's allocators."""

    def __init__(self) -> None:
        self.handed_out_pid: Optional[int] = None  # the process that asked for an enabled adapter
        self.weights: Any = None  # a ModelWeights once the model is adopted
        self._num_ranks = 1  # ranks of the engine whose weights these are
        self._weights_entry: Any = None  # its registry entry's handle, held while the process lives
        self.weights_level = LEVEL_DISCARD
        self._cpu_backup = False  # as the last weights region asked
        self._kv_caches: weakref.WeakSet[Any] = weakref.WeakSet()
        self._said_graphs = False

    @property
    def in_use(self) -> bool:
        """Whether SGLang was handed an enabled kvcached adapter in this process."""
        return self.handed_out_pid == os.getpid()

    # ---- building the engine --------------------------------------------------------

    def weights_region(self, cpu_backup: bool) -> None:
        self._cpu_backup = bool(cpu_backup)

    def adopt_weights(self, model: Any, *, device: str, gpu_id: int) -> Any:
        """Moves ``model``'s weights into kvcached memory on this rank's device and registry entry."""
        from sglang.srt.runtime_context import get_server_args

        from kvcached.weights import ModelWeights

        if self.weights is not None and not self.weights.closed:
            raise IntegrationError(f"kvcached already holds this process's weights ({self.weights.name!r})")
        engine_settings = _plan.settings()
        server_args = get_server_args()
        rank, num_ranks = _plan.this_rank(server_args, _plan.torch_device_of(device, gpu_id))
        name = _plan.engine_name(engine_settings, server_args, num_ranks)
        # The KV cache's registration joins it later: one row per rank.
        budget = register_rank(name, rank, policy=engine_settings.policy, logger=logger, join=True)
        try:
            weights = ModelWeights(model, device=rank.local_device, name=name, budget=budget)
        except BaseException:
            budget.unregister()
            raise
        self.weights, self._weights_entry, self._num_ranks = weights, budget, num_ranks
        self.weights_level = LEVEL_KEEP if self._cpu_backup else LEVEL_DISCARD
        logger.info(
            "kvcached: the model's weights (%d bytes) sleep and wake in place on %s (%s, sleep level %d)",
            weights.nbytes,
            rank.device,
            name,
            self.weights_level,
        )
        return weights

    def track_kv_cache(self, allocator: Any) -> None:
        """An allocator of this process's KV cache (one of kvcached's), released and resumed with it."""
        self._kv_caches.add(allocator)

    # ---- release_memory_occupation / resume_memory_occupation -----------------------

    def pause(self, tag: str) -> None:
        if tag == GPU_MEMORY_TYPE_WEIGHTS:
            self._weights().sleep(self.weights_level)
            self._every_tensor_rank_done()
        elif tag == GPU_MEMORY_TYPE_KV_CACHE:
            for allocator in self._kv_cache_allocators():
                allocator.release_kv_cache()  # sleeps once SGLang flushed the cache, right after
        elif tag == GPU_MEMORY_TYPE_CUDA_GRAPH:
            self._say_graphs_stay()
        else:
            raise InvalidArgumentError(f"kvcached's memory saver knows no memory type {tag!r}")

    def resume(self, tag: str) -> None:
        if tag == GPU_MEMORY_TYPE_WEIGHTS:
            self._weights().wake_up(timeout_s=_plan.settings().wake_timeout_s)
        elif tag == GPU_MEMORY_TYPE_KV_CACHE:
            for allocator in self._kv_cache_allocators():
                allocator.resume_kv_cache()
        elif tag != GPU_MEMORY_TYPE_CUDA_GRAPH:
            raise InvalidArgumentError(f"kvcached's memory saver knows no memory type {tag!r}")

    def _every_tensor_rank_done(self) -> None:
        # SGLang answers the caller from the first rank; the others' weights must be asleep by then
        # too, or the memory lent to training is not all there yet (its resume has such a barrier).
        if self._num_ranks > 1:
            from .ranks import tensor_ranks_barrier

            tensor_ranks_barrier()

    def _weights(self) -> Any:
        if self.weights is None or self.weights.closed:
            raise IntegrationError("kvcached holds no model weights in this process to release or resume")
        return self.weights

    def _kv_cache_allocators(self) -> list[Any]:
        allocators = list(self._kv_caches)
        if not allocators:
            raise IntegrationError("kvcached holds no KV cache in this process to release or resume")
        return allocators

    def _say_graphs_stay(self) -> None:
        if not self._said_graphs:
            self._said_graphs = True
            logger.info("kvcached: CUDA-graph memory is not released (the weights and the KV cache are)")


#: The process's memory saver: every adapter SGLang creates in this process acts on it.
SAVER = MemorySaver()


class KvcachedMemorySaverAdapter(TorchMemorySaverAdapter):
    """SGLang's memory saver adapter, with kvcached holding what it releases (see the module's docstring)."""

    def __init__(self, saver: MemorySaver = SAVER) -> None:
        self.saver = saver

    def configure_subprocess(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nothing to preload: kvcached is a library in each process

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        if tag == GPU_MEMORY_TYPE_WEIGHTS:
            self.saver.weights_region(enable_cpu_backup)  # the model is adopted once loaded
        yield

    def cuda_graph(self, cuda_graph: Any, *, tag: Any = None, enable_cpu_backup: bool = False, **kwargs: Any) -> Any:
        return torch.cuda.graph(cuda_graph, **kwargs)  # captured as without a memory saver

    def disable(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def pause(self, tag: str) -> None:
        self.saver.pause(tag)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)

    @property
    def enabled(self) -> bool:
        return True


# ---- hooks (registered in the package's HOOKS) ------------------------------------------


def hook_create_adapter(original: Any, enable: bool) -> Any:
    """``TorchMemorySaverAdapter.create``: kvcached's adapter wherever kvcached runs the engine."""
    if not enable:
        return original(enable)
    from sglang.srt.runtime_context import get_server_args

    found = _plan.server_refusals(get_server_args())
    if found:  # kvcached does not run this engine: SGLang's own memory saver
        return original(enable)
    SAVER.handed_out_pid = os.getpid()
    return KvcachedMemorySaverAdapter()


def hook_load_model(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``load_model_with_memory_saver``: the weights region ends here, with the model loaded."""
    loaded = original(*args, **kwargs)
    if isinstance(kwargs.get("memory_saver_adapter"), KvcachedMemorySaverAdapter) and not kwargs["is_draft_worker"]:
        SAVER.adopt_weights(loaded.model, device=kwargs["device"], gpu_id=kwargs["gpu_id"])
    return loaded


def check_planned(plan: Any) -> None:
    """At the KV cache's planning: an engine given kvcached's adapter must have kvcached's KV cache."""
    if plan is None and SAVER.in_use:
        raise IntegrationError(
            "kvcached's memory saver (enable_memory_saver) needs kvcached to run this engine's KV cache, "
            "and kvcached cannot (the error above says why); unset KVCACHED_ENABLE to use SGLang's own"
        )


__all__ = [
    "KvcachedMemorySaverAdapter",
    "LEVEL_DISCARD",
    "LEVEL_KEEP",
    "MemorySaver",
    "SAVER",
    "check_planned",
    "hook_create_adapter",
    "hook_load_model",
]
