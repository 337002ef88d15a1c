"""The vLLM integration's registry hook: :mod:`kvcached.integration.common.registration`,
logging into vLLM's log stream."""

from __future__ import annotations

import logging
from typing import Any

from kvcached.integration.common.registration import ensure_registry
from kvcached.integration.common.registration import register_engine as _register_engine

_logger = logging.getLogger("vllm.kvcached")


def register_engine(name: str, *, device: str, limit_bytes: int | None) -> Any:
    """Registers a vLLM engine in ``device``'s registry; see the common function."""
    return _register_engine(name, device=device, limit_bytes=limit_bytes, logger=_logger)


__all__ = ["ensure_registry", "register_engine"]
