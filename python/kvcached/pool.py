"""KV pools: virtual KV tensors whose physical memory follows the blocks in use.

Three objects, so that deciding and mapping can live in different processes,
all built from one :class:`~kvcached.layout.KVLayout` value:

* :class:`BlockManager` decides: block ids, limits, the memory budgets and the
  reserve of ready pages. It never touches a device. It emits ordered
  :class:`PageOps` batches for the KV spaces that mirror it (one per
  tensor-parallel rank or pipeline stage), each charged on its own budget.
* :class:`KVSpace` maps: a reserved address range laid out for the layers and
  buffers of a model, mapping and unmapping page ids when told to.
* :class:`KVPool` is both in one process: the manager drives its own space
  directly and a background worker keeps pages ready.

Tensors leave through DLPack (``torch.from_dlpack(space.tensor())``) and keep
the reservation alive: closing a pool while a tensor lives is safe (it then
reads zeros).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from kvcached import _core, defaults
from kvcached.devices import default_device, open_device
from kvcached.errors import InvalidArgumentError, InvalidTypeError
from kvcached.layout import BlockManagerOptions, KVLayout, KVSpaceOptions, Mirror

BlockIds = Union[Sequence[int], np.ndarray]
PageOps = _core.PageOps
_pool_numbers = itertools.count()


def _open(device: Union[str, _core.Device, None]) -> _core.Device:
    return device if isinstance(device, _core.Device) else open_device(device or default_device())


class _LayoutGeometry:
    """The layout's geometry as attributes of the object built from it."""

    kv_layout: _core.KVLayout

    @property
    def num_layers(self) -> int:
        return self.kv_layout.num_layers

    @property
    def num_buffers(self) -> int:
        return self.kv_layout.num_buffers

    @property
    def block_bytes(self) -> int:
        """One block of one layer and one buffer."""
        return self.kv_layout.block_bytes

    @property
    def page_bytes(self) -> int:
        """One page of one layer and one buffer."""
        return self.kv_layout.page_bytes

    @property
    def num_pages(self) -> int:
        return self.kv_layout.num_pages

    @property
    def layout(self) -> str:
        """The layout's kind: ``"per_layer"`` or ``"contiguous"``."""
        return self.kv_layout.kind


class KVSpace(_LayoutGeometry, _core.KVSpace):
    """The mapping side: a reservation laid out by ``layout`` on ``device``.

    Block ``b`` of layer ``l``, buffer ``k`` lives at
    ``base_address + offset_of(l, k, b)``. Pages are mapped by :meth:`apply`
    (a :class:`PageOps` batch from a :class:`BlockManager`), or by hand with
    :meth:`map_pages` / :meth:`unmap_pages`.
    """

    def __init__(
        self,
        layout: _core.KVLayout,
        device: Union[str, _core.Device, None] = None,
        options: Optional[KVSpaceOptions] = None,
    ) -> None:
        super().__init__(layout, _open(device), options if options is not None else defaults.current().space_options())

    @property
    def num_blocks(self) -> int:
        return self.kv_layout.num_blocks

    @property
    def blocks_per_page(self) -> int:
        return self.kv_layout.blocks_per_page

    @property
    def page_id_bytes(self) -> int:
        return self.kv_layout.page_id_bytes

    @property
    def block_stride_bytes(self) -> int:
        return self.kv_layout.block_stride_bytes

    @property
    def layer_stride_bytes(self) -> int:
        return self.kv_layout.layer_stride_bytes

    @property
    def buffer_stride_bytes(self) -> int:
        return self.kv_layout.buffer_stride_bytes

    def offset_of(self, layer: int, buffer: int, block: int) -> int:
        """Byte offset of (layer, buffer, block) from :attr:`base_address`."""
        return self.kv_layout.offset_of(layer, buffer, block)

    def tensor(self) -> Any:
        """The whole reservation as a flat byte array with ``__dlpack__``.

        ``torch.from_dlpack(space.tensor())`` gives a uint8 tensor on the
        space's device without copying; it keeps the reservation alive.
        """
        return self.device.view(self.base_address, self.size_bytes, self.memory_owner())

    def __enter__(self) -> KVSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockManager(_LayoutGeometry, _core.BlockManager):
    """The deciding side with no device: block ids, limit, budgets and reserve.

    It records page operations for the KV spaces that mirror it (in other
    processes, each on its own device): send every :meth:`take_page_ops` batch
    to every mirror, apply it there with :meth:`KVSpace.apply`, and report back
    with ``acknowledge(mirror_index, seq)``. Every page mapped is charged on
    every mirror's budget (all or nothing) and given back on a mirror's budget
    once that mirror has acknowledged the unmap; a page id is reused only once
    every live mirror has. ``mirror_lost(i)`` gives back what a dead mirror held.

    Args:
        layout: the cache's :class:`~kvcached.layout.KVLayout` (shared by every mirror).
        options: :class:`~kvcached.layout.BlockManagerOptions` (default: the
            configuration's reserve, no worker: :mod:`kvcached.defaults`).
        budget: with ``mirrors`` an int: the budget each of those mirrors is charged on.
        mirrors: how many mirrors, or one :class:`~kvcached.layout.Mirror` per
            mirror (its own budget; a pipeline stage's own layout).
        name: a label (registries, logs).
    """

    def __init__(
        self,
        layout: _core.KVLayout,
        options: Optional[BlockManagerOptions] = None,
        *,
        budget: Optional[_core.MemoryBudget] = None,
        mirrors: Union[int, Sequence[Mirror]] = 1,
        name: Optional[str] = None,
    ) -> None:
        if isinstance(mirrors, bool) or not isinstance(mirrors, (int, list, tuple)):
            raise InvalidTypeError(f"mirrors must be a count or a list of Mirror, got {type(mirrors).__name__}")
        if isinstance(mirrors, int):
            if mirrors < 1:
                raise InvalidArgumentError(f"mirrors must be at least 1, got {mirrors}")
            specs = [Mirror(budget) for _ in range(mirrors)]
        else:
            if budget is not None:
                raise InvalidArgumentError("with a list of Mirror, give each its budget there")
            specs = list(mirrors)
        if options is None:
            options = defaults.current().block_manager_options(spares=False, background_worker=False)
        super().__init__(layout, options, mirrors=specs)
        self.name = name or f"kvcached-{id(self):x}"

    def available_bytes(self) -> int:
        """Physical bytes alloc could still take (``available()`` blocks, all layers)."""
        return self.available() * self.block_id_bytes

    def __enter__(self) -> BlockManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVPool(BlockManager):
    """A KV cache in one process: block allocation plus the memory behind it.

    Give either the geometry (``num_layers``, ``block_bytes``, ...) or a whole
    ``kv_layout``; either way one :class:`~kvcached.layout.KVLayout` is built
    (:meth:`~kvcached.layout.KVLayout.from_config`) and used by the space and the
    manager alike. What is left out comes from the installed defaults
    (:mod:`kvcached.defaults`; after ``import kvcached``, the ``KVCACHED_*`` options and
    the device registry).

    A child of ``fork()`` inherits none of the pool's memory: there its KV
    range reads as zeros and mapping raises; create pools after forking
    (``docs/allocator.md``, "fork()").

    Args:
        num_layers: transformer layers.
        block_bytes: bytes of one block of one layer and one buffer.
        num_buffers: 2 for separate K and V, 1 for MLA or K||V cells.
        num_blocks / capacity_bytes: virtual capacity (default: the device's
            total memory, or ``KVCACHED_VIRTUAL_CAPACITY_BYTES``).
        layout: ``"per_layer"`` or ``"contiguous"`` (``KVCACHED_LAYOUT``).
        page_bytes: page size per layer buffer (multiple of the granularity).
        device: ``"cpu"``, ``"cuda:N"``, ``"hip:N"`` (default: a GPU if any).
        zero_backing: unmapped regions read as zeros (``KVCACHED_ZERO_BACKING``).
        limit_bytes: most physical memory this pool may hold (None: no limit).
        null_block: reserve block 0, which is never handed out or freed.
        budget: a budget shared with other pools. By default (``register=True``)
            the pool takes one from the installed defaults' ``pool_budget``: it
            registers in its device's shared registry and takes its pages from
            the device-wide budget there, so pools in other processes on the
            same device (and ``kvctl`` / ``kvtop``) see it.
        background_worker, min_reserve_pages, max_reserve_pages, placement:
            see :func:`~kvcached.configured.block_manager_options`.
        register: take the default budget when none is given (False: no budget).
        kv_layout: the whole geometry instead of the arguments above.
        options, space_options: whole option values instead of the arguments above.
    """

    def __init__(
        self,
        num_layers: Optional[int] = None,
        block_bytes: Optional[int] = None,
        num_buffers: int = 2,
        num_blocks: Optional[int] = None,
        capacity_bytes: Optional[int] = None,
        layout: Optional[str] = None,
        page_bytes: Optional[int] = None,
        device: Union[str, _core.Device, None] = None,
        zero_backing: Optional[bool] = None,
        limit_bytes: Optional[int] = None,
        null_block: bool = False,
        budget: Optional[_core.MemoryBudget] = None,
        background_worker: bool = True,
        min_reserve_pages: Optional[int] = None,
        max_reserve_pages: Optional[int] = None,
        name: Optional[str] = None,
        register: bool = True,
        *,
        kv_layout: Optional[_core.KVLayout] = None,
        options: Optional[BlockManagerOptions] = None,
        space_options: Optional[KVSpaceOptions] = None,
        placement: str = "fewest_pages",
    ) -> None:
        dev = _open(device)
        supplied = defaults.current()
        if kv_layout is None:
            if num_layers is None or block_bytes is None:
                raise InvalidTypeError("give num_layers and block_bytes, or a kv_layout")
            kv_layout = KVLayout.from_config(
                num_layers,
                block_bytes,
                num_blocks,
                num_buffers=num_buffers,
                page_bytes=page_bytes,
                kind=layout,
                capacity_bytes=capacity_bytes,
                device=dev,
            )
        elif num_layers is not None or block_bytes is not None or num_blocks is not None or layout is not None:
            raise InvalidTypeError("give the geometry either as arguments or as kv_layout, not both")
        if options is None:
            options = supplied.block_manager_options(
                null_block=null_block,
                limit_bytes=limit_bytes,
                min_reserve_pages=min_reserve_pages,
                max_reserve_pages=max_reserve_pages,
                background_worker=background_worker,
                placement=placement,
            )
        if space_options is None:
            space_options = supplied.space_options(zero_backing=zero_backing)
        space = KVSpace(kv_layout, dev, space_options)
        name = name or f"pool-{os.getpid()}-{next(_pool_numbers)}"
        self._registration = None
        try:
            if budget is None and register:
                budget = self._registration = supplied.pool_budget(space.device.name, name)
            _core.BlockManager.__init__(self, kv_layout, options, space=space, budget=budget)
        except BaseException:
            space.close()
            self._unregister()
            raise
        self.name = name
        self.space = space
        self.device = space.device

    def _unregister(self) -> None:
        """Ends the default budget's registration, if it has one (a registry entry does)."""
        unregister = getattr(self._registration, "unregister", None)
        if unregister is not None:
            unregister()

    def tensor(self) -> Any:
        """The whole reservation as a flat DLPack byte array (see :meth:`KVSpace.tensor`)."""
        return self.space.tensor()

    def stats(self) -> dict:
        """Block, page and byte counters (``reserved_bytes``: virtual size; ``limit_bytes``:
        the limit in force, the pool's own or one set from outside with ``kvctl set-limit``)."""
        stats = super().stats()
        stats["reserved_bytes"] = self.space.size_bytes
        return stats

    def close(self) -> None:
        """Unmap everything and stop the worker; live tensors then read zeros.

        Idempotent, also when several threads call it at once."""
        super().close()
        self.space.close()
        self._unregister()


__all__ = ["BlockManager", "KVPool", "KVSpace", "PageOps"]
