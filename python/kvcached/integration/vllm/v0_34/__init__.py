"""kvcached inside vLLM 0.34: vLLM 0.32's package, with what 0.34 changed under it.

What differs from 0.32 among the names kvcached patches or calls (diffed from
the two releases' sources), and what this package does about it:

* As in 0.33, ``get_kv_cache_configs`` takes the global KV cache groups
  (``v0_33.plan`` is reused).
* The V1 model runner is gone (``vllm.v1.worker.gpu_model_runner``,
  ``cpu_model_runner``): Model Runner V2 is the only runner, and the CPU build
  runs it too (``vllm.v1.worker.cpu.model_runner`` on x86, the standalone
  ``cpu.standalone_model_runner`` elsewhere). ``KV_TENSOR_SITES`` names where
  0.34's workers build KV tensors: ``gpu.attn_utils``, ``cpu.attn_utils`` and
  ``worker.utils`` (``allocate_kv_cache``), and the two runners'
  ``initialize_kv_cache``.
* ``allocate_kv_cache`` takes an ``allocate`` callback (``worker``).
* ``KVCacheBlock.pool`` is a weak reference and ``BlockPool.free_blocks``
  takes ``evict_first`` (``block_pool``).
* vLLM's own extensible KV cache, on by default on CUDA and ROCm, is turned
  off while kvcached backs the cache, and refused if asked for (``extensible``).
* A sleep-mode backend's ``suspend`` takes the storages a level-2 sleep may
  discard instead of the level, and the worker no longer saves buffers itself
  (``sleep``: kvcached keeps the rest through the sleep).

Everything else is 0.32's code, verified by the plugin front door against
``PATCH_POINTS`` before anything is patched.
"""

from __future__ import annotations

from kvcached.integration.common.front_door import PatchPoint
from kvcached.integration.common.settings import Settings

from .. import v0_32
from ..v0_32 import KVCachePoolExhausted, UnsupportedVLLMConfig, worker_kv_stats
from ..v0_32.patch_points import (
    ALLOCATE_KV_CACHE_PARAMETERS,
    KVTensorSites,
    block_pool_points,
    patch_points,
    sleep_points,
)
from ..v0_33 import plan as v0_33_plan
from . import block_pool, extensible, worker

KV_TENSOR_SITES = KVTensorSites(
    allocators=("vllm.v1.worker.utils", "vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.cpu.attn_utils"),
    runners=(
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
        "vllm.v1.worker.cpu.standalone_model_runner:StandaloneCPUModelRunner",
    ),
    optional=frozenset({"vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.cpu.standalone_model_runner"}),
    allocate_parameters=ALLOCATE_KV_CACHE_PARAMETERS + ("allocate",),
)

PATCH_POINTS: tuple[PatchPoint, ...] = patch_points(
    KV_TENSOR_SITES,
    block_pool_points(free_blocks=("self", "ordered_blocks", "evict_first")),
    configs_parameters=v0_33_plan.GET_KV_CACHE_CONFIGS_PARAMETERS,
    sleep=sleep_points(
        worker_members=("sleep_mode_backend", "_discardable_parameters"), suspend_parameters=("self", "discardable")
    ),
) + (PatchPoint("vllm.config.vllm", "VllmConfig._resolve_extensible_kv_cache", ("self",), exact=True),)


def _sleep_functions():
    from . import sleep  # imports vLLM's sleep-mode backend: only once vLLM is there

    return sleep


def install(settings: Settings) -> None:
    """Installs 0.32's patches at 0.34's places, then what 0.34 needs besides."""
    v0_32.install(
        settings,
        sites=KV_TENSOR_SITES,
        block_pool_factory=block_pool.make_block_pool_class,
        allocate_wrapper=worker.wrap_allocate_kv_cache,
        configs_wrapper=v0_33_plan.wrap_get_kv_cache_configs,
        sleep_backend=f"{__name__}.sleep",
        cpu_worker_sleep=_sleep_functions(),
    )
    from vllm.config.vllm import VllmConfig
    from vllm.v1.engine import core

    v0_32._patch(VllmConfig, "_resolve_extensible_kv_cache", extensible.wrap_resolve_extensible_kv_cache)
    if not getattr(core.get_kv_cache_configs, extensible._MARKER, False):
        refusing = extensible.wrap_refusing_get_kv_cache_configs(core.get_kv_cache_configs)
        refusing.__wrapped__ = core.get_kv_cache_configs
        setattr(refusing, extensible._MARKER, True)
        setattr(refusing, v0_32._MARKER, True)  # 0.32's install must not wrap it again
        core.get_kv_cache_configs = refusing


__all__ = [
    "KV_TENSOR_SITES",
    "PATCH_POINTS",
    "KVCachePoolExhausted",
    "UnsupportedVLLMConfig",
    "install",
    "worker_kv_stats",
]
