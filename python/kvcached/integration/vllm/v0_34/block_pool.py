"""vLLM 0.34's BlockPool with kvcached: 0.32's subclass, with blocks that point to their pool weakly.

Two changes in 0.34's ``BlockPool`` reach kvcached's subclass:

* ``KVCacheBlock.pool`` is a weak reference (``BlockPool._weak_self``), so a
  block's owner is found by comparing with it; 0.32's identity test would
  treat every block as another pool's and never give memory back.
* ``free_blocks(ordered_blocks, evict_first=False)``: with ``evict_first``
  vLLM puts freed prefix-cache blocks first in line for eviction (another tier
  holds their contents); kvcached keeps them resident but evicts them first too.
"""

from __future__ import annotations

from typing import Any

from ..v0_32 import block_pool as v0_32_block_pool


def make_block_pool_class(base: type) -> type:
    class _PassesEvictFirst(base):  # type: ignore[misc, valid-type]
        """Between vLLM's BlockPool and 0.32's subclass, whose ``free_blocks`` does not pass ``evict_first``."""

        _evict_first_now = False

        def free_blocks(self, ordered_blocks: Any, evict_first: bool = False) -> None:
            base.free_blocks(self, ordered_blocks, evict_first or self._evict_first_now)

    class KvcachedBlockPool(v0_32_block_pool.make_block_pool_class(_PassesEvictFirst)):  # type: ignore[misc]
        """0.32's KvcachedBlockPool, with 0.34's weak block owners and ``evict_first``."""

        def _owns(self, block: Any) -> bool:
            return block.pool is None or block.pool is self._weak_self

        def free_blocks(self, ordered_blocks: Any, evict_first: bool = False) -> None:
            if not evict_first:
                return super().free_blocks(ordered_blocks)
            blocks = list(ordered_blocks)
            self._evict_first_now = True
            try:
                super().free_blocks(blocks)
            finally:
                self._evict_first_now = False
            if self._blocks is None:
                return
            # 0.32's subclass made them the most recently freed; vLLM evicts them first.
            first = [b.block_id for b in blocks if b.block_id in self._resident_free]
            rest = [i for i in self._resident_free if i not in set(first)]
            self._resident_free = dict.fromkeys(first + rest)

    KvcachedBlockPool.__qualname__ = KvcachedBlockPool.__name__ = "KvcachedBlockPool"
    return KvcachedBlockPool


__all__ = ["make_block_pool_class"]
