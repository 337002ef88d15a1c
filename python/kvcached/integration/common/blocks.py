"""The engine side of an integration: the block ids an engine may use, from a kvcached block manager.

:class:`EngineBlocks` wraps a :class:`kvcached.KVPool` (decisions and mapping in
one process: SGLang's scheduler) or a device-less :class:`kvcached.BlockManager`
with one mirror per rank (decisions here, mapping by
:class:`~kvcached.integration.common.space.WorkerSpace` in the ranks'
processes: vLLM's EngineCore and workers). The core keeps every count (blocks
in use, set aside, the null block, each rank's acknowledgements); this class
keeps none of its own and adds only what engines need on top:

* **Secured blocks.** An engine checks capacity and allocates later in the
  same step; under a budget shared with other processes, memory seen at the
  check may be gone at the allocation. :meth:`EngineBlocks.secure` sets blocks
  aside at check time (the core's ``try_reserve``), :meth:`EngineBlocks.alloc`
  hands those out first, and :meth:`EngineBlocks.end_step` gives back what a
  step did not use.
* **Logical accounting.** Engines check their own conservation (in use + free
  == capacity): :meth:`EngineBlocks.logical_free` answers it whatever memory
  allows, while :meth:`EngineBlocks.available` answers what can be allocated now.
* **Ranks.** A deciding manager's page-op batches go to every rank; each rank
  acknowledges what it applied (:class:`~kvcached.integration.common.mirrors.RankMirrors`).

Not thread-safe: one engine thread uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from kvcached.configured import block_manager_options, space_options
from kvcached.errors import InvalidArgumentError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.mirrors import RankMirrors
from kvcached.integration.common.rank_devices import RankDevice
from kvcached.layout import KVLayout, Mirror


class EngineBlocks:
    """Block ids ``[first_block, num_blocks)`` of one engine, with memory behind the ones in use.

    Build it with :meth:`local` or :meth:`deciding`.

    Args:
        manager: a kvcached ``KVPool`` or device-less ``BlockManager``.
        budgets: the registry entries the manager's memory is charged on; they
            are unregistered by :meth:`close`.
        mirrors: the ranks of a deciding manager (None: a local pool).
    """

    def __init__(
        self,
        manager: Any,
        *,
        budgets: Sequence[Any] = (),
        mirrors: Optional[RankMirrors] = None,
        rank_layouts: Sequence[KVLayout] = (),
    ) -> None:
        self.manager = manager
        self.layout: KVLayout = manager.kv_layout
        self.num_blocks = int(self.layout.num_blocks)
        self.first_block = 1 if manager.options.null_block else 0
        self.budgets = list(budgets)
        self.mirrors = mirrors
        # What one page id costs on each budget (each rank's own layout).
        self._page_id_bytes = [
            int(layout.page_id_bytes) for layout in (rank_layouts or [self.layout] * len(self.budgets))
        ]
        #: Blocks :meth:`alloc` can return now, secured ones included (the core's
        #: bound method: engines call it for every request of every step).
        self.available = manager.available
        self.num_short_secures = 0  # secure() calls memory could not satisfy: the engine waited

    # ---- construction: the one place that calls the core constructors ------------

    @classmethod
    def local(
        cls,
        layout: KVLayout,
        *,
        device: str,
        budget: Any,
        name: str,
        null_block: bool = True,
        zero_backing: bool = True,
    ) -> EngineBlocks:
        """Decisions and KV tensors in this process: a KVPool on ``device``.

        No background worker: pages are mapped by :meth:`alloc` / :meth:`secure`
        and returned by :meth:`end_step` / :meth:`trim`, at points the engine
        chooses, so memory the engine was told it has stays mapped until used.
        Unmapping synchronises the device first (the core's fence), so blocks
        a kernel may still touch are never unmapped under it.

        With ``KVCACHED_KEEP_FREED_WHILE_BUSY`` (the default) the engine keeps
        every page it frees mapped: the rounds of :meth:`end_step` give free
        pages back only when another instance on the device waits for memory
        or over the limit, and the rest goes with :meth:`trim` at the end of
        the engine's idle hold. Otherwise a burst of frees followed by a burst
        of allocs (a flushed cache, then the next requests) would unmap pages
        and map them again.
        """
        from kvcached import config
        from kvcached.pool import KVPool

        options = block_manager_options(
            null_block=null_block,
            background_worker=False,
            # Reserve pages only come from explicit maintain() calls: keeping
            # none ready avoids mapping one at every step of an idle engine.
            min_reserve_pages=0,
            max_reserve_pages=int(layout.num_pages) if config.get("keep_freed_while_busy") else None,
        )
        pool = KVPool(
            kv_layout=layout,
            device=device,
            options=options,
            space_options=space_options(zero_backing=zero_backing),
            budget=budget,
            register=False,
            name=name,
        )
        return cls(pool, budgets=[budget] if budget is not None else [])

    @classmethod
    def deciding(
        cls,
        layouts: Sequence[KVLayout],
        budgets: Sequence[Any],
        *,
        ranks: Sequence[RankDevice],
        board: AckBoard,
        name: str,
        ack_timeout_s: float,
        null_block: bool = True,
        logger: Optional[logging.Logger] = None,
    ) -> EngineBlocks:
        """Decisions only: rank ``i`` maps the pages in its own process, on its own device.

        ``layouts[i]`` is rank ``i``'s layout (the same block ids everywhere; a
        pipeline stage holds only its layers), ``budgets[i]`` the budget of its
        device. Every page is charged on every rank's budget, all or nothing,
        and released on a rank's budget once that rank acknowledged the unmap.
        """
        from kvcached.pool import BlockManager

        if not len(layouts) == len(budgets) == len(ranks):
            raise InvalidArgumentError(f"{len(layouts)} layouts, {len(budgets)} budgets and {len(ranks)} ranks")
        manager = BlockManager(
            layouts[0],
            # Page ops are taken at each engine step; a worker producing them in
            # between would only make the order harder to reason about.
            block_manager_options(null_block=null_block, background_worker=False, spares=False),
            mirrors=[Mirror(budget, layout) for budget, layout in zip(budgets, layouts)],
            name=name,
        )
        try:
            mirrors = RankMirrors(manager, board, ranks, ack_timeout_s=ack_timeout_s, logger=logger)
        except BaseException:
            manager.close()
            raise
        return cls(manager, budgets=budgets, mirrors=mirrors, rank_layouts=layouts)

    @property
    def space(self) -> Any:
        """The KV space this manager maps (None when ranks in other processes do)."""
        return getattr(self.manager, "space", None)

    # ---- allocation ---------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray:
        """``n`` block ids (int64), secured ones first. Raises OutOfMemoryError, changing nothing."""
        return self.manager.alloc(n)

    def free(self, ids: Union[Sequence[int], np.ndarray]) -> None:
        """Gives handed-out ids back. Unknown, repeated, free or secured ids raise ValueError, freeing nothing."""
        self.manager.free(ids)

    def want_more(self, missing_blocks: int = 0) -> None:
        """The engine waits for blocks it did not ask for, having seen too few available.

        An engine that checks free blocks before it allocates never has a
        request refused, so nobody would learn that it waits: this records,
        on every rank's registry entry, what that budget could grant now plus
        ``missing_blocks`` (at least one page id more: what it saw was too
        few), unless its own limit is the obstacle. Idle instances of the
        device read it as pressure to give memory back, lower priorities as a
        reclaim target for all of it; called each step while the engine waits,
        it keeps them shrinking until it has enough.
        """
        pages = max(1, -(-int(missing_blocks) // int(self.layout.blocks_per_page)))
        for budget, page_id_bytes in zip(self.budgets, self._page_id_bytes):
            budget.want(int(budget.available_bytes) + pages * page_id_bytes)

    def secure(self, n: int) -> bool:
        """Holds at least ``n`` blocks for the next allocations if memory allows.

        Keeps what it could get when it cannot get all; returns whether ``n``
        are held.
        """
        secured = self.secured
        if n <= secured or self.manager.try_reserve(n - secured):
            return True
        partial = min(n - secured, int(self.available()) - secured)  # available() counts secured blocks
        if partial > 0:
            self.manager.try_reserve(partial)
        self.num_short_secures += 1
        return False

    @property
    def secured(self) -> int:
        """Blocks held by :meth:`secure` and not yet handed out."""
        return int(self.manager.stats()["reserved_blocks"])

    def end_step(self) -> None:
        """End of an engine step: return unused secured blocks, then keep the reserve."""
        self.manager.release_reserved()
        self.manager.maintain()

    def logical_free(self) -> int:
        """Engine ids not handed out, whatever memory allows (the engine's own conservation)."""
        return self.num_blocks - self.first_block - self._handed_out(self.manager.stats())

    def _handed_out(self, stats: dict) -> int:
        """Blocks the engine holds: the core's used blocks less the secured ones and the null block
        (which an asleep manager does not hold)."""
        null_block = 0 if stats["asleep"] else self.first_block
        return int(stats["used_blocks"]) - int(stats["reserved_blocks"]) - null_block

    def clear(self) -> None:
        """Frees every handed-out and secured block (the engine dropped all of its KV)."""
        self.manager.clear()
        self.manager.maintain()

    def trim(self) -> int:
        """Idle engine: give back secured blocks and every free page; returns pages unmapped."""
        self.manager.release_reserved()
        return int(self.manager.trim())

    # ---- the engine released its KV cache (SGLang's memory saver) ----------------

    def sleep(self) -> int:
        """Gives back every page, the null block's too, and maps nothing until :meth:`wake_up`.

        Every block must be free (:meth:`clear` first); secured blocks are given
        back. Returns pages unmapped (0 when asleep already).
        """
        self.manager.release_reserved()
        return int(self.manager.sleep())

    def wake_up(self) -> None:
        """Lets the engine allocate again and maps the null block's page back.

        Raises OutOfMemoryError, still asleep, when that page cannot be had. A no-op when awake.
        """
        self.manager.wake_up()

    @property
    def asleep(self) -> bool:
        """Between :meth:`sleep` and :meth:`wake_up`."""
        return bool(self.manager.asleep)

    # ---- the memory policy: asked to hold less (docs/memory-policy.md) ---------------

    def asked_to_shrink(self) -> bool:
        """Whether a rank's entry holds more than the limit in force now (a higher-priority
        instance's reclaim target, ``kvctl set-limit``, a lowered budget); lock-free reads."""
        for budget in self.budgets:
            limit = budget.external_limit_bytes
            if limit is not None and budget.mapped_bytes > limit:
                return True
        return False

    def pages_over_limit(self) -> int:
        """Page ids with blocks in use beyond the limit in force: what the engine must free
        (cached prefixes, then requests) before its memory can go back."""
        stats = self.manager.stats()
        return max(0, int(stats["used_pages"]) - int(stats["limit_pages"]))

    def give_back_beyond_limit(self) -> None:
        """Unmaps the free pages beyond the limit in force now, not at the end of the engine's
        busy spell; their memory goes back once every rank has applied the unmaps."""
        self.manager.maintain()

    # ---- ranks (decisions here, tensors in WorkerSpaces elsewhere) ----------------

    def take_page_ops(self) -> Any:
        """The pending :class:`kvcached.PageOps` batch for every rank (it pickles itself), or None."""
        ops = self.manager.take_page_ops()
        return ops if ops else None

    def poll_acknowledgements(self) -> None:
        """Takes in what every rank applied; declares dead or stalled ranks lost."""
        if self.mirrors is not None:
            self.mirrors.poll()

    # ---- introspection and lifetime ---------------------------------------------

    def stats(self) -> dict:
        """The core's counters plus the engine's view (blocks handed out, secured, available)."""
        stats = dict(self.manager.stats())
        stats.update(
            engine_blocks=self.num_blocks,
            engine_used_blocks=self._handed_out(stats),
            secured_blocks=int(stats["reserved_blocks"]),
            available_blocks=int(self.available()),
            short_secures=self.num_short_secures,
        )
        if self.mirrors is not None:
            stats["lost_ranks"] = dict(self.mirrors.lost)
        return stats

    def close(self) -> None:
        """Unmaps everything (live tensors then read zeros) and leaves the registries. Idempotent."""
        self.manager.close()
        if self.mirrors is not None:
            self.mirrors.close()
        for budget in self.budgets:
            budget.unregister()
        self.budgets = []


__all__ = ["EngineBlocks"]
