"""Patches for vLLM 0.32 (V1 engine). Every private vLLM name kvcached uses is here.

Rationale
---------
vLLM decides blocks in the EngineCore process (Scheduler -> KVCacheManager ->
BlockPool) while the KV tensors live in worker processes (always on the CPU
build, and on GPUs with tensor parallelism). kvcached splits the same way: a
device-less :class:`kvcached.pool.BlockManager` in the EngineCore decides which
block ids (and so which pages) are in use, and one :class:`kvcached.pool.KVSpace`
per worker maps and unmaps those pages in its own address space.

Approach
--------
Planning (EngineCore, ``get_kv_cache_configs``): workers report a *virtual*
capacity; vLLM plans its one-KV-tensor layout for it; the number of blocks is
rounded so that a layer's region is whole pages, and the resulting geometry
(``_GEOMETRY_ATTR``) rides on each worker's ``KVCacheConfig``.

Tensors (worker, ``allocate_kv_cache``): instead of ``torch.zeros(size)`` the
flat int8 buffer is a kvcached KV space with the same strides, and vLLM's own
``create_kv_cache_views`` carves the per-layer views the attention backend
expects. Minimal caches built for CUDA-graph memory profiling go through
vLLM's original code.

Blocks (EngineCore): :class:`KvcachedBlockPool` subclasses vLLM's BlockPool
(so prefix-cache hashing, events and metrics are vLLM's own) and is bound into
``kv_cache_coordinator``. New blocks come from the BlockManager (best-fit
pages); freed unhashed blocks go back at once; freed *hashed* blocks stay
resident as prefix-cache entries until vLLM evicts them, or until kvcached
needs their memory. If the budget is exhausted, ``allocate_slots`` returns
None, which the scheduler turns into waiting or preemption.

Ordering (option A): after every ``Scheduler.schedule`` the BlockManager's
pending :class:`kvcached.PageOps` batch is attached (as is: it pickles itself) to the ``SchedulerOutput``, which vLLM delivers
to every worker in step order. ``Worker.execute_model`` applies them before the
forward pass (``KVSpace.apply`` synchronises the device before unmapping) and
acknowledges on the step's ``ModelRunnerOutput``; ``update_from_output`` passes
the acknowledgement to the BlockManager, which only then counts unmapped memory
as released. When the engine goes idle, pending ops are flushed to all workers
with one ``collective_rpc`` (ordered with the steps on the same queue).

Limitations
-----------
Refused with a clear error: hybrid models (several KV cache groups or tensors
overlaying one allocation), sleep mode, KV connectors, HiSparse, pipeline
parallelism. With tensor parallelism only the output rank's acknowledgement
comes back; the others applied the same ops earlier in the same step (their
forward passes meet in collectives), so one mirror is tracked.
Written for the V1 and V2 model runners and for CPU, CUDA and ROCm workers; only
the CPU build with the V1 runner has been run.
"""

from __future__ import annotations

import contextvars
import copy
import itertools
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

from kvcached.errors import KvcachedError

from .registry_hook import ensure_registry, register_engine
from .settings import Settings

logger = logging.getLogger("vllm.kvcached")

#: Attribute names kvcached adds to vLLM objects that cross process boundaries.
_GEOMETRY_ATTR = "kvcached_geometry"  # on KVCacheConfig (EngineCore -> workers)
_PAGE_OPS_ATTR = "kvcached_page_ops"  # on SchedulerOutput (EngineCore -> workers)
_ACK_ATTR = "kvcached_ack"  # on ModelRunnerOutput (worker -> EngineCore)
_MARKER = "_kvcached_patched"  # on every patched function (idempotence)

_settings: Settings | None = None


class KVCachePoolExhausted(KvcachedError, ValueError):
    """kvcached cannot provide the blocks vLLM asked for right now.

    A ValueError, like the exception of vLLM's own ``get_new_blocks`` when it
    runs out; ``allocate_slots`` turns it into ``None`` (wait or preempt).
    """


class UnsupportedVLLMConfig(KvcachedError, RuntimeError):
    """A vLLM feature kvcached does not support is enabled."""


# --------------------------------------------------------------------------- #
# Geometry: how vLLM's single KV allocation maps onto a kvcached KV space.
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class KVGeometry:
    """Arguments shared by the EngineCore's BlockManager and the workers' KVSpaces.

    Layer-outermost layouts (LBHNC, LBNHC, LHBNC): one kvcached layer per vLLM
    layer, ``block_bytes`` = one layer's page of one block. Block-outermost
    layouts (BLHNC, ...): a block is one contiguous run holding every layer, so
    the space has one "layer" and ``block_bytes`` = the packed block.
    """

    num_blocks: int
    block_bytes: int
    num_layers: int
    page_bytes: int

    def layout(self) -> Any:
        """The one :class:`kvcached.KVLayout` of the EngineCore's BlockManager and
        the workers' KVSpaces: one buffer (vLLM keeps K||V in one cell),
        per-layer layout (vLLM's own strides)."""
        from kvcached import KVLayout

        return KVLayout(self.num_layers, self.block_bytes, self.num_blocks, num_buffers=1,
                        page_bytes=self.page_bytes, kind="per_layer")


def _refuse_unsupported(vllm_config: Any) -> None:
    """Raises UnsupportedVLLMConfig for features kvcached cannot serve."""
    problems = []
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        problems.append("sleep mode (enable_sleep_mode): it frees the KV cache behind kvcached's back")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("KV connectors (kv_transfer_config): they register and move whole KV ranges")
    attention_config = getattr(vllm_config, "attention_config", None)
    if getattr(attention_config, "hisparse_config", None) is not None:
        problems.append("HiSparse attention: it pins blocks outside the block pool")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism: only tensor parallelism is supported")
    if problems:
        raise UnsupportedVLLMConfig(
            "kvcached cannot run with " + "; ".join(problems) + ". Disable it or unset KVCACHED_ENABLE."
        )


def _geometry_of(kv_cache_config: Any, page_bytes: int) -> KVGeometry:
    """The kvcached geometry of one worker's KVCacheConfig; refuses hybrid layouts."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if len(groups) != 1 or len(tensors) != 1:
        raise UnsupportedVLLMConfig(
            f"kvcached supports models with one KV cache group and one KV tensor; this model "
            f"has {len(groups)} groups and {len(tensors)} tensors (hybrid attention overlays "
            "several groups on one allocation). Unset KVCACHED_ENABLE for this model."
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    tensor = tensors[0]
    if not getattr(spec, "has_layer_views", True) or tensor.host_resident or tensor.offset:
        raise UnsupportedVLLMConfig(
            f"kvcached cannot back KV cache spec {type(spec).__name__} "
            "(raw state buffers, host-resident or offset tensors)"
        )
    num_blocks = kv_cache_config.num_blocks
    num_layers = len(tensor.layers)
    if tensor.block_stride * num_blocks <= tensor.layer_stride:
        geometry = KVGeometry(num_blocks, tensor.block_stride, num_layers, page_bytes)
    elif tensor.layer_stride * num_layers <= tensor.block_stride:
        geometry = KVGeometry(num_blocks, tensor.block_stride, 1, page_bytes)
    else:
        raise UnsupportedVLLMConfig(
            f"unexpected KV strides (layer {tensor.layer_stride}, block {tensor.block_stride})"
        )
    return geometry


def _blocks_multiple(geometry: KVGeometry) -> int:
    """Smallest block count whose bytes are a whole number of pages."""
    return geometry.page_bytes // math.gcd(geometry.page_bytes, geometry.block_bytes)


# --------------------------------------------------------------------------- #
# EngineCore side: planning, BlockPool, ordering of page ops.
# --------------------------------------------------------------------------- #


class EngineKV:
    """kvcached state of one Scheduler (EngineCore process)."""

    def __init__(self, manager: Any, geometry: KVGeometry, name: str) -> None:
        self.manager = manager
        self.geometry = geometry
        self.name = name
        self.num_exhausted = 0  # allocations kvcached refused after vLLM's check passed
        self.num_preempted = 0  # requests vLLM preempted (for lack of KV memory)
        self.registry_handle: Any = None
        self.block_pool: Any = None

    def take_ops(self) -> Any:
        """The pending :class:`kvcached.PageOps` batch (what travels to the
        workers, as is), or None when there is none."""
        ops = self.manager.take_page_ops()
        return ops if ops else None

    def acknowledge(self, seq: int | None) -> None:
        if seq is not None:
            self.manager.acknowledge(0, seq)  # an older seq is a no-op

    def stats(self) -> dict[str, Any]:
        stats = dict(self.manager.stats())
        stats.update(
            name=self.name,
            pid=os.getpid(),
            available_blocks=int(self.manager.available()),
            sent_seq=stats["last_seq"],
            acked_seq=stats["mirrors"][0]["acked_seq"],
            num_exhausted=self.num_exhausted,
            num_preempted=self.num_preempted,
            **{f"geometry_{k}": v for k, v in self.geometry.layout().as_dict().items()},
        )
        return stats


# Set by the Scheduler wrapper while vLLM builds its KVCacheManager, read by
# KvcachedBlockPool.__init__ (BlockPool's signature has no room for it).
_building: contextvars.ContextVar[EngineKV | None] = contextvars.ContextVar(
    "kvcached_building_engine", default=None
)


def _make_block_pool_class(base: type) -> type:
    class KvcachedBlockPool(base):  # type: ignore[misc, valid-type]
        """vLLM's BlockPool with blocks (and their memory) from kvcached.

        Invariant: a block is allocated in kvcached iff it is in use
        (``ref_cnt > 0``, or the null block) or it is a free block that still
        holds a prefix-cache entry (``_resident_free``). vLLM's free queue keeps
        its meaning (every block with ``ref_cnt == 0``); kvcached chooses which
        of the uncached ones to hand out.

        ``_resident_free`` is kept in the order the blocks were freed, which is
        their order in vLLM's free queue (least recently used first), so
        eviction visits only resident blocks instead of walking the queue past
        every never-used block.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engine = _building.get()
            self._kv = engine
            self._resident_free: dict[int, None] = {}  # block id -> None, least recently freed first
            self._available = engine.manager.available if engine is not None else None
            self._count_queue_only = False
            if engine is not None and engine.geometry.num_blocks != self.num_gpu_blocks:
                raise RuntimeError(
                    f"kvcached planned {engine.geometry.num_blocks} blocks, "
                    f"vLLM's BlockPool has {self.num_gpu_blocks}"
                )

        # -- allocation ---------------------------------------------------- #
        def get_new_blocks(self, num_blocks: int) -> list:
            if self._kv is None:
                return super().get_new_blocks(num_blocks)
            if num_blocks == 0:
                return []
            ids = self._alloc_ids(num_blocks)
            blocks = [self.blocks[i] for i in ids]
            queue = self.free_block_queue
            for block in blocks:
                queue.remove(block)
            if self._reuse_watchers:
                self._notify_reuse(blocks)
            for block in blocks:
                if self.enable_caching:
                    self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0, f"kvcached handed out block {block.block_id} in use"
                block.ref_cnt = 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
            return blocks

        def _alloc_ids(self, num_blocks: int) -> list[int]:
            import kvcached

            manager = self._kv.manager
            # Give back prefix-cache blocks nobody uses first when kvcached is
            # short (cheaper than a refused alloc), then once more if the
            # budget moved in between.
            self._evict_resident_until(num_blocks)
            try:
                return manager.alloc(num_blocks).tolist()
            except kvcached.OutOfMemoryError:
                pass
            self._evict_resident_until(num_blocks)
            try:
                return manager.alloc(num_blocks).tolist()
            except kvcached.OutOfMemoryError as exc:
                self._kv.num_exhausted += 1
                raise KVCachePoolExhausted(
                    f"kvcached cannot provide {num_blocks} blocks now: {exc}"
                ) from exc

        def _evict_resident_until(self, num_blocks: int) -> None:
            """Evicts resident prefix-cache blocks, least recently used first,
            until kvcached has ``num_blocks`` available (each one freed adds one)."""
            manager = self._kv.manager
            while self._resident_free:
                shortfall = num_blocks - int(manager.available())
                if shortfall <= 0:
                    return
                oldest = list(itertools.islice(self._resident_free, shortfall))
                self._evict_resident([self.blocks[i] for i in oldest])

        def _evict_resident(self, blocks: list) -> None:
            """Drops these resident blocks' prefix-cache entries (vLLM's eviction:
            hashes, events) and frees them in kvcached with one call."""
            released = []
            for block in blocks:
                super()._maybe_evict_cached_block(block)
                self._resident_free.pop(block.block_id, None)
                if block.block_hash is None and block.ref_cnt == 0:
                    released.append(block.block_id)
            if released:
                self._kv.manager.free(released)

        # -- release ------------------------------------------------------- #
        def free_blocks(self, ordered_blocks: Any) -> None:
            if self._kv is None:
                return super().free_blocks(ordered_blocks)
            blocks = list(ordered_blocks)
            super().free_blocks(blocks)
            release: dict[int, None] = {}
            for block in blocks:
                if block.pool is not None and block.pool is not self:
                    continue
                if block.ref_cnt != 0 or block.is_null:
                    continue
                if block.block_hash is None or not self.enable_caching:
                    release[block.block_id] = None
                else:
                    self._resident_free.pop(block.block_id, None)  # now the most recently freed
                    self._resident_free[block.block_id] = None
            if release:
                self._kv.manager.free(list(release))

        def touch(self, blocks: Any) -> None:
            super().touch(blocks)
            if self._kv is not None and self._resident_free:
                for block in blocks:
                    if block.ref_cnt > 0:
                        self._resident_free.pop(block.block_id, None)

        def _maybe_evict_cached_block(self, block: Any) -> bool:
            evicted = super()._maybe_evict_cached_block(block)
            if (
                self._kv is not None
                and block.block_id in self._resident_free
                and block.block_hash is None
                and block.ref_cnt == 0
            ):
                del self._resident_free[block.block_id]
                self._kv.manager.free([block.block_id])
            return evicted

        def release_cached_blocks(self, keep_bytes: int) -> int:
            """Evicts unused prefix-cache blocks (LRU first) beyond ``keep_bytes``.

            An idle engine keeps no more than that much memory for hits; the
            rest goes back to the shared budget. Returns the blocks released.
            """
            if self._kv is None or not self._resident_free:
                return 0
            geometry = self._kv.geometry
            keep = keep_bytes // (geometry.block_bytes * geometry.num_layers)
            excess = max(0, len(self._resident_free) - keep)
            oldest = list(itertools.islice(self._resident_free, excess))
            self._evict_resident([self.blocks[i] for i in oldest])
            return len(oldest)

        def reset_prefix_cache(self) -> bool:
            if self._kv is None:
                return super().reset_prefix_cache()
            self._count_queue_only = True  # vLLM's "all blocks free" test
            try:
                reset = super().reset_prefix_cache()
            finally:
                self._count_queue_only = False
            if reset and self._resident_free:
                self._kv.manager.free(sorted(self._resident_free))
                self._resident_free.clear()
            return reset

        # -- accounting ---------------------------------------------------- #
        def get_num_free_blocks(self) -> int:
            # Called for every request in every step: read the queue's count
            # directly (what BlockPool's own version does) and use the bound method.
            queued = self.free_block_queue.num_free_blocks
            if self._available is None or self._count_queue_only:
                return queued
            return min(queued, self._available() + len(self._resident_free))

    KvcachedBlockPool.__qualname__ = KvcachedBlockPool.__name__ = "KvcachedBlockPool"
    return KvcachedBlockPool


def _engine_name(vllm_config: Any, settings: Settings) -> str:
    if settings.name:
        return settings.name
    model = os.path.basename(str(vllm_config.model_config.model).rstrip("/")) or "model"
    return f"vllm:{model}:{os.getpid()}"


def _registry_device(vllm_config: Any) -> str:
    """The registry name of the device the workers map on, found without opening it.

    With tensor parallelism every worker maps the same pages on its own device;
    the engine registers on the first one (rank 0: local device 0).
    """
    kind = str(vllm_config.device_config.device_type or "cpu")
    if kind == "cpu":
        return "cpu"
    import torch

    return f"{'rocm' if getattr(torch.version, 'hip', None) else kind}:0"


def _physical_limit(vllm_config: Any, settings: Settings) -> int | None:
    if settings.limit_bytes is not None:
        return settings.limit_bytes
    return vllm_config.cache_config.kv_cache_memory_bytes


def _wrap_get_kv_cache_configs(original: Any) -> Any:
    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, available_memory: Any) -> Any:
        _refuse_unsupported(vllm_config)
        configs = original(vllm_config, kv_cache_specs, available_memory)
        if not configs or not configs[0].kv_cache_tensors:
            return configs  # attention-free model: nothing to back
        page_bytes = _settings.page_bytes
        geometry = _geometry_of(configs[0], page_bytes)
        multiple = _blocks_multiple(geometry)
        rounded = geometry.num_blocks // multiple * multiple
        if rounded < 2:
            raise RuntimeError(
                f"kvcached: virtual KV capacity of {geometry.num_blocks} blocks is below one "
                f"{page_bytes}-byte page per layer; raise KVCACHED_VIRTUAL_CAPACITY_BYTES"
            )
        if rounded != geometry.num_blocks:
            cache_config = vllm_config.cache_config
            saved = cache_config.num_gpu_blocks_override
            cache_config.num_gpu_blocks_override = rounded
            try:
                configs = original(vllm_config, kv_cache_specs, available_memory)
            finally:
                cache_config.num_gpu_blocks_override = saved
        geometries = {_geometry_of(config, page_bytes) for config in configs}
        if len(geometries) != 1:
            raise UnsupportedVLLMConfig(f"workers need different KV geometries: {geometries}")
        geometry = geometries.pop()
        for config in configs:
            setattr(config, _GEOMETRY_ATTR, geometry)
        logger.info(
            "kvcached: virtual KV cache of %d blocks (%d layers x %d B per block, %d B pages)",
            geometry.num_blocks,
            geometry.num_layers,
            geometry.block_bytes,
            geometry.page_bytes,
        )
        return configs

    return get_kv_cache_configs


def _wrap_scheduler_init(original: Any) -> Any:
    def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        geometry = getattr(kv_cache_config, _GEOMETRY_ATTR, None)
        if geometry is None:  # not planned by kvcached (e.g. attention-free model)
            return original(self, vllm_config, kv_cache_config, *args, **kwargs)
        from kvcached.layout import block_manager_options
        from kvcached.pool import BlockManager

        _refuse_unsupported(vllm_config)
        name = _engine_name(vllm_config, _settings)
        # The device's shared budget; the engine's own limit lives in the
        # registry too, so that ``kvctl set-limit`` can change it while it runs.
        budget = register_engine(
            name,
            device=_registry_device(vllm_config),
            limit_bytes=_physical_limit(vllm_config, _settings),
        )
        manager = BlockManager(
            geometry.layout(),
            # Page ops are taken at each schedule(); a thread producing them
            # in between would only make the order harder to reason about.
            block_manager_options(background_worker=False, spares=False),
            budget=budget,
            mirrors=1,
            name=name,
        )
        manager.alloc_ids([0])  # vLLM's null block: always mapped, never handed out
        engine = EngineKV(manager, geometry, name)
        engine.registry_handle = budget
        token = _building.set(engine)
        try:
            original(self, vllm_config, kv_cache_config, *args, **kwargs)
        finally:
            _building.reset(token)
        pool = self.kv_cache_manager.block_pool
        if getattr(pool, "_kv", None) is not engine:
            raise RuntimeError("kvcached: vLLM did not build its BlockPool through kvcached's subclass")
        self._kvcached = engine
        engine.block_pool = pool

    return __init__


def _wrap_allocate_slots(original: Any) -> Any:
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # Runs for every scheduled request in every step: kvcached serves one
        # KV cache group (others are refused), so look at its manager directly.
        request_id = request.request_id
        managers = self.coordinator.single_type_managers
        if len(managers) == 1:
            had_blocks = request_id in managers[0].req_to_blocks
        else:
            had_blocks = any(request_id in manager.req_to_blocks for manager in managers)
        try:
            return original(self, request, *args, **kwargs)
        except KVCachePoolExhausted as exc:
            if not had_blocks:
                # Undo the prefix-hit touches of a request that got nothing.
                self.coordinator.free(request_id)
            logger.debug("kvcached: %s waits or is preempted: %s", request_id, exc)
            return None

    return allocate_slots


def _wrap_schedule(original: Any) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        engine = getattr(self, "_kvcached", None)
        if engine is not None:
            ops = engine.take_ops()
            if ops is not None:
                setattr(output, _PAGE_OPS_ATTR, ops)
        return output

    return schedule


def _wrap_preempt_request(original: Any) -> Any:
    def _preempt_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self, "_kvcached", None)
        if engine is not None:
            engine.num_preempted += 1
        return original(self, *args, **kwargs)

    return _preempt_request


def _wrap_update_from_output(original: Any) -> Any:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        engine = getattr(self, "_kvcached", None)
        if engine is not None:
            engine.acknowledge(getattr(model_runner_output, _ACK_ATTR, None))
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


def _flush_if_idle(engine_core: Any) -> None:
    """Sends pending page ops to every worker when no step will carry them."""
    scheduler = getattr(engine_core, "scheduler", None)
    engine = getattr(scheduler, "_kvcached", None)
    # Unfinished requests mean another schedule() will carry the ops. Finished
    # ones whose ids are still to be reported do not: an in-process front end
    # stops stepping as soon as it has their outputs.
    if (
        engine is None
        or scheduler.get_num_unfinished_requests() > 0
        or getattr(engine_core, "batch_queue", None)
    ):
        return
    engine.block_pool.release_cached_blocks(keep_bytes=_settings.idle_cache_bytes)
    engine.manager.trim()  # reserve pages too: an idle engine holds only the null block's page
    ops = engine.take_ops()
    if ops is None:
        return
    acks = engine_core.model_executor.collective_rpc("kvcached_apply_page_ops", args=(ops,))
    if not isinstance(acks, list):
        acks = [acks]
    engine.acknowledge(min(acks))


def _wrap_flushing(original: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _flush_if_idle(self)
        return result

    return method


def _engine_core_kvcached_stats(self: Any) -> dict[str, Any] | None:
    """EngineCore utility: kvcached's view of this engine (None if not active)."""
    engine = getattr(getattr(self, "scheduler", None), "_kvcached", None)
    return engine.stats() if engine is not None else None


# --------------------------------------------------------------------------- #
# Worker side: the KV space, applying page ops, acknowledging.
# --------------------------------------------------------------------------- #


class WorkerKV:
    """The kvcached KV space of one worker process."""

    def __init__(self, space: Any, geometry: KVGeometry) -> None:
        self.space = space
        self.geometry = geometry
        self.pending_ack: int | None = None

    def apply(self, ops: Any) -> int:
        """Applies a PageOps batch (in order; the device is synchronised before
        unmapping) and returns the seq to acknowledge."""
        return self.space.apply(ops)

    def stats(self) -> dict[str, Any]:
        mapped_pages = self.space.mapped_pages
        return {
            "pid": os.getpid(),
            "mapped_pages": mapped_pages,
            "mapped_bytes": mapped_pages * self.space.kv_layout.page_id_bytes,
            "applied_seq": self.space.applied_seq,
        }


_worker: dict[int, WorkerKV] = {}  # pid -> state (a forked child must not reuse its parent's)
_passthrough = threading.local()  # set while vLLM builds a throw-away profiling cache


def _current_worker() -> WorkerKV:
    state = _worker.get(os.getpid())
    if state is None:
        raise RuntimeError("kvcached: page ops reached a worker that has no kvcached KV space")
    return state


def _worker_apply_page_ops(self: Any, ops: Any) -> int:
    """Worker RPC ``kvcached_apply_page_ops`` (idle flush): apply, return the acknowledgement."""
    return _current_worker().apply(ops)


def worker_kv_stats(worker: Any = None) -> dict[str, Any] | None:
    """Worker RPC ``kvcached_kv_stats``: pages this worker process has mapped."""
    state = _worker.get(os.getpid())
    return state.stats() if state is not None else None


def _kvcached_device(device: Any, for_registry: bool = False) -> str:
    """kvcached's name of a torch device ("cpu", "cuda:N", "hip:N"; registry: "rocm:N")."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    kind = device.type
    if kind == "cuda" and getattr(torch.version, "hip", None):  # PyTorch's ROCm build
        kind = "rocm" if for_registry else "hip"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{kind}:{index}"


def _wrap_allocate_kv_cache(original: Any) -> Any:
    def allocate_kv_cache(
        kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: Any = None
    ) -> dict:
        geometry = getattr(kv_cache_config, _GEOMETRY_ATTR, None)
        if geometry is None or getattr(_passthrough, "active", False):
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        import torch
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

        from kvcached.layout import space_options
        from kvcached.pool import KVSpace

        space = KVSpace(geometry.layout(), _kvcached_device(device), space_options(zero_backing=True))
        (tensor,) = kv_cache_config.kv_cache_tensors
        (group,) = kv_cache_config.kv_cache_groups
        if geometry.num_layers > 1 and (
            space.layer_stride_bytes != tensor.layer_stride
            or space.block_stride_bytes != tensor.block_stride
        ):
            raise RuntimeError(
                f"kvcached KV space strides (layer {space.layer_stride_bytes}, block "
                f"{space.block_stride_bytes}) differ from vLLM's ({tensor.layer_stride}, "
                f"{tensor.block_stride})"
            )
        flat = torch.from_dlpack(space.tensor()).view(torch.int8)
        if flat.numel() < tensor.size or flat.device != torch.device(device):
            raise RuntimeError(
                f"kvcached KV space ({flat.numel()} B on {flat.device}) cannot hold vLLM's "
                f"KV tensor ({tensor.size} B on {device})"
            )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        kernel_block_size = kernel_block_sizes[0] if kernel_block_sizes else None
        views = create_kv_cache_views(
            flat,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size,
        )
        _worker[os.getpid()] = WorkerKV(space, geometry)
        logger.info(
            "kvcached: KV cache of %d layers x %d blocks is a virtual %d-byte space on %s",
            len(tensor.layers),
            geometry.num_blocks,
            flat.numel(),
            _kvcached_device(device),
        )
        return dict(zip(tensor.layers, views))

    return allocate_kv_cache


def _wrap_initialize_kv_cache(original: Any) -> Any:
    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        is_profiling = kwargs.get("is_profiling", args[0] if args else False)
        if not is_profiling:
            return original(self, kv_cache_config, *args, **kwargs)
        _passthrough.active = True  # CUDA-graph profiling builds a minimal throw-away cache
        try:
            return original(self, kv_cache_config, *args, **kwargs)
        finally:
            _passthrough.active = False

    return initialize_kv_cache


def _attach_ack(output: Any, seq: int) -> Any:
    """Returns the step's output carrying ``seq`` (copied: vLLM reuses a constant)."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    if isinstance(output, ModelRunnerOutput):
        output = copy.copy(output)
        setattr(output, _ACK_ATTR, seq)
    elif isinstance(output, AsyncModelRunnerOutput):
        get_output = output.get_output

        def get_output_with_ack() -> Any:
            result = copy.copy(get_output())
            setattr(result, _ACK_ATTR, seq)
            return result

        output.get_output = get_output_with_ack  # type: ignore[method-assign]
    return output


def _take_pending_ack(output: Any) -> Any:
    state = _worker.get(os.getpid())
    if state is None or state.pending_ack is None or output is None:
        return output
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    if not isinstance(output, (ModelRunnerOutput, AsyncModelRunnerOutput)):
        return output  # e.g. intermediate tensors: acknowledge with the sampled output
    seq, state.pending_ack = state.pending_ack, None
    return _attach_ack(output, seq)


def _wrap_execute_model(original: Any) -> Any:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        ops = getattr(scheduler_output, _PAGE_OPS_ATTR, None)
        if ops is not None:
            # Before the model runner: its state update may zero new blocks.
            _current_worker().pending_ack = _current_worker().apply(ops)
        return _take_pending_ack(original(self, scheduler_output, *args, **kwargs))

    return execute_model


def _wrap_sample_tokens(original: Any) -> Any:
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _take_pending_ack(original(self, *args, **kwargs))

    return sample_tokens


def _cpu_determine_available_memory(self: Any) -> int:
    """CPUWorker: report the virtual capacity (vLLM plans blocks for it)."""
    if self._should_warm_up_model():
        self.model_runner.warming_up_model()  # what vLLM's own version does first
    return _virtual_capacity(self)


def _wrap_gpu_determine_available_memory(original: Any) -> Any:
    def determine_available_memory(self: Any) -> int:
        # vLLM's explicit-size path: still compiles/profiles, skips the
        # free-memory arithmetic that kvcached makes meaningless.
        cache_config = self.cache_config
        saved = cache_config.kv_cache_memory_bytes
        cache_config.kv_cache_memory_bytes = _virtual_capacity(self)
        try:
            return original(self)
        finally:
            cache_config.kv_cache_memory_bytes = saved

    return determine_available_memory


def _virtual_capacity(worker: Any) -> int:
    """Virtual KV bytes to plan for; also makes sure the device's registry exists
    (the worker has the device open, the EngineCore must not open it)."""
    import torch

    device = torch.device(getattr(worker, "device", None) or "cpu")
    if device.type == "cpu":
        total_bytes = None  # the registry sizes the host budget itself
        default_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        total_bytes = default_bytes = torch.cuda.mem_get_info(device)[1]
    ensure_registry(_kvcached_device(device, for_registry=True), total_bytes)
    return _settings.virtual_bytes if _settings.virtual_bytes is not None else default_bytes


def _wrap_request_memory(original: Any) -> Any:
    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> int:
        try:
            return original(init_snapshot, cache_config, *args, **kwargs)
        except ValueError as exc:
            # Other engines sharing the device hold memory that kvcached can
            # take back; vLLM's startup check assumes a static partition.
            logger.warning("kvcached: ignoring vLLM's startup free-memory check: %s", exc)
            return math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)

    return request_memory


# --------------------------------------------------------------------------- #
# Installation.
# --------------------------------------------------------------------------- #


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


def install(settings: Settings) -> None:
    """Installs every patch; pure attribute swaps, safe in every vLLM process."""
    global _settings
    _settings = settings

    import importlib

    from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.sched import scheduler
    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_model_runner, gpu_worker, utils as worker_utils

    # EngineCore: planning, block pool, ordering, idle flush.
    _patch(core, "get_kv_cache_configs", _wrap_get_kv_cache_configs)
    if not getattr(kv_cache_coordinator.BlockPool, _MARKER, False):
        pool_class = _make_block_pool_class(block_pool.BlockPool)
        setattr(pool_class, _MARKER, True)
        kv_cache_coordinator.BlockPool = pool_class
    _patch(scheduler.Scheduler, "__init__", _wrap_scheduler_init)
    _patch(scheduler.Scheduler, "schedule", _wrap_schedule)
    _patch(scheduler.Scheduler, "update_from_output", _wrap_update_from_output)
    _patch(scheduler.Scheduler, "_preempt_request", _wrap_preempt_request)
    _patch(kv_cache_manager.KVCacheManager, "allocate_slots", _wrap_allocate_slots)
    for method in ("step", "step_with_batch_queue", "abort_requests"):
        _patch(core.EngineCore, method, _wrap_flushing)
    _set(core.EngineCore, "kvcached_stats", _engine_core_kvcached_stats)

    # Workers: virtual capacity, KV space, page ops.
    _patch(gpu_worker.Worker, "determine_available_memory", _wrap_gpu_determine_available_memory)
    _patch(gpu_worker, "request_memory", _wrap_request_memory)
    _patch(gpu_worker.Worker, "execute_model", _wrap_execute_model)
    _patch(gpu_worker.Worker, "sample_tokens", _wrap_sample_tokens)
    _set(gpu_worker.Worker, "kvcached_apply_page_ops", _worker_apply_page_ops)
    _set(gpu_worker.Worker, "kvcached_kv_stats", worker_kv_stats)
    _patch(gpu_model_runner.GPUModelRunner, "initialize_kv_cache", _wrap_initialize_kv_cache)
    for module in (gpu_model_runner, worker_utils):
        _patch(module, "allocate_kv_cache", _wrap_allocate_kv_cache)
    optional = {
        "vllm.v1.worker.cpu_worker": lambda m: _set(
            m.CPUWorker, "determine_available_memory", _cpu_determine_available_memory
        ),
        "vllm.v1.worker.gpu.attn_utils": lambda m: _patch(m, "allocate_kv_cache", _wrap_allocate_kv_cache),
        "vllm.v1.worker.gpu.model_runner": lambda m: _patch(
            m.GPUModelRunner, "initialize_kv_cache", _wrap_initialize_kv_cache
        ),
    }
    for name, apply in optional.items():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # that worker / runner is not part of this build
            logger.debug("kvcached: skipping %s (%s)", name, exc)
            continue
        apply(module)
