"""Every vLLM 0.32 name kvcached patches or relies on, as patch points the plugin front door verifies.

The EngineCore side (scheduler, block pool, planning) and the worker side
(capacity, page ops, where KV tensors are built) are declared apart: the
worker's KV-tensor sites are data (:class:`KVTensorSites`) that ``install``
patches and that the points are derived from, so what is verified is what is
patched. A later release's package reuses these and replaces what moved.
"""

from __future__ import annotations

import dataclasses

from kvcached.integration.common.front_door import PatchPoint

_CORE = "vllm.v1.engine.core"
_POOL = "vllm.v1.core.block_pool"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_WORKER = "vllm.v1.worker.gpu_worker"

#: ``allocate_kv_cache``'s parameters, all of them: kvcached replaces it, so callers may pass any.
ALLOCATE_KV_CACHE_PARAMETERS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")


def block_pool_points(free_blocks: tuple[str, ...] = ("self", "ordered_blocks")) -> tuple[PatchPoint, ...]:
    """BlockPool: kvcached subclasses it and overrides these methods with these exact signatures."""
    exact = {
        "get_new_blocks": ("self", "num_blocks"),
        "free_blocks": free_blocks,
        "touch": ("self", "blocks"),
        "_maybe_evict_cached_block": ("self", "block"),
        "reset_prefix_cache": ("self",),
        "get_num_free_blocks": ("self",),
    }
    return (
        PatchPoint(_POOL, "BlockPool", members=("_notify_reuse",)),
        # Bound where vLLM looks it up (``from ... import BlockPool`` copies the binding).
        PatchPoint("vllm.v1.core.kv_cache_coordinator", "BlockPool"),
        *(PatchPoint(_POOL, f"BlockPool.{name}", params, exact=True) for name, params in exact.items()),
    )


#: ``get_kv_cache_configs``'s parameters (kvcached's wrapper has this exact signature).
GET_KV_CACHE_CONFIGS_PARAMETERS = ("vllm_config", "kv_cache_specs", "available_memory")

ENGINE_CORE_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(_CORE, "EngineCore._initialize_kv_caches", ("self", "vllm_config"), exact=True),
    PatchPoint(
        _CORE,
        "EngineCore",
        members=(
            "step",
            "step_with_batch_queue",
            "abort_requests",
            "add_request",
            "reset_prefix_cache",
            "collective_rpc",
        ),
    ),
    PatchPoint(_CORE, "EngineCoreProc", members=("run_busy_loop",)),  # tells an in-process EngineCore apart
    PatchPoint("vllm.v1.engine", "EngineCoreRequestType", members=("WAKEUP",)),  # wakes the loop to flush
    PatchPoint("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", ("self", "request")),
    PatchPoint(_SCHEDULER, "Scheduler.__init__", ("self", "vllm_config", "kv_cache_config")),
    PatchPoint(
        _SCHEDULER, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"), exact=True
    ),
    PatchPoint(
        _SCHEDULER, "Scheduler", members=("schedule", "_preempt_request", "shutdown", "get_num_unfinished_requests")
    ),
    # The step's page ops ride on it as an extra attribute, pickled to every worker with it.
    PatchPoint("vllm.v1.core.sched.output", "SchedulerOutput"),
    PatchPoint(
        "vllm.v1.kv_cache_interface",
        "create_kv_cache_views",
        ("raw", "spec", "num_blocks", "layout", "kv_cache_tensor", "kernel_block_size"),
        exact=True,
    ),
    PatchPoint("vllm.v1.kv_cache_interface", "KVCacheConfig", members=("num_blocks_of",)),
    PatchPoint("vllm.v1.kv_cache_interface", "UniformTypeKVCacheSpecs"),
)


@dataclasses.dataclass(frozen=True)
class KVTensorSites:
    """Where a release's workers build KV tensors (patched where each name is looked up).

    ``allocators``: modules whose global ``allocate_kv_cache`` builds the
    tensors; ``runners``: ``module:Class`` of model runners whose
    ``initialize_kv_cache`` may build a throw-away CUDA-graph profiling cache.
    Names in ``optional`` may fail to import in a build (e.g. a runner that needs
    Triton on the CPU build) and are then not patched.
    """

    allocators: tuple[str, ...]
    runners: tuple[str, ...]
    optional: frozenset[str]
    allocate_parameters: tuple[str, ...] = ALLOCATE_KV_CACHE_PARAMETERS

    def points(self) -> tuple[PatchPoint, ...]:
        allocators = tuple(
            PatchPoint(
                module, "allocate_kv_cache", self.allocate_parameters, exact=True, optional=module in self.optional
            )
            for module in self.allocators
        )
        runners = tuple(
            PatchPoint(
                module,
                f"{cls}.initialize_kv_cache",
                ("self", "kv_cache_config", "is_profiling"),
                optional=module in self.optional,
            )
            for module, cls in (runner.split(":") for runner in self.runners)
        )
        return allocators + runners


#: vLLM 0.32: the V1 runner (also the CPU build's), Model Runner V2, and vLLM's shared helper.
KV_TENSOR_SITES = KVTensorSites(
    allocators=("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.utils", "vllm.v1.worker.gpu.attn_utils"),
    runners=("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "vllm.v1.worker.gpu.model_runner:GPUModelRunner"),
    optional=frozenset({"vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.gpu.model_runner"}),
)


def sleep_points(
    worker_members: tuple[str, ...] = ("sleep_mode_backend", "_save_sleep_parameters", "_restore_sleep_parameters"),
    suspend_parameters: tuple[str, ...] = ("self", "level"),
) -> tuple[PatchPoint, ...]:
    """Sleep mode through kvcached (``sleep``): vLLM's backend factory and interface, where the
    weights are loaded and sleep is dispatched, and the CPU build's worker and platform, whose
    sleep kvcached provides. ``worker_members``: what kvcached's CPU-worker sleep calls."""
    backend = "vllm.device_allocator.sleep_mode_backend"
    executor = "vllm.v1.executor.abstract"
    return (
        PatchPoint(
            backend,
            "SleepModeBackendFactory",
            members=("_registry", "register_backend", "get_backend_class", "create_backend"),
        ),
        PatchPoint(backend, "SleepModeBackend", members=("resume", "discard")),
        PatchPoint(backend, "SleepModeBackend.suspend", suspend_parameters, exact=True),
        PatchPoint(executor, "Executor.__init__", ("self", "vllm_config")),
        PatchPoint(executor, "Executor.sleep", ("self", "level"), exact=True),
        PatchPoint(executor, "Executor.wake_up", ("self", "tags"), exact=True),
        PatchPoint(executor, "Executor.discard", ("self", "tags"), exact=True),
        PatchPoint(_WORKER, "Worker.load_model", ("self",)),
        PatchPoint(_WORKER, "Worker._maybe_get_memory_pool_context", ("self", "tag"), exact=True),
        PatchPoint(_WORKER, "Worker", members=worker_members),
        PatchPoint("vllm.v1.worker.cpu_worker", "CPUWorker", members=("sleep", "wake_up", "discard"), optional=True),
        PatchPoint("vllm.platforms.cpu", "CpuPlatform", members=("is_sleep_mode_available",), optional=True),
    )


WORKER_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(_WORKER, "Worker.determine_available_memory", ("self",), exact=True),
    PatchPoint(_WORKER, "Worker.execute_model", ("self", "scheduler_output")),
    PatchPoint(_WORKER, "request_memory", ("init_snapshot", "cache_config")),
    PatchPoint(
        "vllm.v1.worker.cpu_worker", "CPUWorker.determine_available_memory", ("self",), exact=True, optional=True
    ),
    PatchPoint("vllm.v1.worker.cpu_worker", "CPUWorker", members=("_should_warm_up_model",), optional=True),
)


def patch_points(
    sites: KVTensorSites = KV_TENSOR_SITES,
    pool: tuple[PatchPoint, ...] = block_pool_points(),
    configs_parameters: tuple[str, ...] = GET_KV_CACHE_CONFIGS_PARAMETERS,
    sleep: tuple[PatchPoint, ...] = sleep_points(),
) -> tuple[PatchPoint, ...]:
    """A release's patch points: the EngineCore's (with its planner's signature), the block pool's,
    the workers', sleep mode's and its KV-tensor sites'."""
    planner = PatchPoint(_CORE, "get_kv_cache_configs", configs_parameters, exact=True)
    return ENGINE_CORE_POINTS + (planner,) + pool + WORKER_POINTS + sleep + sites.points()


PATCH_POINTS = patch_points()

__all__ = [
    "ALLOCATE_KV_CACHE_PARAMETERS",
    "ENGINE_CORE_POINTS",
    "GET_KV_CACHE_CONFIGS_PARAMETERS",
    "KV_TENSOR_SITES",
    "KVTensorSites",
    "PATCH_POINTS",
    "WORKER_POINTS",
    "block_pool_points",
    "patch_points",
    "sleep_points",
]
