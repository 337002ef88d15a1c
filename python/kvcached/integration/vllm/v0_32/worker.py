"""vLLM 0.32's workers with kvcached: each rank's KV space, its page ops, its acknowledgements.

* ``kvcached_describe_rank`` (RPC, before planning): the worker's device, by
  its physical identity and the index it sees; creates the device's registry.
* Capacity: workers report a *virtual* KV capacity instead of profiled free memory.
* Tensors (``allocate_kv_cache``): instead of ``torch.zeros(size)`` the flat int8
  buffer is this rank's :class:`~kvcached.integration.common.space.WorkerSpace`
  (its own layout: a pipeline stage holds only its layers) with vLLM's strides,
  and vLLM's own ``create_kv_cache_views`` carves the per-layer views of every
  KV cache group over it (the groups overlay, as in vLLM's own buffer; see
  :mod:`.kv_tensors`). Minimal caches built for CUDA-graph memory profiling
  go through vLLM's original code.
* A CPU worker, which runs the model in its own process, keeps its freed heap
  (``KVCACHED_HOST_HEAP_KEEP_BYTES``, :mod:`kvcached.integration.common.heap`).
* Page ops: ``Worker.execute_model`` applies the step's batch before the model
  runner (its state update may zero new blocks); the space synchronises the
  device before unmapping and acknowledges the batch on the engine's board.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

from kvcached.errors import IntegrationError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.heap import keep_freed_heap
from kvcached.integration.common.rank_devices import RankDevice, describe_rank
from kvcached.integration.common.space import WorkerSpace

from .kv_tensors import describe_groups, describe_layers, footprint, views_over
from .plan import PAGE_OPS_ATTR, PLAN_ATTR, RANK_ATTR, settings

logger = logging.getLogger(__name__)

_spaces: dict[int, WorkerSpace] = {}  # pid -> this worker's space (a forked child must not reuse its parent's)
_passthrough = threading.local()  # set while vLLM builds a throw-away profiling cache


def _current_space() -> WorkerSpace:
    space = _spaces.get(os.getpid())
    if space is None:
        raise IntegrationError("kvcached: page ops reached a worker that has no kvcached KV space")
    return space


def worker_describe_rank(self: Any) -> RankDevice:
    """Worker RPC ``kvcached_describe_rank``: this worker's device, for the EngineCore's plan."""
    return describe_rank(self.device, self.rank)


def worker_apply_page_ops(self: Any, ops: Any) -> int:
    """Worker RPC ``kvcached_apply_page_ops`` (idle flush): apply and acknowledge; returns the seq."""
    return _current_space().apply(ops)


def worker_kv_stats(worker: Any = None) -> dict[str, Any] | None:
    """Worker RPC ``kvcached_kv_stats``: what this rank has mapped, in its own process."""
    space = _spaces.get(os.getpid())
    return space.stats() if space is not None else None


def wrap_allocate_kv_cache(original: Any) -> Any:
    def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: Any = None) -> dict:
        plan = getattr(kv_cache_config, PLAN_ATTR, None)
        if plan is None or getattr(_passthrough, "active", False):
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        from kvcached.devices import device_name_from_torch, parse_device

        rank = getattr(kv_cache_config, RANK_ATTR)
        kv_device = device_name_from_torch(device)
        if parse_device(kv_device)[0] == "host":
            # A CPU worker runs the model here: keep its freed heap (common/heap.py).
            keep_freed_heap(settings().host_heap_keep_bytes, logger)
        board = AckBoard.attach(plan.board_path, len(plan.ranks))
        space = WorkerSpace(plan.layouts[rank], device=kv_device, rank=rank, board=board)
        try:
            flat = _flat_for(space, kv_cache_config, device)
            # Every group's layers are views over the one space (groups overlay, as in vLLM's buffer).
            views = views_over(flat, kv_cache_config, layout, kernel_block_sizes)
        except BaseException:
            space.close()
            raise
        _spaces[os.getpid()] = space
        device_info = plan.ranks[rank]
        logger.info(
            "kvcached: KV cache of %d layers (%s; %s) x %d blocks is a virtual %d-byte space on %s (rank %d, %s)",
            len(views),
            describe_groups(kv_cache_config),
            describe_layers(views),
            space.space.kv_layout.num_blocks,
            flat.numel(),
            device_info.local_device,
            rank,
            device_info.device,
        )
        return views

    return allocate_kv_cache


def _flat_for(space: WorkerSpace, kv_cache_config: Any, device: Any) -> Any:
    """The space as vLLM's flat int8 buffer, once its strides are checked against vLLM's tensors."""
    import torch

    kv_layout = space.space.kv_layout
    found = footprint(kv_cache_config)
    if kv_layout.num_layers > 1 and (
        kv_layout.layer_stride_bytes != found.layer_stride or kv_layout.block_stride_bytes != found.block_bytes
    ):
        raise IntegrationError(
            f"kvcached KV space strides (layer {kv_layout.layer_stride_bytes}, block "
            f"{kv_layout.block_stride_bytes}) differ from vLLM's ({found.layer_stride}, {found.block_bytes})"
        )
    flat = space.flat_bytes().view(torch.int8)
    size = kv_cache_config.kv_cache_tensors[0].size
    if flat.numel() < size or flat.device != torch.device(device):
        raise IntegrationError(
            f"kvcached KV space ({flat.numel()} B on {flat.device}) cannot hold vLLM's "
            f"KV tensors ({size} B on {device})"
        )
    return flat


def wrap_initialize_kv_cache(original: Any) -> Any:
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


def wrap_execute_model(original: Any) -> Any:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        ops = getattr(scheduler_output, PAGE_OPS_ATTR, None)
        if ops is not None:
            _current_space().apply(ops)  # before the model runner: its state update may zero new blocks
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def cpu_determine_available_memory(self: Any) -> int:
    """CPUWorker: report the virtual capacity (vLLM plans blocks for it)."""
    if self._should_warm_up_model():
        self.model_runner.warming_up_model()  # what vLLM's own version does first
    return _virtual_capacity(self)


def wrap_gpu_determine_available_memory(original: Any) -> Any:
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
    """Virtual KV bytes to plan for: KVCACHED_VIRTUAL_CAPACITY_BYTES, else the device's memory."""
    virtual_bytes = settings().virtual_bytes
    if virtual_bytes is not None:
        return virtual_bytes
    from kvcached.devices import device_name_from_torch, open_device

    return int(open_device(device_name_from_torch(worker.device)).memory_info()[1])


def wrap_request_memory(original: Any) -> Any:
    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> int:
        try:
            return original(init_snapshot, cache_config, *args, **kwargs)
        except ValueError as exc:
            # Other engines sharing the device hold memory that kvcached can
            # take back; vLLM's startup check assumes a static partition.
            logger.warning("kvcached: ignoring vLLM's startup free-memory check: %s", exc)
            return math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)

    return request_memory


__all__ = [
    "cpu_determine_available_memory",
    "worker_apply_page_ops",
    "worker_describe_rank",
    "worker_kv_stats",
    "wrap_allocate_kv_cache",
    "wrap_execute_model",
    "wrap_gpu_determine_available_memory",
    "wrap_initialize_kv_cache",
    "wrap_request_memory",
]
