"""Hook from the vLLM integration into kvcached's per-device registry (kvctl, kvtop).

The EngineCore calls :func:`register_engine` once, after it created the
:class:`kvcached.BlockManager` that decides this engine's blocks, so that the
instance shows up in ``kvctl list`` and draws on the device's shared budget.
The registry is versioned with kvcached itself; this module is the single place
that adapts the vLLM integration to it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.kvcached")


def register_engine(manager: Any, *, name: str, device: str, info: dict[str, Any]) -> Any:
    """Registers a vLLM engine's block manager with kvcached's registry.

    Returns the registry's handle (keep it alive for the engine's lifetime), or
    None when this kvcached build has no registry. ``device`` is the device the
    engine's workers map memory on ("cpu", "cuda:0", "hip:0"); ``info`` carries
    descriptive fields (engine, model, block and page sizes).
    """
    try:
        from kvcached import registry  # type: ignore[attr-defined]
    except ImportError:
        logger.debug("kvcached registry not available; %s is not registered", name)
        return None
    register = getattr(registry, "register_instance", None) or getattr(registry, "register", None)
    if register is None:
        logger.warning("kvcached.registry has no register_instance(); %s is not registered", name)
        return None
    return register(manager, name=name, device=device, info=info)
