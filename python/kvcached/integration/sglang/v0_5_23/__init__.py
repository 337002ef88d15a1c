"""kvcached inside SGLang 0.5.23. Every private SGLang name kvcached uses is in this package.

Rationale
---------
SGLang runs one scheduler process per tensor-parallel rank. That process owns
both sides of the KV cache: the scheduler decides which token slots are in use
(``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``, radix cache,
retraction) and its in-process model runner holds the KV tensors
(``MHATokenToKVPool``) that the attention backends read and write. So, unlike
vLLM, block ids are decided where the tensors live: one kvcached ``KVPool`` per
scheduler process decides and maps locally, with no page-op messages.
Its device is the rank's own GPU, or the host for SGLang's CPU engine.
With several ranks (tensor parallelism, pipeline stages) the first rank
decides for all of them and the others replay its answers (``ranks``).

Approach
--------
* One kvcached block is one SGLang page (``page_size`` token slots, one slot at
  ``page_size`` 1); block ids are SGLang's page ids. Block 0 is SGLang's
  padding page (dummy writes of padded tokens): kvcached keeps it mapped and
  never hands it out.
* Sizing: ``KVCacheConfigurator._profile_available_bytes`` returns a virtual
  capacity (``KVCACHED_VIRTUAL_CAPACITY_BYTES``, default the device's total
  memory) instead of the free memory SGLang measured; a user's
  ``--max-total-tokens`` still caps the pool.
* Tensors: ``_resolve_kv_pool_class`` hands SGLang subclasses of
  ``MHATokenToKVPool`` / ``MLATokenToKVPool`` whose buffers are views of a
  kvcached KV space in SGLang's own NHD layout (per layer: K rows, then V rows).
* Blocks: ``_build_token_to_kv_pool_allocator`` builds allocators taking ids
  from :class:`~kvcached.integration.common.blocks.EngineBlocks`;
  ``available_size()`` is kvcached's. The paged allocator runs SGLang's own
  ``alloc_extend`` / ``alloc_decode`` kernels over exactly the pages kvcached
  gave it.
* No crash when memory runs out: SGLang checks capacity, then allocates
  later in the same step, and a failed allocation raises. kvcached therefore
  *secures* memory at the checks: the prefill budget (``create_prefill_budget``)
  and the decode check (``check_decode_capacity``) allocate the blocks they
  approve; the allocation takes those. A check that cannot secure its blocks
  says no, so requests wait in the queue or are retracted. What a step did not
  use is returned after ``Scheduler.get_next_batch_to_run``. Where SGLang would
  abort its last running request (even it cannot grow), the decode check waits
  up to ``LAST_REQUEST_WAIT_S`` for memory other engines give back.
* Fencing: the pool has no background worker, so nothing is unmapped behind the
  scheduler's back; pages are unmapped only at the end of a step or when idle,
  and kvcached synchronises the device before any unmap. With the overlap
  scheduler, frees of step N happen while step N+1 runs on the GPU; a freed
  block is reused only by later kernels of the same stream, and its page is
  unmapped only after a device synchronisation.
* Idle: at the end of ``Scheduler.on_idle`` (which runs over and over while
  the scheduler idles), before SGLang's optional idle sleep
  (``--sleep-on-idle``), kvcached evicts the radix cache down to
  ``KVCACHED_IDLE_CACHE_BYTES`` (default 0) and trims, so an idle engine holds
  only its padding page, once the engine has been idle for
  ``KVCACHED_IDLE_RELEASE_S`` (default 5 s) or at once when another instance
  on the device was refused memory or a limit is below what it holds
  (``common/idle.py``). While it holds, SGLang's idle sleep also ends when
  either comes (``sleep_waker``). SGLang's own accounting
  (``PoolStatsObserver``) counts slots, whatever memory allows.
* Each engine registers in its device's registry (``KVCACHED_NAME``), so
  ``kvctl`` shows it and ``kvctl set-limit`` steers it while it runs.
* Busy and over its limit in force (a higher priority's reclaim target,
  ``kvctl set-limit``): before each step the engine evicts cached prefixes,
  then its decode check has SGLang retract requests, until its blocks in use
  fit; the step's end unmaps the pages freed (``shrink``).
* Memory saver (``enable_memory_saver``): kvcached provides SGLang's adapter;
  ``release_memory_occupation`` puts the model's weights (a
  ``kvcached.ModelWeights`` on the rank's registry entry) and the KV cache to
  sleep, ``resume_memory_occupation`` wakes them in place (``memory_saver``).

Limitations
-----------
Refused with a logged error (SGLang then runs without kvcached): DP attention
(not run: SGLang 0.5.23's CPU build fails with it by itself), context
parallelism, multi-host engines, speculative decoding, SGLang's hybrid SWA and
Mamba / linear-attention pools (``model_families`` says why), DSA models, HiCache,
LMCache, PD disaggregation, HiSparse, the unified memory pool, KV sharding,
page-major / HND / AITER layouts, FP4 / MXFP8 KV caches, K and V of
different head dimensions. Allocations outside the scheduler's checks (none in
the paths above) still go straight to kvcached and may fail under a budget another
process took meanwhile. Run on SGLang's CPU engine (host backend); the CUDA and
ROCm paths are written for but have not run.

Files: ``plan`` (refusals, where and as what an engine runs), ``model_families``
(which pool families are backed, and why not the others), ``pools`` (KV
pools over a kvcached space), ``allocators`` (ids from kvcached, admission),
``ranks`` (several ranks: one decision, replayed everywhere) with its
allocators in ``agreed_allocators``,
``shrink`` (giving memory back while busy, when asked to hold less),
``sleep_waker`` (ending SGLang's idle sleep when the idle hold is due),
``memory_saver`` (releasing and resuming weights and KV cache), and
here the hooks that put them in SGLang's way.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from kvcached.errors import IntegrationError
from kvcached.integration.common.agreed_blocks import FollowerBlocks, LeaderBlocks
from kvcached.integration.common.front_door import PatchPoint
from kvcached.integration.common.settings import Settings

from . import plan as _plan_module
from .agreed_allocators import AgreedPagedTokenToKVPoolAllocator, AgreedTokenToKVPoolAllocator
from .allocators import (
    KvcachedPagedTokenToKVPoolAllocator,
    KvcachedPrefillBudget,
    KvcachedTokenToKVPoolAllocator,
    _KvcachedAllocator,
)
from .memory_saver import SAVER, KvcachedMemorySaverAdapter, check_planned, hook_create_adapter, hook_load_model
from .plan import Plan, building, logger, plan_for, refusals
from .pools import KvcachedMHATokenToKVPool, KvcachedMLATokenToKVPool
from .shrink import evict_while_over

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_LOAD_MODEL = "sglang.srt.model_executor.model_runner_components.load_model_utils.load_model_with_memory_saver"
_MEMORY_SAVER = "sglang.srt.utils.torch_memory_saver_adapter.TorchMemorySaverAdapter"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_POOL_STATS = "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver"


def _hook_configure(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    plan = plan_for(configurator)
    check_planned(plan)
    with building(plan):
        return original(configurator, *args, **kwargs)


def _hook_profile_available_bytes(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> int:
    plan = plan_for(configurator)
    if plan is None:
        return original(configurator, *args, **kwargs)
    logger.info("kvcached: planning SGLang's KV cache for a virtual %d bytes on %s", plan.virtual_bytes, plan.device)
    return plan.virtual_bytes


def _hook_resolve_kv_pool_class(original: Any, configurator: Any, *, kind: str, default: type) -> type:
    pool_class = original(configurator, kind=kind, default=default)
    if plan_for(configurator) is None or kind == "dsa":
        return pool_class
    ours = {MHATokenToKVPool: KvcachedMHATokenToKVPool, MLATokenToKVPool: KvcachedMLATokenToKVPool}
    if pool_class not in ours:
        raise IntegrationError(f"kvcached cannot back SGLang's {pool_class.__name__}; unset KVCACHED_ENABLE")
    return ours[pool_class]


def _hook_build_allocator(
    original: Any,
    configurator: Any,
    *,
    sizes: Any,
    token_to_kv_pool: Any,
    token_to_kv_pool_allocator: Any,
    **kwargs: Any,
) -> Any:
    if token_to_kv_pool_allocator is not None or not hasattr(token_to_kv_pool, "kvcached_blocks"):
        return original(
            configurator,
            sizes=sizes,
            token_to_kv_pool=token_to_kv_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            **kwargs,
        )
    page_size = token_to_kv_pool.page_size
    common = dict(
        dtype=configurator.kv_cache_dtype, device=configurator.device, kvcache=token_to_kv_pool, need_sort=False
    )
    blocks = token_to_kv_pool.kvcached_blocks
    agreed = isinstance(blocks, (LeaderBlocks, FollowerBlocks))  # one of several ranks
    if page_size == 1:
        cls = AgreedTokenToKVPoolAllocator if agreed else KvcachedTokenToKVPoolAllocator
        allocator = cls(sizes.max_total_num_tokens, **common)
    else:
        cls = AgreedPagedTokenToKVPoolAllocator if agreed else KvcachedPagedTokenToKVPoolAllocator
        allocator = cls(sizes.max_total_num_tokens, page_size=page_size, **common)
    SAVER.track_kv_cache(allocator)
    logger.info(
        "kvcached: SGLang's KV cache is %d pages of %d tokens over a virtual %d-byte space (%s)",
        blocks.num_blocks - 1,
        page_size,
        blocks.space.size_bytes,
        type(allocator).__name__,
    )
    return allocator


def _allocator_of(scheduler: Any) -> Optional[_KvcachedAllocator]:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    return allocator if isinstance(allocator, _KvcachedAllocator) else None


def _hook_get_next_batch_to_run(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    allocator = _allocator_of(scheduler)
    if allocator is None:
        return original(scheduler, *args, **kwargs)
    # Asked to hold less (docs/memory-policy.md): cached prefixes go before the step; if that
    # is not enough, the step's decode check has SGLang retract requests (shrink).
    evict_while_over(allocator, scheduler.tree_cache)
    plan = original(scheduler, *args, **kwargs)
    allocator.end_step()  # allocations done: unused secured memory, and pages beyond the limit, go back
    return plan


def _hook_sleep_on_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    # The last step of Scheduler.on_idle, which runs again and again while the
    # scheduler idles (with --sleep-on-idle it blocks here until the next
    # request, or 1 s). Give memory back once the idle hold has passed or the
    # device wants it; while holding, the sleep also ends when either comes.
    allocator = _allocator_of(scheduler)
    if allocator is None or not scheduler.is_fully_idle():
        return original(scheduler, *args, **kwargs)
    allocator.sleep_waker.drain()  # a wake-up that came must not end the next sleep too
    if not allocator.release_when_idle(scheduler.tree_cache, _plan_module.settings().idle_cache_bytes):
        allocator.sleep_waker.arm(allocator.idle, scheduler.idle_sleeper)
    return original(scheduler, *args, **kwargs)


def _hook_after_get_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    allocator = _allocator_of(scheduler)
    if allocator is not None:
        result.internal_state["kvcached"] = allocator.kvcached_stats()


def _hook_token_info(original: Any, observer: Any, *args: Any, **kwargs: Any) -> Any:
    stats = original(observer, *args, **kwargs)
    allocator = observer.token_to_kv_pool_allocator
    if not isinstance(allocator, _KvcachedAllocator):
        return stats
    total = observer.max_total_num_tokens
    available = allocator.logical_available_size()
    used = total - (available + stats.full_evictable_size)
    return dataclasses.replace(stats, full_available_size=available, full_num_used=used, full_token_usage=used / total)


HOOKS: list[tuple[str, Any, str]] = [
    (f"{_CONFIGURATOR}.configure", _hook_configure, "AROUND"),
    (f"{_CONFIGURATOR}._profile_available_bytes", _hook_profile_available_bytes, "AROUND"),
    (f"{_CONFIGURATOR}._resolve_kv_pool_class", _hook_resolve_kv_pool_class, "AROUND"),
    (f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", _hook_build_allocator, "AROUND"),
    (f"{_SCHEDULER}.get_next_batch_to_run", _hook_get_next_batch_to_run, "AROUND"),
    (f"{_SCHEDULER}.maybe_sleep_on_idle", _hook_sleep_on_idle, "AROUND"),
    (f"{_SCHEDULER}.get_internal_state", _hook_after_get_internal_state, "AFTER"),
    (f"{_POOL_STATS}._get_token_info", _hook_token_info, "AROUND"),
    (f"{_MEMORY_SAVER}.create", hook_create_adapter, "AROUND"),
    (_LOAD_MODEL, hook_load_model, "AROUND"),
]


def _hooked(target: str) -> PatchPoint:
    """The SGLang name a hook target ``module.Class.method`` names (as :data:`_SHAPES` says, where it matters)."""
    if target in _SHAPES:
        return _SHAPES[target]
    module_and_class, method = target.rsplit(".", 1)
    module, cls = module_and_class.rsplit(".", 1)
    return PatchPoint(module, f"{cls}.{method}")


_LOAD_MODEL_MODULE, _LOAD_MODEL_FUNCTION = _LOAD_MODEL.rsplit(".", 1)
# Hooked names whose parameters the hooks take or read.
_SHAPES: dict[str, PatchPoint] = {
    f"{_MEMORY_SAVER}.create": PatchPoint(
        "sglang.srt.utils.torch_memory_saver_adapter",
        "TorchMemorySaverAdapter.create",
        parameters=("enable",),
        exact=True,
    ),
    _LOAD_MODEL: PatchPoint(
        _LOAD_MODEL_MODULE,
        _LOAD_MODEL_FUNCTION,
        parameters=("device", "gpu_id", "memory_saver_adapter", "is_draft_worker"),
    ),
}

#: Every SGLang name kvcached hooks, verified by the plugin front door before any hook is registered.
PATCH_POINTS: tuple[PatchPoint, ...] = tuple(_hooked(target) for target, _, _ in HOOKS) + (
    PatchPoint("sglang.srt.plugins.hook_registry", "HookRegistry", members=("register",)),
    PatchPoint("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool"),
    PatchPoint("sglang.srt.mem_cache.memory_pool", "MLATokenToKVPool"),
    # What memory_saver.py subclasses, calls and overrides.
    PatchPoint(
        "sglang.srt.utils.torch_memory_saver_adapter",
        "TorchMemorySaverAdapter",
        members=("configure_subprocess", "region", "cuda_graph", "disable", "pause", "resume", "enabled"),
    ),
    PatchPoint(_LOAD_MODEL_MODULE, "LoadedModel", members=("model",)),
    PatchPoint("sglang.srt.runtime_context", "get_server_args"),
    PatchPoint("sglang.srt.runtime_context", "get_parallel"),
    PatchPoint("sglang.srt.constants", "GPU_MEMORY_TYPE_WEIGHTS"),
    PatchPoint("sglang.srt.constants", "GPU_MEMORY_TYPE_KV_CACHE"),
    PatchPoint("sglang.srt.constants", "GPU_MEMORY_TYPE_CUDA_GRAPH"),
)

_registered_pid: Optional[int] = None


def install(settings: Settings) -> None:
    """Registers kvcached's hooks with SGLang's HookRegistry (once per process).

    ``load_plugins()`` applies them right after the plugins ran.
    """
    global _registered_pid
    _plan_module.use_settings(settings)
    if _registered_pid == os.getpid():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    _registered_pid = os.getpid()


__all__ = [
    "HOOKS",
    "KvcachedMHATokenToKVPool",
    "KvcachedMLATokenToKVPool",
    "KvcachedMemorySaverAdapter",
    "KvcachedPagedTokenToKVPoolAllocator",
    "KvcachedPrefillBudget",
    "KvcachedTokenToKVPoolAllocator",
    "PATCH_POINTS",
    "Plan",
    "building",
    "install",
    "plan_for",
    "refusals",
]
