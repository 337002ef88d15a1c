"""Environment settings shared by the engine integrations (vLLM, SGLang).

Every value comes from kvcached's one options table (:mod:`kvcached.config`,
documented in ``docs/configuration.md``), read when needed, so spawned engine
processes see what their parent exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The page size when KVCACHED_PAGE_BYTES is unset. An engine may decide page ids
# in a process that never opens the device (vLLM's EngineCore), so it cannot ask
# the driver for its granularity: 2 MiB, CUDA's and HIP's recommended one.
from kvcached.layout import DEFAULT_PAGE_BYTES
from kvcached.registry import MemoryPolicy

__all__ = ["DEFAULT_PAGE_BYTES", "Settings", "is_enabled"]


def is_enabled() -> bool:
    """True when ``KVCACHED_ENABLE`` (or the older ``ENABLE_KVCACHED``) is set to a true value.

    An unparsable value counts as off (an engine plugin must not raise).
    """
    from kvcached import config

    try:
        return bool(config.get("enable"))
    except ValueError:
        return False


@dataclass(frozen=True)
class Settings:
    """What an engine integration reads from the environment."""

    #: Virtual KV capacity the engine plans for (``KVCACHED_VIRTUAL_CAPACITY_BYTES``);
    #: None: the device's total memory.
    virtual_bytes: Optional[int]
    #: Each rank's memory policy in the device registry (``docs/memory-policy.md``):
    #: ``KVCACHED_MIN_BYTES``, ``KVCACHED_LIMIT_BYTES`` (its max; None: the engine's
    #: own KV size setting where it has one, else only the device's shared budget)
    #: and ``KVCACHED_PRIORITY``.
    policy: MemoryPolicy
    #: Page size of the engine's block manager and KV spaces.
    page_bytes: int
    #: Name in the device registries (``KVCACHED_NAME``); None: derived.
    name: Optional[str]
    #: Prefix-cache memory an idle engine keeps (``KVCACHED_IDLE_CACHE_BYTES``);
    #: default 0: an engine with no requests returns all of its KV memory.
    idle_cache_bytes: int = 0
    #: Seconds an idle engine keeps its memory unless another instance wants
    #: it (``KVCACHED_IDLE_RELEASE_S``; :mod:`kvcached.integration.common.idle`).
    idle_release_s: float = 5.0
    #: The longest that hold grows to for an engine whose work keeps coming back
    #: just after it gave its memory back (``KVCACHED_IDLE_RELEASE_MAX_S``).
    idle_release_max_s: float = 30.0
    #: A rank whose oldest unacknowledged page-op batch is older than this is
    #: declared lost (``KVCACHED_RANK_ACK_TIMEOUT_S``).
    rank_ack_timeout_s: float = 120.0
    #: Freed heap memory an engine computing on the CPU keeps for its next step
    #: (``KVCACHED_HOST_HEAP_KEEP_BYTES``; :mod:`kvcached.integration.common.heap`).
    host_heap_keep_bytes: int = 256 << 20
    #: How long woken weights wait for device memory (``KVCACHED_WAKE_TIMEOUT_S``).
    wake_timeout_s: float = 10.0

    @classmethod
    def from_env(cls) -> Settings:
        from kvcached import config

        return cls(
            virtual_bytes=config.get("virtual_capacity_bytes") or None,
            policy=MemoryPolicy(config.get("min_bytes"), config.get("max_bytes"), config.get("priority")),
            page_bytes=config.get("page_bytes") or DEFAULT_PAGE_BYTES,
            name=config.get("name"),
            idle_cache_bytes=config.get("idle_cache_bytes"),
            idle_release_s=config.get("idle_release_s"),
            idle_release_max_s=config.get("idle_release_max_s"),
            rank_ack_timeout_s=config.get("rank_ack_timeout_s"),
            host_heap_keep_bytes=config.get("host_heap_keep_bytes"),
            wake_timeout_s=config.get("wake_timeout_s"),
        )
