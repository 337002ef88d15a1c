"""The values a KV cache is built from: its layout and its options, each checked once (in C++).

* :class:`KVLayout` — the geometry: layers x buffers of ``num_blocks`` blocks on
  pages, ``per_layer`` or ``contiguous``. Immutable, comparable, picklable; the
  same value goes to the :class:`~kvcached.pool.KVSpace` that maps and to the
  :class:`~kvcached.pool.BlockManager` that decides, in this process or another.
* :class:`KVSpaceOptions` — how a space maps (zero backing, spares).
* :class:`BlockManagerOptions` — how a manager behaves (null block, limit,
  reserve targets, background worker, placement).

Every value here is explicit; :meth:`KVLayout.from_config` fills what its caller leaves out
from the installed defaults (:mod:`kvcached.defaults`: the ``KVCACHED_*`` options) and the
device (its granularity and size). Options from the configuration:
:func:`kvcached.configured.space_options`, :func:`kvcached.configured.block_manager_options`.
"""

from __future__ import annotations

from typing import Optional, Union

from kvcached import _core, defaults
from kvcached.errors import InvalidArgumentError

KVSpaceOptions = _core.KVSpaceOptions
BlockManagerOptions = _core.BlockManagerOptions
Mirror = _core.Mirror
DEFAULT_PAGE_BYTES = 2 << 20  # the recommended granularity of CUDA and the host backend
DeviceLike = Union[str, "_core.Device", None]

#: The layout a pool gets, by device kind (backend), when neither the caller nor
#: ``KVCACHED_LAYOUT`` chooses. Why contiguous everywhere, and how a device kind would be
#: measured into ``per_layer``: ``docs/configuration.md`` ("Defaults, and where they come from").
DEFAULT_LAYOUTS = {"cuda": "contiguous", "hip": "contiguous", "host": "contiguous"}
#: For a backend missing from the table.
FALLBACK_LAYOUT = "contiguous"


def device_kind_layout(backend: Optional[str] = None) -> str:
    """The layout of :data:`DEFAULT_LAYOUTS` for ``backend`` ("cuda", "hip", "host"; None: host)."""
    return DEFAULT_LAYOUTS.get(backend or "host", FALLBACK_LAYOUT)


def _device_of(device: DeviceLike) -> Optional[_core.Device]:
    if device is None or isinstance(device, _core.Device):
        return device
    from kvcached.devices import open_device

    return open_device(device)


class KVLayout(_core.KVLayout):
    """A KV cache's geometry, every value given (:meth:`from_config` fills in defaults).

    Args:
        num_layers: transformer layers (or, for a block-outermost engine
            layout, 1 with ``block_bytes`` holding every layer).
        block_bytes: one block of one layer and one buffer.
        num_blocks: block ids the cache addresses, ``[0, num_blocks)``; need not
            be a whole number of pages.
        page_bytes: page size per layer and buffer (a multiple of the device's
            granularity and of ``block_bytes``).
        kind: ``"per_layer"`` or ``"contiguous"``.
        num_buffers: 2 (K and V) or 1 (MLA, K||V cells).
    """

    def __init__(
        self, num_layers: int, block_bytes: int, num_blocks: int, *, page_bytes: int, kind: str, num_buffers: int = 2
    ) -> None:
        super().__init__(num_layers, block_bytes, num_blocks, page_bytes, num_buffers, kind)

    @classmethod
    def from_config(
        cls,
        num_layers: int,
        block_bytes: int,
        num_blocks: Optional[int] = None,
        *,
        num_buffers: int = 2,
        page_bytes: Optional[int] = None,
        kind: Optional[str] = None,
        capacity_bytes: Optional[int] = None,
        device: DeviceLike = None,
    ) -> KVLayout:
        """A layout whose values left out come from the configuration, then the device.

        ``kind``: ``KVCACHED_LAYOUT``, else the device kind's (:data:`DEFAULT_LAYOUTS`).
        ``page_bytes``: ``KVCACHED_PAGE_BYTES``, else the device's recommended granularity,
        else 2 MiB. ``num_blocks``: as many whole pages as ``capacity_bytes`` holds
        (``KVCACHED_VIRTUAL_CAPACITY_BYTES``, else the device's total memory).
        ``device`` is used only for these defaults (opened only if one is needed).
        """
        supplied = defaults.current()
        dev = None
        if not kind:
            kind = supplied.layout_kind()
        if not kind:
            dev = _device_of(device)
            kind = device_kind_layout(dev.backend if dev is not None else None)
        if page_bytes is None:
            page_bytes = supplied.page_bytes()
            if not page_bytes:
                dev = _device_of(device)
                page_bytes = dev.granularity[1] if dev is not None else DEFAULT_PAGE_BYTES
        if num_blocks is None:
            if capacity_bytes is None:
                capacity_bytes = supplied.virtual_capacity_bytes() or None
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
        return cls(num_layers, block_bytes, num_blocks, page_bytes=page_bytes, kind=kind, num_buffers=num_buffers)


__all__ = [
    "DEFAULT_LAYOUTS",
    "DEFAULT_PAGE_BYTES",
    "FALLBACK_LAYOUT",
    "BlockManagerOptions",
    "KVLayout",
    "KVSpaceOptions",
    "Mirror",
    "device_kind_layout",
]
