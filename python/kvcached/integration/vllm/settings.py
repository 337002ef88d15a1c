"""Environment settings of the vLLM integration (version-independent).

Every knob is one ``KVCACHED_*`` environment variable, read when it is needed so
that spawned engine processes see what their parent exported.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_TRUE = {"1", "true", "yes", "on"}

#: Page size both sides agree on unless ``KVCACHED_PAGE_BYTES`` says otherwise:
#: the EngineCore decides page ids without a device, so it cannot ask the
#: driver for its granularity. 2 MiB is the CUDA/HIP recommended granularity
#: and the host backend's default.
DEFAULT_PAGE_BYTES = 2 << 20

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """Parses ``"2147483648"``, ``"2GiB"``, ``"512 MiB"`` or ``"1.5g"`` (binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 4294967296, 4GiB or 512MiB)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 0:
        raise ValueError(f"byte size must not be negative: {text!r}")
    return int(value)


def is_enabled() -> bool:
    """True when ``KVCACHED_ENABLE`` (or the older ``ENABLE_KVCACHED``) is set to a true value."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED")
    )


def _env_bytes(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


@dataclass(frozen=True)
class Settings:
    """What the vLLM integration reads from the environment."""

    #: Virtual KV capacity per worker that vLLM plans blocks for
    #: (``KVCACHED_VIRTUAL_BYTES``); None: the device's total memory.
    virtual_bytes: int | None
    #: Physical limit of this engine's KV cache (``KVCACHED_LIMIT_BYTES``);
    #: None: vLLM's ``kv_cache_memory_bytes`` if set, else only the shared budget.
    limit_bytes: int | None
    #: Page size used by the EngineCore's BlockManager and the workers' KVSpaces.
    page_bytes: int
    #: Name under which the engine registers (``KVCACHED_NAME``); None: derived.
    name: str | None
    #: Prefix-cache memory an idle engine keeps (``KVCACHED_IDLE_CACHE_BYTES``);
    #: default 0: an engine with no requests returns all its KV memory.
    idle_cache_bytes: int = 0

    @classmethod
    def from_env(cls) -> "Settings":
        page_bytes = _env_bytes("KVCACHED_PAGE_BYTES") or DEFAULT_PAGE_BYTES
        return cls(
            virtual_bytes=_env_bytes("KVCACHED_VIRTUAL_BYTES"),
            limit_bytes=_env_bytes("KVCACHED_LIMIT_BYTES"),
            page_bytes=page_bytes,
            name=os.environ.get("KVCACHED_NAME") or None,
            idle_cache_bytes=_env_bytes("KVCACHED_IDLE_CACHE_BYTES") or 0,
        )
