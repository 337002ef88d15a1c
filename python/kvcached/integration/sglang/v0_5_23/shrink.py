"""A busy SGLang engine asked to hold less gives memory back: cached prefixes first, then retraction.

The memory policy (``docs/memory-policy.md``): a refused higher-priority instance on the
device lowers this engine's limit in force (its reclaim target), as ``kvctl set-limit`` or a
lowered budget does. An idle engine gives everything back (``Scheduler.on_idle``); a busy one
would give back only as its requests end. So before each scheduling step an engine whose
blocks in use exceed its limit evicts unreferenced radix-cache prefixes (SGLang's own
``tree_cache.evict``, least recently used first) until they fit; if they still do not, its
decode check says no (:meth:`_KvcachedAllocator.check_decode_capacity`), so that SGLang
retracts running requests as it does when its pool is full: they are re-queued and
recomputed later, so outputs do not change, and SGLang keeps at least one running. The step's
end (``end_step``) unmaps the pages then free beyond the limit.

With several ranks every "how far over" comes from the deciding rank
(``ranks._AgreedAllocator.pages_over_limit``), so each rank evicts and retracts alike.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["OverLimit", "evict_while_over"]


class OverLimit(Protocol):
    """What the shrink needs of an allocator."""

    page_size: int
    kvcached_blocks: Any

    def pages_over_limit(self) -> int: ...


def evict_while_over(allocator: OverLimit, tree_cache: Any) -> int:
    """Evicts cached prefixes while the engine holds more than its limit; returns page ids still over.

    Each round evicts the blocks of the page ids over the limit; blocks of one page id may be
    scattered, so it goes on until the blocks in use fit or nothing is left to evict.
    """
    over = allocator.pages_over_limit()
    if over <= 0 or tree_cache is None or not tree_cache.supports_prefix_sharing():
        return over
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tokens_per_page_id = int(allocator.kvcached_blocks.layout.blocks_per_page) * allocator.page_size
    while over > 0 and (evictable := tree_cache.evictable_size()) > 0:
        tree_cache.evict(EvictParams(num_tokens=over * tokens_per_page_id))
        if tree_cache.evictable_size() >= evictable:
            break  # nothing could go (the same on every rank: their trees are alike)
        over = allocator.pages_over_limit()
    return over
