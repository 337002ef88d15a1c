"""The engine side of an integration: the block ids an engine may use, from a kvcached block manager.

:class:`EngineBlocks` wraps a :class:`kvcached.KVPool` (decisions and mapping in
one process) or a device-less :class:`kvcached.BlockManager` (mapping done by
:class:`~kvcached.integration.common.space.WorkerSpace` mirrors elsewhere), and
adds what every engine needs on top of the core:

* **Engine range.** kvcached rounds its space up to whole pages; ids past the
  engine's ``num_blocks`` are *parked* (kept allocated, never handed out) when
  the core hands one out, and given back when the engine goes idle.
* **Secured blocks.** An engine checks capacity and allocates later in the same
  step; under a budget shared with other processes, memory seen at the check
  may be gone at the allocation. :meth:`EngineBlocks.secure` allocates blocks
  at check time and holds them; :meth:`EngineBlocks.alloc` takes those first.
  What a step did not use goes back with :meth:`EngineBlocks.end_step`.
* **Logical accounting.** Engines check their own conservation (in use + free
  == capacity); :meth:`EngineBlocks.logical_free` answers it whatever the
  physical limit is, while :meth:`EngineBlocks.available` answers what can be
  allocated now.

Every call into the core's block manager goes through this class, so a change
of the core API is adapted here. Not thread-safe: one engine thread uses it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import numpy as np

from kvcached.errors import OutOfMemoryError
from kvcached.integration.common.geometry import KVGeometry

_logger = logging.getLogger(__name__)
_NO_IDS = np.empty(0, dtype=np.int64)

WireOps = tuple  # (seq, map_pages, unmap_pages): a page-op batch as plain Python values


class EngineBlocks:
    """Block ids ``[first, num_blocks)`` for one engine, with memory behind the ones in use.

    Args:
        manager: a kvcached ``KVPool`` or ``BlockManager`` built for ``geometry``.
        geometry: the engine's geometry (``num_blocks``: the ids it addresses).
        null_block: block 0 is the engine's padding block: kvcached keeps it
            mapped and never hands it out (the manager must have been built
            with ``null_block=True``).
        budget: the registry entry the manager's memory comes from; kept
            (registered) as long as this object lives.
    """

    def __init__(self, manager: Any, geometry: KVGeometry, *, null_block: bool, budget: Any = None) -> None:
        if manager.num_blocks < geometry.num_blocks:
            raise ValueError(f"the manager has {manager.num_blocks} blocks, the engine needs {geometry.num_blocks}")
        self.manager = manager
        self.budget = budget
        self.geometry = geometry
        self.num_blocks = geometry.num_blocks
        self.first_block = 1 if null_block else 0
        self._tail = int(manager.num_blocks) - self.num_blocks
        self._parked: list[int] = []
        self._in_use = np.zeros(self.num_blocks, dtype=bool)  # handed to the engine
        self._num_in_use = 0
        self._secured = _NO_IDS  # allocated in kvcached, not yet handed out
        self._last_sent_seq = 0
        self.num_short_secures = 0  # secure() calls memory could not satisfy: the engine waited

    # ---- construction: the one place that calls the core constructors ------------

    @classmethod
    def local(
        cls,
        geometry: KVGeometry,
        *,
        device: str,
        budget: Any,
        name: str,
        null_block: bool = True,
        zero_backing: bool = True,
    ) -> "EngineBlocks":
        """Decisions and KV tensors in this process: a KVPool on ``device``.

        No background worker: pages are mapped by :meth:`alloc` / :meth:`secure`
        and returned by :meth:`end_step` / :meth:`trim`, at points the engine
        chooses, so memory the engine was told it has stays mapped until used.
        Unmapping synchronises the device first (the core's fence), so blocks
        a kernel may still touch are never unmapped under it.
        """
        from kvcached.pool import KVPool

        pool = KVPool(
            **geometry.core_kwargs(),
            device=device,
            zero_backing=zero_backing,
            null_block=null_block,
            budget=budget,
            register=False,
            background_worker=False,
            # Reserve pages only come from explicit maintain() calls: keeping
            # none ready avoids mapping one at every step of an idle engine.
            min_reserve_pages=0,
            name=name,
        )
        return cls(pool, geometry, null_block=null_block, budget=budget)

    @classmethod
    def deciding(
        cls, geometry: KVGeometry, *, budget: Any, name: str, num_mirrors: int = 1, null_block: bool = False
    ) -> "EngineBlocks":
        """Decisions only: KV tensors live in other processes (``num_mirrors`` WorkerSpaces)."""
        from kvcached.pool import BlockManager

        manager = BlockManager(
            **geometry.core_kwargs(),
            num_mirrors=num_mirrors,
            null_block=null_block,
            budget=budget,
            background_worker=False,
            name=name,
        )
        return cls(manager, geometry, null_block=null_block, budget=budget)

    @property
    def space(self) -> Any:
        """The KV space this manager maps (None when mirrors in other processes do)."""
        return getattr(self.manager, "space", None)

    # ---- allocation ---------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray:
        """``n`` block ids (int64), secured ones first. Raises OutOfMemoryError, changing nothing."""
        if n <= 0:
            return _NO_IDS
        take = min(n, self._secured.size)
        ids, self._secured = self._secured[:take], self._secured[take:]
        if n > take:
            try:
                ids = np.concatenate([ids, self._alloc_engine_ids(n - take)])
            except OutOfMemoryError:
                self._secured = np.concatenate([ids, self._secured])
                raise
        self._in_use[ids] = True
        self._num_in_use += ids.size
        return ids

    def free(self, ids: Union[Sequence[int], np.ndarray]) -> None:
        """Give handed-out ids back. Unknown, repeated or free ids raise ValueError and free nothing."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < self.first_block or high >= self.num_blocks:
            raise ValueError(f"block id {low if low < self.first_block else high} is outside "
                             f"[{self.first_block}, {self.num_blocks})")
        if not self._in_use[ids].all():
            raise ValueError(f"block ids {ids[~self._in_use[ids]][:8].tolist()} were not handed out")
        self.manager.free(ids)  # raises on duplicates before changing anything
        self._in_use[ids] = False
        self._num_in_use -= ids.size

    def secure(self, n: int) -> bool:
        """Holds at least ``n`` blocks for the next allocations if memory allows.

        Keeps what it could get when it cannot get all; returns whether ``n``
        are held.
        """
        need = n - self._secured.size
        if need <= 0:
            return True
        try:
            got = self._alloc_engine_ids(need)
        except OutOfMemoryError:
            got = _NO_IDS
            can = min(need, self._core_available())
            if can > 0:
                try:
                    got = self._alloc_engine_ids(can)
                except OutOfMemoryError:
                    pass
        self._secured = np.concatenate([self._secured, got])
        if self._secured.size < n:
            self.num_short_secures += 1
            return False
        return True

    @property
    def secured(self) -> int:
        """Blocks held by :meth:`secure` and not yet handed out."""
        return int(self._secured.size)

    def end_step(self) -> None:
        """End of an engine step: return unused secured blocks, then keep the reserve."""
        if self._secured.size:
            self.manager.free(self._secured)
            self._secured = _NO_IDS
        self.manager.maintain()

    def available(self) -> int:
        """Blocks :meth:`alloc` can return now (secured ones included)."""
        return min(self.logical_free(), self._secured.size + self._core_available())

    def logical_free(self) -> int:
        """Engine ids not handed out, whatever memory allows (the engine's own conservation)."""
        return self.num_blocks - self.first_block - self._num_in_use

    def clear(self) -> None:
        """Frees every handed-out and secured block (the engine dropped all of its KV)."""
        ids = np.flatnonzero(self._in_use).astype(np.int64)
        if ids.size:
            self.manager.free(ids)
        self._in_use[:] = False
        self._num_in_use = 0
        self.end_step()

    def trim(self) -> int:
        """Idle engine: give back parked and secured blocks and every free page; returns pages unmapped."""
        if self._parked:
            self.manager.free(np.asarray(self._parked, dtype=np.int64))
            self._parked = []
        self.end_step()
        return int(self.manager.trim())

    # ---- mirrors (decisions here, tensors in WorkerSpaces elsewhere) -------------

    def take_page_ops(self) -> Optional[WireOps]:
        """Pending page operations as ``(seq, map_pages, unmap_pages)``, or None."""
        ops = self.manager.take_page_ops()
        if not ops.map_pages and not ops.unmap_pages:
            return None
        self._last_sent_seq = int(ops.seq)
        return (int(ops.seq), list(ops.map_pages), list(ops.unmap_pages))

    def acknowledge(self, seq: int, mirror: int = 0) -> None:
        """Mirror ``mirror`` applied every batch up to ``seq``; their unmapped memory is released."""
        self.manager.acknowledge(mirror, seq)

    # ---- introspection and lifetime ---------------------------------------------

    def stats(self) -> dict:
        """The core's counters plus the engine's (blocks handed out, secured, parked)."""
        stats = dict(self.manager.stats())
        stats.update(
            engine_blocks=self.num_blocks,
            engine_used_blocks=self._num_in_use,
            secured_blocks=int(self._secured.size),
            parked_blocks=len(self._parked),
            available_blocks=self.available(),
            short_secures=self.num_short_secures,
            sent_seq=self._last_sent_seq,
        )
        return stats

    def close(self) -> None:
        """Unmaps everything; live tensors then read zeros. Idempotent."""
        self.manager.close()

    # ---- internals ------------------------------------------------------------------

    def _alloc_engine_ids(self, n: int) -> np.ndarray:
        """``n`` ids below ``num_blocks`` from the core; ids past it are parked (all or nothing)."""
        ids = np.asarray(self.manager.alloc(n), dtype=np.int64)
        if not self._tail or int(ids.max()) < self.num_blocks:
            return ids
        good = ids[ids < self.num_blocks]
        tail = ids[ids >= self.num_blocks]
        try:
            while tail.size:
                self._parked.extend(tail.tolist())
                more = np.asarray(self.manager.alloc(int(tail.size)), dtype=np.int64)
                good = np.concatenate([good, more[more < self.num_blocks]])
                tail = more[more >= self.num_blocks]
        except BaseException:
            if good.size:
                self.manager.free(good)
            raise
        return good

    def _core_available(self) -> int:
        """The core's ``available()`` without ids past the engine range."""
        available = int(self.manager.available())
        unparked = self._tail - len(self._parked)
        if unparked and self._tail_counted():
            available = max(0, available - unparked)
        return available

    def _tail_counted(self) -> bool:
        """Whether the core's figure may include the tail ids (conservative without a space)."""
        space = self.space
        return space is None or space.is_mapped(space.num_pages - 1) or self._all_pages_growable()

    def _all_pages_growable(self) -> bool:
        stats = self.manager.stats()
        growable_pages = (int(self.manager.available()) - stats["free_mapped_blocks"]) // stats["blocks_per_page"]
        return growable_pages >= self.space.num_pages - stats["mapped_pages"]


__all__ = ["EngineBlocks", "WireOps"]
