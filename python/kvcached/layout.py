"""The values a KV cache is built from: its layout and its options, each checked once (in C++).

* :class:`KVLayout` — the geometry: layers x buffers of ``num_blocks`` blocks on
  pages, ``per_layer`` or ``contiguous``. Immutable, comparable, picklable; the
  same value goes to the :class:`~kvcached.pool.KVSpace` that maps and to the
  :class:`~kvcached.pool.BlockManager` that decides, in this process or another.
* :class:`KVSpaceOptions` — how a space maps (zero backing, spares).
* :class:`BlockManagerOptions` — how a manager behaves (null block, limit,
  reserve targets, background worker, placement).

This module only fills in defaults (``KVCACHED_*`` variables, the device's
granularity and size); every check lives in the C++ values.
"""

from __future__ import annotations

from typing import Optional, Union

from kvcached import _core, config
from kvcached.errors import InvalidArgumentError

KVSpaceOptions = _core.KVSpaceOptions
BlockManagerOptions = _core.BlockManagerOptions
Mirror = _core.Mirror
DEFAULT_PAGE_BYTES = 2 << 20  # the recommended granularity of CUDA and the host backend
DeviceLike = Union[str, "_core.Device", None]

#: The layout a pool gets, by device kind (backend), when neither the caller nor
#: ``KVCACHED_LAYOUT`` chooses. Measured on both sides of the trade (bench/RESULTS.md):
#: a gather of random blocks of one layer reads as fast in either layout (H200: 0.96x /
#: 1.15x / 1.01x for 512 / 2048 / 16384 blocks, contiguous / per-layer; host 1.03x / 0.99x),
#: while moving memory costs per physical allocation, 2*L per page id per-layer against
#: one contiguous (H200, 8 GiB hand-over: 14 ms contiguous, 578 ms per-layer). HIP: no
#: measurement says otherwise (docs/amd.md). A device whose attention kernels read the
#: contiguous layout slower (the reference's authors saw 56 % slower reads on a GB10)
#: should default to per_layer here, from the same benchmark.
DEFAULT_LAYOUTS = {"cuda": "contiguous", "hip": "contiguous", "host": "contiguous"}
#: For a backend missing from the table.
FALLBACK_LAYOUT = "contiguous"


def default_layout(backend: Optional[str] = None) -> str:
    """The layout a pool on ``backend`` ("cuda", "hip", "host") gets: ``KVCACHED_LAYOUT``, else
    :data:`DEFAULT_LAYOUTS`."""
    return config.get("layout") or DEFAULT_LAYOUTS.get(backend or "host", FALLBACK_LAYOUT)


def _device_of(device: DeviceLike) -> Optional[_core.Device]:
    if device is None or isinstance(device, _core.Device):
        return device
    from kvcached.devices import open_device

    return open_device(device)


class KVLayout(_core.KVLayout):
    """A KV cache's geometry; defaults come from the configuration and the device.

    Args:
        num_layers: transformer layers (or, for a block-outermost engine
            layout, 1 with ``block_bytes`` holding every layer).
        block_bytes: one block of one layer and one buffer.
        num_blocks: block ids the cache addresses, ``[0, num_blocks)``; need not
            be a whole number of pages. Default: as many whole pages as
            ``capacity_bytes`` holds.
        num_buffers: 2 (K and V) or 1 (MLA, K||V cells).
        page_bytes: page size per layer and buffer (``KVCACHED_PAGE_BYTES``,
            else the device's recommended granularity, else 2 MiB).
        kind: ``"per_layer"`` or ``"contiguous"`` (``KVCACHED_LAYOUT``, else the device
            kind's default: :func:`default_layout`).
        capacity_bytes: virtual capacity when ``num_blocks`` is not given
            (``KVCACHED_VIRTUAL_CAPACITY_BYTES``, else the device's total memory).
        device: used only for the defaults above.
    """

    def __init__(
        self,
        num_layers: int,
        block_bytes: int,
        num_blocks: Optional[int] = None,
        *,
        num_buffers: int = 2,
        page_bytes: Optional[int] = None,
        kind: Optional[str] = None,
        capacity_bytes: Optional[int] = None,
        device: DeviceLike = None,
    ) -> None:
        dev = None
        if not kind:
            kind = config.get("layout")
        if not kind:
            dev = _device_of(device)
            kind = default_layout(dev.backend if dev is not None else None)
        if page_bytes is None:
            page_bytes = config.get("page_bytes")
            if not page_bytes:
                dev = _device_of(device)
                page_bytes = dev.granularity[1] if dev is not None else DEFAULT_PAGE_BYTES
        if num_blocks is None:
            if capacity_bytes is None:
                capacity_bytes = config.get("virtual_capacity_bytes") or None
            if capacity_bytes is None:
                dev = dev or _device_of(device)
                if dev is None:
                    raise InvalidArgumentError(
                        "give num_blocks or capacity_bytes (without a device there is no default)"
                    )
                capacity_bytes = dev.memory_info()[1]
            num_blocks = _core.KVLayout.for_capacity(
                num_layers, block_bytes, capacity_bytes, page_bytes, num_buffers, kind
            ).num_blocks
        super().__init__(num_layers, block_bytes, num_blocks, page_bytes, num_buffers, kind)


def space_options(*, zero_backing: Optional[bool] = None, max_spare_pages: Optional[int] = None) -> KVSpaceOptions:
    """KVSpaceOptions from the configuration, with these overrides."""
    return KVSpaceOptions(
        zero_backing=config.get("zero_backing") if zero_backing is None else zero_backing,
        zero_chunk_bytes=config.get("zero_chunk_bytes"),
        max_spare_pages=config.get("max_spare_pages") if max_spare_pages is None else max_spare_pages,
        zero_frontier_pages=config.get("zero_frontier_pages"),
    )


def block_manager_options(
    *,
    null_block: bool = False,
    limit_bytes: Optional[int] = None,
    min_reserve_pages: Optional[int] = None,
    max_reserve_pages: Optional[int] = None,
    spares: bool = True,
    background_worker: bool = True,
    placement: str = "fewest_pages",
) -> BlockManagerOptions:
    """BlockManagerOptions from the configuration, with these overrides.

    ``min/max_reserve_pages``: mapped free pages kept ready (a maximum below the
    minimum is raised to it). ``spares``: keep pre-created allocations (only
    a manager with a local KV space has any).
    """
    min_free = config.get("min_reserve_pages") if min_reserve_pages is None else min_reserve_pages
    max_free = config.get("max_reserve_pages") if max_reserve_pages is None else max_reserve_pages
    min_spare, max_spare = (config.get("min_spare_pages"), config.get("max_spare_pages")) if spares else (0, 0)
    if isinstance(min_free, int) and isinstance(max_free, int) and min(min_free, max_free) >= 0:
        max_free = max(min_free, max_free)  # the C++ value refuses negative ones with their name
    return BlockManagerOptions(
        null_block=null_block,
        limit_bytes=limit_bytes,
        min_free_pages=min_free,
        max_free_pages=max_free,
        min_spare_pages=min_spare,
        max_spare_pages=max(min_spare, max_spare),
        background_worker=background_worker,
        placement=placement,
    )


__all__ = [
    "DEFAULT_LAYOUTS",
    "BlockManagerOptions",
    "KVLayout",
    "KVSpaceOptions",
    "Mirror",
    "block_manager_options",
    "default_layout",
    "space_options",
]
