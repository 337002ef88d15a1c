"""The core's defaults read from kvcached's options: what ``import kvcached`` installs.

Each function reads the ``KVCACHED_*`` options it needs (:mod:`kvcached.config`) when called,
so a process may set them before it builds its KV cache; :class:`ConfiguredDefaults` hands
them to the core as its :class:`~kvcached.defaults.Defaults` (the core itself reads no
option). ``space_options()`` and ``block_manager_options()`` are also what engine
integrations build their spaces and managers with.
"""

from __future__ import annotations

from typing import Callable, Optional

from kvcached import _core, config
from kvcached.defaults import HostDeviceSettings
from kvcached.layout import BlockManagerOptions, KVSpaceOptions, device_kind_layout


def default_layout(backend: Optional[str] = None) -> str:
    """The layout a pool on ``backend`` ("cuda", "hip", "host") gets: ``KVCACHED_LAYOUT``, else
    :data:`kvcached.layout.DEFAULT_LAYOUTS`."""
    return config.get("layout") or device_kind_layout(backend)


def host_device_settings() -> HostDeviceSettings:
    """``KVCACHED_HOST_CAPACITY_BYTES``, ``KVCACHED_HOST_MEMORY`` and ``KVCACHED_HOST_POPULATE``."""
    return HostDeviceSettings(
        capacity_bytes=config.get("host_capacity_bytes"),
        memory=config.get("host_memory"),
        populate=config.get("host_populate"),
    )


def host_capacity_bytes() -> int:
    """The host backend's capacity: ``KVCACHED_HOST_CAPACITY_BYTES``, else half of the machine's
    (or cgroup's) memory limit."""
    return int(config.get("host_capacity_bytes") or _core.machine_host_capacity_bytes())


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


class ConfiguredDefaults:
    """:class:`~kvcached.defaults.Defaults` from the options; a pool given no budget gets one from
    ``pool_budget(device_name, pool_name)`` (the package passes a registration in the device's
    registry, :func:`kvcached.registry.register_pool`)."""

    def __init__(self, pool_budget: Callable[[str, str], _core.MemoryBudget]) -> None:
        self.pool_budget = pool_budget

    host_device_settings = staticmethod(host_device_settings)
    space_options = staticmethod(space_options)
    block_manager_options = staticmethod(block_manager_options)

    @staticmethod
    def hip_mapping_settle_us() -> int:
        return int(config.get("hip_mapping_settle_us"))

    @staticmethod
    def layout_kind() -> Optional[str]:
        return config.get("layout")

    @staticmethod
    def page_bytes() -> int:
        return int(config.get("page_bytes"))

    @staticmethod
    def virtual_capacity_bytes() -> int:
        return int(config.get("virtual_capacity_bytes"))


__all__ = [
    "ConfiguredDefaults",
    "block_manager_options",
    "default_layout",
    "host_capacity_bytes",
    "host_device_settings",
    "space_options",
]
