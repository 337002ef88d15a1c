"""kvcached inside SGLang 0.5.23. Every private SGLang name kvcached uses is here.

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
* Idle: ``Scheduler.on_idle`` evicts the radix cache down to
  ``KVCACHED_IDLE_CACHE_BYTES`` (default 0) and trims, so an idle engine holds
  only its padding page; SGLang's own accounting (``PoolStatsObserver``) counts
  slots, whatever memory allows.
* Each engine registers in its device's registry (``KVCACHED_NAME``), so
  ``kvctl`` shows it and ``kvctl set-limit`` steers it while it runs.

Limitations
-----------
Refused with a logged error (SGLang then runs without kvcached): tensor, pipeline,
data or context parallelism (each rank decides for itself, and the ranks'
decisions must stay identical while kvcached's answers depend on each rank's own
device budget), speculative decoding, hybrid SWA / Mamba / DSA models, HiCache,
LMCache, PD disaggregation, HiSparse, the unified memory pool, memory saver, KV
sharding, page-major / HND / AITER layouts, FP4 / MXFP8 KV caches, K and V of
different head dimensions. Allocations outside the scheduler's checks (none in
the paths above) still go straight to kvcached and may fail under a budget another
process took meanwhile. Run on SGLang's CPU engine (host backend); the CUDA and
ROCm paths are written for but have not run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import os
import time
from typing import Any, Iterator, Optional

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.utils import get_num_new_pages

from kvcached.errors import OutOfMemoryError
from kvcached.geometry import sglang_views, strided_bytes_view
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.devices import kvcached_device_name
from kvcached.integration.common.geometry import KVGeometry
from kvcached.integration.common.registration import ensure_registry, register_engine
from kvcached.integration.common.settings import Settings

logger = logging.getLogger("sglang.srt.kvcached")

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_POOL_STATS = "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver"
#: How long the last running request waits for memory before SGLang aborts it.
LAST_REQUEST_WAIT_S = 30.0

# ServerArgs attribute -> (unsupported when, what it is). Checked before sizing,
# so a refused engine is sized and built by SGLang alone.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "tp_size": (lambda v: (v or 1) > 1, "tensor parallelism"),
    "pp_size": (lambda v: (v or 1) > 1, "pipeline parallelism"),
    "dp_size": (lambda v: (v or 1) > 1, "data parallelism"),
    "attn_cp_size": (lambda v: (v or 1) > 1, "context parallelism"),
    "dcp_size": (lambda v: (v or 1) > 1, "decode context parallelism"),
    "enable_dp_attention": (bool, "DP attention"),
    "speculative_algorithm": (bool, "speculative decoding"),
    "disaggregation_mode": (lambda v: str(v or "null") != "null", "PD disaggregation"),
    "enable_hierarchical_cache": (bool, "HiCache"),
    "enable_lmcache": (bool, "LMCache"),
    "enable_hisparse": (bool, "HiSparse"),
    "enable_unified_memory": (bool, "the unified memory pool"),
    "enable_memory_saver": (bool, "the memory saver"),
    "enable_kv_cache_sharding": (bool, "KV cache sharding"),
    "enable_page_major_kv_layout": (bool, "the page-major KV layout"),
    "prefill_only_disable_kv_cache": (bool, "prefill-only mode without KV cache"),
    "kv_cache_dtype": (lambda v: "fp4" in str(v) or "mxfp8" in str(v), "FP4 / MXFP8 KV caches"),
}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where and as what one SGLang engine (scheduler process) runs kvcached."""

    settings: Settings
    device: str  # kvcached device ("cpu", "cuda:N", "hip:N")
    registry_device: str  # its registry ("cpu", "cuda:N", "rocm:N")
    name: str
    virtual_bytes: int

    def open_blocks(self, geometry: KVGeometry) -> EngineBlocks:
        budget = register_engine(
            self.name, device=self.registry_device, limit_bytes=self.settings.limit_bytes, logger=logger
        )
        return EngineBlocks.local(geometry, device=self.device, budget=budget, name=self.name)


_current_plan: contextvars.ContextVar[Optional[_Plan]] = contextvars.ContextVar("kvcached_sglang_plan", default=None)
_settings: Optional[Settings] = None
# id(KVCacheConfigurator) -> (it, its plan or None when refused); the
# configurator has __slots__, and lives as long as its model runner.
_plans: dict[int, tuple[Any, Optional[_Plan]]] = {}


def _refusals(configurator: Any) -> list[str]:
    server_args = configurator.server_args
    found = [what for attr, (bad, what) in _UNSUPPORTED.items() if bad(getattr(server_args, attr, None))]
    model = configurator.model_config
    if configurator.is_draft_worker:
        found.append("draft workers")
    if configurator.is_hybrid_swa or configurator.mambaish_config is not None:
        found.append("hybrid SWA / Mamba models")
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


def _plan_for(configurator: Any) -> Optional[_Plan]:
    """kvcached's plan for the engine this configurator builds (None: refused, logged once)."""
    known = _plans.get(id(configurator))
    if known is not None and known[0] is configurator:
        return known[1]
    refusals = _refusals(configurator)
    if refusals:
        logger.error("kvcached is NOT active for this engine: it cannot run with %s. "
                     "Unset KVCACHED_ENABLE to silence this message.", ", ".join(refusals))
        _plans[id(configurator)] = (configurator, None)
        return None
    from kvcached.devices import open_device

    settings = _settings or Settings.from_env()
    torch_device = torch.device("cpu") if configurator.device == "cpu" else torch.device("cuda", configurator.gpu_id)
    device = kvcached_device_name(torch_device)
    registry_device = kvcached_device_name(torch_device, registry=True)
    total_bytes = int(open_device(device).memory_info()[1])
    ensure_registry(registry_device, None if device == "cpu" else total_bytes)
    model = os.path.basename(str(configurator.server_args.model_path).rstrip("/")) or "model"
    plan = _Plan(
        settings=settings,
        device=device,
        registry_device=registry_device,
        name=settings.name or f"sglang:{model}:{os.getpid()}",
        virtual_bytes=settings.virtual_bytes or total_bytes,
    )
    _plans[id(configurator)] = (configurator, plan)
    return plan


@contextlib.contextmanager
def building(plan: Optional[_Plan]) -> Iterator[None]:
    """Pools created inside take their kvcached plan from ``plan`` (SGLang builds them in ``configure``)."""
    token = _current_plan.set(plan)
    try:
        yield
    finally:
        _current_plan.reset(token)


def _geometry(num_blocks: int, block_bytes: int, num_layers: int, num_buffers: int, page_bytes: int) -> KVGeometry:
    # A page must hold whole blocks: round the page up to a common multiple.
    page_bytes = page_bytes * block_bytes // math.gcd(page_bytes, block_bytes)
    return KVGeometry(num_blocks, block_bytes, num_layers, num_buffers, page_bytes)


def _require_plan(pool: Any) -> _Plan:
    plan = _current_plan.get()
    if plan is None:
        raise RuntimeError(f"kvcached: {type(pool).__name__} built outside an engine kvcached plans for")
    return plan


# --------------------------------------------------------------------------- #
# KV pools: SGLang's buffers as views of a kvcached KV space.
# --------------------------------------------------------------------------- #


class KvcachedMHATokenToKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose per-layer K and V buffers are kvcached views (NHD)."""

    def _create_buffers_normal(self) -> None:
        if self.kv_cache_layout != "nhd":
            raise RuntimeError(f"kvcached backs only SGLang's NHD KV layout, not {self.kv_cache_layout!r}")
        plan = _require_plan(self)
        rows = self.size + self.page_size  # slot 0's page pads dummy writes
        item = torch.empty((), dtype=self.store_dtype).element_size()
        geometry = _geometry(
            num_blocks=-(-rows // self.page_size),
            block_bytes=self.page_size * self.head_num * self.head_dim * item,
            num_layers=self.layer_num,
            num_buffers=2,
            page_bytes=plan.settings.page_bytes,
        )
        self.kvcached_blocks = plan.open_blocks(geometry)
        views = sglang_views(
            self.kvcached_blocks.space, num_heads=self.head_num, head_dim=self.head_dim, dtype=self.store_dtype
        )
        self.k_buffer = [k[:rows] for k, _ in views]
        self.v_buffer = [v[:rows] for _, v in views]


class KvcachedMLATokenToKVPool(MLATokenToKVPool):
    """``MLATokenToKVPool`` whose per-layer latent buffers are kvcached views."""

    def _create_buffers(self) -> None:
        if self.use_dsa or self.kv_cache_dim != self.kv_lora_rank + self.qk_rope_head_dim:
            raise RuntimeError("kvcached backs only plain MLA pools (no DSA, no packed FP8 rows)")
        plan = _require_plan(self)
        rows = self.size + self.page_size
        item = torch.empty((), dtype=self.store_dtype).element_size()
        row_bytes = self.kv_cache_dim * item
        geometry = _geometry(
            num_blocks=-(-rows // self.page_size),
            block_bytes=self.page_size * row_bytes,
            num_layers=self.layer_num,
            num_buffers=1,
            page_bytes=plan.settings.page_bytes,
        )
        self.kvcached_blocks = plan.open_blocks(geometry)
        space = self.kvcached_blocks.space
        flat = torch.from_dlpack(space.tensor())
        self.kv_buffer = [
            strided_bytes_view(
                flat,
                shape=[rows, 1, self.kv_cache_dim],
                strides_bytes=[row_bytes, row_bytes, item],
                dtype=self.store_dtype,
                offset_bytes=layer * space.layer_stride_bytes,
            )
            for layer in range(self.layer_num)
        ]


# --------------------------------------------------------------------------- #
# Allocators and admission: ids from kvcached, memory secured at the checks.
# --------------------------------------------------------------------------- #


class _KvcachedAllocator:
    """What both allocators add to SGLang's (first base, so its methods win)."""

    page_size: int
    device: Any
    free_group: Any

    def _attach(self, kvcache: Any) -> None:
        self.kvcached_blocks: EngineBlocks = kvcache.kvcached_blocks
        self._trimmed = False

    # -- what SGLang reads --
    def available_size(self) -> int:
        return self.kvcached_blocks.available() * self.page_size

    def logical_available_size(self) -> int:
        """Slots not handed out, whatever memory allows (SGLang's conservation check)."""
        return self.kvcached_blocks.logical_free() * self.page_size

    def get_all_free_pages(self) -> None:
        return None  # ids come from kvcached: there is no free list to list

    def merge_and_sort_free(self) -> None:
        pass

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> PrefillBudget:
        return KvcachedPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        self.evict_to_free_tokens(tree_cache, num_tokens)  # SGLang's: the radix cache first
        if self.secure_tokens(num_tokens):
            return True
        if requests is None or len(requests) > 1:
            return False  # SGLang retracts a request and asks again
        # SGLang aborts its last request when even it cannot grow. Memory other
        # engines hold comes back as their requests finish: wait for it a while.
        deadline = time.monotonic() + LAST_REQUEST_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            self.evict_to_free_tokens(tree_cache, num_tokens)
            if self.secure_tokens(num_tokens):
                return True
        return False

    # -- kvcached --
    def secure_tokens(self, num_tokens: int) -> bool:
        """Holds memory for ``num_tokens`` slots until this step allocates them."""
        return num_tokens <= 0 or self.kvcached_blocks.secure(-(-num_tokens // self.page_size))

    def secured_tokens(self) -> int:
        return self.kvcached_blocks.secured * self.page_size

    def end_step(self) -> None:
        self.kvcached_blocks.end_step()

    def release_when_idle(self, tree_cache: Any, keep_bytes: int) -> None:
        """Evicts the radix cache down to ``keep_bytes`` and gives free memory back (once per idle spell)."""
        if self._trimmed:
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        keep_tokens = keep_bytes // self.kvcached_blocks.geometry.block_id_bytes * self.page_size
        evictable = tree_cache.evictable_size() if tree_cache is not None else 0
        if evictable > keep_tokens:
            tree_cache.evict(EvictParams(num_tokens=evictable - keep_tokens))
        self.kvcached_blocks.trim()
        self._trimmed = True

    def kvcached_stats(self) -> dict:
        return self.kvcached_blocks.stats()

    def clear(self) -> None:
        self.kvcached_blocks.clear()
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.release_pages = self.free_pages
        self.free_group = None
        self.free_page_ids_group = []
        self.staged_pages = []
        self.num_staged_pages = 0

    def _take_ids(self, count: int) -> Optional[torch.Tensor]:
        try:
            ids = self.kvcached_blocks.alloc(count)
        except OutOfMemoryError as exc:
            logger.debug("kvcached: %d blocks refused: %s", count, exc)
            return None
        self._trimmed = False
        return torch.from_numpy(ids).to(self.device)

    def _release_ids(self, ids: torch.Tensor) -> None:
        if ids.numel():
            self.kvcached_blocks.free(ids.to("cpu", torch.int64).numpy())
            self._trimmed = False


class KvcachedTokenToKVPoolAllocator(_KvcachedAllocator, TokenToKVPoolAllocator):
    """Token-slot allocator (``page_size`` 1) whose slot ids are kvcached block ids."""

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool) -> None:
        self._attach(kvcache)
        super().__init__(size, dtype, device, kvcache, need_sort)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        return self._take_ids(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is None:
            self._release_ids(free_index)
        else:
            self.free_group.append(self._copy_for_free_group(free_index))


class KvcachedPagedTokenToKVPoolAllocator(_KvcachedAllocator, PagedTokenToKVPoolAllocator):
    """Paged allocator whose page ids are kvcached block ids; SGLang's kernels place the tokens."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any,
                 need_sort: bool) -> None:
        self._attach(kvcache)
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        pages = self._take_ids(need_size // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     num_new_pages=None, **kwargs):
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                              prefix_lens=prefix_lens_cpu)
        return self._with_pages(num_new_pages, super().alloc_extend, prefix_lens, prefix_lens_cpu, seq_lens,
                                seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages=num_new_pages, **kwargs)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, **kwargs):
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        return self._with_pages(num_new_pages, super().alloc_decode, seq_lens, seq_lens_cpu, last_loc, **kwargs)

    def _with_pages(self, page_count: int, place: Any, *args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        """Runs SGLang's placement kernel over exactly the ``page_count`` pages kvcached gives."""
        pages = self._take_ids(page_count)
        if pages is None:
            return None
        self.free_pages = pages
        try:
            out = place(*args, **kwargs)
        except BaseException:
            self._release_ids(pages)
            raise
        finally:
            leftover, self.free_pages = self.free_pages, pages[:0]
        if out is None:
            self._release_ids(pages)
        elif leftover.numel():
            raise RuntimeError(f"kvcached: SGLang used {page_count - leftover.numel()} of {page_count} pages")
        return out

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        self._release_ids(torch.cat(page_ids))

    def _debug_check_no_duplicate_pages(self) -> None:
        pass  # kvcached refuses duplicate and unknown ids itself


class KvcachedPrefillBudget(PrefillBudget):
    """SGLang's prefill budget; admitting a request first secures the memory its prefill needs.

    Radix-cache entries count as available, as in SGLang: they are this
    engine's memory, evicted right before the allocation.
    """

    def _secure(self, tokens: int) -> bool:
        return self.allocator.secure_tokens(tokens - self.tree_cache.evictable_size())

    def check_prefill(self, **kwargs: Any) -> tuple[bool, Optional[int]]:
        admit, chunk_limit = super().check_prefill(**kwargs)
        if admit:
            extend = kwargs["extend_input_len"] if chunk_limit is None else min(kwargs["extend_input_len"], chunk_limit)
            if not self._secure(self.current_offset + self.ceil_paged_tokens(extend) + self.page_size):
                return False, None
        return admit, chunk_limit

    def can_allocate_prefill(self, *, paged_input: int, **kwargs: Any) -> bool:
        return super().can_allocate_prefill(paged_input=paged_input, **kwargs) and self._secure(
            self.current_offset + paged_input
        )

    def available_chunk_tokens(self, chunk_limit: int) -> Optional[int]:
        tokens = super().available_chunk_tokens(chunk_limit)
        if tokens is None or self._secure(self.current_offset + self.ceil_paged_tokens(tokens) + self.page_size):
            return tokens
        held = self.allocator.secured_tokens() + self.tree_cache.evictable_size() - self.current_offset - self.page_size
        held = held // self.page_size * self.page_size
        return held if held > 0 else None  # None: the chunked request waits for memory

    def reserve(self, *args: Any, **kwargs: Any) -> None:
        super().reserve(*args, **kwargs)
        self._secure(self.current_offset)


# --------------------------------------------------------------------------- #
# Hooks (SGLang's HookRegistry): sizing, classes, step end, idle, accounting.
# --------------------------------------------------------------------------- #


def _hook_configure(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    with building(_plan_for(configurator)):
        return original(configurator, *args, **kwargs)


def _hook_profile_available_bytes(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> int:
    plan = _plan_for(configurator)
    if plan is None:
        return original(configurator, *args, **kwargs)
    logger.info("kvcached: planning SGLang's KV cache for a virtual %d bytes on %s", plan.virtual_bytes, plan.device)
    return plan.virtual_bytes


def _hook_resolve_kv_pool_class(original: Any, configurator: Any, *, kind: str, default: type) -> type:
    pool_class = original(configurator, kind=kind, default=default)
    if _plan_for(configurator) is None or kind == "dsa":
        return pool_class
    ours = {MHATokenToKVPool: KvcachedMHATokenToKVPool, MLATokenToKVPool: KvcachedMLATokenToKVPool}
    if pool_class not in ours:
        raise RuntimeError(f"kvcached cannot back SGLang's {pool_class.__name__}; unset KVCACHED_ENABLE")
    return ours[pool_class]


def _hook_build_allocator(original: Any, configurator: Any, *, sizes: Any, token_to_kv_pool: Any,
                          token_to_kv_pool_allocator: Any, **kwargs: Any) -> Any:
    if token_to_kv_pool_allocator is not None or not hasattr(token_to_kv_pool, "kvcached_blocks"):
        return original(configurator, sizes=sizes, token_to_kv_pool=token_to_kv_pool,
                        token_to_kv_pool_allocator=token_to_kv_pool_allocator, **kwargs)
    page_size = token_to_kv_pool.page_size
    common = dict(dtype=configurator.kv_cache_dtype, device=configurator.device, kvcache=token_to_kv_pool,
                  need_sort=False)
    if page_size == 1:
        allocator = KvcachedTokenToKVPoolAllocator(sizes.max_total_num_tokens, **common)
    else:
        allocator = KvcachedPagedTokenToKVPoolAllocator(sizes.max_total_num_tokens, page_size=page_size, **common)
    blocks = token_to_kv_pool.kvcached_blocks
    logger.info("kvcached: SGLang's KV cache is %d pages of %d tokens over a virtual %d-byte space (%s)",
                blocks.num_blocks - 1, page_size, blocks.space.size_bytes, type(allocator).__name__)
    return allocator


def _allocator_of(scheduler: Any) -> Optional[_KvcachedAllocator]:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    return allocator if isinstance(allocator, _KvcachedAllocator) else None


def _hook_after_get_next_batch_to_run(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    allocator = _allocator_of(scheduler)
    if allocator is not None:
        allocator.end_step()  # this step's allocations are done: unused secured memory goes back


def _hook_after_on_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    allocator = _allocator_of(scheduler)
    if allocator is not None and scheduler.is_fully_idle():
        allocator.release_when_idle(scheduler.tree_cache, _settings.idle_cache_bytes if _settings else 0)


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
    return dataclasses.replace(stats, full_available_size=available, full_num_used=used,
                               full_token_usage=used / total)


HOOKS: list[tuple[str, Any, str]] = [
    (f"{_CONFIGURATOR}.configure", _hook_configure, "AROUND"),
    (f"{_CONFIGURATOR}._profile_available_bytes", _hook_profile_available_bytes, "AROUND"),
    (f"{_CONFIGURATOR}._resolve_kv_pool_class", _hook_resolve_kv_pool_class, "AROUND"),
    (f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", _hook_build_allocator, "AROUND"),
    (f"{_SCHEDULER}.get_next_batch_to_run", _hook_after_get_next_batch_to_run, "AFTER"),
    (f"{_SCHEDULER}.on_idle", _hook_after_on_idle, "AFTER"),
    (f"{_SCHEDULER}.get_internal_state", _hook_after_get_internal_state, "AFTER"),
    (f"{_POOL_STATS}._get_token_info", _hook_token_info, "AROUND"),
]

_registered_pid: Optional[int] = None


def install(settings: Settings) -> None:
    """Registers kvcached's hooks with SGLang's HookRegistry (once per process).

    ``load_plugins()`` applies them right after the plugins ran.
    """
    global _settings, _registered_pid
    _settings = settings
    if _registered_pid == os.getpid():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    _registered_pid = os.getpid()
