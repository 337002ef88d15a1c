"""What the core uses where its caller leaves a value out, and who supplies it.

The core (:mod:`~kvcached.devices`, :mod:`~kvcached.layout`, :mod:`~kvcached.pool`,
:mod:`~kvcached.tensor_views`) reads no option and opens no registry: its callers give it
values (a :class:`~kvcached.layout.KVLayout`, options, a budget). Where a caller leaves one out
(``KVPool(num_layers=2, block_bytes=4096)``, ``open_device("cpu")``,
``KVLayout.from_config(...)``), the core asks the :class:`Defaults` installed here.

``import kvcached`` installs the configured ones (:class:`kvcached.configured.ConfiguredDefaults`:
the ``KVCACHED_*`` options, and each pool registered in its device's registry); Python imports the
package before any of its modules, so no part of the core runs without them. A program may
install its own with :func:`install` (a pool that registers nowhere, options from a file).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

from kvcached import _core
from kvcached.errors import ConfigurationError


@dataclasses.dataclass(frozen=True)
class HostDeviceSettings:
    """How the host backend is opened (``kvcached._core.open_host_device``)."""

    capacity_bytes: Optional[int]  # None: half of the machine's (or cgroup's) memory limit
    memory: str  # "shared_files", "anonymous" or "huge_pages"
    populate: str  # "background" or "on_touch"


class Defaults(Protocol):
    """The values a caller of the core may leave out; each is read when the core needs it."""

    def host_device_settings(self) -> HostDeviceSettings:
        """How the host device is opened."""

    def hip_mapping_settle_us(self) -> int:
        """How old (µs) the newest HIP mapping must be before fresh ones go to GPU work."""

    def layout_kind(self) -> Optional[str]:
        """The layout a pool gets; None: its device kind's (:data:`kvcached.layout.DEFAULT_LAYOUTS`)."""

    def page_bytes(self) -> int:
        """A pool's page size per layer and buffer; 0: its device's recommended granularity."""

    def virtual_capacity_bytes(self) -> int:
        """A pool's virtual capacity when neither blocks nor capacity are given; 0: its device's memory."""

    def space_options(
        self, *, zero_backing: Optional[bool] = None, max_spare_pages: Optional[int] = None
    ) -> _core.KVSpaceOptions:
        """How a KV space maps, with these overrides."""

    def block_manager_options(
        self,
        *,
        null_block: bool = False,
        limit_bytes: Optional[int] = None,
        min_reserve_pages: Optional[int] = None,
        max_reserve_pages: Optional[int] = None,
        spares: bool = True,
        background_worker: bool = True,
        placement: str = "fewest_pages",
    ) -> _core.BlockManagerOptions:
        """How a block manager behaves, with these overrides."""

    def pool_budget(self, device_name: str, pool_name: str) -> _core.MemoryBudget:
        """The budget of a pool given none, on the device this process calls ``device_name``; if it
        has ``unregister()`` (a registry entry), the pool calls it when it closes."""


_installed: Optional[Defaults] = None


def install(defaults: Defaults) -> None:
    """Makes ``defaults`` the values every later pool, layout and device of this process gets."""
    global _installed
    _installed = defaults


def current() -> Defaults:
    """The installed defaults; ConfigurationError if none are (the package installs them on import)."""
    if _installed is None:
        raise ConfigurationError("kvcached's defaults are not installed: import kvcached (it installs them)")
    return _installed


__all__ = ["Defaults", "HostDeviceSettings", "current", "install"]
