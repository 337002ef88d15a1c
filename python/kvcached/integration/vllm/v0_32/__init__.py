"""kvcached inside vLLM 0.32 (V1 engine). Every private vLLM name kvcached uses is in this package.

Rationale
---------
vLLM decides blocks in the EngineCore process (Scheduler -> KVCacheManager ->
BlockPool) while the KV tensors live in worker processes (always on the CPU
build, and on GPUs with tensor or pipeline parallelism: one worker per rank).
kvcached splits the same way: a device-less block manager in the EngineCore
decides which block ids (and so which pages) are in use, and one KV space per
worker rank maps and unmaps those pages in its own address space, on its own
device. The EngineCore never opens a device.

Approach
--------
* ``plan``: every worker describes its device (physical identity, the index it
  sees); vLLM plans its one-KV-tensor layout for a virtual capacity; each rank
  gets its own layout (same block ids; a pipeline stage only its layers).
* ``scheduler`` and ``block_pool``: the engine registers one entry per rank in
  that rank's device registry; its block manager has one mirror per rank,
  charged on that rank's budget at that rank's page cost, all or nothing, and
  released on a rank's budget once that rank acknowledged the unmap. vLLM's
  BlockPool takes its blocks from it; running out becomes waiting or preemption.
* Ordering: each step's page ops ride on the ``SchedulerOutput`` that vLLM
  delivers to every worker in step order; an idle engine flushes them with one
  ordered ``collective_rpc`` once its idle hold has passed or another instance
  wants the memory (``KVCACHED_IDLE_RELEASE_S``, ``common/idle.py``).
* ``worker``: each rank backs vLLM's KV views with its KV space, applies each
  batch before the forward pass (synchronising the device before unmapping)
  and acknowledges it itself on the engine's acknowledgement board (shared
  memory). A rank whose process is gone, or that acknowledges nothing for
  ``KVCACHED_RANK_ACK_TIMEOUT_S``, is declared lost: its budget returns.

Hybrid models
-------------
vLLM's hybrid KV cache manager keeps several KV cache groups (full attention,
sliding window, chunked local, Mamba / GDN state, ...) in one allocation over
one ``BlockPool``; ``kv_tensors`` covers that allocation with one kvcached
space whose block ``b`` holds every group's block ``b``, every group's views
are carved over it, and every group's blocks (including those a sliding
window drops and Mamba state blocks) come from and go back to kvcached's
block pool. The model families that have run are listed in ``docs/models.md``.

Limitations
-----------
Refused with a clear error: KV tensors outside the block pool (host-resident
HiSparse pools, raw state buffers) and KV layouts one block-id space cannot
cover, sleep mode, KV connectors, HiSparse, workers on another host than the
EngineCore, and pipeline parallelism with a block-outermost KV layout. Written
for the V1 and V2 model runners and for CPU, CUDA and ROCm workers; the CPU
build with the V1 runner has run (one worker, tensor parallelism 2, pipeline
parallelism 2).

Every vLLM name patched here is declared in ``patch_points`` and verified by
the plugin front door before anything is patched. ``v0_33`` and ``v0_34``
reuse this package and hold only what differs.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from kvcached.integration.common.settings import Settings

from . import block_pool, plan, scheduler, sleep, worker
from .block_pool import KVCachePoolExhausted
from .patch_points import KV_TENSOR_SITES, PATCH_POINTS, KVTensorSites
from .plan import UnsupportedVLLMConfig, logger
from .worker import worker_kv_stats

_MARKER = "_kvcached_patched"  # on every patched function and class (idempotence)


def _patch(owner: Any, name: str, wrapper: Any) -> None:
    current = getattr(owner, name)
    if getattr(current, _MARKER, False):
        return
    replacement = wrapper(current)
    setattr(replacement, _MARKER, True)
    replacement.__wrapped__ = current
    replacement.__name__ = getattr(current, "__name__", name)
    replacement.__qualname__ = getattr(current, "__qualname__", name)
    setattr(owner, name, replacement)


def _set(owner: Any, name: str, value: Any) -> None:
    if not getattr(getattr(owner, name, None), _MARKER, False):
        setattr(value, _MARKER, True)
        setattr(owner, name, value)


def install(
    settings: Settings,
    *,
    sites: KVTensorSites = KV_TENSOR_SITES,
    block_pool_factory: Callable[[type], type] = block_pool.make_block_pool_class,
    allocate_wrapper: Callable[[Any], Any] = worker.wrap_allocate_kv_cache,
    configs_wrapper: Callable[[Any], Any] = plan.wrap_get_kv_cache_configs,
    sleep_backend: str = f"{__name__}.sleep_backend",
    cpu_worker_sleep: Any = sleep,
) -> None:
    """Installs every patch; pure attribute swaps, safe in every vLLM process.

    A later release's package passes where its workers build KV tensors
    (``sites``), its own block pool, ``allocate_kv_cache`` or
    ``get_kv_cache_configs`` wrapper, its sleep-mode backend (the module holding
    ``KvcachedSleepBackend``) and the module whose
    ``worker_sleep`` / ``worker_wake_up`` / ``worker_discard`` the CPU worker gets.
    """
    plan.use_settings(settings)

    from vllm.v1.core import block_pool as vllm_block_pool
    from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.sched import scheduler as vllm_scheduler
    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_worker

    # EngineCore: the ranks' devices, planning, block pool, ordering, idle flush.
    _patch(core.EngineCore, "_initialize_kv_caches", plan.wrap_initialize_kv_caches)
    _patch(core, "get_kv_cache_configs", configs_wrapper)
    if not getattr(kv_cache_coordinator.BlockPool, _MARKER, False):
        pool_class = block_pool_factory(vllm_block_pool.BlockPool)
        setattr(pool_class, _MARKER, True)
        kv_cache_coordinator.BlockPool = pool_class
    Scheduler = vllm_scheduler.Scheduler
    _patch(Scheduler, "__init__", scheduler.wrap_scheduler_init)
    _patch(Scheduler, "schedule", scheduler.wrap_schedule)
    _patch(Scheduler, "update_from_output", scheduler.wrap_update_from_output)
    _patch(Scheduler, "_preempt_request", scheduler.wrap_preempt_request)
    _patch(Scheduler, "shutdown", scheduler.wrap_scheduler_shutdown)
    _patch(kv_cache_manager.KVCacheManager, "allocate_slots", scheduler.wrap_allocate_slots)
    for method in ("step", "step_with_batch_queue", "abort_requests"):
        _patch(core.EngineCore, method, scheduler.wrap_flushing)
    for method in ("add_request", "reset_prefix_cache", "collective_rpc"):
        _patch(core.EngineCore, method, scheduler.wrap_serialized)
    _set(core.EngineCore, "kvcached_stats", scheduler.engine_core_kvcached_stats)
    install_sleep_mode(sleep_backend, cpu_worker_sleep)

    # Workers: their devices, virtual capacity, KV spaces, page ops.
    Worker = gpu_worker.Worker
    _set(Worker, "kvcached_describe_rank", worker.worker_describe_rank)
    _patch(Worker, "determine_available_memory", worker.wrap_gpu_determine_available_memory)
    _patch(gpu_worker, "request_memory", worker.wrap_request_memory)
    _patch(Worker, "execute_model", worker.wrap_execute_model)
    _set(Worker, "kvcached_apply_page_ops", worker.worker_apply_page_ops)
    _set(Worker, "kvcached_kv_stats", worker.worker_kv_stats)
    cpu_worker = _import("vllm.v1.worker.cpu_worker", optional=True)
    if cpu_worker is not None:
        _set(cpu_worker.CPUWorker, "determine_available_memory", worker.cpu_determine_available_memory)
    install_kv_tensor_sites(sites, allocate_wrapper)


def install_sleep_mode(backend_module: str, cpu_worker_sleep: Any) -> None:
    """vLLM's sleep mode through kvcached (:mod:`.sleep`): the backend, the weights, the KV cache."""
    from vllm.device_allocator import sleep_mode_backend
    from vllm.v1.executor import abstract
    from vllm.v1.worker import gpu_worker

    sleep.register_backend(backend_module)
    factory = sleep_mode_backend.SleepModeBackendFactory
    if not getattr(factory.__dict__["create_backend"], _MARKER, False):
        replacement = sleep.wrap_create_backend(factory.create_backend)
        setattr(replacement, _MARKER, True)
        factory.create_backend = replacement
    _patch(abstract.Executor, "__init__", sleep.wrap_executor_init)
    _patch(abstract.Executor, "sleep", sleep.wrap_executor_sleep)
    _patch(abstract.Executor, "wake_up", sleep.wrap_executor_wake_up)
    _patch(abstract.Executor, "discard", sleep.wrap_executor_discard)
    _patch(gpu_worker.Worker, "load_model", sleep.wrap_load_model)
    _patch(gpu_worker.Worker, "_maybe_get_memory_pool_context", sleep.wrap_memory_pool_context)
    cpu_worker = _import("vllm.v1.worker.cpu_worker", optional=True)
    if cpu_worker is not None:  # vLLM's CPU worker only warns; it gets the GPU worker's behaviour
        _set(cpu_worker.CPUWorker, "sleep", cpu_worker_sleep.worker_sleep)
        _set(cpu_worker.CPUWorker, "wake_up", cpu_worker_sleep.worker_wake_up)
        _set(cpu_worker.CPUWorker, "discard", cpu_worker_sleep.worker_discard)
    cpu_platform = _import("vllm.platforms.cpu", optional=True)
    if cpu_platform is not None:
        _set(cpu_platform.CpuPlatform, "is_sleep_mode_available", sleep.sleep_mode_available)


def _import(name: str, *, optional: bool) -> Any:
    """The module, or None for an optional one whose own imports fail in this build."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if not optional:
            raise
        logger.debug("kvcached: skipping %s (%s)", name, exc)  # that worker / runner is not part of this build
        return None


def install_kv_tensor_sites(sites: KVTensorSites, allocate_wrapper: Callable[[Any], Any]) -> None:
    """Backs vLLM's KV views with kvcached wherever ``sites`` says workers build them."""
    for name in sites.allocators:
        module = _import(name, optional=name in sites.optional)
        if module is not None:
            _patch(module, "allocate_kv_cache", allocate_wrapper)
    for runner in sites.runners:
        name, cls = runner.split(":")
        module = _import(name, optional=name in sites.optional)
        if module is not None:
            _patch(getattr(module, cls), "initialize_kv_cache", worker.wrap_initialize_kv_cache)


__all__ = [
    "PATCH_POINTS",
    "KVCachePoolExhausted",
    "UnsupportedVLLMConfig",
    "install",
    "install_kv_tensor_sites",
    "worker_kv_stats",
]
