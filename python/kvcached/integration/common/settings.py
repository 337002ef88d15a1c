"""Environment settings shared by the engine integrations (vLLM, SGLang).

Options kvcached already has (page size, virtual capacity) come from
:mod:`kvcached.config`; the ones that only make sense for an engine are read
here. Everything is read when needed, so spawned engine processes see what their
parent exported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = {"1", "true", "yes", "on"}

#: Page size when ``KVCACHED_PAGE_BYTES`` is unset. An engine may decide page
#: ids in a process that never opens the device (vLLM's EngineCore), so it
#: cannot ask the driver for its granularity. 2 MiB is CUDA's and HIP's
#: recommended granularity and the host backend's default.
DEFAULT_PAGE_BYTES = 2 << 20


def is_enabled() -> bool:
    """True when ``KVCACHED_ENABLE`` (or the older ``ENABLE_KVCACHED``) is set to a true value."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED")
    )


def _env_bytes(name: str) -> int | None:
    from kvcached.registry import parse_bytes

    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


@dataclass(frozen=True)
class Settings:
    """What an engine integration reads from the environment."""

    #: Virtual KV capacity the engine plans for (``KVCACHED_VIRTUAL_CAPACITY_BYTES``);
    #: None: the device's total memory.
    virtual_bytes: int | None
    #: This engine's own physical limit (``KVCACHED_LIMIT_BYTES``); None: the
    #: engine's own KV size setting where it has one, else only the device's
    #: shared budget.
    limit_bytes: int | None
    #: Page size of the engine's block manager and KV spaces.
    page_bytes: int
    #: Name in the device registry (``KVCACHED_NAME``); None: derived.
    name: str | None
    #: Prefix-cache memory an idle engine keeps (``KVCACHED_IDLE_CACHE_BYTES``);
    #: default 0: an engine with no requests returns all of its KV memory.
    idle_cache_bytes: int = 0

    @classmethod
    def from_env(cls) -> "Settings":
        from kvcached import config

        return cls(
            virtual_bytes=config.get("virtual_capacity_bytes") or None,
            limit_bytes=_env_bytes("KVCACHED_LIMIT_BYTES"),
            page_bytes=config.get("page_bytes") or DEFAULT_PAGE_BYTES,
            name=os.environ.get("KVCACHED_NAME") or None,
            idle_cache_bytes=_env_bytes("KVCACHED_IDLE_CACHE_BYTES") or 0,
        )
