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
from collections.abc import Sequence
from typing import Any, Optional

from kvcached.errors import IntegrationError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.engine_layout import engine_layout
from kvcached.integration.common.rank_devices import RankDevice, require_one_host
from kvcached.integration.common.settings import Settings
from kvcached.layout import KVLayout

from .errors import UnsupportedVLLMConfig
from .kv_tensors import describe_groups, footprint

logger = logging.getLogger(__name__)

#: Attributes kvcached adds to vLLM objects that cross processes (EngineCore -> workers).
PLAN_ATTR = "kvcached_plan"  # on each KVCacheConfig: the EnginePlan (the scheduler's deep copy keeps it)
RANK_ATTR = "kvcached_rank"  # on each KVCacheConfig: which of the plan's ranks its worker is
PAGE_OPS_ATTR = "kvcached_page_ops"  # on SchedulerOutput: the step's PageOps batch
ENGINE_CORE_ATTR = "kvcached_engine_core"  # on the EngineCore's executor: that EngineCore (sleep mode)

#: The sleep-mode backend's name in vLLM's SleepModeBackendFactory.
BACKEND_NAME = "kvcached"
#: vLLM's default backend, which kvcached's replaces (its allocator would own the weights
#: and KV cache behind kvcached's back).
VLLM_DEFAULT_BACKEND = "cumem"


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


def sleep_mode_wanted(vllm_config: Any) -> bool:
    model_config = getattr(vllm_config, "model_config", None)
    return bool(getattr(model_config, "enable_sleep_mode", False))


def sleep_mode_refusal(vllm_config: Any) -> str | None:
    """Why sleep mode cannot run with kvcached here, or None."""
    if not sleep_mode_wanted(vllm_config):
        return None
    backend = getattr(vllm_config.model_config, "sleep_mode_backend", VLLM_DEFAULT_BACKEND)
    if backend not in (BACKEND_NAME, VLLM_DEFAULT_BACKEND):
        return (
            f"sleep mode backend {backend!r}: it would free the KV cache behind kvcached's back "
            f"(leave the default; kvcached serves sleep mode as {BACKEND_NAME!r})"
        )
    return None


def refuse_unsupported(vllm_config: Any) -> None:
    """Raises UnsupportedVLLMConfig for features kvcached cannot serve."""
    problems = []
    sleep_problem = sleep_mode_refusal(vllm_config)
    if sleep_problem:
        problems.append(sleep_problem)
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
    """The kvcached layout of one worker's KVCacheConfig, every KV cache group included.

    Layer-outermost layouts (LBHNC, LBNHC): one kvcached layer per layer slot
    of vLLM's allocation (the groups overlay the slots), ``block_bytes`` = one
    (padded) page. Block-outermost layouts (BLHNC, ...): a block is one
    contiguous run holding every layer, so the space has one "layer" and
    ``block_bytes`` = the packed block. One buffer: vLLM keeps K||V in one
    cell. See :mod:`.kv_tensors`; raises UnsupportedVLLMConfig for layouts
    one block-id space cannot cover.
    """
    found = footprint(kv_cache_config)
    return engine_layout(
        num_blocks=kv_cache_config.num_blocks,
        block_bytes=found.block_bytes,
        num_layers=found.num_layers,
        num_buffers=1,
        page_bytes=page_bytes,
    )


def _check_ranks(ranks: Sequence[RankDevice], layouts: Sequence[KVLayout]) -> None:
    """Every rank on this host, in rank order, with layouts that differ only in their layers."""
    if [rank.rank for rank in ranks] != list(range(len(layouts))):
        raise IntegrationError(
            f"kvcached: workers described ranks {[r.rank for r in ranks]} for {len(layouts)} configs"
        )
    require_one_host(ranks, ranks_called="worker", decider="the EngineCore", error=UnsupportedVLLMConfig)
    first = layouts[0]
    for rank, layout in enumerate(layouts):
        if (layout.num_blocks, layout.blocks_per_page, layout.block_bytes) != (
            first.num_blocks,
            first.blocks_per_page,
            first.block_bytes,
        ):
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
        setattr(self.model_executor, ENGINE_CORE_ATTR, self)  # its sleep gives this engine's KV memory back
        ranks = list(self.model_executor.collective_rpc("kvcached_describe_rank"))
        token = _described.set(ranks)
        try:
            return original(self, vllm_config)
        finally:
            _described.reset(token)

    return _initialize_kv_caches


def _without_kvcached(
    original: Any, vllm_config: Any, kv_cache_specs: Any, available_memory: Any, refusal: UnsupportedVLLMConfig
) -> Any:
    """A model kvcached refuses runs on vLLM's own static KV cache, of the size the user set.

    The workers reported kvcached's virtual capacity, so vLLM needs a real size
    to fall back to: ``kv_cache_memory_bytes`` (vLLM's CPU build sets it from
    ``VLLM_CPU_KVCACHE_SPACE``). Without one the refusal stands, saying so.
    """
    static_bytes = vllm_config.cache_config.kv_cache_memory_bytes
    if not static_bytes:
        raise UnsupportedVLLMConfig(
            f"{refusal} (to run it on vLLM's own KV cache with kvcached enabled, set kv_cache_memory_bytes)"
        ) from refusal
    logger.error(
        "kvcached is NOT active for this engine: %s; vLLM serves it from its own static KV cache "
        "of %d bytes per worker",
        refusal,
        static_bytes,
    )
    return original(vllm_config, kv_cache_specs, [min(static_bytes, m) for m in available_memory])


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
        try:
            layout = layout_of(configs[0], page_bytes)
        except UnsupportedVLLMConfig as exc:
            return _without_kvcached(original, vllm_config, kv_cache_specs, available_memory, exc)
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
            "kvcached: virtual KV cache of %d blocks (%s layers x %d B per block, %d B pages; groups: %s) on %s",
            layouts[0].num_blocks,
            "+".join(str(layout.num_layers) for layout in layouts),
            layouts[0].block_bytes,
            layouts[0].page_bytes,
            describe_groups(configs[0]),
            ", ".join(f"{r.label} ({r.device})" for r in ranks),
        )
        return configs

    return get_kv_cache_configs


__all__ = [
    "BACKEND_NAME",
    "ENGINE_CORE_ATTR",
    "VLLM_DEFAULT_BACKEND",
    "PAGE_OPS_ATTR",
    "PLAN_ATTR",
    "RANK_ATTR",
    "EnginePlan",
    "UnsupportedVLLMConfig",
    "layout_of",
    "refuse_unsupported",
    "settings",
    "sleep_mode_refusal",
    "sleep_mode_wanted",
    "take_board",
    "use_settings",
    "wrap_get_kv_cache_configs",
    "wrap_initialize_kv_caches",
]
