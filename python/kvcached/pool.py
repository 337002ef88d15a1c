"""KV pools: virtual KV tensors whose physical memory follows the blocks in use.

Three objects, so that deciding and mapping can live in different processes:

* :class:`BlockManager` decides: block ids, limits, the memory budget and the
  reserve of ready pages. It never touches a device. With mirrors it emits
  ordered :class:`PageOps` batches for KV spaces in other processes.
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
from typing import Any, Optional, Sequence, Union

import numpy as np

from kvcached import _core, config
from kvcached.devices import default_device, open_device

BlockIds = Union[Sequence[int], np.ndarray]
_pool_numbers = itertools.count()
PageOps = _core.PageOps


def _resolve_page_bytes(device: Optional[_core.Device], page_bytes: Optional[int]) -> int:
    if page_bytes is None:
        page_bytes = config.get("page_bytes")
    if not page_bytes:
        page_bytes = device.granularity[1] if device is not None else 2 << 20
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    return int(page_bytes)


def _resolve_num_pages(
    num_blocks: Optional[int],
    capacity_bytes: Optional[int],
    block_bytes: int,
    page_bytes: int,
    regions: int,
    device: Optional[_core.Device],
) -> int:
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    if block_bytes > page_bytes or page_bytes % block_bytes:
        # Let the C++ layout produce the message with the page size that would work.
        return 1
    if num_blocks is not None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        return _core.pages_for_blocks(num_blocks, block_bytes, page_bytes)
    if capacity_bytes is None:
        capacity_bytes = config.get("virtual_capacity_bytes") or None
    if capacity_bytes is None:
        if device is None:
            raise ValueError("give num_blocks or capacity_bytes (a manager without a device cannot guess)")
        capacity_bytes = device.memory_info()[1]
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
    num_pages = capacity_bytes // (page_bytes * regions)
    if num_pages == 0:
        raise ValueError(
            f"capacity_bytes={capacity_bytes} is smaller than one page id "
            f"({page_bytes} bytes x {regions} layer buffers)"
        )
    return int(num_pages)


def _check_limit(limit_bytes: Optional[int]) -> None:
    if limit_bytes is not None and limit_bytes < 0:
        raise ValueError(f"limit_bytes must not be negative, got {limit_bytes}")


def _check_counts(num_layers: int, num_buffers: int) -> None:
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    if num_buffers not in (1, 2):
        raise ValueError(f"num_buffers must be 1 (MLA, K||V cells) or 2 (K and V), got {num_buffers}")


class KVSpace(_core.KVSpace):
    """The mapping side: a reservation for ``num_layers`` x ``num_buffers`` block arrays.

    Block ``b`` of layer ``l``, buffer ``k`` lives at
    ``base_address + offset_of(l, k, b)``; see :attr:`block_stride_bytes`,
    :attr:`layer_stride_bytes`, :attr:`buffer_stride_bytes`.
    """

    def __init__(
        self,
        num_blocks: Optional[int],
        block_bytes: int,
        num_layers: int,
        num_buffers: int = 2,
        layout: Optional[str] = None,
        page_bytes: Optional[int] = None,
        device: Union[str, _core.Device, None] = None,
        zero_backing: Optional[bool] = None,
        capacity_bytes: Optional[int] = None,
        max_spare_pages: Optional[int] = None,
    ) -> None:
        _check_counts(num_layers, num_buffers)
        dev = device if isinstance(device, _core.Device) else open_device(device or default_device())
        page_bytes = _resolve_page_bytes(dev, page_bytes)
        num_pages = _resolve_num_pages(
            num_blocks, capacity_bytes, block_bytes, page_bytes, num_layers * num_buffers, dev
        )
        super().__init__(
            dev,
            num_layers,
            num_buffers,
            block_bytes,
            page_bytes,
            num_pages,
            layout or config.get("layout"),
            config.get("zero_backing") if zero_backing is None else zero_backing,
            config.get("zero_chunk_bytes"),
            config.get("max_spare_pages") if max_spare_pages is None else max_spare_pages,
        )
        self.num_layers = num_layers
        self.num_buffers = num_buffers
        self.block_bytes = block_bytes
        self.page_bytes = page_bytes
        self.layout = layout or config.get("layout")

    def tensor(self) -> Any:
        """The whole reservation as a flat byte array with ``__dlpack__``.

        ``torch.from_dlpack(space.tensor())`` gives a uint8 tensor on the
        space's device without copying; it keeps the reservation alive.
        """
        return self.device.view(self.base_address, self.size_bytes, self.memory_owner())

    def __enter__(self) -> "KVSpace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockManager(_core.BlockManager):
    """The deciding side: block ids, limit, budget and reserve, with no device.

    Without ``space`` it records page operations for ``num_mirrors`` KV spaces
    in other processes: send :meth:`take_page_ops` batches to them, apply with
    :meth:`KVSpace.apply`, and report back with :meth:`acknowledge`; unmapped
    memory counts as released only once every mirror has acknowledged.
    """

    def __init__(
        self,
        num_blocks: Optional[int],
        block_bytes: int,
        num_layers: int,
        num_buffers: int = 2,
        layout: Optional[str] = None,
        page_bytes: Optional[int] = None,
        limit_bytes: Optional[int] = None,
        null_block: bool = False,
        num_mirrors: int = 1,
        capacity_bytes: Optional[int] = None,
        budget: Optional[_core.MemoryBudget] = None,
        background_worker: bool = True,
        min_reserve_pages: Optional[int] = None,
        max_reserve_pages: Optional[int] = None,
        name: Optional[str] = None,
        _space: Optional[KVSpace] = None,
    ) -> None:
        _check_counts(num_layers, num_buffers)
        _check_limit(limit_bytes)
        if num_mirrors < 1:
            raise ValueError(f"num_mirrors must be at least 1, got {num_mirrors}")
        if _space is not None:
            page_bytes, num_pages = _space.page_bytes, _space.num_pages
            spare = (config.get("min_spare_pages"), config.get("max_spare_pages"))
        else:
            page_bytes = _resolve_page_bytes(None, page_bytes)
            num_pages = _resolve_num_pages(
                num_blocks, capacity_bytes, block_bytes, page_bytes, num_layers * num_buffers, None
            )
            spare = (0, 0)
        min_free = config.get("min_reserve_pages") if min_reserve_pages is None else min_reserve_pages
        max_free = config.get("max_reserve_pages") if max_reserve_pages is None else max_reserve_pages
        if min_free < 0 or max_free < 0:
            raise ValueError("reserve sizes must not be negative")
        super().__init__(
            num_layers,
            num_buffers,
            block_bytes,
            page_bytes,
            num_pages,
            layout or config.get("layout"),
            _space,
            num_mirrors,
            null_block,
            limit_bytes,
            min_free,
            max(min_free, max_free),
            spare[0],
            max(spare),
            background_worker,
            budget,
        )
        self.name = name or f"kvcached-{id(self):x}"
        self.num_layers = num_layers
        self.num_buffers = num_buffers
        self.block_bytes = block_bytes
        self.null_block = null_block

    def resize(self, limit_bytes: Optional[int]) -> None:
        """Set the limit in bytes (None: no limit). Below current use, memory returns as blocks are freed."""
        _check_limit(limit_bytes)
        super().resize(limit_bytes)

    def available_bytes(self) -> int:
        """Physical bytes alloc could still take (``available()`` blocks, all layers)."""
        return self.available() * self.block_id_bytes

    def __enter__(self) -> "BlockManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVPool(BlockManager):
    """A KV cache in one process: block allocation plus the memory behind it.

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
            the pool registers itself in its device's shared registry and
            takes its pages from the device-wide budget there, so pools in
            other processes on the same device (and ``kvctl`` / ``kvtop``) see it.
        register: register in the device registry when no budget is given.
    """

    def __init__(
        self,
        num_layers: int,
        block_bytes: int,
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
    ) -> None:
        _check_counts(num_layers, num_buffers)
        _check_limit(limit_bytes)
        space = KVSpace(
            num_blocks,
            block_bytes,
            num_layers,
            num_buffers,
            layout=layout,
            page_bytes=page_bytes,
            device=device,
            zero_backing=zero_backing,
            capacity_bytes=capacity_bytes,
        )
        self._registration = None
        try:
            if budget is None and register:
                from kvcached.registry import registry_for

                name = name or f"pool-{os.getpid()}-{next(_pool_numbers)}"
                budget = self._registration = registry_for(space.device.name).register(name)
            super().__init__(
                None,
                block_bytes,
                num_layers,
                num_buffers,
                layout=space.layout,
                limit_bytes=limit_bytes,
                null_block=null_block,
                budget=budget,
                background_worker=background_worker,
                min_reserve_pages=min_reserve_pages,
                max_reserve_pages=max_reserve_pages,
                name=name,
                _space=space,
            )
        except BaseException:
            space.close()
            if self._registration is not None:
                self._registration.unregister()
            raise
        self.space = space
        self.device = space.device
        self.layout = space.layout

    def tensor(self) -> Any:
        """The whole reservation as a flat DLPack byte array (see :meth:`KVSpace.tensor`)."""
        return self.space.tensor()

    def stats(self) -> dict:
        """Block, page and byte counters (``reserved_bytes``: virtual size)."""
        stats = super().stats()
        stats["reserved_bytes"] = self.space.size_bytes
        return stats

    def close(self) -> None:
        """Unmap everything and stop the worker; live tensors then read zeros. Idempotent."""
        super().close()
        self.space.close()
        if self._registration is not None:
            self._registration.unregister()

    @property
    def closed(self) -> bool:
        return self.space.closed


__all__ = ["BlockManager", "KVPool", "KVSpace", "PageOps"]
