"""vLLM 0.32's BlockPool with its blocks, and the memory behind them, from kvcached (EngineCore).

:func:`make_block_pool_class` subclasses vLLM's own ``BlockPool`` (so prefix-cache
hashing, events and metrics stay vLLM's) and is bound into
``kv_cache_coordinator``. New blocks come from the engine's
:class:`~kvcached.integration.common.blocks.EngineBlocks` (best-fit pages);
freed unhashed blocks go back at once; freed *hashed* blocks stay resident as
prefix-cache entries until vLLM evicts them, or until kvcached needs their
memory. If memory is short, ``allocate_slots`` returns None, which the
scheduler turns into waiting or preemption.
"""

from __future__ import annotations

import contextvars
import itertools
from typing import Any, Optional

from kvcached.errors import IntegrationError, KvcachedError


class KVCachePoolExhausted(KvcachedError, ValueError):
    """kvcached cannot provide the blocks vLLM asked for right now.

    A ValueError, like the exception of vLLM's own ``get_new_blocks`` when it
    runs out; ``allocate_slots`` turns it into ``None`` (wait or preempt).
    """


# Set by the Scheduler wrapper while vLLM builds its KVCacheManager, read by
# KvcachedBlockPool.__init__ (BlockPool's signature has no room for it): the
# engine's kvcached state (scheduler.EngineKV).
building: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("kvcached_building_engine", default=None)


def make_block_pool_class(base: type) -> type:
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
            engine = building.get()
            self._kv = engine
            self._blocks = engine.blocks if engine is not None else None
            self._resident_free: dict[int, None] = {}  # block id -> None, least recently freed first
            self._available = self._blocks.available if self._blocks is not None else None
            # kvcached's available blocks as last read: vLLM asks for the free count once per
            # request per step; read again after this pool allocates or frees, and each step.
            self._available_seen: Optional[int] = None
            self._count_queue_only = False
            if self._blocks is not None and self._blocks.num_blocks != self.num_gpu_blocks:
                raise IntegrationError(
                    f"kvcached planned {self._blocks.num_blocks} blocks, vLLM's BlockPool has {self.num_gpu_blocks}"
                )

        # -- allocation ---------------------------------------------------- #
        def get_new_blocks(self, num_blocks: int) -> list:
            if self._blocks is None:
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

            # Give back prefix-cache blocks nobody uses first when kvcached is
            # short (cheaper than a refused alloc), then once more if the
            # budget moved in between.
            self._evict_resident_until(num_blocks)
            self._available_seen = None
            try:
                return self._blocks.alloc(num_blocks).tolist()
            except kvcached.OutOfMemoryError:
                pass
            self._evict_resident_until(num_blocks)
            try:
                return self._blocks.alloc(num_blocks).tolist()
            except kvcached.OutOfMemoryError as exc:
                self._kv.num_exhausted += 1
                raise KVCachePoolExhausted(f"kvcached cannot provide {num_blocks} blocks now: {exc}") from exc

        def _evict_resident_until(self, num_blocks: int) -> None:
            """Evicts resident prefix-cache blocks, least recently used first,
            until kvcached has ``num_blocks`` available (each one freed adds one)."""
            while self._resident_free:
                shortfall = num_blocks - int(self._available())
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
                self._blocks.free(released)
                self._available_seen = None

        # -- release ------------------------------------------------------- #
        def free_blocks(self, ordered_blocks: Any) -> None:
            if self._blocks is None:
                return super().free_blocks(ordered_blocks)
            blocks = list(ordered_blocks)
            super().free_blocks(blocks)
            release: dict[int, None] = {}
            for block in blocks:
                if not self._owns(block):
                    continue
                if block.ref_cnt != 0 or block.is_null:
                    continue
                if block.block_hash is None or not self.enable_caching:
                    release[block.block_id] = None
                else:
                    self._resident_free.pop(block.block_id, None)  # now the most recently freed
                    self._resident_free[block.block_id] = None
            if release:
                self._blocks.free(list(release))
                self._available_seen = None

        def _owns(self, block: Any) -> bool:
            """Whether this pool frees ``block`` (vLLM forwards blocks of other pools to them)."""
            return block.pool is None or block.pool is self

        def touch(self, blocks: Any) -> None:
            super().touch(blocks)
            if self._blocks is not None and self._resident_free:
                for block in blocks:
                    if block.ref_cnt > 0:
                        self._resident_free.pop(block.block_id, None)

        def _maybe_evict_cached_block(self, block: Any) -> bool:
            evicted = super()._maybe_evict_cached_block(block)
            if (
                self._blocks is not None
                and block.block_id in self._resident_free
                and block.block_hash is None
                and block.ref_cnt == 0
            ):
                del self._resident_free[block.block_id]
                self._blocks.free([block.block_id])
                self._available_seen = None
            return evicted

        def release_cached_blocks(self, keep_bytes: int) -> int:
            """Evicts unused prefix-cache blocks (LRU first) beyond ``keep_bytes``.

            An idle engine keeps no more than that much memory for hits; the
            rest goes back to the shared budget. Returns the blocks released.
            """
            if self._blocks is None or not self._resident_free:
                return 0
            keep = keep_bytes // self._blocks.layout.block_id_bytes
            excess = max(0, len(self._resident_free) - keep)
            oldest = list(itertools.islice(self._resident_free, excess))
            self._evict_resident([self.blocks[i] for i in oldest])
            return len(oldest)

        def drop_cached_blocks(self, num_blocks: int) -> int:
            """Evicts up to ``num_blocks`` unused prefix-cache blocks, least recently used
            first (a busy engine asked to shrink); returns how many."""
            if self._blocks is None or num_blocks <= 0:
                return 0
            oldest = list(itertools.islice(self._resident_free, num_blocks))
            self._evict_resident([self.blocks[i] for i in oldest])
            return len(oldest)

        def reset_prefix_cache(self) -> bool:
            if self._blocks is None:
                return super().reset_prefix_cache()
            self._count_queue_only = True  # vLLM's "all blocks free" test
            try:
                reset = super().reset_prefix_cache()
            finally:
                self._count_queue_only = False
            if reset and self._resident_free:
                self._blocks.free(sorted(self._resident_free))
                self._resident_free.clear()
                self._available_seen = None
            return reset

        # -- accounting ---------------------------------------------------- #
        def forget_available(self) -> None:
            """The next free count reads kvcached again (a new step: the budget may have moved)."""
            self._available_seen = None

        def get_num_free_blocks(self) -> int:
            # Called for every request in every step: read the queue's count
            # directly (what BlockPool's own version does), and kvcached's
            # count once per step unless this pool allocated or freed since.
            queued = self.free_block_queue.num_free_blocks
            if self._available is None or self._count_queue_only:
                return queued
            available = self._available_seen
            if available is None:
                available = self._available_seen = self._available()
            return min(queued, available + len(self._resident_free))

    KvcachedBlockPool.__qualname__ = KvcachedBlockPool.__name__ = "KvcachedBlockPool"
    return KvcachedBlockPool


__all__ = ["KVCachePoolExhausted", "building", "make_block_pool_class"]
