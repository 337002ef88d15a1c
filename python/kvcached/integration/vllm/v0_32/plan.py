"""Planning vLLM 0.32's KV cache for kvcached (EngineCore): refusals, ranks, one layout per rank.

Before vLLM plans its KV cache, every worker describes its device
(``kvcached_describe_rank``, an RPC in ``EngineCore._initialize_kv_caches``):
the EngineCore never opens a device. vLLM then plans for a *virtual* capacity
(the workers report it as their free memory); kvcached rounds the block count
to whole pages (vLLM's per-layer stride must equal the KV space's) and derives
each worker's :class:`kvcached.KVLayout` from its own ``KVCacheConfig``: the
same block ids everywhere, a pipeline stage holding only its layers. The
resulting :class:`EnginePlan` rides on every worker's ``KVCacheConfig``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import socket
from typing import Any, Optional, Sequence

from kvcached.errors import IntegrationError, KvcachedError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.engine_layout import engine_layout
from kvcached.integration.common.rank_devices import RankDevice
from kvcached.integration.common.settings import Settings
from kvcached.layout import KVLayout

logger = logging.getLogger(__name__)

#: Attributes kvcached adds to vLLM objects that cross processes (EngineCore -> workers).
PLAN_ATTR = "kvcached_plan"  # on each KVCacheConfig: the EnginePlan (the scheduler's deep copy keeps it)
RANK_ATTR = "kvcached_rank"  # on each KVCacheConfig: which of the plan's ranks its worker is
PAGE_OPS_ATTR = "kvcached_page_ops"  # on SchedulerOutput: the step's PageOps batch


class UnsupportedVLLMConfig(KvcachedError, RuntimeError):
    """A vLLM feature kvcached does not support is enabled."""


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """kvcached's plan of one engine: its ranks, each rank's layout, where they acknowledge."""

    ranks: tuple[RankDevice, ...]  # by vLLM's global worker rank
    layouts: tuple[KVLayout, ...]  # rank i's layout (a pipeline stage: only its layers)
    board_path: str  # the AckBoard the ranks publish on (see kvcached.integration.common.acks)


_settings: Optional[Settings] = None
# Set by the _initialize_kv_caches wrapper while vLLM plans: the workers' devices.
_described: contextvars.ContextVar[Optional[list[RankDevice]]] = contextvars.ContextVar(
    "kvcached_vllm_ranks", default=None
)
# Boards created while planning, by path, until the engine's scheduler takes its own.
_boards: dict[str, AckBoard] = {}


def settings() -> Settings:
    """The integration's settings (from the environment when the plugin did not pass them)."""
    return _settings or Settings.from_env()


def use_settings(value: Settings) -> None:
    global _settings
    _settings = value


def take_board(path: str) -> AckBoard:
    """The board created for the plan at ``path`` (handed to the one scheduler that uses it)."""
    board = _boards.pop(path, None)
    if board is None:
        raise IntegrationError(f"kvcached: no acknowledgement board {path} was planned in this process")
    return board


def refuse_unsupported(vllm_config: Any) -> None:
    """Raises UnsupportedVLLMConfig for features kvcached cannot serve."""
    problems = []
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        problems.append("sleep mode (enable_sleep_mode): it frees the KV cache behind kvcached's back")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("KV connectors (kv_transfer_config): they register and move whole KV ranges")
    attention_config = getattr(vllm_config, "attention_config", None)
    if getattr(attention_config, "hisparse_config", None) is not None:
        problems.append("HiSparse attention: it pins blocks outside the block pool")
    if problems:
        raise UnsupportedVLLMConfig(
            "kvcached cannot run with " + "; ".join(problems) + ". Disable it or unset KVCACHED_ENABLE."
        )


def layout_of(kv_cache_config: Any, page_bytes: int) -> KVLayout:
    """The kvcached layout of one worker's KVCacheConfig; refuses hybrid layouts.

    Layer-outermost layouts (LBHNC, LBNHC, LHBNC): one kvcached layer per vLLM
    layer, ``block_bytes`` = one layer's page of one block. Block-outermost
    layouts (BLHNC, ...): a block is one contiguous run holding every layer, so
    the space has one "layer" and ``block_bytes`` = the packed block. One
    buffer: vLLM keeps K||V in one cell.
    """
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
        block_bytes, layers = tensor.block_stride, num_layers
    elif tensor.layer_stride * num_layers <= tensor.block_stride:
        block_bytes, layers = tensor.block_stride, 1
    else:
        raise UnsupportedVLLMConfig(f"unexpected KV strides (layer {tensor.layer_stride}, block {tensor.block_stride})")
    return engine_layout(num_blocks=num_blocks, block_bytes=block_bytes, num_layers=layers, num_buffers=1,
                         page_bytes=page_bytes)


def _check_ranks(ranks: Sequence[RankDevice], layouts: Sequence[KVLayout]) -> None:
    """Every rank on this host, in rank order, with layouts that differ only in their layers."""
    if [rank.rank for rank in ranks] != list(range(len(layouts))):
        raise IntegrationError(f"kvcached: workers described ranks {[r.rank for r in ranks]} for {len(layouts)} configs")
    host = socket.gethostname()
    remote = sorted({rank.host for rank in ranks} - {host})
    if remote:
        raise UnsupportedVLLMConfig(
            f"kvcached needs every worker on the EngineCore's host ({host}); workers run on {', '.join(remote)}. "
            "Unset KVCACHED_ENABLE for multi-node engines."
        )
    first = layouts[0]
    for rank, layout in enumerate(layouts):
        if (layout.num_blocks, layout.blocks_per_page, layout.block_bytes) != (
                first.num_blocks, first.blocks_per_page, first.block_bytes):
            raise UnsupportedVLLMConfig(
                f"kvcached needs the same blocks on every rank; rank {rank} has {layout}, rank 0 {first} "
                "(a block-outermost KV layout with pipeline parallelism packs different layers per stage)"
            )


def _blocks_in_whole_pages(layout: KVLayout) -> int:
    """The largest block count below the layout's whose blocks fill whole pages."""
    return layout.num_blocks // layout.blocks_per_page * layout.blocks_per_page


def wrap_initialize_kv_caches(original: Any) -> Any:
    """EngineCore: every worker describes its device before vLLM plans the KV cache."""

    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        ranks = list(self.model_executor.collective_rpc("kvcached_describe_rank"))
        token = _described.set(ranks)
        try:
            return original(self, vllm_config)
        finally:
            _described.reset(token)

    return _initialize_kv_caches


def wrap_get_kv_cache_configs(original: Any) -> Any:
    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, available_memory: Any) -> Any:
        refuse_unsupported(vllm_config)
        configs = original(vllm_config, kv_cache_specs, available_memory)
        if not configs or not configs[0].kv_cache_tensors:
            return configs  # attention-free model: nothing to back
        ranks = _described.get()
        if ranks is None:
            raise IntegrationError("kvcached: vLLM planned its KV cache without asking the workers for their devices")
        page_bytes = settings().page_bytes
        layout = layout_of(configs[0], page_bytes)
        rounded = _blocks_in_whole_pages(layout)
        if rounded < 2:
            raise IntegrationError(
                f"kvcached: virtual KV capacity of {layout.num_blocks} blocks is below one "
                f"{layout.page_bytes}-byte page per layer; raise KVCACHED_VIRTUAL_CAPACITY_BYTES"
            )
        if rounded != layout.num_blocks:
            cache_config = vllm_config.cache_config
            saved = cache_config.num_gpu_blocks_override
            cache_config.num_gpu_blocks_override = rounded
            try:
                configs = original(vllm_config, kv_cache_specs, available_memory)
            finally:
                cache_config.num_gpu_blocks_override = saved
        layouts = tuple(layout_of(config, page_bytes) for config in configs)
        _check_ranks(ranks, layouts)
        board = AckBoard.create(len(ranks))
        _boards[board.path] = board
        plan = EnginePlan(ranks=tuple(ranks), layouts=layouts, board_path=board.path)
        for rank, config in enumerate(configs):
            setattr(config, PLAN_ATTR, plan)
            setattr(config, RANK_ATTR, rank)
        logger.info(
            "kvcached: virtual KV cache of %d blocks (%s layers x %d B per block, %d B pages) on %s",
            layouts[0].num_blocks, "+".join(str(l.num_layers) for l in layouts), layouts[0].block_bytes,
            layouts[0].page_bytes, ", ".join(f"{r.label} ({r.device})" for r in ranks),
        )
        return configs

    return get_kv_cache_configs


__all__ = [
    "PAGE_OPS_ATTR",
    "PLAN_ATTR",
    "RANK_ATTR",
    "EnginePlan",
    "UnsupportedVLLMConfig",
    "layout_of",
    "refuse_unsupported",
    "settings",
    "take_board",
    "use_settings",
    "wrap_get_kv_cache_configs",
    "wrap_initialize_kv_caches",
]
