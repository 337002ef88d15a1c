"""SGLang 0.5.23's allocators and prefill budget with ids from kvcached, memory secured at the checks."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.utils import get_num_new_pages

from kvcached.errors import IntegrationError, OutOfMemoryError
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.idle import IdleRelease

from . import plan as _plan
from .shrink import evict_while_over
from .sleep_waker import SleepWaker

logger = logging.getLogger(__name__)
#: How long the last running request waits for memory before SGLang aborts it.
LAST_REQUEST_WAIT_S = 30.0


class _KvcachedAllocator:
    """What both allocators add to SGLang's (first base, so its methods win)."""

    page_size: int
    device: Any
    free_group: Any

    def _attach(self, kvcache: Any) -> None:
        self.kvcached_blocks: EngineBlocks = kvcache.kvcached_blocks
        self.idle = IdleRelease(
            _plan.settings().idle_release_s,
            self.kvcached_blocks.budgets,
            max_hold_s=_plan.settings().idle_release_max_s,
        )
        self.sleep_waker = SleepWaker()
        self._trimmed = False
        self.kv_released = False  # SGLang's release_memory_occupation, until resume_memory_occupation

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

    def check_decode_capacity(
        self, *, num_tokens: int, tree_cache: Any, requests: Any = None, spec_algorithm: Any = None
    ) -> bool:
        if requests is not None and len(requests) > 1 and evict_while_over(self, tree_cache) > 0:
            return False  # over the limit in force (shrink): SGLang retracts a request and asks again
        self.evict_to_free_tokens(tree_cache, num_tokens)  # SGLang's: the radix cache first
        if self.secure_tokens(num_tokens):
            return True
        if requests is None or len(requests) > 1:
            return False  # SGLang retracts a request and asks again
        # SGLang aborts its last request when even it cannot grow. Memory other
        # engines hold comes back as their requests finish: wait for it a while.
        deadline = time.monotonic() + LAST_REQUEST_WAIT_S
        while self._keep_waiting(deadline):
            time.sleep(0.05)
            self.evict_to_free_tokens(tree_cache, num_tokens)
            if self.secure_tokens(num_tokens):
                return True
        return False

    # -- kvcached --
    def secure_tokens(self, num_tokens: int) -> bool:
        """Holds memory for ``num_tokens`` slots until this step allocates them."""
        if num_tokens <= 0:
            return True
        self.idle.busy()
        if self.kvcached_blocks.secure(-(-num_tokens // self.page_size)):
            return True
        # Short: say that this engine waits, so that idle engines on the device
        # give memory back (want() ignores a no that came from its own limit).
        self.want_more()
        return False

    def want_more(self) -> None:
        """Says that this engine waits for memory; not while its KV cache is released (it waits for its resume)."""
        if not self.kv_released:
            self.kvcached_blocks.want_more()

    def pages_over_limit(self) -> int:
        """Page ids of blocks in use beyond the limit in force (``docs/memory-policy.md``); 0 within it."""
        blocks = self.kvcached_blocks
        return blocks.pages_over_limit() if blocks.asked_to_shrink() else 0

    def secured_tokens(self) -> int:
        return self.kvcached_blocks.secured * self.page_size

    def end_step(self) -> None:
        self.kvcached_blocks.end_step()

    def release_when_idle(self, tree_cache: Any, keep_bytes: int) -> bool:
        """Called while the engine is fully idle; returns whether its memory is given back.

        Once the idle hold has passed, or at once when the device wants the
        memory (:class:`~kvcached.integration.common.idle.IdleRelease`), evicts
        the radix cache down to ``keep_bytes`` and gives free memory back
        (once per idle spell).
        """
        if self.kvcached_blocks.asleep:
            self.kvcached_blocks.poll_acknowledgements()  # ranks that slept since: their budgets
            return True
        if self._trimmed:
            return True
        if not self._idle_due():
            return False
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        keep_tokens = keep_bytes // self.kvcached_blocks.layout.block_id_bytes * self.page_size
        evictable = tree_cache.evictable_size() if tree_cache is not None else 0
        if evictable > keep_tokens:
            tree_cache.evict(EvictParams(num_tokens=evictable - keep_tokens))
        self.kvcached_blocks.trim()
        self._trimmed = True
        return True

    def _idle_due(self) -> bool:
        return self.idle.due()

    def _keep_waiting(self, deadline: float) -> bool:
        return time.monotonic() < deadline

    # -- SGLang's memory saver (memory_saver.py) --
    def release_kv_cache(self) -> None:
        """``release_memory_occupation``: the KV cache sleeps once it holds no block.

        SGLang flushes its cache right after (:meth:`clear`); an empty cache sleeps at once.
        """
        self.kv_released = True
        self._sleep_if_released()

    def resume_kv_cache(self) -> None:
        """``resume_memory_occupation``: maps the padding page again (or raises, still released);
        the cache grows on demand."""
        self.kvcached_blocks.wake_up()
        self.kv_released = False
        self._trimmed = False

    def _sleep_if_released(self) -> None:
        blocks = self.kvcached_blocks
        if self.kv_released and not blocks.asleep and blocks.logical_free() == blocks.num_blocks - blocks.first_block:
            blocks.sleep()
            self._trimmed = True  # nothing for the idle release to give back
            self._after_sleep()

    def _after_sleep(self) -> None:
        pass  # one rank: its memory is back already

    def kvcached_stats(self) -> dict:
        stats = self.kvcached_blocks.stats()
        stats.update(idle_release_s=self.idle.hold_s, idle_early_releases=self.idle.num_early)
        if torch.device(self.device).type == "cpu":
            from kvcached import config

            stats["host_populate"] = config.get("host_populate")  # as the host device read it when opened
        return stats

    def clear(self) -> None:
        self.kvcached_blocks.clear()
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.release_pages = self.free_pages
        self.free_group = None
        self.free_page_ids_group = []
        self.staged_pages = []
        self.num_staged_pages = 0
        self._sleep_if_released()  # SGLang's release_memory_occupation flushes the cache here

    def _take_ids(self, count: int) -> Optional[torch.Tensor]:
        try:
            ids = self.kvcached_blocks.alloc(count)
        except OutOfMemoryError as exc:
            logger.debug("kvcached: %d blocks refused: %s", count, exc)
            return None
        self._trimmed = False
        self.idle.busy()
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

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        self._attach(kvcache)
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        pages = self._take_ids(need_size // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        num_new_pages=None,
        **kwargs,
    ):
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        return self._with_pages(
            num_new_pages,
            super().alloc_extend,
            prefix_lens,
            prefix_lens_cpu,
            seq_lens,
            seq_lens_cpu,
            last_loc,
            extend_num_tokens,
            num_new_pages=num_new_pages,
            **kwargs,
        )

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
            raise IntegrationError(f"kvcached: SGLang used {page_count - leftover.numel()} of {page_count} pages")
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
        if not admit:  # SGLang's only reason: too little available; say that this engine waits
            self.allocator.want_more()
        else:
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
