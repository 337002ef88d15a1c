"""The allocators of an SGLang 0.5.23 engine with several ranks (:mod:`.ranks`): one decision for all.

They differ from the one-rank ones (:mod:`.allocators`) where SGLang would read
memory-dependent figures on one rank only (logging, metrics): their
``available_size()`` counts slots not handed out, the same on every rank; the
memory checks (prefill admission, decode capacity, the radix-cache eviction
that precedes an allocation, the idle release, how far the engine is over its
limit in force) ask the leader.
"""

from __future__ import annotations

import time
from typing import Any

from .allocators import KvcachedPagedTokenToKVPoolAllocator, KvcachedTokenToKVPoolAllocator
from .ranks import tensor_ranks_barrier


class _AgreedAllocator:
    """What the allocators of an engine with several ranks do differently (first base, so these win)."""

    kvcached_blocks: Any
    page_size: int
    idle: Any

    def available_size(self) -> int:
        # Read by SGLang on one rank only, too (logs, metrics): the same figure
        # everywhere. What memory allows is asked of the leader where it decides.
        return self.kvcached_blocks.logical_free() * self.page_size

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        shortfall = num_tokens - self.kvcached_blocks.available() * self.page_size
        if shortfall > 0:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))

    def pages_over_limit(self) -> int:
        # The deciding rank's figure on every rank: each then evicts and retracts alike.
        blocks = self.kvcached_blocks
        return blocks.agree(lambda: blocks.blocks.pages_over_limit() if blocks.blocks.asked_to_shrink() else 0)

    def _idle_due(self) -> bool:
        return self.kvcached_blocks.agree(self.idle.due)

    def _keep_waiting(self, deadline: float) -> bool:
        return self.kvcached_blocks.agree(lambda: time.monotonic() < deadline)

    def _after_sleep(self) -> None:
        # Every tensor rank has replayed the sleep (its unmaps acknowledged) once past the barrier,
        # so release_memory_occupation returns with each one's memory back on its budget.
        # Pipeline stages take the request in turn; their words come in while the engine idles.
        tensor_ranks_barrier()
        self.kvcached_blocks.poll_acknowledgements()


class AgreedTokenToKVPoolAllocator(_AgreedAllocator, KvcachedTokenToKVPoolAllocator):
    """The token-slot allocator (``page_size`` 1) of one of several ranks."""


class AgreedPagedTokenToKVPoolAllocator(_AgreedAllocator, KvcachedPagedTokenToKVPoolAllocator):
    """The paged allocator of one of several ranks."""


__all__ = ["AgreedPagedTokenToKVPoolAllocator", "AgreedTokenToKVPoolAllocator"]
