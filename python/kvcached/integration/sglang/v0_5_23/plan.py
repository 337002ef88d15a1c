"""Whether and how kvcached runs one SGLang 0.5.23 engine: refusals and the plan."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any, Optional

import torch

from kvcached.devices import parse_device
from kvcached.errors import IntegrationError
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.heap import keep_freed_heap
from kvcached.integration.common.host_populate import populate_on_touch_beside_sibling_ranks
from kvcached.integration.common.rank_devices import RankDevice, describe_rank
from kvcached.integration.common.registration import register_rank
from kvcached.integration.common.settings import Settings
from kvcached.layout import KVLayout

from .model_families import family_refusals
from .ranks import agreed_virtual_bytes, engine_ranks, first_ranks_value, open_agreed_blocks

logger = logging.getLogger(__name__)


# ServerArgs attribute -> (unsupported when, what it is). Checked before sizing,
# so a refused engine is sized and built by SGLang alone.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "attn_cp_size": (lambda v: (v or 1) > 1, "context parallelism"),
    "dcp_size": (lambda v: (v or 1) > 1, "decode context parallelism"),
    # Each attention-DP replica would decide its own blocks; not run: SGLang 0.5.23's CPU build
    # fails with DP attention by itself ('TorchNativeAttnBackend' object has no attribute
    # 'get_cpu_graph_seq_len_fill_value').
    "enable_dp_attention": (bool, "DP attention"),
    "speculative_algorithm": (bool, "speculative decoding"),
    "disaggregation_mode": (lambda v: str(v or "null") != "null", "PD disaggregation"),
    "enable_hierarchical_cache": (bool, "HiCache"),
    "enable_lmcache": (bool, "LMCache"),
    "enable_hisparse": (bool, "HiSparse"),
    "enable_unified_memory": (bool, "the unified memory pool"),
    "enable_kv_cache_sharding": (bool, "KV cache sharding"),
    "enable_page_major_kv_layout": (bool, "the page-major KV layout"),
    "prefill_only_disable_kv_cache": (bool, "prefill-only mode without KV cache"),
    "kv_cache_dtype": (lambda v: "fp4" in str(v) or "mxfp8" in str(v), "FP4 / MXFP8 KV caches"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where and as what one SGLang engine (scheduler process) runs kvcached."""

    settings: Settings
    rank: RankDevice  # the scheduler's device: the physical identity and the index it sees
    name: str
    virtual_bytes: int
    num_ranks: int = 1  # schedulers deciding the same blocks (tensor ranks x pipeline stages)

    @property
    def device(self) -> str:
        """The kvcached device this process opens ("cpu", "cuda:N", "hip:N")."""
        return self.rank.local_device

    def open_blocks(self, layout: KVLayout) -> EngineBlocks:
        """The engine's blocks and KV space, registered in its device's registry.

        On the CPU, where SGLang's scheduler also runs the model, the process
        first keeps its freed heap (:mod:`kvcached.integration.common.heap`).
        """
        if parse_device(self.device)[0] == "host":
            keep_freed_heap(self.settings.host_heap_keep_bytes)
        if self.num_ranks > 1:
            return open_agreed_blocks(self, layout)
        budget = register_rank(
            self.name,
            self.rank,
            policy=self.settings.policy,
            logger=logger,
            join=True,  # the rank's weights may be on its entry already (memory_saver)
        )
        try:
            return EngineBlocks.local(layout, device=self.device, budget=budget, name=self.name)
        except BaseException:
            budget.unregister()
            raise


_current_plan: contextvars.ContextVar[Optional[Plan]] = contextvars.ContextVar("kvcached_sglang_plan", default=None)
_settings: Optional[Settings] = None  # set by install(); read lazily otherwise
# id(KVCacheConfigurator) -> (it, its plan or None when refused); the
# configurator has __slots__, and lives as long as its model runner.
_plans: dict[int, tuple[Any, Optional[Plan]]] = {}


def settings() -> Settings:
    """The integration's settings (from the environment when the plugin did not pass them)."""
    return _settings or Settings.from_env()


def use_settings(value: Settings) -> None:
    global _settings
    _settings = value


def server_refusals(server_args: Any) -> list[str]:
    """What of the server arguments kvcached cannot run with (known before the model loads)."""
    return [what for attr, (bad, what) in _UNSUPPORTED.items() if bad(getattr(server_args, attr, None))]


def refusals(configurator: Any) -> list[str]:
    """What of this engine's configuration kvcached cannot run with (empty: nothing)."""
    found = server_refusals(configurator.server_args)
    model = configurator.model_config
    if configurator.is_draft_worker:
        found.append("draft workers")
    found.extend(family_refusals(configurator))
    if configurator.use_mla_backend and getattr(model, "index_head_dim", None):
        found.append("DSA (sparse MLA) models")
    if not configurator.use_mla_backend and model.v_head_dim not in (None, model.head_dim):
        found.append(f"K and V of different head dimensions ({model.head_dim} and {model.v_head_dim})")
    if os.environ.get("SGLANG_USE_HND_KVCACHE", "").lower() in ("1", "true"):
        found.append("the HND KV layout")
    if configurator.post_capture_kv_active:
        found.append("post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING)")
    if str(configurator.device) not in ("cpu", "cuda"):
        found.append(f"device {configurator.device!r}")
    return found


def plan_for(configurator: Any) -> Optional[Plan]:
    """kvcached's plan for the engine this configurator builds (None: refused, logged once)."""
    known = _plans.get(id(configurator))
    if known is not None and known[0] is configurator:
        return known[1]
    found = refusals(configurator)
    if found:
        logger.error(
            "kvcached is NOT active for this engine: it cannot run with %s. "
            "Unset KVCACHED_ENABLE to silence this message.",
            ", ".join(found),
        )
        _plans[id(configurator)] = (configurator, None)
        return None
    engine_settings = settings()
    server_args = configurator.server_args
    rank, num_ranks = this_rank(server_args, torch_device_of(configurator.device, configurator.gpu_id))
    virtual_bytes = engine_settings.virtual_bytes or rank.total_bytes
    plan = Plan(
        settings=engine_settings,
        rank=rank,
        name=engine_name(engine_settings, server_args, num_ranks),
        # Every rank must size the same pool (SGLang takes the smallest free memory of all ranks too).
        virtual_bytes=agreed_virtual_bytes(virtual_bytes) if num_ranks > 1 else virtual_bytes,
        num_ranks=num_ranks,
    )
    _plans[id(configurator)] = (configurator, plan)
    return plan


def torch_device_of(device: str, gpu_id: int) -> torch.device:
    """The torch device of a model runner's ``device`` ("cpu", "cuda") and ``gpu_id``."""
    return torch.device("cpu") if device == "cpu" else torch.device("cuda", gpu_id)


def this_rank(server_args: Any, torch_device: torch.device) -> tuple[RankDevice, int]:
    """This scheduler's rank and its device, and how many ranks decide the same blocks."""

    index, num_ranks = engine_ranks(server_args)
    if torch_device.type == "cpu":  # before describe_rank opens the host device
        populate_on_touch_beside_sibling_ranks(num_ranks * _replicas(server_args), logger)
    return describe_rank(torch_device, index), num_ranks


_engine_names: dict[int, str] = {}  # pid -> the engine's name, once known


def engine_name(engine_settings: Settings, server_args: Any, num_ranks: int) -> str:
    """The engine's name in the device registries, the same on every rank.

    ``KVCACHED_NAME``, or ``sglang:<model>:<pid of the first rank>``. With
    several ranks this is a collective the first time (each rank asks at the
    same point of its start: loading the model's weights, or planning its KV cache).
    """
    if engine_settings.name:
        return engine_settings.name
    name = _engine_names.get(os.getpid())
    if name is None:
        model = os.path.basename(str(server_args.model_path).rstrip("/")) or "model"
        name = f"sglang:{model}:{os.getpid()}"
        if num_ranks > 1:
            name = first_ranks_value(name)
        _engine_names[os.getpid()] = name
    return name


def _replicas(server_args: Any) -> int:
    """Data-parallel replicas: each its own engine, bound to CPUs of its own like a rank."""
    return max(1, int(getattr(server_args, "dp_size", 1) or 1))


@contextlib.contextmanager
def building(plan: Optional[Plan]) -> Iterator[None]:
    """Pools created inside take their kvcached plan from ``plan`` (SGLang builds them in ``configure``)."""
    token = _current_plan.set(plan)
    try:
        yield
    finally:
        _current_plan.reset(token)


def require_plan(pool: Any) -> Plan:
    """The plan of the engine building ``pool`` (see :func:`building`)."""
    plan = _current_plan.get()
    if plan is None:
        raise IntegrationError(f"kvcached: {type(pool).__name__} built outside an engine kvcached plans for")
    return plan
